"""The controller's attempts across clusters: a *group* of one Slurm job per cluster, started and re-planned together.

A het job cannot span clusters, so on a site of several clusters the controller's attempt is one job per
cluster (:func:`sailor_hpc.jobs.render.render_job_script` with a :class:`ClusterPart`), all joining one
rendezvous; they only train when every one of them runs. These are the policies of that attempt, steps of
the one :class:`~sailor_hpc.controller.loop.Controller` (its run directory, lock, journal and outage wait):

- every cluster's job is submitted (each with its cluster's ``SLURM_CONF``, a fresh rendezvous file) after
  the group's intent is journaled (``group_intent``: its jobs' names, unique to the run), so a group cut short
  while submitting, by a kill or a Slurm outage, is found by name;
- a cluster whose job still pends ``--grow-timeout`` after submission is dropped: the group is cancelled and
  the run re-planned without it (the ranks already running would only wait);
- a cluster whose job Slurm ends (cancelled, node failure, preemption, time limit) is lost like a node: the
  group is cancelled and re-planned on the remaining clusters, resuming from the newest complete checkpoint;
  a job that FAILED (the training's own error, or its ranks losing a peer cluster) retries the group on the
  same clusters;
- a cluster that left comes back once it has idle GPUs, ``--replan-interval`` after it left, after the
  running group saved a checkpoint of its own and when the plan across it gains ``--min-gain`` after the
  measured restart cost (:func:`~sailor_hpc.controller.policy.judge`; refused, it is asked again later): the
  group checkpoints and stops (SIGUSR1), then the run is re-planned across it;
- a Slurm outage anywhere is waited out with the controller's back-off, then the run goes on as a resumed
  one: the current group's jobs, journaled or found by name, are adopted when all of them pend or run, else
  stopped. A run starts at most ``--max-restarts`` + 1 groups per controller start, then gives up.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sailor_hpc.controller import records
from sailor_hpc.controller.planning import plan_on
from sailor_hpc.controller.policy import Score, judge, restart_cost
from sailor_hpc.controller.slurm_ops import cancel_and_wait, find_job_by_name, request_checkpoint
from sailor_hpc.controller.spec import RunSpec
from sailor_hpc.controller.state import RunDir, RunState, job_name_prefix
from sailor_hpc.core.archive import ProfileArchive
from sailor_hpc.core.checkpoint import newest_step
from sailor_hpc.core.errors import JobFailed, SailorError, SlurmUnavailable
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.site import Site
from sailor_hpc.jobs.options import ClusterPart, JobOptions, Limits, Training
from sailor_hpc.jobs.render import cluster_submit_env, plan_clusters, render_job_script, write_job_script
from sailor_hpc.slurm.commands import controller_answers, sinfo_nodes
from sailor_hpc.slurm.hostlist import expand_hostlists
from sailor_hpc.slurm.status import JobStatus, poll_jobs
from sailor_hpc.slurm.submit import submit_script
from simulator import SimOptions, simulate

PlanFor = Callable[[tuple[str, ...]], Plan]
#: a job that ends in one of these lost its cluster (Slurm ended it: cancelled, node failure, preemption, ...);
#: a FAILED job is the training's own failure, or the echo of a peer cluster's loss: retried, not dropped
CLUSTER_LOSS = frozenset({"CANCELLED", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "TIMEOUT"})
SETTLE_S = 10.0  # after one job ends badly, how long the others get to end too (see _settle)
#: events after which the next group running is a recovery (its time is the run's measured restart cost)
TRIGGERS = frozenset({"dropped", "lost", "failed", "rejoin"})


def across_clusters(site: Site) -> bool:
    """Whether the controller's attempts are groups (one job per cluster) on this site."""
    return len(site.clusters) > 1


