"""Re-plan on what is free now: the planner on idle GPU counts, checked against the free GPUs per node.

The planner sees GPUs per partition; Slurm gives whole per-node shares. A plan that puts 2 ranks
on one node of a partition whose idle GPUs are 1 + 1 on two nodes would wait in the queue forever, and
so would one that puts 1 rank on each of two nodes where only one node has idle GPUs (the other down,
drained or busy). So every plan is checked node by node (:func:`misfit`: each het component's nodes on
distinct usable nodes with enough free GPUs); where it does not fit, the partition's count is lowered
below what that plan used and the planner asked again.

"Free" means idle, plus the GPUs of the run's own running job: moving the job releases them.

Objective time plans a new job on the queue instead (:func:`plan_on_queue`): a plan may wait for a busy
partition when that finishes first, and while the job pends it is judged again on the current queue
(:func:`judge_pending`), since the blockers may end sooner or later than their limits said.

A run of runtime ``auto`` searches both runtimes at every re-plan and takes DeepSpeed's best plan while it is
within ``min_gain`` of megatron_patch's (:func:`_per_runtime`): DeepSpeed is what its users run, and the
layout-free checkpoint lets the next job resume under either runtime when the free GPUs need a plan DeepSpeed's
engine cannot express (a heterogeneous one).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar

from planner import SearchResult
from planner.on_queue import QueueState, RequestFor, plan_on_state
from planner.time_goal import TimeGoal, plan_shape
from planner.time_queue import TimeTerms
from sailor_hpc.controller.policy import Score
from sailor_hpc.controller.spec import RunSpec
from sailor_hpc.core.archive import ProfileArchive
from sailor_hpc.core.checkpoint import newest_step
from sailor_hpc.core.errors import NoPlanFits, SailorError
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.site import Site
from sailor_hpc.core.start_times import QueueSnapshot
from sailor_hpc.jobs.layout import job_layout
from sailor_hpc.jobs.render import parse_time_limit
from sailor_hpc.slurm.start_estimate import StartEstimator

FreeByNode = Mapping[str, Mapping[str, int]]  # partition -> node -> free GPUs
TEST_ONLY_TOP = 3  # plans whose start Slurm is asked (sbatch --test-only), as `plan` shows by default
AUTO_RUNTIMES = ("deepspeed", "megatron_patch")  # what runtime auto searches, preferred first
_T = TypeVar("_T")


@dataclass(frozen=True)
class QueueOutlook:
    """When a plan on the queue is expected to start (and from which estimate) and to finish, in seconds from
    ``queue_read_t``, when the queue was read."""

    start_s: float
    source: str
    finish_s: float
    queue_read_t: float


@dataclass(frozen=True)
class Planned:
    plan: Plan
    score: Score
    iteration_s: float
    available: dict[str, int]  # GPUs per partition the planner was given
    queue: QueueOutlook | None = None  # objective time on the queue
    runtime: str = "megatron_patch"  # who trains the plan
    runtime_reason: str | None = None  # runtime auto: why this runtime's plan was taken

    def summary(self) -> dict[str, Any]:
        out = {"gpus": self.plan.gpus_by_partition(), "throughput": self.score.throughput,
               "cost_per_hour": self.score.cost_per_hour, "iteration_s": self.iteration_s,
               "pipelines": len(self.plan.pipelines), "runtime": self.runtime}
        if self.runtime_reason is not None:
            out["runtime_reason"] = self.runtime_reason
        if self.queue is not None:
            q = self.queue
            out.update(expected_start_s=q.start_s, start_source=q.source, expected_finish_s=q.finish_s,
                       queue_read_t=q.queue_read_t)
        return out


@dataclass(frozen=True)
class PendingVerdict:
    """The run's pending job against the best plan on the current queue (finishes: seconds from the read)."""

    move: bool
    best: Planned
    pending_finish_s: float
    pending_start_s: float
    gain: float  # the share of the pending job's expected finish the best plan saves
    reason: str


def node_demands(plan: Plan) -> dict[str, list[int]]:
    """GPUs per node the plan's job asks for, per partition (one entry per node of the job)."""
    out: dict[str, list[int]] = {}
    for comp in job_layout(plan).components:
        out.setdefault(comp.partition, []).extend([comp.tasks_per_node] * comp.nodes)
    return out


def misfit(plan: Plan, free: FreeByNode) -> str | None:
    """The first partition whose per-node demands do not fit its nodes' free GPUs (None: it all fits).

    The nodes of one het component are distinct nodes (``--nodes=N`` never gives a node twice): a
    component of 2 nodes of 1 rank needs two nodes with a free GPU, not one node with two, else Slurm
    waits for a node that is down or busy. Components may share a node (Slurm allocates each alone).
    Largest demands first, each component on the nodes with the most GPUs left."""
    left = {part: dict(nodes) for part, nodes in free.items()}
    for comp in sorted(job_layout(plan).components, key=lambda c: -c.tasks_per_node):
        slots = left.setdefault(comp.partition, {})
        fit = sorted((n for n, have in slots.items() if have >= comp.tasks_per_node), key=lambda n: -slots[n])
        if len(fit) < comp.nodes:
            return comp.partition
        for node in fit[:comp.nodes]:
            slots[node] -= comp.tasks_per_node
    return None


