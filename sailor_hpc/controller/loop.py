"""The controller: watch the run's jobs, re-plan, resubmit, resume from the newest checkpoint.

One loop, one *attempt* at a time, every step journaled before it is acted on. What an attempt is, is chosen
once per run, from the site: on one cluster one (het) job (:class:`~sailor_hpc.controller.one_job.OneJob`), on
several a group of one job per cluster (:class:`~sailor_hpc.controller.groups.Groups`). Both are
:class:`AttemptKind`: the loop reconciles the journal with Slurm, starts an attempt when there is none, else
watches it, and waits out Slurm outages; each kind acts through the run's one
:class:`~sailor_hpc.controller.context.RunContext` (journal, state, inputs, clusters).

Errors carry their handling (:mod:`sailor_hpc.core.errors`): Slurm not answering (SlurmUnavailable) is
waited out with back-off and journaled once, never taken for a lost job; no plan fitting (NoPlanFits) waits
for GPUs; bad input (SailorError) ends the run at once; sbatch refusing fails the attempt (back-off).

The controller can be killed at any point; ``sailor-hpc run --resume`` folds the journal back into the same
state and finds a job submitted just before the kill by its name.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Protocol

from sailor_hpc.controller import records
from sailor_hpc.controller.context import EXIT_FINISHED, EXIT_GAVE_UP, EXIT_INTERRUPTED, EXIT_STOPPED, RunContext
from sailor_hpc.controller.groups import Groups, PlanFor, across_clusters
from sailor_hpc.controller.one_job import OneJob
from sailor_hpc.controller.state import Attempt, RunDir, RunState
from sailor_hpc.core.errors import JobFailed, SailorError, SlurmUnavailable


class AttemptKind(Protocol):
    """How a run's attempts are reconciled, started and watched (one job, or a group of jobs across clusters)."""

    def reconcile(self) -> None:
        """After a (re)start: adopt the current attempt's jobs or stop them; cancel jobs of the run that are not
        the current attempt's."""

    def start(self) -> None:
        """No current attempt: plan and submit the next one (or journal why not yet)."""

    def watch(self, cur: Attempt) -> None:
        """One poll of the current attempt."""

    def slurm_answers(self) -> bool:
        """Whether every Slurm the run uses answers now (the end of an outage)."""

    def end_all(self, how: str) -> dict[str, str]:
        """End every job of the run (``stop``: each rank saves a complete checkpoint first; ``cancel``: at once);
        returns each job's final state."""


