"""Co-scheduling a plan across Slurm clusters: one job per cluster, started together, re-planned together.

A het job cannot span clusters, so a plan across clusters runs as one job per cluster
(:func:`sailor_hpc.jobs.render.render_job_script` with ``cluster=``), all joining one rendezvous. Those
jobs only train when every one of them runs, so the co-scheduler treats them as one *group*:

- it submits every cluster's job (each with its cluster's ``SLURM_CONF``) and a fresh rendezvous file;
- a cluster whose job is still pending ``pending_bound_s`` after submission is dropped: the whole group
  is cancelled and the run re-planned without it (the ranks already running would only wait);
- a cluster whose job Slurm ends (cancelled, node failure, preemption, time limit) is lost like a node:
  the group is cancelled and the run re-planned on the remaining clusters; the next group starts from the
  newest complete checkpoint (``--auto-resume`` on the one checkpoint directory, layout-independent); a
  job that FAILED (the training's own error, or its ranks losing a peer cluster) cancels the group and
  retries it on the same clusters;
- a dropped or lost cluster comes back once it has idle GPUs again, ``rejoin_after_s`` after it left,
  after the running group has saved a checkpoint of its own and when ``regrow_gate`` agrees (the run's
  ``min_gain`` policy, :mod:`sailor_hpc.controller.geo_run`; refused, it is asked again ``rejoin_after_s``
  later): the group is asked to checkpoint and stop (SIGUSR1), then the run is re-planned across it (growth).

Planning is ``plan_for(clusters)``: :func:`planner_plan_for` asks the controller's planner
(:func:`~sailor_hpc.controller.planning.plan_on`) on the idle GPUs of those clusters' partitions; tests may
give fixed plans. Every event goes to ``on_event``; :mod:`sailor_hpc.controller.geo_run` journals them, and
resumes a killed co-scheduler by adopting its group (``run(adopt=...)``).
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sailor_hpc.controller.planning import plan_on
from sailor_hpc.controller.slurm_ops import cancel_and_wait, request_checkpoint
from sailor_hpc.controller.spec import RunSpec
from sailor_hpc.core.archive import ProfileArchive
from sailor_hpc.core.checkpoint import newest_step
from sailor_hpc.core.errors import JobFailed, SailorError, SlurmUnavailable
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.site import Site
from sailor_hpc.jobs.options import ClusterPart, JobOptions, Limits, Training
from sailor_hpc.jobs.render import cluster_submit_env, plan_clusters, render_job_script, write_job_script
from sailor_hpc.slurm.commands import sinfo_nodes
from sailor_hpc.slurm.status import JobStatus, poll_jobs
from sailor_hpc.slurm.submit import submit_script

SLURM_BACKOFF_MAX_S = 30.0  # the longest wait between polls while Slurm does not answer
PlanFor = Callable[[tuple[str, ...]], Plan]
#: a job that ends in one of these lost its cluster (Slurm ended it: cancelled, node failure, preemption, ...);
#: a FAILED job is the training's own failure, or the echo of a peer cluster's loss: retried, not dropped
CLUSTER_LOSS = frozenset({"CANCELLED", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "TIMEOUT"})


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
    """``plan_for`` from the planner: the run's best plan on the GPUs idle now in the given clusters (the
    group's own jobs are gone when it is asked: the co-scheduler re-plans only after they ended)."""
    return lambda clusters: plan_on(spec, site, archive, idle_by_node(site, clusters, env)).plan


@dataclass
class Group:
    """One attempt: the jobs of every cluster of one plan."""

    attempt: int
    plan: Plan
    jobs: dict[str, str]  # cluster -> job id (ids are per cluster)
    envs: dict[str, dict[str, str]]
    logs: dict[str, Path]
    submitted: float
    start_step: int  # newest complete checkpoint when submitted (what the group resumes from)

    def poll(self) -> dict[str, JobStatus]:
        return {c: poll_jobs([j], self.envs[c])[j] for c, j in self.jobs.items()}