def partitions_for_time(time_limit: str | None, site: Site) -> set[str]:
    """Partitions whose maximum walltime admits jobs of ``time_limit`` (Slurm refuses a job over it, and a
    re-plan onto such a partition would end the run). Without a limit, every partition: each job then
    gets the default time, cut to its partitions' maxima."""
    if time_limit is None:
        return {p.name for p in site.partitions}
    norm, seconds = parse_time_limit(time_limit)
    allowed = {p.name for p in site.partitions if p.max_walltime_s is None or p.max_walltime_s >= seconds}
    if not allowed:
        longest = max(site.partitions, key=lambda p: p.max_walltime_s or 0)
        raise SailorError(f"time limit {norm} exceeds every partition's maximum (longest: {longest.name!r}, "
                          f"{longest.max_walltime})", field="--time",
                          fix="ask for less time: each job checkpoints on its limit and the next one resumes")
    return allowed


def plan_on(spec: RunSpec, site: Site, archive: ProfileArchive, free: FreeByNode) -> Planned:
    """The planner's best plan for the run on the free GPUs ``free``, placeable now, on partitions that
    admit the run's time limit (runtime auto: the runtime chosen as :func:`_per_runtime` says)."""
    best, runtime, why = _per_runtime(spec, partial(_plan_on, spec, site, archive, free), lambda p: p)
    return replace(best, runtime=runtime, runtime_reason=why)


def _plan_on(spec: RunSpec, site: Site, archive: ProfileArchive, free: FreeByNode, runtime: str) -> Planned:
    """:func:`plan_on` for one runtime."""
    allowed = partitions_for_time(spec.job.time_limit, site)
    available = {p.name: int(sum(free.get(p.name, {}).values())) if p.name in allowed else 0 for p in site.partitions}
    idle = QueueSnapshot.all_idle(free)  # objective time: every plan starts now, they differ in run and restarts
    time = _time_terms(spec)
    for _ in range(1 + sum(available.values())):
        if sum(available.values()) <= 0:
            break
        state = QueueState(dict(available), idle)
        best = _plan_on_state(site, archive, state, partial(spec.planning.request, runtime=runtime), time, 1).candidates[0]
        bad = misfit(best.plan, free)
        if bad is None:
            r = best.result
            return Planned(best.plan, Score(r.throughput_samples_per_s, r.cost_per_hour), r.iteration_time_s,
                           dict(available), runtime=runtime)
        available[bad] = max(0, min(available[bad], best.plan.gpus_by_partition().get(bad, 0)) - 1)
    raise NoPlanFits(f"no plan fits the free GPUs now ({ {p: sum(n.values()) for p, n in free.items()} })",
                      field="availability", fix="the controller waits for GPUs to become idle")


def _measure(objective: str, planned: Planned) -> float:
    """What the objective minimises for ``planned``: the expected finish on the queue, the cost of a sample, or
    the time of a sample (throughput, and time on the GPUs free now, where the finish is remaining / throughput)."""
    if planned.queue is not None:
        return planned.queue.finish_s
    if planned.score.throughput <= 0:
        return math.inf
    per_sample = 1.0 / planned.score.throughput
    return per_sample * planned.score.cost_per_hour if objective == "cost" else per_sample


def _per_runtime(spec: RunSpec, plan_with: Callable[[str], _T],
                 planned_of: Callable[[_T], Planned]) -> tuple[_T, str, str | None]:
    """``plan_with(runtime)`` for the run's runtime; under ``auto`` for both, taking DeepSpeed's plan when its
    objective measure is within ``min_gain`` of megatron_patch's (or when only one runtime has a plan on these
    GPUs). Returns the result, its runtime and why (None: the run has one runtime)."""
    if spec.planning.runtime != "auto":
        return plan_with(spec.planning.runtime), spec.planning.runtime, None
    found: dict[str, _T] = {}
    failed: dict[str, NoPlanFits] = {}
    for runtime in AUTO_RUNTIMES:
        try:
            found[runtime] = plan_with(runtime)
        except NoPlanFits as exc:
            failed[runtime] = exc
    if not found:
        raise failed["megatron_patch"]  # its plan space holds DeepSpeed's: its reason is the general one
    if len(found) == 1:
        (runtime, result), = found.items()
        other = next(iter(failed))
        return result, runtime, f"only {runtime} has a plan here ({other}: {failed[other].message})"
    ds, mp = (_measure(spec.planning.objective, planned_of(found[r])) for r in AUTO_RUNTIMES)
    behind = ds / mp - 1.0 if math.isfinite(ds) and mp > 0 else math.inf
    runtime = "deepspeed" if behind <= spec.control.min_gain else "megatron_patch"
    what = "expected finish" if planned_of(found["deepspeed"]).queue is not None else spec.planning.objective
    why = (f"DeepSpeed's best plan is {100 * behind:+.1f} % behind megatron_patch's in {what} "
           f"({'<=' if runtime == 'deepspeed' else '>'} min_gain {100 * spec.control.min_gain:.0f} %)")
    return found[runtime], runtime, why


