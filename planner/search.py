"""The search: templates per partition, then how many pipelines of each, then exact scoring.

1. *Templates* (:mod:`planner.templates`): for every partition with GPUs available, the most efficient
   pipeline shapes (stage count, split, TP per stage, micro-batch size).
2. *Allocations*: for each partition, a template and a number of copies; the global batch is shared
   among all pipelines so they flush together (:mod:`planner.balance`). Copy counts are the values where
   a pipeline's micro-batch count changes (n = ceil(M / m)), the only ones worth paying for. Partitions
   are combined by a beam search (exhaustive while the product of options is small) ranked by the
   objective on the balanced flush plus the template set's sync tail.
3. *Exact scoring*: the best allocations become placed plans and are simulated whole
   (:func:`simulator.simulate`: flush, gradient syncs, optimizer, memory); constraints are checked on
   those numbers and the plans are ranked by them.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from planner.balance import Share, balance
from planner.candidates import (
    ESTIMATE_SLACK,
    Candidate,
    Progress,
    ScoredAllocation,
    SearchResult,
    best_over_dtypes,
    candidate_dtypes,
    copy_counts,
    default_available,
    infeasible,
    partition_gpus,
    ranking,
    usable_gpus,
)
from planner.request import PlanRequest
from planner.templates import Template, TemplateBuilder, build_templates
from planner.time_goal import TimeGoal, packed_shape
from sailor_hpc.core.archive import ProfileArchive
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import get_model
from sailor_hpc.core.placement import place_plan
from sailor_hpc.core.plan import Pipeline, Plan, Stage, validate_plan
from sailor_hpc.core.site import Partition, Site
from simulator import SimOptions, StageEvaluator, simulate
from simulator.network import Endpoint

Option = tuple[Template, int]  # a template and how many copies
TailCache = dict[tuple, float]  # Tails' memo: sorted (template key, copies) pairs -> seconds


@dataclass
class Allocation:
    options: tuple[Option, ...]
    time_s: float  # estimated iteration time: balanced flush + the template set's tail
    shares: list[Share]
    gpus: int
    cost_per_hour: float
    finish_s: float = 0.0  # expected finish under the time objective (planner.time_goal)
    start_s: float = 0.0  # and expected start

    def score(self, objective: str, gbs: int) -> float:
        """Smaller is better: seconds per sample, cost per sample, or seconds to the result."""
        if objective == "time":
            return self.finish_s
        per_sample = self.time_s / gbs
        return per_sample if objective == "throughput" else per_sample * self.cost_per_hour

    def misses(self, request: PlanRequest) -> bool:
        """Whether the estimate misses --min-throughput or --max-cost-per-iteration by more than the
        estimate's own error (the simulation of the whole plan decides at the end)."""
        c = request.constraints
        slack = ESTIMATE_SLACK
        if c.min_throughput is not None and request.global_batch_size / self.time_s < c.min_throughput * (1 - slack):
            return True
        return (c.max_cost_per_iteration is not None
                and self.cost_per_hour * self.time_s / 3600 > c.max_cost_per_iteration * (1 + slack))


@dataclass
class SearchSettings:
    """Knobs of the search's heuristics. Small problems are searched exhaustively: every template when a
    partition has at most ``exhaustive_templates`` shapes, every (template, copies) option of a partition
    while there are at most ``exhaustive_options`` (else the ``templates_per_partition`` best templates
    and the best of each micro-batch size), every allocation simulated when there are at most
    ``exhaustive_allocations``, and the beam keeps everything while it is narrower than ``beam``."""

    templates_per_partition: int = 4
    exhaustive_templates: int = 600
    exhaustive_options: int = 40
    exhaustive_allocations: int = 64
    beam: int = 24
    simulate_top: int = 12
    simulate_limit: int = 240  # plans simulated at most while bounds reject the best-estimated ones
    plans_per_template_set: int = 3  # results sharing one template set, once simulate_top are simulated
    max_stages: int = 16
    flush_cut: int = 6  # templates kept by the flush-only ranking, in multiples of templates_per_partition
    tail_copies: int = 8  # copies per template at most in an allocation's sync-tail estimate (Tails)
    solo_tail_copies: int = 4  # the same for the template ranking's quick estimate