@dataclass
class CoScheduler:
    """Runs one training across the clusters of ``site`` until its last step (see module doc)."""

    site: Site
    plan_for: PlanFor
    directory: Path  # scripts, plans, logs, rendezvous files: on a filesystem every cluster mounts
    save: Path
    data: str
    steps: int
    env: Mapping[str, str]
    train_args: Sequence[str] = ()
    time_limit: str = "00:30:00"
    pending_bound_s: float = 60.0
    rejoin_after_s: float = 30.0
    settle_s: float = 10.0  # after one job ends badly, how long the others get to end too (see _settle)
    poll_s: float = 0.5
    python: str | None = None  # interpreter on the compute nodes (default: the render's)
    name_prefix: str = "sailor-geo-"  # job names: <prefix><group>-<cluster> (the run's prefix: unique to the run)
    regrow_gate: Callable[[Group, tuple[str, ...]], bool] = lambda group, back: True
    on_event: Callable[[dict[str, Any]], None] = lambda e: None
    events: list[dict[str, Any]] = field(default_factory=list)
    _left: dict[str, float] = field(default_factory=dict)  # cluster -> when it was dropped or lost

    def _event(self, kind: str, **info: Any) -> None:
        rec = {"kind": kind, "t": time.time(), **info}
        self.events.append(rec)
        self.on_event(rec)

    def _newest_step(self) -> int:
        return newest_step(self.save)

    def _has_idle_gpus(self, cluster: str) -> bool:
        try:
            idle = idle_by_node(self.site, [cluster], self.env)
        except SlurmUnavailable:
            return False  # its controller does not answer: not back yet
        return any(g > 0 for nodes in idle.values() for g in nodes.values())

    def submit(self, clusters: tuple[str, ...], attempt: int) -> Group:
        plan = self.plan_for(clusters)
        used = plan_clusters(plan, self.site)
        if not set(used) <= set(clusters):
            raise SailorError(f"the plan for clusters {', '.join(clusters)} uses {', '.join(used)}",
                              field="plan_for", fix="plan only on the clusters given")
        self.directory.mkdir(parents=True, exist_ok=True)
        plan_path = self.directory / f"plan.{attempt}.json"
        plan.save(plan_path)
        rdzv = self.directory / f"rendezvous.{attempt}.{uuid.uuid4().hex}"  # fresh: an old one holds an old address
        start = self._newest_step()
        names = {c: f"{self.name_prefix}{attempt:03d}-{c}" for c in used}
        # journaled before the first sbatch: a group cut short by a kill or an outage is found by these names
        self._event("intent", attempt=attempt, job_names=names, start_step=start, plan_file=str(plan_path))
        jobs, envs, logs = {}, {}, {}
        for cluster in used:
            options = JobOptions(plan_path=plan_path, work=Training(self.data, self.save), steps=self.steps,
                                 limits=Limits(self.time_limit), train_args=tuple(self.train_args),
                                 scope=ClusterPart(cluster, rdzv), requeue=False,
                                 job_name=names[cluster], workdir=self.directory,
                                 python=self.python)
            text = render_job_script(plan, self.site, options)
            env = cluster_submit_env(self.site, cluster, self.env)
            rec = submit_script(write_job_script(self.directory / f"job.{attempt}.{cluster}.sh", text), env)
            jobs[cluster], envs[cluster], logs[cluster] = rec.job_id, env, Path(rec.log)
        self._event("submitted", attempt=attempt, jobs=dict(jobs), clusters=list(used), start_step=start,
                    plan_file=str(plan_path))
        return Group(attempt, plan, jobs, envs, logs, time.monotonic(), start)

    def stop(self, group: Group, reason: str) -> None:
        """Cancel every cluster's job of the group and wait until all are gone."""
        states = {c: cancel_and_wait(j, group.envs[c]) for c, j in group.jobs.items()}
        self._event("stopped", attempt=group.attempt, reason=reason, states=states)

    def _rejoining(self, group: Group) -> list[str]:
        """Clusters that left and may come back now (see module doc)."""
        now = time.monotonic()
        if self._newest_step() <= group.start_step:
            return []  # the group has not saved anything yet: moving now would recompute its steps
        back = [c for c, t in self._left.items() if now - t >= self.rejoin_after_s and self._has_idle_gpus(c)]
        if back and not self.regrow_gate(group, tuple(back)):
            self._left.update({c: now for c in back})  # not worth it now: asked again rejoin_after_s later
            return []
        return back

    def run(self, clusters: Sequence[str] | None = None, max_attempts: int = 20, *, first_attempt: int = 1,
            adopt: Group | None = None, left: Mapping[str, float] | None = None) -> int:
        """Train to ``steps``; returns the number of the last group. Raises JobFailed on giving up.

        A resumed co-scheduler passes the group it found still running (``adopt``: watched, not submitted),
        the next group's number (``first_attempt``) and the clusters that had left (cluster -> monotonic time)."""
        current = tuple(clusters or [c.name for c in self.site.clusters])
        self._left.update(left or {})
        for attempt in range(first_attempt, first_attempt + max_attempts):
            group = adopt if adopt is not None and attempt == adopt.attempt else self.submit(current, attempt)
            outcome = self._watch(group)
            if outcome is None:
                self._event("finished", attempt=attempt, step=self._newest_step())
                return attempt
            current = outcome
        raise JobFailed(f"no finished run after {max_attempts} groups", field="max_attempts",
                          fix="see the events: a cluster keeps failing or pending")

    def _watch(self, group: Group) -> tuple[str, ...] | None:
        """Poll the group until it finishes (None) or must change: the clusters to re-plan on."""
        all_running = False
        while True:
            time.sleep(self.poll_s)
            states = self._poll(group)
            if all(s.state == "COMPLETED" for s in states.values()):
                return None
            ended = {c: s.state for c, s in states.items() if s.final and s.state != "COMPLETED"}
            pending = [c for c, s in states.items() if s.state == "PENDING"]
            if not ended and pending and time.monotonic() - group.submitted > self.pending_bound_s:
                self._event("dropped", attempt=group.attempt, clusters=pending, reason="pending")
                return self._replan(group, pending, "pending")
            if ended:  # states read before our own cancel turns the others CANCELLED
                ended = self._settle(group, ended)
                lost = [c for c, st in ended.items() if st in CLUSTER_LOSS]
                self._event("lost" if lost else "failed", attempt=group.attempt, clusters=lost, states=ended)
                return self._replan(group, lost, "cluster lost" if lost else "job failed")
            if not all_running and all(s.state == "RUNNING" for s in states.values()):
                all_running = True
                self._event("all_running", attempt=group.attempt)
            back = self._rejoining(group) if all_running else []
            if back:
                self._event("rejoin", attempt=group.attempt, clusters=back, step=self._newest_step())
                for c, j in group.jobs.items():
                    request_checkpoint(j, group.envs[c])
                self._wait_final(group)
                for c in back:
                    del self._left[c]
                return tuple(dict.fromkeys([*group.jobs, *back]))

    def _poll(self, group: Group) -> dict[str, JobStatus]:
        """The group's job states, waiting (with back-off, said once) while a cluster's Slurm does not answer:
        as the single-cluster controller does, an outage is waited out, never taken for a lost cluster."""
        waits = 0
        while True:
            try:
                states = group.poll()
            except SlurmUnavailable as exc:
                if waits == 0:
                    self._event("slurm_unavailable", attempt=group.attempt, message=exc.message,
                                where="slurm unavailable")
                waits += 1
                time.sleep(min(SLURM_BACKOFF_MAX_S, self.poll_s * 2 ** min(waits, 10)))
                continue
            if waits:
                self._event("slurm_available", attempt=group.attempt, message="Slurm answers again",
                            where="slurm available")
            return states

    def _settle(self, group: Group, ended: dict[str, str]) -> dict[str, str]:
        """The end states of every job that ends within ``settle_s`` of the first: a cancelled cluster's job
        may show up final after its peers' ranks already failed on the lost connection."""
        deadline = time.monotonic() + self.settle_s
        while len(ended) < len(group.jobs) and time.monotonic() < deadline:
            time.sleep(self.poll_s)
            ended |= {c: s.state for c, s in group.poll().items() if s.final and s.state != "COMPLETED" and c not in ended}
        return ended

    def _replan(self, group: Group, gone: list[str], reason: str) -> tuple[str, ...]:
        self.stop(group, reason)
        now = time.monotonic()
        for c in gone:
            self._left[c] = now
        rest = tuple(c for c in group.jobs if c not in gone)
        if not rest:
            raise JobFailed(f"every cluster of the run left ({reason}: {', '.join(gone)})", field="clusters",
                              fix="check the clusters' queues and nodes, then start the run again")
        return rest

    def _wait_final(self, group: Group, timeout_s: float = 300.0) -> None:
        """After a checkpoint request: wait for every job to end by itself (exit 75), else cancel it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(s.final for s in group.poll().values()):
                self._event("stopped", attempt=group.attempt, reason="rejoin")
                return
            time.sleep(self.poll_s)
        self.stop(group, "rejoin: checkpoint request timed out")
