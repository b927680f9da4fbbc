"""What every search speaks: its candidates and result, their ranking, the GPUs a request may use, and why
nothing was feasible. The single-cluster, geo and DeepSpeed searches all build on these, so a plan is ranked,
bounded and refused the same way whichever search found it."""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from planner.request import PlanRequest
from sailor_hpc.core.archive import ProfileArchive
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import get_model
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.precision import PREFERENCE
from sailor_hpc.core.site import Partition, Site
from simulator import SimResult

TIE_DIGITS = 4  # significant digits of the ranked value below which two plans tie (the plan table prints as many)
ESTIMATE_SLACK = 0.05  # a search's estimated time against the simulation of its plan (capped sync tails)
Progress = Callable[[int, int], None]  # (done, total) callbacks of a search


@dataclass
class Candidate:
    """A placed plan and its simulation."""

    plan: Plan
    result: SimResult

    @property
    def throughput(self) -> float:
        return self.result.throughput_samples_per_s


class ScoredAllocation(NamedTuple):
    """One allocation the search scored, by its estimate (not simulated): a point of the Pareto chart."""

    gpus: int
    cost_per_hour: float
    throughput: float  # samples per second, estimated


@dataclass
class SearchResult:
    """What a search answers: the feasible plans, best first by :func:`ranking`, and what it cost to find them."""

    request: PlanRequest
    candidates: list[Candidate]  # feasible, best first
    search_time_s: float
    allocations_scored: int
    plans_simulated: int
    rejected: dict[str, int] = field(default_factory=dict)
    simulated: list[Candidate] = field(default_factory=list)  # every plan simulated that fits in memory
    scored: list[ScoredAllocation] = field(default_factory=list)  # every allocation scored (empty: not kept)
    left_out: dict[str, str] = field(default_factory=dict)  # partition -> why no job of it can start now


def default_available(site: Site) -> dict[str, int]:
    """Every GPU a job may take from each partition (its size, capped by the per-job node limit)."""
    return {p.name: min(p.nodes, p.max_nodes_per_job) * p.gpus_per_node for p in site.partitions}


def usable_gpus(site: Site, request: PlanRequest) -> dict[str, int]:
    """GPUs per partition the request may use: what it names, else every GPU a job may take."""
    return request.available or default_available(site)


def copy_counts(max_copies: int, micro_batches: int) -> list[int]:
    """n = ceil(M / m) for m = 1..M: the fewest pipelines that give each micro-batch count m."""
    values = sorted({math.ceil(micro_batches / m) for m in range(1, micro_batches + 1)})
    return [n for n in values if n <= max_copies]


def candidate_dtypes(site: Site, archive: ProfileArchive, request: PlanRequest) -> list[str]:
    """The dtypes, best first (:data:`PREFERENCE`), that some partition the request may use trains in and
    has compute profiles of: a plan's dtype is then the best its GPUs support, never a guess from another's."""
    model = get_model(request.model).name
    available = usable_gpus(site, request)
    usable = [p for p in site.partitions if available.get(p.name, 0) > 0]
    return [d for d in PREFERENCE
            if any(d in site.gpu(p.gpu_type).dtypes and archive.has_compute(model, p.gpu_type, d) for p in usable)]


def tie_value(x: float) -> float:
    """``x`` to :data:`TIE_DIGITS` significant digits: the ranking's grid, on which equal values are a tie."""
    return float(f"{x:.{TIE_DIGITS}g}")


def ranking(request: PlanRequest) -> Callable[[Candidate], tuple[float, ...]]:
    """Best first: iteration time, cost per sample, or expected finish. Under the throughput and cost
    objectives a tie (equal on the :func:`tie_value` grid, as the plan table prints them) goes to the plan
    with fewer GPUs, then the cheaper per hour: a few thousandths of a second are the simulator's noise, not
    a reason to take more GPUs. The time objective ranks on finish, then throughput."""
    goal = request.time_goal
    if request.objective == "time" and goal is not None:
        return lambda x: (goal.plan_outlook(x.plan, x.result.iteration_time_s).finish_s, -x.throughput)
    gbs = request.global_batch_size

    def primary(x: Candidate) -> float:
        r = x.result
        return r.iteration_time_s if request.objective == "throughput" else r.cost_per_iteration / gbs

    return lambda x: (tie_value(primary(x)), x.plan.num_gpus, x.result.cost_per_hour, primary(x), -x.throughput)


def partition_gpus(part: Partition, available: int, capacity: int, request: PlanRequest) -> tuple[int, bool]:
    """GPUs of ``part`` a plan may use under the request's constraints, and whether the cost budget alone
    leaves none (no more GPUs than the budget buys: templates are ranked on the GPUs they may really get)."""
    c = request.constraints
    gpus = available if c.max_gpus is None else min(available, c.max_gpus)
    priced_out = False
    if c.max_cost_per_hour is not None and part.cost_per_gpu_hour > 0:
        gpus = min(gpus, int(c.max_cost_per_hour / part.cost_per_gpu_hour + 1e-9))
        priced_out = gpus <= 0
    return min(gpus, capacity), priced_out