def search(site: Site, archive: ProfileArchive, request: PlanRequest, *, settings: SearchSettings | None = None,
           progress: Progress | None = None) -> SearchResult:
    """Best plans for ``request`` on ``site``, best first (raises SailorError when none is feasible)."""
    if request.dtype == "auto":
        return _search_dtypes(site, archive, request, settings, progress)
    t0 = time.perf_counter()
    settings = settings or SearchSettings()
    ev = StageEvaluator(archive, site, get_model(request.model), dtype=request.dtype,
                        options=SimOptions(runtime=request.runtime))
    tails = Tails(ev, request, copies=settings.tail_copies)
    per_part, priced_out = _options_per_partition(ev, archive, request, settings, tails.cache)
    if not per_part:
        raise _no_partition(request, site, priced_out)
    allocations, scored = _combine(per_part, request, site, tails, progress, settings)
    if request.time_goal is not None:
        allocations = start_now_first(allocations)
    best, simulated, rejected, fitting = _simulate_best(site, archive, request, allocations, settings)
    if not best:
        raise infeasible(request, site, rejected, fitting, scored)
    gbs = request.global_batch_size
    points = [ScoredAllocation(a.gpus, a.cost_per_hour, gbs / a.time_s) for a in allocations]
    return SearchResult(request, best, time.perf_counter() - t0, scored, simulated, rejected, fitting, points)


def _search_dtypes(site: Site, archive: ProfileArchive, request: PlanRequest, settings: SearchSettings | None,
                   progress: Progress | None) -> SearchResult:
    """``--dtype auto``: every candidate dtype searched, the best plans of all kept (:func:`best_over_dtypes`)."""
    dtypes = candidate_dtypes(site, archive, request)
    if not dtypes:  # said in auto's terms: suggesting --dtype auto to a user who passed it helps nobody
        model = get_model(request.model).name
        types = sorted({p.gpu_type for p in site.partitions if usable_gpus(site, request).get(p.name, 0) > 0})
        if not types:
            raise SailorError(f"the request leaves no GPU of site {site.name!r} to plan on", file=site.source,
                              field="partitions", fix="give some partition GPUs (--available, --max-gpus)")
        raise SailorError(f"no partition of site {site.name!r} the plan may use has profiles of {model} in a dtype "
                          f"its GPU type trains in (GPU types: {', '.join(types) or 'none available'})",
                          file=site.source, field="partitions",
                          fix=f"profile {model} on them (sailor-hpc profile --site SITE --model {model} --dtype D), "
                              "check what the archive holds (sailor-hpc profiles list), or pass --profiles with an "
                              "archive that has them")
    return best_over_dtypes(request, dtypes, lambda one: search(site, archive, one, settings=settings,
                                                                 progress=progress))


def _options_per_partition(ev: StageEvaluator, archive: ProfileArchive, request: PlanRequest,
                           settings: SearchSettings, tail_cache: TailCache | None = None) -> tuple[list[list[Option]], bool]:
    """Step 1: each partition's (template, copies) options, and whether the cost budget buys no GPU of
    some partition (which then explains an empty result). ``tail_cache``: the sync tails the allocations'
    :class:`Tails` will read (the ranking's one-template tails are among them)."""
    site = ev.site
    capacity = default_available(site)
    available = usable_gpus(site, request)
    for name in available:
        site.partition(name)  # unknown partition names are errors
    solo = SoloTime(ev, request, settings, tail_cache)
    per_part: list[list[Option]] = []
    priced_out = False
    for part in site.partitions:
        gpus, priced = partition_gpus(part, available.get(part.name, 0), capacity[part.name], request)
        priced_out |= priced
        if (gpus <= 0 or request.dtype not in site.gpu(part.gpu_type).dtypes
                or not archive.has_compute(ev.model.name, part.gpu_type, request.dtype)):
            continue
        templates = _rank_templates(_partition_templates(ev, archive, part, request, settings, gpus), gpus, solo,
                                     settings)
        options = _partition_options(templates, gpus, request.global_batch_size, settings)
        if options:
            per_part.append(options)
    return per_part, priced_out