class Controller:
    """Drives one run (a run directory) until it is finished or gives up.

    ``plan_for`` replaces the planner of a run across clusters (tests give fixed plans per set of clusters)."""

    def __init__(self, rundir: RunDir, env: Mapping[str, str] | None = None, *,
                 echo: Callable[[str], None] | None = None, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep, plan_for: PlanFor | None = None) -> None:
        self.ctx = RunContext(rundir, env, echo=echo, clock=clock, sleep=sleep)
        self.across = across_clusters(self.ctx.site)
        self.attempts: AttemptKind = Groups(self.ctx, plan_for) if self.across else OneJob(self.ctx)

    @property
    def state(self) -> RunState:
        return self.ctx.state

    def run(self, *, resume: bool = False) -> int:
        """Hold the run's lock and drive it; returns 0 (finished, or stopped by its user), 1 (gave up) or 130
        (interrupted). ``resume``: a run that stopped or gave up goes on (journaled, with why it had ended)."""
        with self.ctx.rundir.lock():
            self.ctx.begin()
            if resume:
                self._resume()
            try:
                return self.loop()
            except KeyboardInterrupt:
                self.ctx.note(records.ControllerStopped(
                    reason="interrupted; the jobs keep running (sailor-hpc run --resume)"))
                return EXIT_INTERRUPTED

    def loop(self) -> int:
        """Poll until the run is finished or gives up: first reconcile the journal with Slurm, then start an
        attempt when there is none, else watch it. Slurm not answering is waited out with back-off (journaled once
        per outage); across clusters the run is then reconciled again (a group cut short while submitting is
        adopted or stopped). Bad input (SailorError) or a run left without clusters (JobFailed) ends the run."""
        ctx = self.ctx
        reconciled = False
        while True:
            if reconciled and self._stop_asked():  # the run's jobs are known (adopted) before they are ended
                return self._end_run()
            if ctx.state.stopped:
                return EXIT_STOPPED
            if ctx.state.finished:
                return EXIT_FINISHED
            if ctx.state.gave_up:
                return EXIT_GAVE_UP
            cur = ctx.state.current
            try:
                if not reconciled:
                    self.attempts.reconcile()
                    reconciled = True
                    continue
                if cur is None:
                    self.attempts.start()
                else:
                    self.attempts.watch(cur)
            except SlurmUnavailable as exc:
                self._wait_out(exc)
                # across clusters the group may have been cut short while submitting: adopt or stop it
                reconciled = reconciled and not self.across
                continue
            except (SailorError, JobFailed) as exc:  # a deterministic refusal: retrying cannot fix it
                ctx.note(records.GaveUp(reason=str(exc)))
                return EXIT_GAVE_UP
            ctx.said.pop(records.Kind.ERROR, None)
            if cur is not None and ctx.state.current is None and ctx.state.backoff_until is None:
                continue  # the attempt is gone: plan and submit the next one now, not a poll later
            if not (ctx.state.finished or ctx.state.gave_up):
                ctx.sleep(ctx.spec.control.poll_s)

    def _stop_asked(self) -> bool:
        """Whether the user asked the run to end (journaled once, when the controller first sees the request)."""
        ctx = self.ctx
        ask = ctx.rundir.stop_request()
        if ask is not None and ctx.state.stop_requested is None and ctx.state.stopped is None:
            ctx.note(records.StopRequested(how=ask.how, by=ask.by))
        elif ask is not None and ctx.state.stopped is not None:
            ctx.rundir.clear_stop_request()  # asked again after it had stopped: nothing left to end
        return ctx.state.stop_requested is not None

    def _end_run(self) -> int:
        """End every job of the run as the user asked, then journal that the run stopped (a controller killed
        meanwhile finishes the stop when resumed: the request is journaled)."""
        ctx = self.ctx
        ask = ctx.state.stop_requested
        assert ask is not None
        while True:
            try:
                jobs = self.attempts.end_all(ask.how)
                break
            except SlurmUnavailable as exc:
                self._wait_out(exc)
        ctx.checkpoint(None)
        ctx.note(records.RunStopped(how=ask.how, by=ask.by, step=ctx.checkpoint_step(), jobs=jobs))
        ctx.rundir.clear_stop_request()
        return EXIT_STOPPED

    def _resume(self) -> None:
        """``run --resume`` of a run that stopped or gave up: journal why it had ended; it then goes on as if its
        controller had only been restarted (its restarts count afresh)."""
        st = self.ctx.state
        was = (f"was stopped by {st.stopped.by} ({st.stopped.how})" if st.stopped is not None
               else f"gave up ({st.gave_up})" if st.gave_up is not None else None)
        if was is not None and st.finished is None:
            self.ctx.rundir.clear_stop_request()
            self.ctx.checkpoint(None)
            self.ctx.note(records.RunResumed(was=was, step=self.ctx.checkpoint_step()))

    def _wait_out(self, exc: SlurmUnavailable) -> None:
        """A Slurm outage: journal it once, wait with back-off until every cluster the run uses answers, journal
        that."""
        ctx = self.ctx
        group = (len(ctx.state.attempts) or None) if self.across else None
        ctx.note_once(records.ErrorSeen(message=exc.message, where="slurm unavailable", group=group))
        ctx.wait_for_slurm(self.attempts.slurm_answers)
        # Slurm's return is journaled before what it then reports (a job that finished meanwhile)
        ctx.note(records.ErrorSeen(message="Slurm answers again", where="slurm available", group=group))
        ctx.said.pop(records.Kind.ERROR, None)  # a later outage is journaled again
