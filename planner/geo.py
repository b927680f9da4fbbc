"""Planning across clusters: pipelines that cross clusters, data parallelism inside them.

:func:`planner.search.search` already plans a multi-cluster site: its pipelines live inside one
partition and data parallelism spans partitions, hence clusters, with the gradient rings timed on the
measured cluster links and their bytes priced (``simulator.cost``). That is the right shape while the
gradients are small next to the activations. Sailor's geo heuristics take the other shape: a stage's
data-parallel replicas stay inside one region (H5; zones of a region merged, H6) and the pipeline
crosses regions stage by stage, so only activations travel between them.

This module searches that second shape (*chains*): a uniform split into P stages of TP t, D replicas,
and for each stage the group (a cluster, or a region of clusters) all of its replicas run in, filling
the group's partitions in order and never taking more TP groups than a partition's nodes hold.
:func:`geo_search` keeps the best of both shapes by the simulator's exact numbers, and
:func:`chain_search` with region groups and the greedy order is Sailor's heuristic re-implemented (the
benchmark's baseline: Sailor's own geo plans are not in its published data).

Candidates are ranked by a quick estimate (one replica's 1F1B flush + the slowest stage's ring
all-reduce + its optimizer step, from :class:`simulator.StageEvaluator`), then the best are simulated
whole. Small problems (every stage-to-group assignment enumerable) are searched exhaustively; a test
checks the result against a brute force over all assignments.
"""
from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from planner.candidates import (
    ESTIMATE_SLACK,
    Candidate,
    Progress,
    SearchResult,
    candidate_dtypes,
    copy_counts,
    ranking,
    usable_gpus,
)
from planner.request import PlanRequest
from planner.search import SearchSettings, search
from planner.templates import uniform_split
from sailor_hpc.core.archive import ProfileArchive
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import get_model
from sailor_hpc.core.network import LinkTable
from sailor_hpc.core.placement import place_plan
from sailor_hpc.core.plan import Pipeline, Plan, Stage, validate_plan
from sailor_hpc.core.site import Site
from simulator import SimOptions, StageEvaluator, simulate
from simulator.cost import Transfer, egress, ring_transfers
from simulator.memory import GRAD_BYTES
from simulator.network import Endpoint


@dataclass(frozen=True)
class Group:
    """Clusters whose partitions a stage's replicas may share (one cluster, or a region's zones)."""

    name: str
    partitions: tuple[str, ...]  # in the order replicas fill them


@dataclass(frozen=True)
class Chain:
    """A plan shape: uniform split, one TP and micro-batch size, D replicas, a group per stage."""

    mbs: int
    tp: int
    split: tuple[tuple[int, int], ...]
    replicas: int
    groups: tuple[int, ...]  # index into the group list, per stage


@dataclass(frozen=True)
class ChainSettings:
    exhaustive_assignments: int = 32  # every stage-to-group assignment while G^P is at most this
    simulate_top: int = 16  # chains simulated whole, best estimates first
    simulate_limit: int = 64  # at most, while none of them meets the request's bounds
    exhaustive_chains: int = 96  # simulate every chain while there are at most this many


def cluster_groups(site: Site) -> list[Group]:
    """One group per cluster (one for a site without [[clusters]])."""
    names = [c.name for c in site.clusters] or [""]
    return [Group(n or site.name, tuple(p.name for p in site.partitions if p.cluster == n)) for n in names]


def region_groups(site: Site, region_of: Callable[[str], str]) -> list[Group]:
    """Clusters merged by region (Sailor's H6), regions in order of first appearance."""
    regions: dict[str, list[str]] = {}
    for c in site.clusters:
        regions.setdefault(region_of(c.name), []).extend(p.name for p in site.partitions if p.cluster == c.name)
    return [Group(r, tuple(ps)) for r, ps in regions.items()]