def _partition_templates(ev: StageEvaluator, archive: ProfileArchive, part: Partition, request: PlanRequest,
                         settings: SearchSettings, gpus: int) -> list[Template]:
    """The pipeline shapes of ``part`` on at most ``gpus`` GPUs at every profiled micro-batch size and TP
    degree that fits a node."""
    model, gbs = ev.model, request.global_batch_size
    points = archive.compute_points(model.name, part.gpu_type, request.dtype)
    tps = sorted({t for _, t in points if t <= part.gpus_per_node and model.num_heads % t == 0})
    usable = [m for m in sorted({b for b, _ in points if b <= gbs}) if any((m, t) in points for t in tps)]
    builder = TemplateBuilder(ev, part, tps, request.max_stages or settings.max_stages, gbs, max_gpus=gpus)
    templates: list[Template] = []
    for mbs in usable:
        builder.tps = sorted(t for t in tps if (mbs, t) in points)
        templates += build_templates(builder, [mbs], sailor_shape=request.space == "sailor",
                                     keep=settings.templates_per_partition,
                                     exhaustive_limit=settings.exhaustive_templates // max(1, len(usable)))
    return templates


def _first_of_each(templates: list[Template], key: Callable[[Template], tuple]) -> list[Template]:
    """The first (best-ranked) template of each ``key`` group, in ranking order."""
    seen: set[tuple] = set()
    out = []
    for t in templates:
        if key(t) not in seen:
            seen.add(key(t))
            out.append(t)
    return out


def _rank_templates(templates: list[Template], gpus: int, solo: SoloTime, settings: SearchSettings) -> list[Template]:
    """Templates that fit in ``gpus``, best first by what they achieve alone on the partition (flush at the
    micro-batch count its GPUs leave them, plus their sync tail): the bubble and the sync matter as much as
    the steady-state period. A first cut on flush alone (cheap) keeps ``flush_cut`` x templates_per_partition
    and the best of each (mbs, stages) shape; then the sync tail decides among the survivors."""
    fitting = [t for t in templates if t.gpus <= gpus]
    fitting.sort(key=lambda t: (solo(t, gpus, with_tail=False), t.gpus, t.key))
    cut = settings.flush_cut * settings.templates_per_partition
    kept = fitting[:cut] + [t for t in _first_of_each(fitting, lambda t: (t.mbs, t.num_stages)) if t not in fitting[:cut]]
    kept.sort(key=lambda t: (solo(t, gpus), t.gpus, t.key))
    return kept


def _partition_options(templates: list[Template], gpus: int, gbs: int, settings: SearchSettings) -> list[Option]:
    """(template, copies) options of a partition: every one while few, else the best templates and the best
    of each micro-batch size."""
    def options(ts: list[Template]) -> list[Option]:
        return [(t, n) for t in ts for n in copy_counts(gpus // t.gpus, gbs // t.mbs)]

    out = options(templates)
    if len(out) > settings.exhaustive_options:
        keep = templates[:settings.templates_per_partition]
        keep += [t for t in _first_of_each(templates, lambda t: (t.mbs,)) if t not in keep]
        out = options(keep)
    return out


def _no_partition(request: PlanRequest, site: Site, priced_out: bool) -> SailorError:
    if priced_out:
        return infeasible(request, site, {}, [], 0)
    model = get_model(request.model).name
    return SailorError(f"no partition of site {site.name!r} can run {model} in {request.dtype}", file=site.source,
                       field="partitions", fix="check the available GPUs, that their GPU types train in "
                                               f"{request.dtype} and that the archive has {request.dtype} profiles "
                                               f"of {model} for them (sailor-hpc profiles list), or use --dtype auto")


class SoloTime:
    """Seconds per sample of a template on ``gpus`` GPUs of its partition alone (the template ranking), with
    a quick sync-tail estimate (few copies, not crossing nodes: no cheap plan takes a whole partition)."""

    def __init__(self, ev: StageEvaluator, request: PlanRequest, settings: SearchSettings,
                 tail_cache: TailCache | None = None) -> None:
        self.gbs = request.global_batch_size
        self.tails = Tails(ev, request, copies=settings.solo_tail_copies, cross_nodes=False, cache=tail_cache)

    def __call__(self, t: Template, gpus: int, with_tail: bool = True) -> float:
        n = max(1, min(gpus // t.gpus, self.gbs // t.mbs))
        m = math.ceil(self.gbs / (t.mbs * n))
        tail = self.tails(((t, n),)) if with_tail else 0.0
        return (t.speed().time(m) + tail) / (n * m * t.mbs)


def _gpu_cost(site: Site, options: tuple[Option, ...]) -> tuple[int, float]:
    gpus = sum(t.gpus * n for t, n in options)
    per_hour = sum(t.gpus * n * site.partition(t.partition).cost_per_gpu_hour for t, n in options)
    return gpus, per_hour


class Tails:
    """Seconds from the pipelines' flush to the end of the iteration (gradient syncs, optimizer step) of a
    set of templates, from the simulator's iteration model on a plan with the allocation's copies of each
    template, capped at ``copies``: exact for small allocations; larger ones reuse the capped ring (a ring
    all-reduce grows slowly with its size), as long as the capped copies still leave one node when the
    real ones do (a ring that crosses nodes runs at the inter-node bandwidth, often 10-50x below the
    intra-node one). The plans finally returned are simulated whole.

    ``cache`` may be shared by instances of one evaluator and request whatever their caps: a key names
    the copies of each template its plan holds. A one-template key is a pure function of itself; a
    key of several templates keeps the tail of the first order it was asked in, as within one instance."""

    def __init__(self, ev: StageEvaluator, request: PlanRequest, copies: int = 8, cross_nodes: bool = True,
                 cache: TailCache | None = None) -> None:
        self.ev, self.request, self.copies, self.cross_nodes = ev, request, copies, cross_nodes
        self.cache: TailCache = {} if cache is None else cache
        self._per_node = {p.name: p.gpus_per_node for p in ev.site.partitions}  # asked for every allocation

    def capped(self, t: Template, n: int) -> int:
        """Copies rounded down to a power of two and capped (few distinct small plans to simulate), but
        never so few that they fit in one node when the ``n`` copies do not (unless ``cross_nodes`` is
        off: the template ranking prices a template on its whole partition, which no cheap plan takes)."""
        c = min(1 << (n.bit_length() - 1), self.copies)
        per_node = self._per_node[t.partition]
        if self.cross_nodes and n * t.gpus > per_node >= c * t.gpus:
            c = min(n, per_node // t.gpus + 1)
        return c

    def __call__(self, options: tuple[Option, ...]) -> float:
        key = tuple(sorted((t.key, self.capped(t, n)) for t, n in options))
        hit = self.cache.get(key)
        if hit is None:
            pipes = []
            copies = dict(key)
            for t, _ in options:
                stages = tuple(Stage(i, j, tp, t.gpu, t.partition) for i, j, tp in t.stages)
                pipes += [Pipeline(t.mbs, 1, stages)] * copies[t.key]
            plan = Plan(get_model(self.request.model).name, sum(p.samples for p in pipes), tuple(pipes),
                        seq_len=self.request.seq_len, dtype=self.request.dtype)
            try:
                placed = place_plan(plan, self.ev.site)
                validate_plan(placed, self.ev.site, check_placement=True)
            except SailorError:  # its TP groups do not pack into the nodes a job may take: not a candidate
                hit = self.cache[key] = math.inf
                return hit
            costs = [[self.ev.stage(s.gpu_type, s.tp, p.micro_batch_size, s.first_layer, s.last_layer)
                      for s in p.stages] for p in placed.pipelines]
            ends = [[Endpoint.of(s) for s in p.stages] for p in placed.pipelines]
            timing = self.ev.iteration(costs, ends, [1] * len(costs))  # what simulate() computes, minus reports
            flush = max(float(sched.makespan.max()) for sched in timing.schedules)
            hit = self.cache[key] = timing.time_s - flush
        return hit


def _evaluate(options: tuple[Option, ...], request: PlanRequest, site: Site, tails: Tails) -> Allocation | None:
    gbs = request.global_batch_size
    gpus, per_hour = _gpu_cost(site, options)
    c = request.constraints
    if (c.max_gpus is not None and gpus > c.max_gpus) or (c.max_cost_per_hour is not None and per_hour > c.max_cost_per_hour):
        return None
    if request.space == "sailor":
        if len({(t.mbs, t.num_stages) for t, _ in options}) > 1:
            return None
        total = sum(n for _, n in options)
        mbs = options[0][0].mbs
        if gbs % (mbs * total):
            return None  # Sailor's shape: the same micro-batch count on every pipeline
        m = gbs // (mbs * total)
        shares = [Share(m, n, n) for _, n in options]
        flush = max(t.speed().time(m) for t, _ in options)
    else:
        balanced = balance([(t.speed(), n) for t, n in options], gbs)
        if balanced is None:
            return None
        flush, shares = balanced
    tail = tails(options)
    if math.isinf(tail):
        return None
    alloc = Allocation(options, flush + tail, shares, gpus, per_hour)
    if request.time_goal is not None:
        alloc.start_s, alloc.finish_s = allocation_times(request.time_goal, site, options, alloc.time_s)
    return alloc


def _combine(per_part: list[list[Option]], request: PlanRequest, site: Site, tails: Tails,
             progress: Progress | None, settings: SearchSettings) -> tuple[list[Allocation], int]:
    """Beam search over partitions (each: skip it, or one of its options)."""
    obj, gbs = request.objective, request.global_batch_size
    beam: list[tuple[Option, ...]] = [()]
    scored: dict[tuple, Allocation] = {}
    total = sum(len(o) for o in per_part) * (settings.beam + 1) + 1
    done = 0
    for k, options in enumerate(per_part):
        nxt: list[tuple[Allocation, tuple[Option, ...]]] = []
        for partial in beam:
            for opt in [None, *options]:
                combo = partial if opt is None else partial + (opt,)
                if not combo or (request.space == "homogeneous" and len(combo) > 1):
                    continue
                key = tuple((t.key, n) for t, n in combo)
                if key not in scored:
                    alloc = _evaluate(combo, request, site, tails)
                    if alloc is None:
                        continue
                    scored[key] = alloc
                    done += 1
                nxt.append((scored[key], combo))
            if progress is not None:
                progress(done, total)
        nxt.sort(key=lambda ac: (ac[0].score(obj, gbs), ac[0].gpus, tuple((t.key, n) for t, n in ac[1])))
        width = settings.beam if k < len(per_part) - 1 else len(nxt)
        beam = [combo for _, combo in nxt[:width]]
        # the best-scoring partial allocations may all miss a throughput or cost-per-iteration bound that
        # others meet (a cheap partition alone is slow): keep the best of those that meet it too
        beam += [combo for a, combo in nxt[width:] if not a.misses(request)][:width]
        if k < len(per_part) - 1:
            beam = [()] + beam  # later partitions may also run alone
    allocations = sorted(scored.values(), key=lambda a: (a.misses(request), a.score(obj, gbs), a.gpus,
                                                        tuple((t.key, n) for t, n in a.options)))
    return allocations, len(scored)


def to_plan(alloc: Allocation, request: PlanRequest) -> Plan:
    pipes = []
    for (t, _), share in zip(alloc.options, alloc.shares):
        stages = tuple(Stage(i, j, tp, t.gpu, t.partition) for i, j, tp in t.stages)
        pipes += [Pipeline(t.mbs, m, stages) for m in share.counts()]
    return Plan(model=get_model(request.model).name, global_batch_size=request.global_batch_size,
                pipelines=tuple(pipes), seq_len=request.seq_len, dtype=request.dtype,
                notes={"planner": {"objective": request.objective, "space": request.space}})


def _simulate_best(site: Site, archive: ProfileArchive, request: PlanRequest, allocations: list[Allocation],
                   settings: SearchSettings) -> tuple[list[Candidate], int, dict[str, int], list[Candidate]]:
    c = request.constraints
    rejected: dict[str, int] = {}
    out: list[Candidate] = []
    fitting: list[Candidate] = []
    simulated = 0
    per_set: dict[tuple, int] = {}
    exhaustive = len(allocations) <= settings.exhaustive_allocations
    for alloc in allocations:
        if not exhaustive and simulated >= settings.simulate_top and len(out) >= max(1, request.top_k):
            break
        if not exhaustive and simulated >= settings.simulate_limit:
            break
        family = tuple(t.key for t, _ in alloc.options)
        # few plans per template set among the results, once enough are simulated; plans a bound
        # rejects do not count (their siblings with fewer copies may meet it)
        if (not exhaustive and per_set.get(family, 0) >= settings.plans_per_template_set
                and simulated >= settings.simulate_top):
            continue
        try:
            plan = place_plan(to_plan(alloc, request), site)
            validate_plan(plan, site, check_placement=True)
        except SailorError:  # more copies than the capped plan of its tail estimate: too many nodes
            rejected["placement"] = rejected.get("placement", 0) + 1
            continue
        res = simulate(plan, site, archive, options=SimOptions(runtime=request.runtime))
        simulated += 1
        # the runtime logs its measured step time against this prediction
        plan = replace(plan, notes={**plan.notes, "simulator": {"iteration_time_s": res.iteration_time_s}})
        reason = None
        if res.fits:
            fitting.append(Candidate(plan, res))
        if not res.fits:
            reason = "memory"
        elif c.min_throughput is not None and res.throughput_samples_per_s < c.min_throughput:
            reason = "min_throughput"
        elif c.max_cost_per_iteration is not None and res.cost_per_iteration > c.max_cost_per_iteration:
            reason = "max_cost_per_iteration"
        elif request.time_goal is not None:
            reason = request.time_goal.violation(request.time_goal.plan_outlook(plan, res.iteration_time_s))
        if reason:
            rejected[reason] = rejected.get(reason, 0) + 1
            continue
        per_set[family] = per_set.get(family, 0) + 1
        out.append(Candidate(plan, res))
    out.sort(key=ranking(request))
    return out, simulated, rejected, fitting


def allocation_times(goal: TimeGoal, site: Site, options: tuple[Option, ...], iteration_s: float) -> tuple[float, float]:
    """An allocation's expected start and finish, its GPUs packed into nodes as placement will (the exact
    shape of the placed plan decides among the simulated plans)."""
    gpus: dict[str, int] = {}
    for t, n in options:
        gpus[t.partition] = gpus.get(t.partition, 0) + t.gpus * n
    look = goal.outlook(packed_shape(site, gpus), iteration_s, sum(gpus.values()))
    return look.start.start_s, look.finish_s


def start_now_first(allocations: list[Allocation]) -> list[Allocation]:
    """The time objective's allocations with the best one that starts now moved second: it is always
    simulated, so that starting now and growing later can be weighed against waiting."""
    now = next((a for a in allocations if a.start_s == 0), None)
    if now is None or now is allocations[0]:
        return allocations
    return [allocations[0], now, *(a for a in allocations[1:] if a is not now)]