def idle_by_node(site: Site, clusters: Sequence[str], env: Mapping[str, str],
                 whole: Mapping[str, set[str]] | None = None) -> dict[str, dict[str, int]]:
    """Idle GPUs per usable node of ``clusters``' partitions, partition -> node -> GPUs (``sinfo`` through each
    cluster's SLURM_CONF; node names may repeat across clusters, partition names do not). Nodes in
    ``whole[cluster]`` count with every GPU (a running group's own, as if it had stopped)."""
    out: dict[str, dict[str, int]] = {}
    for cluster in clusters:
        parts = [p.name for p in site.partitions if p.cluster == cluster]
        full = (whole or {}).get(cluster, set())
        for n in sinfo_nodes(cluster_submit_env(site, cluster, env), parts):
            if n.usable and n.partition in parts:
                out.setdefault(n.partition, {})[n.name] = n.gpus if n.name in full else max(0, n.gpus - n.gpus_used)
    return out


def planner_plan_for(spec: RunSpec, site: Site, archive: ProfileArchive, env: Mapping[str, str]) -> PlanFor:
    """The run's best plan on the GPUs idle now in the given clusters (a group is only re-planned after its
    jobs ended, so its own GPUs are idle by then)."""
    return lambda clusters: plan_on(spec, site, archive, idle_by_node(site, clusters, env)).plan


@dataclass
class Group:
    """One attempt across clusters: the jobs of every cluster of one plan."""

    attempt: int
    plan: Plan
    jobs: dict[str, str]  # cluster -> job id (ids are per cluster)
    envs: dict[str, dict[str, str]]
    logs: dict[str, Path]
    submitted: float  # monotonic
    start_step: int  # newest complete checkpoint when submitted (what the group resumes from)

    def poll(self) -> dict[str, JobStatus]:
        return {c: poll_jobs([j], self.envs[c])[j] for c, j in self.jobs.items()}


