"""``sailor-hpc run`` on a site of several clusters: the co-scheduler driven from a run directory, journaled.

A het job cannot span clusters, so such a run is not the controller's one job per attempt but the
:class:`~sailor_hpc.controller.cosched.CoScheduler`'s group of jobs (one per cluster). This module gives it
what the controller has: the run directory (``run.json``, the lock, the journal), every co-scheduler event
as a journal record (``group_submitted``, ``cluster_dropped``, ``cluster_lost``, ``regrown``,
``group_recovered``...; numbered by ``group``, folded by :func:`~sailor_hpc.controller.state.apply`), so
``sailor-hpc run status`` tells the story, and ``--resume`` after a kill: the last group's jobs still
pending or running are adopted and watched; else what is left of them is cancelled and the run continues
from the newest complete checkpoint. A group's intent (``group_intent``, its jobs' names unique to the run)
is journaled before its first ``sbatch``, so a group cut short while submitting is found by name; a Slurm
outage is waited out with back-off and then handled as such a resume.

The spec's options map onto the co-scheduler: ``--grow-timeout`` bounds how long a cluster's job may stay
pending, ``--replan-interval`` how soon a cluster that left is tried again, ``--poll`` the polling; and a
cluster that is back is only regrown across when the new plan gains ``--min-gain`` after the restart
cost (:func:`~sailor_hpc.controller.policy.judge`, the restart cost measured from the run's recoveries).
A run starts at most ``--max-restarts`` + 1 groups per co-scheduler start, then gives up.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sailor_hpc.controller.cosched import (
    SLURM_BACKOFF_MAX_S,
    CoScheduler,
    Group,
    PlanFor,
    idle_by_node,
    planner_plan_for,
)
from sailor_hpc.controller.planning import plan_on
from sailor_hpc.controller.policy import Score, judge, restart_cost
from sailor_hpc.controller.recorder import EXIT_FINISHED, EXIT_GAVE_UP, EXIT_INTERRUPTED, Recorder
from sailor_hpc.controller.records import (
    ClusterDropped,
    ClusterLost,
    ControllerStopped,
    ErrorSeen,
    Finished,
    GaveUp,
    GroupAdopted,
    GroupFailed,
    GroupIntent,
    GroupRecovered,
    GroupRunning,
    GroupStopped,
    GroupSubmitted,
    Record,
    RegrowDecision,
    Regrown,
)
from sailor_hpc.controller.slurm_ops import find_job_by_name
from sailor_hpc.controller.state import RunDir, RunState, job_name_prefix
from sailor_hpc.core.archive import open_archive
from sailor_hpc.core.checkpoint import newest_step
from sailor_hpc.core.errors import JobFailed, SailorError, SlurmUnavailable
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.site import Site, load_site
from sailor_hpc.jobs.render import cluster_submit_env
from sailor_hpc.slurm.commands import controller_answers
from sailor_hpc.slurm.hostlist import expand_hostlists
from simulator import SimOptions, simulate

#: events after which the next group running is a recovery (its time is the run's measured restart cost)
TRIGGERS = frozenset({"dropped", "lost", "failed", "rejoin"})


def record_of(event: dict[str, Any]) -> Record:
    """The journal record of one co-scheduler event (its ``attempt`` is the record's ``group``)."""
    group, kind = int(event["attempt"]), event["kind"]
    match kind:
        case "intent":
            return GroupIntent(group=group, job_names=event["job_names"], start_step=event["start_step"],
                               plan_file=event["plan_file"])
        case "submitted":
            return GroupSubmitted(group=group, jobs=event["jobs"], clusters=event["clusters"],
                                  start_step=event["start_step"], plan_file=event["plan_file"])
        case "all_running":
            return GroupRunning(group=group)
        case "dropped":
            return ClusterDropped(group=group, clusters=event["clusters"], reason=event["reason"])
        case "lost":
            return ClusterLost(group=group, clusters=event["clusters"], states=event["states"])
        case "failed":
            return GroupFailed(group=group, clusters=event["clusters"], states=event["states"])
        case "rejoin":
            return Regrown(group=group, clusters=event["clusters"], step=event["step"])
        case "stopped":
            return GroupStopped(group=group, reason=event["reason"], states=event.get("states"))
        case "finished":
            return Finished(group=group, step=event["step"])
        case "slurm_unavailable" | "slurm_available":
            return ErrorSeen(group=group, message=event["message"], where=event["where"])
    raise ValueError(f"no journal record for the co-scheduler's {kind!r} event")


def across_clusters(site: Site) -> bool:
    """Whether ``sailor-hpc run`` drives this site with the co-scheduler."""
    return len(site.clusters) > 1


def free_with_group(site: Site, clusters: tuple[str, ...], env: Mapping[str, str], group: Group) -> dict[str, dict[str, int]]:
    """GPUs free per node of ``clusters`` if ``group`` stopped: idle ones, and every GPU of the group's nodes
    (it may not hold them all; the plan made once it stopped is checked against what is really free)."""
    states = group.poll() if any(c in group.jobs for c in clusters) else {}
    ours = {c: set(expand_hostlists(p.nodes for p in states[c].components)) for c in clusters if c in group.jobs}
    return idle_by_node(site, clusters, env, ours)


class GeoRun(Recorder):
    """Drives one run directory whose site has several clusters until it is finished or gives up.

    ``plan_for`` replaces the planner (tests give fixed plans); the regrow decision then judges the plan it
    gives for the grown clusters."""

    def __init__(self, rundir: RunDir, env: Mapping[str, str] | None = None, *,
                 echo: Callable[[str], None] | None = None, plan_for: PlanFor | None = None) -> None:
        self.rundir = rundir
        self.spec = rundir.spec()
        self.env = dict(os.environ if env is None else env)
        self.site = load_site(self.spec.site)
        self.archive = open_archive(self.spec.profiles, self.site)
        self.fixed_plans = plan_for
        self.plan_for = plan_for or planner_plan_for(self.spec, self.site, self.archive, self.env)
        self.echo = echo or (lambda _line: None)
        self.state = RunState()
        self.journal: Any = None
        self._trigger: tuple[str, float] | None = None

    def scheduler(self) -> CoScheduler:
        s = self.spec
        return CoScheduler(site=self.site, plan_for=self.plan_for, directory=self.rundir.path, save=Path(s.save),
                           data=s.data, steps=s.steps, env=self.env,
                           train_args=("--save-interval", str(s.save_interval), *s.train_args),
                           time_limit=s.time_limit or "00:30:00", pending_bound_s=s.grow_timeout_s,
                           rejoin_after_s=s.replan_interval_s, poll_s=s.poll_s, python=s.python,
                           regrow_gate=self._worth_regrowing, on_event=self._on_event,
                           name_prefix=job_name_prefix(s.run_id))

    def run(self) -> int:
        """Hold the run's lock and drive it; returns 0 (finished), 1 (gave up) or 130 (interrupted)."""
        with self.rundir.lock():
            self.begin()
            if self.state.finished:
                return EXIT_FINISHED
            if self.state.gave_up:
                return EXIT_GAVE_UP
            sched = self.scheduler()
            try:
                self._drive(sched)
            except KeyboardInterrupt:
                self.note(ControllerStopped(reason="interrupted; the jobs keep running (sailor-hpc run --resume)"))
                return EXIT_INTERRUPTED
            except (JobFailed, SailorError) as exc:  # every cluster left, or bad input: retrying cannot help
                self.note(GaveUp(reason=str(exc)))
                return EXIT_GAVE_UP
            return EXIT_FINISHED

    def _drive(self, sched: CoScheduler) -> None:
        """Run the co-scheduler from the journal's state until the run finishes. A Slurm outage anywhere (an
        ``sbatch`` that does not answer, a cancel, a plan's ``sinfo``) is waited out with back-off, said once
        when it starts and once when every cluster answers again; then the run goes on as a resumed one:
        the current group, partly submitted or not, is adopted or stopped (:meth:`_reconcile`)."""
        while True:
            try:
                adopt = self._reconcile(sched)
                if self.state.finished:
                    return
                gone = set(self.state.left)
                clusters = (adopt.jobs if adopt is not None
                            else [c.name for c in self.site.clusters if c.name not in gone] or list(gone))
                first = adopt.attempt if adopt is not None else len(self.state.groups) + 1
                sched.run(tuple(clusters), max_attempts=self.spec.max_restarts + 1, first_attempt=first,
                          adopt=adopt, left={c: time.monotonic() - (time.time() - t) for c, t in self.state.left.items()})
                return
            except SlurmUnavailable as exc:
                self.note(ErrorSeen(group=len(self.state.groups) or None, message=exc.message,
                                    where="slurm unavailable"))
            waits = 0
            while not self._slurm_answers():
                waits += 1
                time.sleep(min(SLURM_BACKOFF_MAX_S, self.spec.poll_s * 2 ** min(waits, 10)))
            self.note(ErrorSeen(group=len(self.state.groups) or None, message="Slurm answers again",
                                where="slurm available"))

    def _slurm_answers(self) -> bool:
        """Whether the slurmctld of every cluster the run may use (not left) answers."""
        clusters = [c.name for c in self.site.clusters if c.name not in self.state.left]
        return all(controller_answers(cluster_submit_env(self.site, c, self.env)) for c in clusters)

    def _reconcile(self, sched: CoScheduler) -> Group | None:
        """After a restart or an outage: the last group, adopted if every cluster's job of it (journaled, or
        found by its name when the group was cut short while submitting) still pends or runs; else stopped."""
        cur = self.state.current_group
        if cur is None:
            return None
        envs = {c: cluster_submit_env(self.site, c, self.env) for c in cur.clusters}
        jobs = dict(cur.jobs)
        for c, name in cur.job_names.items():
            if c not in jobs and (found := find_job_by_name(self.spec.run_id, name, envs[c], cur.submitted_t)):
                jobs[c] = found
        submitted = time.monotonic() - (time.time() - cur.submitted_t)  # the journal's clock -> the pending bound's
        group = Group(cur.number, load_plan(cur.plan_file, site=self.site), jobs, envs, {}, submitted,
                      cur.start_step)
        states = {c: s.state for c, s in group.poll().items()}
        whole = set(jobs) == set(cur.clusters)
        if whole and all(st == "COMPLETED" for st in states.values()):
            self.note(Finished(group=cur.number, step=newest_step(Path(self.spec.save)), states=states))
        elif whole and all(st in ("PENDING", "RUNNING") for st in states.values()):
            self.note(GroupAdopted(group=cur.number, jobs=dict(jobs), states=states))
            return group
        else:
            missing = sorted(set(cur.clusters) - set(jobs))
            sched.stop(group, f"resumed: not every job runs ({states}"
                              + (f"; never submitted on {', '.join(missing)})" if missing else ")"))
        return None

    def _on_event(self, event: dict[str, Any]) -> None:
        """Journal one co-scheduler event (``attempt`` becomes ``group``), and a recovery once the group after a
        change runs whole."""
        self.note(record_of(event))
        if event["kind"] in TRIGGERS:
            self._trigger = (event["kind"], event["t"])
        elif event["kind"] == "all_running" and self._trigger is not None:
            self.note(GroupRecovered(group=event["attempt"], trigger=self._trigger[0],
                      recovery_s=round(event["t"] - self._trigger[1], 3)))
            self._trigger = None

    def _score(self, plan: Plan) -> Score:
        """The plan scored as the planner scores it: simulated as the runtime that will run it runs it."""
        r = simulate(plan, self.site, self.archive, options=SimOptions(runtime=self.spec.plan_request({}).runtime))
        return Score(r.throughput_samples_per_s, r.cost_per_hour)

    def _worth_regrowing(self, group: Group, back: tuple[str, ...]) -> bool:
        """The controller's resize policy for growing back across ``back``: the plan on the grown clusters must
        gain ``min_gain`` over the running group's after the (measured) restart cost."""
        grown = tuple(dict.fromkeys([*group.jobs, *back]))
        try:
            new = (self.fixed_plans(grown) if self.fixed_plans is not None
                   else plan_on(self.spec, self.site, self.archive, free_with_group(self.site, grown, self.env, group)).plan)
            current, candidate = self._score(group.plan), self._score(new)
        except (SailorError, SlurmUnavailable) as exc:  # no plan fits the grown clusters, or one does not answer
            self.note(RegrowDecision(group=group.attempt, clusters=list(back), resize=False, reason=str(exc)))
            return False
        remaining = max(0, self.spec.steps - newest_step(Path(self.spec.save))) * self.spec.gbs
        measured = [r.recovery_s for r in self.journal.records if isinstance(r, GroupRecovered)]
        verdict = judge(self.spec.objective, current, candidate, remaining,
                        restart_cost(self.spec.restart_cost_s, measured), self.spec.min_gain)
        self.note(RegrowDecision(group=group.attempt, clusters=list(back), **verdict.to_dict()))
        return verdict.resize
