"""Seeing allocation changes: one snapshot of the job and the partitions per poll, and what changed.

An :class:`Observation` is what the controller knows after one round of Slurm queries: the job's
state and nodes (``squeue``/``sacct`` through :class:`~sailor_hpc.slurm.watch.JobWatcher`), every
node's state and the idle GPUs per node (``sinfo``), and from those the GPUs *free for the run*
(idle, plus the run's own job's GPUs while it runs: a new plan may reuse them).

The changes the controller reacts to are pure functions of observations:

- :func:`lost_nodes`: nodes of the job that are down, drained or draining, failing, not responding
  (:func:`is_lost`; a node merely *planned* for another job, or busy, is not lost);
- :func:`idle_increase`: partitions where more GPUs are free for the run than when it last judged;
- the job leaving RUNNING (requeued after a node failure or a preemption, saved on its time-limit
  signal, failed, completed) is read from the job state by the loop.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from sailor_hpc.core.plan import Plan
from sailor_hpc.jobs.layout import job_layout
from sailor_hpc.slurm.commands import SinfoNode
from sailor_hpc.slurm.hostlist import expand_hostlist
from sailor_hpc.slurm.safety import BUNDLE_SEP
from sailor_hpc.slurm.status import RUNNING_STATES, ComponentStatus, JobStatus, aggregate_state


@dataclass
class Observation:
    t: float
    job: JobStatus | None = None
    job_nodes: list[str] = field(default_factory=list)
    node_states: dict[str, str] = field(default_factory=dict)  # node -> sinfo long state
    unusable: dict[str, str] = field(default_factory=dict)  # node -> state, for nodes no new job can use now
    lost: dict[str, str] = field(default_factory=dict)  # node -> state, for nodes that lost (or drain) their jobs
    free: dict[str, dict[str, int]] = field(default_factory=dict)  # partition -> node -> GPUs free for the run
    idle: dict[str, dict[str, int]] = field(default_factory=dict)  # the same without the job's own GPUs

    @property
    def job_running(self) -> bool:
        return self.job is not None and self.job.state in RUNNING_STATES

    @property
    def available(self) -> dict[str, int]:
        return {p: sum(nodes.values()) for p, nodes in self.free.items()}


#: node states (``sinfo`` long names and their short forms) in which a node no longer runs its jobs,
#: or will stop to (draining); "planned" (``-``), "reserved" or "completing" nodes are not lost
_LOST_WORDS = ("down", "drain", "drng", "fail", "maint", "reboot", "power", "unknown", "inval", "not_responding")


def is_lost(state: str) -> bool:
    """Whether a node in this ``sinfo`` state is lost for the job on it (``*``: not responding)."""
    s = state.lower()
    return "*" in s or any(w in s for w in _LOST_WORDS)


def ends_its_jobs(state: str) -> bool:
    """Whether Slurm ends the jobs on a node in this ``sinfo`` state (down: at once; a draining node lets
    them run, so its jobs are lost to the plan, not ended)."""
    return state.lower().startswith("down")


def node_states(rows: list[SinfoNode]) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """(every node's state, the states of nodes no new job can use, the states of lost nodes) from ``sinfo -N``."""
    states: dict[str, str] = {}
    unusable: dict[str, str] = {}
    lost: dict[str, str] = {}
    for r in rows:
        states[r.name] = r.state
        if not r.usable:
            unusable[r.name] = r.state
        if is_lost(r.state):
            lost[r.name] = r.state
    return states, unusable, lost


def own_gpus(plan: Plan, job: JobStatus, hosts_of: Mapping[str, list[str]]) -> dict[str, dict[str, int]]:
    """GPUs the running job holds, partition -> node -> count (het component i runs layout component i)."""
    out: dict[str, dict[str, int]] = {}
    comps = job_layout(plan).components
    for comp, status in zip(comps, job.components):
        if status.final:  # a bundle's job that Slurm ended: its nodes are no longer the run's
            continue
        for host in hosts_of.get(status.nodes, []):
            part = out.setdefault(comp.partition, {})
            part[host] = part.get(host, 0) + comp.tasks_per_node
    return out


def free_for_run(idle: Mapping[str, Mapping[str, int]], own: Mapping[str, Mapping[str, int]],
                 unusable: Mapping[str, str], lost: Mapping[str, str]) -> dict[str, dict[str, int]]:
    """Idle GPUs per usable node plus the run's own GPUs (except on lost nodes)."""
    out = {p: {n: int(g) for n, g in nodes.items() if n not in unusable} for p, nodes in idle.items()}
    for p, nodes in own.items():
        for n, g in nodes.items():
            if n not in lost:
                out.setdefault(p, {})[n] = out.get(p, {}).get(n, 0) + g
    return out


def cpu_bound(idle: Mapping[str, Mapping[str, int]], rows: list[SinfoNode],
              cpus_per_gpu: Mapping[str, int]) -> dict[str, dict[str, int]]:
    """Idle GPUs per node that a job can also get CPUs for: each rank asks ``cpus_per_gpu[partition]`` CPUs,
    so a node whose CPUs are held (by the run's own job, or another) has fewer usable GPUs than idle ones,
    and a plan on all of them would wait for CPUs that never free up."""
    cpus = {(r.partition, r.name): r.cpus_idle for r in rows}
    return {p: {n: min(int(g), cpus.get((p, n), 0) // max(1, cpus_per_gpu.get(p, 1))) for n, g in nodes.items()}
            for p, nodes in idle.items()}


def never_now(unusable: Mapping[str, str]) -> list[str]:
    """Nodes no job can get now nor soon (down, drained, failing, reserved ...): a new job excludes them.
    A node merely *planned* for a pending job (``-``, "planned") is not: a job that ends first may use it."""
    return sorted(n for n, s in unusable.items() if not (s.endswith("-") or "planned" in s.lower()))


#: squeue reasons of a pending job that Slurm does not clear soon: what it waits for is down, drained or set
#: aside, not busy (Resources, Priority: those clear as jobs end)
_NODE_REASONS = ("ReqNodeNotAvail", "NodeDown", "Nodes required for job are DOWN")
_STUCK_REASONS = (*_NODE_REASONS, "PartitionDown", "PartitionInactive", "Reservation", "ResvDeleted")


def stuck_reason(job: JobStatus) -> str | None:
    """The squeue reason a component of the pending job waits for that will not clear soon (None: none does)."""
    return next((c.reason for c in job.components if c.reason.startswith(_STUCK_REASONS)), None)


def about_nodes(reason: str) -> bool:
    """Whether a pending job's reason is about nodes (down, drained): a new job without them can start."""
    return reason.startswith(_NODE_REASONS)


def lost_nodes(job_nodes: list[str], lost: Mapping[str, str], known: Mapping[str, str]) -> dict[str, str]:
    """Nodes of the job that are lost and were not reported yet (node -> state)."""
    return {n: lost[n] for n in job_nodes if n in lost and n not in known}


def draining_only(states: Mapping[str, str]) -> bool:
    """All these nodes still run their jobs (draining: the job may checkpoint before it leaves)."""
    return bool(states) and all(s.lower().startswith(("draining", "drng")) for s in states.values())


def idle_increase(baseline: Mapping[str, int], available: Mapping[str, int]) -> dict[str, tuple[int, int]]:
    """Partitions with more GPUs free for the run than ``baseline``: partition -> (before, now)."""
    return {p: (int(baseline.get(p, 0)), int(n)) for p, n in available.items() if n > baseline.get(p, 0)}


def all_running(job: JobStatus) -> bool:
    """Every component runs (a completing one is ending, and its GPUs are no longer the run's)."""
    return bool(job.components) and all(_runs(c) for c in job.components)


def trains(job: JobStatus) -> bool:
    """The job's ranks may be training: every component runs; a bundle's (``12,13``), its first job runs and every
    other job runs or ended. That first job's agent answers for the whole bundle
    (:mod:`sailor_hpc.controller.job_agent`): a job Slurm ended with its batch node is its to re-plan without
    (in place), any other end is its to end the bundle for, which the controller then sees."""
    ids = job.job_id.split(BUNDLE_SEP)
    if len(ids) == 1:
        return all_running(job)
    return (any(c.job_id == ids[0] and _runs(c) for c in job.components)
            and all(_runs(c) or c.final for c in job.components))


def without_ended_jobs(job: JobStatus, lost: Collection[str]) -> JobStatus:
    """A bundle's status without the jobs it went on without (ended, every node of theirs lost: a lost batch node,
    answered in place): the state of what the run still had is the others'. Anything else is left as it is."""
    if BUNDLE_SEP not in job.job_id:
        return job
    keep = [c for c in job.components if not (c.final and c.nodes and set(expand_hostlist(c.nodes)) <= set(lost))]
    if not keep or len(keep) == len(job.components):
        return job
    return JobStatus(job.job_id, keep, aggregate_state([c.state for c in keep]))


def _runs(c: ComponentStatus) -> bool:
    return c.state in RUNNING_STATES and c.state != "COMPLETING"