def _time_terms(spec: RunSpec) -> TimeTerms | None:
    """Objective time's terms of the run (None for the other objectives): its remaining steps decide its finish,
    since a resized or resumed run has fewer left than it began with."""
    if spec.planning.objective != "time":
        return None
    job = spec.job
    return TimeTerms(max(1, job.steps - newest_step(job.save)), time_limit=job.time_limit, time_min=job.time_min,
                     restart_cost_s=60.0 if spec.control.restart_cost_s is None else spec.control.restart_cost_s)


def _plan_on_state(site: Site, archive: ProfileArchive, state: QueueState, request_for: RequestFor,
                   time: TimeTerms | None, top_k: int) -> SearchResult:
    """:func:`planner.on_queue.plan_on_state`, "no plan on these GPUs" (memory, profiles of the free types) a wait
    (NoPlanFits); a bad request stays bad input (SailorError)."""
    return plan_on_state(site, archive, state, request_for, time, top_k=top_k, no_plan=_wait)


def _wait(exc: SailorError) -> SailorError:
    if isinstance(exc, NoPlanFits):
        return exc
    return NoPlanFits(exc.message, file=exc.file, field=exc.field, fix="the controller waits for GPUs to become idle")


def plan_on_queue(spec: RunSpec, site: Site, archive: ProfileArchive, estimator: StartEstimator,
                  pending: frozenset[str] = frozenset()) -> tuple[Planned, TimeGoal]:
    """Objective time: the plan of the run's remaining steps that finishes first on the queue read now (the
    same goal and ranking as ``plan --objective time``), and the goal it was ranked on. ``pending``: the job
    ids of the run's own pending job, left out of the queue (it is the one being judged, not a blocker).
    Runtime auto: the runtime chosen as :func:`_per_runtime` says, on the same queue read."""
    allowed = partitions_for_time(spec.job.time_limit, site)
    estimator.new_plan()  # each re-plan gets the whole budget of Slurm calls
    snapshot = estimator.site_snapshot(site, sorted(allowed))
    if pending:
        snapshot = replace(snapshot, holds=tuple(h for h in snapshot.holds if h.job not in pending),
                           unplanned=tuple(j for j in snapshot.unplanned if j.job not in pending))
    available = {p.name: int(sum(snapshot.node_gpus.get(p.name, {}).values())) if p.name in allowed else 0
                 for p in site.partitions}
    state = QueueState(available, snapshot, partial(estimator.test_only, site))

    def on_queue(runtime: str) -> tuple[Planned, TimeGoal]:
        result = _plan_on_state(site, archive, state, partial(spec.planning.request, runtime=runtime), _time_terms(spec),
                                TEST_ONLY_TOP)
        best, ranked = result.candidates[0], result.request.time_goal
        assert ranked is not None
        o = ranked.plan_outlook(best.plan, best.result.iteration_time_s)
        r = best.result
        return Planned(best.plan, Score(r.throughput_samples_per_s, r.cost_per_hour), r.iteration_time_s, available,
                       QueueOutlook(o.start.start_s, o.start.source, o.finish_s, snapshot.taken_at), runtime), ranked

    (planned, ranked), _, why = _per_runtime(spec, on_queue, lambda t: t[0])
    return replace(planned, runtime_reason=why), ranked


def judge_pending(spec: RunSpec, site: Site, archive: ProfileArchive, estimator: StartEstimator, job_id: str,
                  plan: Plan, iteration_s: float) -> PendingVerdict:
    """Re-plan on the current queue while the run's job ``job_id`` (of ``plan``) pends: move (cancel it and
    submit the best plan) only when the best plan's expected finish beats the pending job's by more than
    ``min_gain`` of it; the pending job's own finish is the queue timeline's (Slurm's --test-only would
    queue the question behind the job itself)."""
    pending = frozenset(str(int(job_id) + i) for i in range(len(job_layout(plan).components)))  # het components
    best, goal = plan_on_queue(spec, site, archive, estimator, pending)
    timeline = replace(goal, snapshot=replace(goal.snapshot, tested={}))
    mine = timeline.plan_outlook(plan, iteration_s)
    assert best.queue is not None
    if plan_shape(best.plan) == plan_shape(plan):
        return PendingVerdict(False, best, mine.finish_s, mine.start.start_s, 0.0,
                              "the pending job's plan is still the one that finishes first")
    gain = (mine.finish_s - best.queue.finish_s) / mine.finish_s if math.isfinite(mine.finish_s) else 1.0
    move = gain > spec.control.min_gain
    reason = (f"pending job: start in {mine.start.start_s:.0f} s ({mine.start.source}), finish in "
              f"{mine.finish_s:.0f} s; best plan {best.plan.gpus_by_partition()}: start in {best.queue.start_s:.0f} s "
              f"({best.queue.source}), finish in {best.queue.finish_s:.0f} s; gain {100 * gain:.0f} % "
              f"{'>' if move else '<='} min_gain {100 * spec.control.min_gain:.0f} %")
    return PendingVerdict(move, best, mine.finish_s, mine.start.start_s, gain, reason)