class Groups:
    """The controller's steps for attempts that are groups (see the module doc)."""

    # what the Controller this is mixed into provides
    spec: RunSpec
    site: Site
    archive: ProfileArchive
    rundir: RunDir
    state: RunState
    journal: Any
    genv: dict[str, str]  # the environment every cluster's own is derived from
    plan_for: PlanFor
    fixed_plans: PlanFor | None
    _trigger: tuple[str, float] | None
    _left: dict[str, float]  # cluster -> when it was dropped or lost (monotonic)

    if TYPE_CHECKING:  # declared for the type checker only, so no stub can shadow the Controller's methods
        def note(self, record: records.Record) -> records.Record: ...  # Recorder.note

        def wait_for_slurm(self, answers: Callable[[], bool]) -> None: ...  # Controller.wait_for_slurm

    # ------------------------------------------------------------------------------------------ driving

    def drive_groups(self) -> None:
        """Run groups from the journal's state until the run finishes (raises JobFailed or SailorError on
        giving up). A Slurm outage anywhere (an ``sbatch``, a cancel, a plan's ``sinfo``) is waited out, said
        once when it starts and once when every cluster answers again; then the current group, partly
        submitted or not, is adopted or stopped (:meth:`_reconcile_group`)."""
        while True:
            try:
                adopt = self._reconcile_group()
                if self.state.finished:
                    return
                gone = set(self.state.left)
                clusters = (adopt.jobs if adopt is not None
                            else [c.name for c in self.site.clusters if c.name not in gone] or list(gone))
                first = adopt.attempt if adopt is not None else len(self.state.groups) + 1
                self._left = {c: time.monotonic() - (time.time() - t) for c, t in self.state.left.items()}
                self._run_groups(tuple(clusters), first, adopt)
                return
            except SlurmUnavailable as exc:
                self.note(records.ErrorSeen(group=len(self.state.groups) or None, message=exc.message,
                                    where="slurm unavailable"))
            self.wait_for_slurm(self._clusters_answer)
            self.note(records.ErrorSeen(group=len(self.state.groups) or None, message="Slurm answers again",
                                where="slurm available"))

    def _clusters_answer(self) -> bool:
        """Whether the slurmctld of every cluster the run may use (not left) answers."""
        clusters = [c.name for c in self.site.clusters if c.name not in self.state.left]
        return all(controller_answers(cluster_submit_env(self.site, c, self.genv)) for c in clusters)

    def _run_groups(self, clusters: tuple[str, ...], first: int, adopt: Group | None) -> None:
        """Train to ``steps``, at most ``max_restarts`` + 1 groups; a resumed controller watches the group it
        adopted instead of submitting it."""
        tries = self.spec.max_restarts + 1
        for attempt in range(first, first + tries):
            group = adopt if adopt is not None and attempt == adopt.attempt else self._submit_group(clusters, attempt)
            outcome = self._watch_group(group)
            if outcome is None:
                self._event("finished", attempt=attempt, step=newest_step(Path(self.spec.save)))
                return
            clusters = outcome
        raise JobFailed(f"no finished run after {tries} groups", field="max_attempts",
                        fix="see the events: a cluster keeps failing or pending")

    def _reconcile_group(self) -> Group | None:
        """After a restart or an outage: the last group, adopted if every cluster's job of it (journaled, or
        found by its name when the group was cut short while submitting) still pends or runs; else stopped."""
        cur = self.state.current_group
        if cur is None:
            return None
        envs = {c: cluster_submit_env(self.site, c, self.genv) for c in cur.clusters}
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
            self.note(records.Finished(group=cur.number, step=newest_step(Path(self.spec.save)), states=states))
        elif whole and all(st in ("PENDING", "RUNNING") for st in states.values()):
            self.note(records.GroupAdopted(group=cur.number, jobs=dict(jobs), states=states))
            return group
        else:
            missing = sorted(set(cur.clusters) - set(jobs))
            self._stop_group(group, f"resumed: not every job runs ({states}"
                             + (f"; never submitted on {', '.join(missing)})" if missing else ")"))
        return None

    # ------------------------------------------------------------------------------------------ journal

    def _event(self, kind: str, **info: Any) -> None:
        self._on_event({"kind": kind, "t": time.time(), **info})

    def _on_event(self, event: dict[str, Any]) -> None:
        """Journal one group event (``attempt`` becomes ``group``), and a recovery once the group after a
        change runs whole."""
        self.note(record_of(event))
        if event["kind"] in TRIGGERS:
            self._trigger = (event["kind"], event["t"])
        elif event["kind"] == "all_running" and self._trigger is not None:
            self.note(records.GroupRecovered(group=event["attempt"], trigger=self._trigger[0],
                      recovery_s=round(event["t"] - self._trigger[1], 3)))
            self._trigger = None

    # ----------------------------------------------------------------------------------------- one group

    def _submit_group(self, clusters: tuple[str, ...], attempt: int) -> Group:
        s, directory = self.spec, self.rundir.path
        plan = self.plan_for(clusters)
        used = plan_clusters(plan, self.site)
        if not set(used) <= set(clusters):
            raise SailorError(f"the plan for clusters {', '.join(clusters)} uses {', '.join(used)}",
                              field="plan_for", fix="plan only on the clusters given")
        plan_path = directory / f"plan.{attempt}.json"
        plan.save(plan_path)
        rdzv = directory / f"rendezvous.{attempt}.{uuid.uuid4().hex}"  # fresh: an old one holds an old address
        start = newest_step(Path(s.save))
        names = {c: f"{job_name_prefix(s.run_id)}{attempt:03d}-{c}" for c in used}
        # journaled before the first sbatch: a group cut short by a kill or an outage is found by these names
        self._event("intent", attempt=attempt, job_names=names, start_step=start, plan_file=str(plan_path))
        jobs, envs, logs = {}, {}, {}
        for cluster in used:
            options = JobOptions(plan_path=plan_path, work=Training(s.data, Path(s.save)), steps=s.steps,
                                 limits=Limits(s.time_limit or "00:30:00"),
                                 train_args=("--save-interval", str(s.save_interval), *s.train_args),
                                 scope=ClusterPart(cluster, rdzv), requeue=False,
                                 job_name=names[cluster], workdir=directory, python=s.python)
            env = cluster_submit_env(self.site, cluster, self.genv)
            text = render_job_script(plan, self.site, options)
            rec = submit_script(write_job_script(directory / f"job.{attempt}.{cluster}.sh", text), env)
            jobs[cluster], envs[cluster], logs[cluster] = rec.job_id, env, Path(rec.log)
        self._event("submitted", attempt=attempt, jobs=dict(jobs), clusters=list(used), start_step=start,
                    plan_file=str(plan_path))
        return Group(attempt, plan, jobs, envs, logs, time.monotonic(), start)

    def _stop_group(self, group: Group, reason: str) -> None:
        """Cancel every cluster's job of the group and wait until all are gone."""
        states = {c: cancel_and_wait(j, group.envs[c]) for c, j in group.jobs.items()}
        self._event("stopped", attempt=group.attempt, reason=reason, states=states)

    def _watch_group(self, group: Group) -> tuple[str, ...] | None:
        """Poll the group until it finishes (None) or must change: the clusters to re-plan on."""
        all_running = False
        while True:
            time.sleep(self.spec.poll_s)
            states = self._poll_group(group)
            if all(s.state == "COMPLETED" for s in states.values()):
                return None
            ended = {c: s.state for c, s in states.items() if s.final and s.state != "COMPLETED"}
            pending = [c for c, s in states.items() if s.state == "PENDING"]
            if not ended and pending and time.monotonic() - group.submitted > self.spec.grow_timeout_s:
                self._event("dropped", attempt=group.attempt, clusters=pending, reason="pending")
                return self._replan_without(group, pending, "pending")
            if ended:  # states read before our own cancel turns the others CANCELLED
                ended = self._settle(group, ended)
                lost = [c for c, st in ended.items() if st in CLUSTER_LOSS]
                self._event("lost" if lost else "failed", attempt=group.attempt, clusters=lost, states=ended)
                return self._replan_without(group, lost, "cluster lost" if lost else "job failed")
            if not all_running and all(s.state == "RUNNING" for s in states.values()):
                all_running = True
                self._event("all_running", attempt=group.attempt)
            back = self._rejoining(group) if all_running else []
            if back:
                self._event("rejoin", attempt=group.attempt, clusters=back, step=newest_step(Path(self.spec.save)))
                for c, j in group.jobs.items():
                    request_checkpoint(j, group.envs[c])
                self._wait_group_final(group)
                for c in back:
                    del self._left[c]
                return tuple(dict.fromkeys([*group.jobs, *back]))

    def _poll_group(self, group: Group) -> dict[str, JobStatus]:
        """The group's job states; a cluster's Slurm not answering is waited out (said once), never taken for
        a lost cluster."""
        try:
            return group.poll()
        except SlurmUnavailable as exc:
            self._event("slurm_unavailable", attempt=group.attempt, message=exc.message, where="slurm unavailable")
        states: dict[str, JobStatus] = {}

        def answers() -> bool:
            try:
                states.update(group.poll())
            except SlurmUnavailable:
                return False
            return True

        self.wait_for_slurm(answers)
        self._event("slurm_available", attempt=group.attempt, message="Slurm answers again", where="slurm available")
        return states

    def _settle(self, group: Group, ended: dict[str, str]) -> dict[str, str]:
        """The end states of every job that ends within ``SETTLE_S`` of the first: a cancelled cluster's job
        may show up final after its peers' ranks already failed on the lost connection."""
        deadline = time.monotonic() + SETTLE_S
        while len(ended) < len(group.jobs) and time.monotonic() < deadline:
            time.sleep(self.spec.poll_s)
            ended |= {c: s.state for c, s in group.poll().items() if s.final and s.state != "COMPLETED" and c not in ended}
        return ended

    def _replan_without(self, group: Group, gone: list[str], reason: str) -> tuple[str, ...]:
        self._stop_group(group, reason)
        now = time.monotonic()
        for c in gone:
            self._left[c] = now
        rest = tuple(c for c in group.jobs if c not in gone)
        if not rest:
            raise JobFailed(f"every cluster of the run left ({reason}: {', '.join(gone)})", field="clusters",
                            fix="check the clusters' queues and nodes, then start the run again")
        return rest

    def _wait_group_final(self, group: Group, timeout_s: float = 300.0) -> None:
        """After a checkpoint request: wait for every job to end by itself (exit 75), else cancel it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(s.final for s in group.poll().values()):
                self._event("stopped", attempt=group.attempt, reason="rejoin")
                return
            time.sleep(self.spec.poll_s)
        self._stop_group(group, "rejoin: checkpoint request timed out")

    # -------------------------------------------------------------------------------------------- regrow

    def _has_idle_gpus(self, cluster: str) -> bool:
        try:
            idle = idle_by_node(self.site, [cluster], self.genv)
        except SlurmUnavailable:
            return False  # its controller does not answer: not back yet
        return any(g > 0 for nodes in idle.values() for g in nodes.values())

    def _rejoining(self, group: Group) -> list[str]:
        """Clusters that left and may come back now (see the module doc)."""
        now = time.monotonic()
        if newest_step(Path(self.spec.save)) <= group.start_step:
            return []  # the group has not saved anything yet: moving now would recompute its steps
        back = [c for c, t in self._left.items()
                if now - t >= self.spec.replan_interval_s and self._has_idle_gpus(c)]
        if back and not self._worth_regrowing(group, tuple(back)):
            self._left.update({c: now for c in back})  # not worth it now: asked again a replan interval later
            return []
        return back

    def _score(self, plan: Plan) -> Score:
        """The plan scored as the planner scores it: simulated as the runtime that will run it runs it."""
        r = simulate(plan, self.site, self.archive, options=SimOptions(runtime=self.spec.plan_request({}).runtime))
        return Score(r.throughput_samples_per_s, r.cost_per_hour)

    def _worth_regrowing(self, group: Group, back: tuple[str, ...]) -> bool:
        """The resize policy for growing back across ``back``: the plan on the grown clusters must gain
        ``min_gain`` over the running group's after the (measured) restart cost."""
        grown = tuple(dict.fromkeys([*group.jobs, *back]))
        try:
            new = (self.fixed_plans(grown) if self.fixed_plans is not None
                   else plan_on(self.spec, self.site, self.archive, self._free_with_group(grown, group)).plan)
            current, candidate = self._score(group.plan), self._score(new)
        except (SailorError, SlurmUnavailable) as exc:  # no plan fits the grown clusters, or one does not answer
            self.note(records.RegrowDecision(group=group.attempt, clusters=list(back), resize=False, reason=str(exc)))
            return False
        remaining = max(0, self.spec.steps - newest_step(Path(self.spec.save))) * self.spec.gbs
        measured = [r.recovery_s for r in self.journal.records if isinstance(r, records.GroupRecovered)]
        verdict = judge(self.spec.objective, current, candidate, remaining,
                        restart_cost(self.spec.restart_cost_s, measured), self.spec.min_gain)
        self.note(records.RegrowDecision(group=group.attempt, clusters=list(back), **verdict.to_dict()))
        return verdict.resize

    def _free_with_group(self, clusters: tuple[str, ...], group: Group) -> dict[str, dict[str, int]]:
        """GPUs free per node of ``clusters`` if ``group`` stopped: idle ones, and every GPU of the group's nodes
        (it may not hold them all; the plan made once it stopped is checked against what is really free)."""
        states = group.poll() if any(c in group.jobs for c in clusters) else {}
        ours = {c: set(expand_hostlists(p.nodes for p in states[c].components)) for c in clusters if c in group.jobs}
        return idle_by_node(self.site, clusters, self.genv, ours)