def linked_groups(site: Site, ratio: float = 0.5) -> list[Group]:
    """Clusters merged where their link is nearly as fast as their own networks (peak at least ``ratio``
    of the slower one's inter-node peak): Sailor's "zones of a region are merged" (H6), read off the
    measured links instead of the zones' names."""
    def peak(table: LinkTable) -> float:
        return max(f.peak_bytes_per_s for f in table.fits.values())

    names = [c.name for c in site.clusters]
    own = {n: min((peak(p.inter_node) for p in site.partitions if p.cluster == n and p.inter_node), default=0.0)
           for n in names}
    root = {n: n for n in names}

    def find(n: str) -> str:
        while root[n] != n:
            n = root[n]
        return n

    for pair, table in site.links.clusters.items():
        a, b = sorted(pair)
        if peak(table) >= ratio * min(own[a], own[b]):
            root[find(b)] = find(a)
    return region_groups(site, find)


def _slots(site: Site, request: PlanRequest, tp: int) -> dict[str, int]:
    """TP groups of size tp each partition can host: whole groups per node, within the GPUs the request
    may use and the nodes a job may take (the cap Sailor's planner once exceeded: 132 GPUs of 128)."""
    available = usable_gpus(site, request)
    out = {}
    for p in site.partitions:
        per_node = p.gpus_per_node // tp
        out[p.name] = min(min(p.nodes, p.max_nodes_per_job) * per_node, available.get(p.name, 0) // tp)
    return out


Where = tuple[tuple[tuple[str, int], ...], ...]  # per stage: (partition, replicas there), in fill order


def assign(chain: Chain, groups: Sequence[Group], slots: dict[str, int]) -> Where | None:
    """Where every stage's replicas run, filling its group's partitions in order, or None when a group
    lacks room."""
    left = dict(slots)
    out = []
    for g in chain.groups:
        need, parts = chain.replicas, []
        for name in groups[g].partitions:
            take = min(need, left[name])
            if take:
                left[name] -= take
                need -= take
                parts.append((name, take))
        if need:
            return None
        out.append(tuple(parts))
    return tuple(out)


def replica_partitions(where: Where, stage: int) -> list[str]:
    """The partition of each replica of a stage (replica j = pipeline j)."""
    return [name for name, n in where[stage] for _ in range(n)]


def chain_plan(site: Site, request: PlanRequest, chain: Chain, where: Where) -> Plan:
    """The plan of a chain: replica j of every stage is pipeline j; the global batch is shared as evenly
    as whole micro-batches allow (Sailor's m = ceil(gbs / (mbs D)) would overshoot the batch)."""
    model = get_model(request.model)
    total = request.global_batch_size // chain.mbs
    base, extra = divmod(total, chain.replicas)
    pipes = []
    parts = [replica_partitions(where, s) for s in range(len(chain.split))]
    for j in range(chain.replicas):
        stages = tuple(Stage(lo, hi, chain.tp, site.partition(parts[s][j]).gpu_type, parts[s][j])
                       for s, (lo, hi) in enumerate(chain.split))
        pipes.append(Pipeline(chain.mbs, base + (1 if j < extra else 0), stages))
    return Plan(model=model.name, global_batch_size=request.global_batch_size, pipelines=tuple(pipes),
                seq_len=request.seq_len, dtype=request.dtype,
                notes={"planner": {"objective": request.objective, "space": "geo-chain",
                                   "stages_in": [[name for name, _ in w] for w in where]}})


def chains(ev: StageEvaluator, archive: ProfileArchive, site: Site, request: PlanRequest, groups: Sequence[Group],
           settings: ChainSettings, *, greedy_only: bool = False) -> Iterator[Chain]:
    """Every chain shape worth pricing: each profiled (mbs, tp) of the groups' GPU types, P stages of the
    uniform split, D replicas at the counts where the micro-batch count changes, and the stage-to-group
    assignments (all of them when few, else the greedy fills: from each group, the next one over the
    fastest link, as many stages per group as it holds)."""
    model, gbs = ev.model, request.global_batch_size
    L = model.num_pipeline_layers
    gpu_types = {site.partition(p).gpu_type for g in groups for p in g.partitions}
    points = set.intersection(*(set(archive.compute_points(model.name, g, request.dtype)) for g in gpu_types))
    min_node = min(site.partition(p).gpus_per_node for g in groups for p in g.partitions)
    for mbs, tp in sorted(points):
        if tp > min_node or model.num_heads % tp or mbs > gbs or gbs % mbs:
            continue
        slots = _slots(site, request, tp)
        room = [sum(slots[p] for p in g.partitions) for g in groups]
        total = sum(room)
        max_stages = min(L, request.max_stages or L, total)
        counts = copy_counts(total, gbs // mbs)
        for P in range(1, max_stages + 1):
            split = tuple(uniform_split(L, P))
            for D in (d for d in counts if d * P <= total):
                if greedy_only or len(groups) ** P > settings.exhaustive_assignments:
                    assignments = _greedy(site, groups, room, D, P)
                else:
                    assignments = itertools.product(range(len(groups)), repeat=P)
                for a in assignments:
                    yield Chain(mbs, tp, split, D, tuple(a))


def _greedy(site: Site, groups: Sequence[Group], room: list[int], D: int, P: int) -> Iterator[tuple[int, ...]]:
    """From each starting group: fill it with as many stages as its room holds, then move to the group
    with the fastest link from the current one (ties: more room)."""
    seen = set()
    for start in range(len(groups)):
        order, left = [start], [i for i in range(len(groups)) if i != start]
        while left:
            cur = groups[order[-1]].partitions[0] if groups[order[-1]].partitions else None
            left.sort(key=lambda i: (-_peak(site, cur, groups[i]), -room[i]))
            order.append(left.pop(0))
        out: list[int] = []
        for g in order:
            out += [g] * min(room[g] // D if D else 0, P - len(out))
        if len(out) == P and tuple(out) not in seen:
            seen.add(tuple(out))
            yield tuple(out)


def _peak(site: Site, a: str | None, g: Group) -> float:
    if a is None or not g.partitions:
        return 0.0
    return site.inter_node_fit(a, g.partitions[0], 1).peak_bytes_per_s


class Estimator:
    """Seconds per iteration of a chain, quickly (the ranking before exact simulation): replica 0's 1F1B
    flush in closed form -- the first micro-batch through every stage and back, then one steady period
    (the busiest stage's forward + backward and its exchanges) per further micro-batch -- plus the slowest
    stage's gradient ring among its D replicas and its optimizer step. None: a stage overflows memory."""

    def __init__(self, ev: StageEvaluator) -> None:
        self.ev = ev
        self._rings: dict[tuple, float] = {}

    def ring(self, where: Where, stage: int, tp: int, grad_bytes: float) -> float:
        key = (where[stage], tp, grad_bytes)
        hit = self._rings.get(key)
        if hit is None:
            eps = [Endpoint(p, None, tp) for p in replica_partitions(where, stage)]
            hit = self._rings[key] = self.ev.allreduce(eps, [grad_bytes] * len(eps), GRAD_BYTES[self.ev.dtype])
        return hit

    def __call__(self, chain: Chain, where: Where, gbs: int) -> float | None:
        ev, P = self.ev, len(chain.split)
        m = math.ceil(gbs / (chain.mbs * chain.replicas))
        costs = [ev.stage(ev.site.partition(where[s][0][0]).gpu_type, chain.tp, chain.mbs, lo, hi)
                 for s, (lo, hi) in enumerate(chain.split)]
        for s, c in enumerate(costs):
            if ev.stage_memory(c, stage=s, num_stages=P, micro_batches=m).total > ev.capacity(c.gpu):
                return None
        ends = [Endpoint(where[s][0][0], None, chain.tp) for s in range(P)]
        x = [0.0] + [ev.p2p(ends[s], ends[s + 1], costs[s].out_bytes) for s in range(P - 1)] + [0.0]
        period = max(c.fwd_s + c.bwd_s + x[s] + x[s + 1] for s, c in enumerate(costs))
        flush = sum(c.fwd_s + c.bwd_s for c in costs) + 2 * sum(x) + (m - 1) * period
        heaviest: dict[tuple, int] = {}  # per set of replica places, the stage with the most gradient
        for s, c in enumerate(costs):
            if c.grad_bytes > costs[heaviest.setdefault(where[s], s)].grad_bytes:
                heaviest[where[s]] = s
        sync = max(self.ring(where, s, chain.tp, costs[s].grad_bytes) for s in heaviest.values())
        return flush + sync + max(c.update_s for c in costs)

    def cost(self, chain: Chain, where: Where, seconds: float, gbs: int) -> float:
        """Cost of one iteration of ``seconds``: the GPUs held, plus the egress of every pipeline's
        boundaries, each stage's gradient ring and the tied embeddings' all-reduce, priced by
        :func:`simulator.cost.egress` as simulate() prices the plan."""
        site, ev = self.ev.site, self.ev
        per_hour = sum(n * chain.tp * site.partition(name).cost_per_gpu_hour for w in where for name, n in w)
        base, extra = divmod(gbs // chain.mbs, chain.replicas)  # micro-batches per pipeline, as chain_plan
        parts = [replica_partitions(where, s) for s in range(len(chain.split))]
        L = ev.model.num_pipeline_layers

        def transfers() -> Iterator[Transfer]:
            for s, (lo, hi) in enumerate(chain.split):
                c = ev.stage(site.partition(parts[s][0]).gpu_type, chain.tp, chain.mbs, lo, hi)
                if s + 1 < len(chain.split):  # every micro-batch's activation forward and its gradient back
                    for j, (a, b) in enumerate(zip(parts[s], parts[s + 1])):
                        total = c.out_bytes * (base + (j < extra))
                        yield from ((a, b, total), (b, a, total))
                yield from ring_transfers(parts[s], c.grad_bytes * chain.tp)
            if ev.model.tied_embeddings and len(chain.split) > 1:  # each pipeline's first and last stage
                tied = ev.memory_table(chain.tp).params(L - 1, L - 1) * GRAD_BYTES[ev.dtype] * chain.tp
                for a, b in zip(parts[0], parts[-1]):
                    yield from ring_transfers([a, b], tied)

        return per_hour * seconds / 3600 + egress(site, transfers())[1]


def chain_search(site: Site, archive: ProfileArchive, request: PlanRequest, groups: Sequence[Group], *,
                 settings: ChainSettings | None = None, greedy_only: bool = False,
                 progress: Progress | None = None) -> list[Candidate]:
    """The best chains for ``request``, simulated whole and ranked like :func:`planner.search.search`;
    ``progress(done, total)`` follows the simulations (the slow part)."""
    settings = settings or ChainSettings()
    ev = StageEvaluator(archive, site, get_model(request.model), dtype=request.dtype,
                        options=SimOptions(runtime=request.runtime))
    priced: list[tuple[float, Chain, Where]] = []
    gbs, c = request.global_batch_size, request.constraints
    estimate = Estimator(ev)
    for chain in chains(ev, archive, site, request, groups, settings, greedy_only=greedy_only):
        where = assign(chain, groups, _slots(site, request, chain.tp))
        if where is None:
            continue
        t = estimate(chain, where, gbs)
        if t is None or (c.min_throughput is not None and gbs / t < c.min_throughput * (1 - ESTIMATE_SLACK)):
            continue
        cost = estimate.cost(chain, where, t, gbs)
        if c.max_cost_per_iteration is not None and cost > c.max_cost_per_iteration * (1 + ESTIMATE_SLACK):
            continue
        priced.append((t if request.objective == "throughput" else cost, chain, where))
    priced.sort(key=lambda x: (x[0], x[1].replicas * x[1].tp * len(x[1].split)))
    exhaustive = len(priced) <= settings.exhaustive_chains
    out: list[Candidate] = []
    simulated = 0
    budget = len(priced) if exhaustive else min(len(priced), settings.simulate_limit)
    for _, chain, where in priced:
        if progress is not None:
            progress(min(simulated, budget), max(1, budget))
        # past the estimate's best, only while the bounds keep rejecting what the estimate let through
        if not exhaustive and (simulated >= settings.simulate_limit
                               or (simulated >= settings.simulate_top and out)):
            break
        try:
            plan = place_plan(chain_plan(site, request, chain, where), site)
            validate_plan(plan, site, check_placement=True)
        except SailorError:  # TP groups that do not pack into the nodes a job may take
            continue
        res = simulate(plan, site, archive, options=SimOptions(runtime=request.runtime))
        simulated += 1
        if res.fits and _meets(request, res.throughput_samples_per_s, res.cost_per_iteration):
            out.append(Candidate(plan, res))
    if progress is not None:
        progress(1, 1)
    out.sort(key=ranking(request))
    return out


class _Phases:
    """One (done, total) progress over several searches run in turn: phase ``i`` of ``n`` fills its share."""

    SCALE = 1000

    def __init__(self, progress: Progress | None, phases: int) -> None:
        self.progress, self.phases, self.phase = progress, max(1, phases), 0

    def __call__(self, done: int, total: int) -> None:
        if self.progress is not None:
            share = (self.phase + min(1.0, done / max(1, total))) / self.phases
            self.progress(int(share * self.SCALE), self.SCALE)

    def next(self) -> None:
        self.phase += 1
        self(0, 1)


def _meets(request: PlanRequest, throughput: float, cost_per_iteration: float) -> bool:
    c = request.constraints
    return ((c.min_throughput is None or throughput >= c.min_throughput)
            and (c.max_cost_per_iteration is None or cost_per_iteration <= c.max_cost_per_iteration))


def geo_search(site: Site, archive: ProfileArchive, request: PlanRequest, *,
               settings: SearchSettings | None = None, chain_settings: ChainSettings | None = None,
               progress: Progress | None = None) -> SearchResult:
    """The best plans of both shapes: the partition-local pipelines of :func:`planner.search.search`
    (data parallelism may cross clusters) and the chains of :func:`chain_search` (pipelines cross
    clusters), with each stage's data parallelism inside one cluster, and inside one group of
    :func:`linked_groups` (clusters joined by fast links, Sailor's merged region)."""
    t0 = time.perf_counter()
    local_error: SailorError | None = None
    dtypes: list[str] = []
    groupings: list[list[Group]] = []
    if len(site.clusters) > 1:
        dtypes = candidate_dtypes(site, archive, request) if request.dtype == "auto" else [request.dtype]
        groupings = [cluster_groups(site)]
        linked = linked_groups(site)
        if linked != groupings[0]:
            groupings.append(linked)
    phases = _Phases(progress, 1 + len(dtypes) * len(groupings))
    try:
        local = search(site, archive, request, settings=settings, progress=phases)
    except SailorError as exc:
        local, local_error = None, exc
    crossing: list[Candidate] = []
    for dtype in dtypes:
        for groups in groupings:
            phases.next()
            crossing += chain_search(site, archive, replace(request, dtype=dtype), groups, settings=chain_settings,
                                     progress=phases)
    if local_error is not None and not crossing:
        raise local_error  # the local search's explanation
    unique = {repr(c.plan.pipelines): c for c in [*(local.candidates if local else []), *crossing]}  # both find some
    merged = sorted(unique.values(), key=ranking(request))
    return SearchResult(request, merged, time.perf_counter() - t0,
                        local.allocations_scored if local else 0,
                        (local.plans_simulated if local else 0) + len(crossing),
                        local.rejected if local else {}, [*(local.simulated if local else []), *crossing],
                        local.scored if local else [])


def gpus_per_cluster(plan: Plan, site: Site) -> dict[str, int]:
    """GPUs a plan takes in each cluster (what the per-cluster jobs ask for)."""
    out: dict[str, int] = {}
    for pipe in plan.pipelines:
        for s in pipe.stages:
            key = site.cluster_of(str(s.partition)) or site.name
            out[key] = out.get(key, 0) + s.tp
    return out