def infeasible(request: PlanRequest, site: Site, rejected: dict[str, int], fitting: list[Candidate],
                scored: int) -> SailorError:
    """Explain why no plan met the request: the constraint that cut the most, with the closest value."""
    c = request.constraints
    if not scored:
        limits = ", ".join(f"{k}={v}" for k, v in (("max_gpus", c.max_gpus), ("max_cost_per_hour", c.max_cost_per_hour))
                           if v is not None)
        return SailorError(f"no allocation fits the GPU limits ({limits or 'the available GPUs'})",
                           field="--max-gpus/--max-cost-per-hour",
                           fix="raise the limit, or make more GPUs available")
    if fitting and rejected.get("min_throughput"):
        best = max(x.throughput for x in fitting)
        return SailorError(f"the fastest plan found reaches {best:.1f} samples/s, below --min-throughput "
                           f"{c.min_throughput}", field="--min-throughput",
                           fix="lower it, or allow more GPUs / a higher budget")
    if fitting and rejected.get("max_cost_per_iteration"):
        cheapest = min(x.result.cost_per_iteration for x in fitting)
        return SailorError(f"the cheapest plan this search simulated costs {cheapest:.4g} {site.cost_unit} per "
                           f"iteration, above --max-cost-per-iteration {c.max_cost_per_iteration}",
                           field="--max-cost-per-iteration",
                           fix="raise it, or lower the global batch (`--objective cost` finds the cheapest plan)")
    if fitting and (rejected.get("deadline") or rejected.get("max_gpu_hours") or rejected.get("never_starts")):
        return time_infeasible(request, fitting)
    if not fitting and set(rejected) == {"placement"}:
        return SailorError(f"no plan of {request.model} packs its TP groups into the nodes a job may take",
                           field="partitions", file=site.source,
                           fix="raise max_nodes_per_job, or make more nodes available")
    return SailorError(f"no plan of {request.model} fits in GPU memory on the available GPUs",
                       field="--available", fix="make GPUs with more memory available, or a smaller model/batch")


def time_infeasible(request: PlanRequest, fitting: list[Candidate]) -> SailorError:
    """No plan meets --deadline / --max-gpu-hours, or none can start: say the closest one, or why."""
    goal = request.time_goal
    assert goal is not None
    looks = [goal.plan_outlook(c.plan, c.result.iteration_time_s) for c in fitting]
    starting = [o for o in looks if math.isfinite(o.start.start_s)]
    if not starting:
        reasons = sorted({o.start.detail or o.start.source for o in looks})
        return SailorError(f"no plan can start under the site's current states: {'; '.join(reasons)}",
                           field="partitions", fix="wait until the site can start them (sailor-hpc plan again), "
                                                   "or plan on other partitions (--available)")
    if goal.deadline_s is not None and all(o.finish_s > goal.deadline_s for o in starting):
        best = min(starting, key=lambda o: o.finish_s)
        return SailorError(f"the soonest expected finish is {_hms(best.finish_s)} from now (start {_hms(best.start.start_s)} "
                           f"+ run {_hms(best.run_s + best.restart_s)}), after --deadline ({_hms(goal.deadline_s)})",
                           field="--deadline", fix="move the deadline, train fewer steps, or allow a larger budget")
    least = min(o.gpu_hours for o in starting)
    return SailorError(f"the plan using the fewest GPU-hours needs {least:.3g}, above --max-gpu-hours "
                       f"{goal.max_gpu_hours}", field="--max-gpu-hours", fix="raise it, or train fewer steps")


def _hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def best_over_dtypes(request: PlanRequest, dtypes: list[str],
                     search_one: Callable[[PlanRequest], SearchResult]) -> SearchResult:
    """``--dtype auto``: ``search_one`` in each of ``dtypes`` (non-empty), the best plans of all merged (a mix of
    GPU types may plan faster in fp16 than its bf16 part alone); the first dtype's error when none has a plan."""
    results: list[SearchResult] = []
    first_error: SailorError | None = None
    for dtype in dtypes:
        try:
            results.append(search_one(replace(request, dtype=dtype)))
        except SailorError as exc:
            first_error = first_error or exc
    if not results:
        assert first_error is not None
        raise first_error
    merged = sorted((c for r in results for c in r.candidates), key=ranking(request))
    return SearchResult(request, merged, sum(r.search_time_s for r in results),
                        sum(r.allocations_scored for r in results), sum(r.plans_simulated for r in results),
                        dict(sum((Counter(r.rejected) for r in results), Counter())),
                        [c for r in results for c in r.simulated], [p for r in results for p in r.scored])