def record_of(event: dict[str, Any]) -> records.Record:
    """The journal record of one group event (its ``attempt`` is the record's ``group``)."""
    group, kind = int(event["attempt"]), event["kind"]
    match kind:
        case "intent":
            return records.GroupIntent(group=group, job_names=event["job_names"], start_step=event["start_step"],
                               plan_file=event["plan_file"])
        case "submitted":
            return records.GroupSubmitted(group=group, jobs=event["jobs"], clusters=event["clusters"],
                                  start_step=event["start_step"], plan_file=event["plan_file"])
        case "all_running":
            return records.GroupRunning(group=group)
        case "dropped":
            return records.ClusterDropped(group=group, clusters=event["clusters"], reason=event["reason"])
        case "lost":
            return records.ClusterLost(group=group, clusters=event["clusters"], states=event["states"])
        case "failed":
            return records.GroupFailed(group=group, clusters=event["clusters"], states=event["states"])
        case "rejoin":
            return records.Regrown(group=group, clusters=event["clusters"], step=event["step"])
        case "stopped":
            return records.GroupStopped(group=group, reason=event["reason"], states=event.get("states"))
        case "finished":
            return records.Finished(group=group, step=event["step"])
        case "slurm_unavailable" | "slurm_available":
            return records.ErrorSeen(group=group, message=event["message"], where=event["where"])
    raise ValueError(f"no journal record for the group event {kind!r}")
