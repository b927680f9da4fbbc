"""Grow without a gap: a bigger job beside the running one, which takes over once its ranks are ready.

When more idle GPUs make a bigger plan worth its restart (``min_gain``) and a plan on the idle GPUs
alone is worth it too, the run need not stop first:

1. the bigger job is submitted while the running one trains (``grow_submitted``); its ranks start,
   rendezvous, build the model, and wait for a gate file before loading anything
   (``megatron_patch.launch --wait-for <run dir>/gates/attempt-N.go``);
2. once it runs (``grow_running``) and every rank says it waits, the running job is asked to
   checkpoint and stop (SIGUSR1, and ``Requeue=0`` so it ends instead of requeueing itself);
3. once that job's ``srun`` steps are gone, no rank of it can write checkpoints any more: the gate
   opens (``gate_opened``) and the new ranks load exactly the checkpoint it saved on the signal;
4. once the old job is gone (journaled), the bigger job becomes the run's attempt (``submit_intent``
   with ``handover_from``): the journal still never has two current jobs.

A bigger job whose ranks are not ready within ``grow_timeout_s``, or that fails before, is cancelled
(``grow_cancelled``) and training goes on where it is; so it is when the old job ends by itself first.
Part of the one-job attempt (:class:`~sailor_hpc.controller.one_job.OneJob`), acting through the run's context.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sailor_hpc.controller import records, slurm_ops
from sailor_hpc.controller.attempt_job import prepare_attempt, submit_attempt
from sailor_hpc.controller.context import RunContext
from sailor_hpc.controller.events import Observation, all_running, never_now
from sailor_hpc.controller.planning import plan_on
from sailor_hpc.controller.policy import Score, judge
from sailor_hpc.controller.progress import LogTail, saved_on_signal
from sailor_hpc.controller.state import RESIZE_REASON, Attempt, Successor, job_name
from sailor_hpc.core.atomic import atomic_write_text
from sailor_hpc.core.errors import NoPlanFits, SailorError
from sailor_hpc.slurm.handle import SlurmCluster
from sailor_hpc.slurm.hostlist import expand_hostlists


class Grower:
    """The grow-without-a-gap steps of a run on one cluster (see the module doc). ``stop(attempt, reason)`` asks
    the attempt's job to checkpoint and end (the one-job attempt's own way)."""

    def __init__(self, ctx: RunContext, cluster: SlurmCluster, stop: Callable[[Attempt, str], None]) -> None:
        self.ctx = ctx
        self.cluster = cluster
        self.stop = stop
        self._tails: dict[str, LogTail] = {}
        self._logs: dict[str, list[Path]] = {}  # the bigger job's logs (a bundle's: one per job)

    def grow(self, cur: Attempt, obs: Observation, trigger_t: float, remaining: int, restart_s: float) -> bool:
        """Submit the bigger job on idle GPUs alone, beside the running one, if such a plan is worth it too;
        the running job trains until the new one runs (:meth:`watch_successor`). False: it needs the job's
        own GPUs (or none fits): the caller stops the job first, as before."""
        try:
            planned = plan_on(self.ctx.spec, self.ctx.site, self.ctx.archive, obs.idle)
        except NoPlanFits:
            return False
        if not judge(self.ctx.spec.planning.objective, Score(cur.throughput, cur.cost_per_hour), planned.score, remaining,
                     restart_s, self.ctx.spec.control.min_gain).resize:
            return False
        number = len(self.ctx.state.attempts) + 1
        name = job_name(self.ctx.spec.run_id, number)
        plan_path, scripts = prepare_attempt(self.ctx.rundir, self.ctx.spec, self.ctx.site, planned.plan, number,
                                             name, gate=self.ctx.rundir.gate_file(number), exclude=never_now(obs.unusable))
        self.ctx.note(records.PlanChosen(reason=RESIZE_REASON, available=obs.available, planner_available=planned.available,
                  plan_file=str(plan_path), **planned.summary()))
        try:
            job, log = submit_attempt(self.cluster, scripts, plan_path, self.ctx.spec.planning.site)
        except SailorError as exc:  # sbatch refused the bigger job: train on where it is, judge again later
            self.ctx.note(records.ErrorSeen(message=str(exc), where="sbatch (bigger job)"))
            self.ctx.note(records.Baseline(available=obs.available))
            return True
        self.ctx.note(records.GrowSubmitted(attempt=cur.number, next_attempt=number, job_id=job.id, job_name=name,
                  log=log, plan_file=str(plan_path), script=" ".join(map(str, scripts)), trigger_t=trigger_t,
                  gpus=planned.summary()["gpus"], throughput=planned.score.throughput,
                  cost_per_hour=planned.score.cost_per_hour))
        return True

    def watch_successor(self, cur: Attempt, idle: dict[str, dict[str, int]]) -> None:
        """Once the bigger job runs and all its ranks wait at the gate (started, rendezvous done, model
        built), ask this one to checkpoint and end; cancel the bigger one if it is not that far within
        ``grow_timeout_s`` (the run keeps training where it is). One that timed out still pending journals the
        queue it could not start on (``idle``, GPUs per node): no bigger job is tried on that queue again."""
        succ = cur.successor
        assert succ is not None
        job = self.cluster.job(succ.grown.job_id).status()
        if succ.running_t is None and all_running(job):
            hosts = expand_hostlists(c.nodes for c in job.components)
            self.ctx.note(records.GrowRunning(attempt=cur.number, job_id=succ.grown.job_id, nodes=hosts))
        if succ.running_t is not None and cur.stop is None and self._successor_ready(succ):
            self.stop(cur, "resize")
        elif cur.stop is None and (job.final or self.ctx.clock() - succ.grown.t > self.ctx.spec.control.grow_timeout_s):
            why = f"ended ({job.state}) before its ranks were ready" if job.final else \
                f"its ranks were not ready {self.ctx.spec.control.grow_timeout_s:.0f} s after it was submitted"
            self.drop_successor(cur, why, queue=idle if succ.running_t is None and not job.final else None)

    def _successor_ready(self, succ: Successor) -> bool:
        """Every rank of the bigger job said it waits for the gate (its logs' ``waiting`` records: a bundle's ranks
        write to their own job's log)."""
        if succ.grown.job_id not in self._logs:
            self._logs[succ.grown.job_id] = self.cluster.job(succ.grown.job_id).logs()
        waiting = 0
        for log in self._logs[succ.grown.job_id]:
            tail = self._tails.setdefault(str(log), LogTail(str(log)))
            tail.poll()
            waiting += tail.waiting
        return waiting >= self.ctx.plan(succ.grown.plan_file).num_gpus

    def drop_successor(self, cur: Attempt, reason: str, queue: dict[str, dict[str, int]] | None = None) -> str:
        """Cancel the bigger job (the run trains on where it is); returns its final state. ``queue``: the idle
        GPUs per node it could not start on."""
        succ = cur.successor
        assert succ is not None
        state = slurm_ops.cancel_and_wait(self.cluster.job(succ.grown.job_id))
        self.ctx.note(records.GrowCancelled(attempt=cur.number, job_id=succ.grown.job_id, reason=reason, state=state,
                                            queue=queue))
        return state

    def open_gate_early(self, cur: Attempt, tail: LogTail | None) -> bool:
        """Let the bigger job's waiting ranks load as soon as this job's ranks are gone (they saved on the
        resize signal): its batch script still ends, but no rank of it writes checkpoints any more."""
        succ = cur.successor
        if cur.successor_loading:  # opened before this controller was resumed
            return True
        if not (cur.waits_for_successor and succ and succ.running_t and saved_on_signal(tail, self.ctx.checkpoint_step())):
            return False
        if cur.job_id is None or not slurm_ops.training_steps_gone(self.cluster.job(cur.job_id)):
            return False
        self.open_gate(succ.grown.next_attempt)
        self.ctx.note(records.GateOpened(attempt=cur.number, next_attempt=succ.grown.next_attempt, job_id=succ.grown.job_id))
        return True

    def handover(self, prev: Attempt) -> None:
        """The old job is gone: the bigger one becomes the run's job, and its waiting ranks may load."""
        s = prev.successor
        assert s is not None
        g = s.grown
        n = g.next_attempt
        self.ctx.note(records.SubmitIntent(attempt=n, job_name=g.job_name, plan_file=g.plan_file, script=g.script,
                  reason=RESIZE_REASON, trigger=records.Kind.IDLE_GPUS, trigger_t=g.trigger_t, gpus=g.gpus,
                  throughput=g.throughput, cost_per_hour=g.cost_per_hour, handover_from=prev.number))
        self.ctx.note(records.Submitted(attempt=n, job_id=g.job_id, log=g.log, submitted_t=g.t))
        self.ctx.note(records.JobRunning(attempt=n, job_id=g.job_id, nodes=s.nodes, since=s.running_t))
        self.open_gate(n)

    def open_gate(self, attempt: int) -> None:
        gate = self.ctx.rundir.gate_file(attempt)
        gate.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(gate, "go\n")
