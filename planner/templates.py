"""Pipeline templates: the best way to run one pipeline on one partition.

For a partition, a micro-batch size and a stage count P, a dynamic program over the layers picks the
split (and each stage's TP) that minimises the pipeline's steady-state period -- the busiest stage's
forward + backward plus its exchanges with both neighbours, which is what the simulator's 1F1B
schedule converges to -- subject to every stage fitting in memory with the micro-batches it holds in
flight. The DP runs over suffixes ("k stages left for layers i..L-1"), because a stage's in-flight
count is ``min(k, m)``, k the number of stages from it to the end; one pass gives the best split for
every P. A template's m is only known once an allocation shares the global batch among its copies,
so a stage is checked with ``min(k, ceil(gbs / mbs))`` in flight, the most any copy can run: a split
rejected then fits no allocation, and one kept fits every allocation (fewer micro-batches hold fewer).

TP per stage follows one of two policies: *uniform* (every stage TP t, for each profiled t) or
*min-fit* (each stage takes the smallest profiled TP under which it fits), so stages of a pipeline can
differ in TP where memory asks for it. All numbers come from :class:`simulator.StageEvaluator`.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from planner.balance import PipelineSpeed
from sailor_hpc.core.placement import node_segments
from sailor_hpc.core.site import Partition
from simulator import StageEvaluator
from simulator.network import Endpoint

INF = math.inf


@dataclass
class Template:
    """One pipeline shape on one partition, with its exact flush times for every micro-batch count."""

    partition: str
    gpu: str
    mbs: int
    stages: tuple[tuple[int, int, int], ...]  # (first layer, last layer, tp)
    period: float  # steady-state seconds per micro-batch (the DP's objective)
    flush: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))  # flush[m-1]: m micro-batches
    slope: float = 0.0  # seconds each micro-batch beyond len(flush) adds
    _speed: PipelineSpeed | None = field(default=None, repr=False, compare=False)

    def speed(self) -> PipelineSpeed:
        if self._speed is None:
            self._speed = PipelineSpeed(self.flush, self.slope, self.mbs)
        return self._speed

    # cached: the allocation search reads them for every allocation it scores (the fields never change)
    @cached_property
    def gpus(self) -> int:
        return sum(t for _, _, t in self.stages)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @cached_property
    def key(self) -> tuple:
        return (self.partition, self.mbs, self.stages)

    def efficiency(self) -> float:
        """Samples per second per GPU in the steady state (how templates of one partition compare)."""
        return self.mbs / (self.period * self.gpus)


def endpoints(stages: tuple[tuple[int, int, int], ...], part: Partition) -> list[Endpoint]:
    """Stages packed onto consecutive nodes in order: the node segments that ``place_plan`` keeps
    together in the job (:func:`sailor_hpc.core.placement.node_segments`), numbered from 0."""
    segments = node_segments([tp for _, _, tp in stages], part.gpus_per_node)
    return [Endpoint(part.name, node, stages[j][2]) for node, seg in enumerate(segments) for j in seg]


class TemplateBuilder:
    """Builds templates of one partition (cached per micro-batch size)."""

    def __init__(self, ev: StageEvaluator, part: Partition, tps: list[int], max_stages: int,
                 max_micro_batches: int, max_gpus: int | None = None) -> None:
        self.ev = ev
        self.part = part
        self.tps = sorted(tps)
        self.L = ev.model.num_pipeline_layers
        job_gpus = part.gpus_per_node * part.max_nodes_per_job
        # a pipeline never has more GPUs than one job may get, nor more stages than GPUs
        self.max_gpus = job_gpus if max_gpus is None else max(1, min(max_gpus, job_gpus))
        self.max_stages = max(1, min(max_stages, self.L, self.max_gpus // max(1, min(self.tps, default=1))))
        self.max_m = max_micro_batches
        self.capacity = ev.capacity(part.gpu_type)
        self._fits: dict[tuple, int] = {}
        self._memory: dict[tuple[int, int], list[list[list[float]]]] = {}

    # -------------------------------------------------------------- per-stage numbers
    def _cost(self, mbs: int, tp: int, i: int, j: int):
        return self.ev.stage(self.part.gpu_type, tp, mbs, i, j)

    def in_flight(self, mbs: int, k: int) -> int:
        """Micro-batches a stage with ``k`` stages from it to the end holds at most: 1F1B's ``min(k, m)``
        with m at its largest, every sample of the global batch in this pipeline (``ceil(gbs / mbs)``)."""
        return max(1, min(k, -(-self.max_m // mbs)))

    def _fits_mem(self, mbs: int, tp: int, i: int, j: int, k: int) -> bool:
        """Whether layers i..j fit on one GPU of a TP-``tp`` stage ``k`` stages from the end of its pipeline."""
        return j <= self._max_last(mbs, tp, i, self.in_flight(mbs, k))

    def _max_last(self, mbs: int, tp: int, i: int, k: int) -> int:
        """The last layer j such that layers i..j still fit (i - 1 if not even layer i does). A stage's
        memory only grows as it takes more layers, so a bisection over j needs log2(L) evaluations."""
        key = (mbs, tp, i, k)
        hit = self._fits.get(key)
        if hit is None:
            totals = self._totals(mbs, tp, k)[i]
            lo, hi = i - 1, self.L - 1  # invariant: lo fits (i - 1: the empty stage), everything > hi does not
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if totals[mid] <= self.capacity:
                    lo = mid
                else:
                    hi = mid - 1
            hit = self._fits[key] = lo
        return hit

    def _totals(self, mbs: int, tp: int, k: int) -> list[list[float]]:
        """Peak memory of every layer range at TP ``tp`` holding ``k`` micro-batches: one array pass of the
        simulator's memory model per (mbs, tp) for every in-flight count up to ``max_stages`` at once,
        instead of one call per range and count the bisections visit."""
        hit = self._memory.get((mbs, tp))
        if hit is None:
            counts = range(1, self.max_stages + 1)
            hit = self._memory[(mbs, tp)] = self.ev.first_stage_totals(self.part.gpu_type, tp, mbs, counts).tolist()
        if k > len(hit):  # no pipeline of this builder holds more micro-batches than it has stages
            return self.ev.first_stage_totals(self.part.gpu_type, tp, mbs, [k]).tolist()[0]
        return hit[k - 1]

    def _boundary_endpoint(self) -> Endpoint | None:
        """Where the DP prices a stage boundary: nowhere when no pipeline of this builder has two stages;
        inside one node when every pipeline it can make fits on one node; else between nodes (a
        conservative bound: :meth:`finish` prices each placed boundary exactly). So a site without an
        inter-node fit plans whatever stays on one node, and a pipeline that could cross nodes asks for
        the fit by name."""
        if self.max_stages == 1:
            return None
        widest = min(self.max_gpus, self.max_stages * max(self.tps, default=1))
        return Endpoint(self.part.name, 0 if widest <= self.part.gpus_per_node else None, 1)

    def _boundaries(self, mbs: int) -> list[float]:
        """Seconds of activation + gradient across the boundary after each layer j (0 after the last)."""
        end = self._boundary_endpoint()
        if end is None:
            return [0.0] * self.L
        return [self.ev.p2p(end, end, self._cost(mbs, self.tps[0], j, j).out_bytes) * 2 if j < self.L - 1 else 0.0
                for j in range(self.L)]

    def _stage_time(self, mbs: int, tp: int, i: int, j: int, bnd: list[float]) -> float:
        """The DP's per-stage objective: forward + backward plus the exchanges at both of its boundaries."""
        c = self._cost(mbs, tp, i, j)
        return c.fwd_s + c.bwd_s + (bnd[i - 1] if i > 0 else 0.0) + bnd[j]

    # -------------------------------------------------------------- the DP
    def build(self, mbs: int, policy: int | None) -> list[tuple[tuple[tuple[int, int, int], ...], float]]:
        """Best split for every stage count P (policy: a uniform TP, or None for min-fit), with the DP's
        period estimate; :meth:`finish` turns the ones worth keeping into templates."""
        L, K = self.L, self.max_stages
        bnd = self._boundaries(mbs)

        def stage_tp(i: int, j: int, k: int) -> int | None:
            options = [policy] if policy is not None else self.tps
            for tp in options:
                if self._fits_mem(mbs, tp, i, j, k):
                    return tp
            return None

        def stage_time(i: int, j: int, tp: int) -> float:
            return self._stage_time(mbs, tp, i, j, bnd)

        # best[k][i]: min period of layers i..L-1 in k stages; choice[k][i] = (j, tp)
        best = [[INF] * (L + 1) for _ in range(K + 1)]
        choice: list[list[tuple[int, int] | None]] = [[None] * (L + 1) for _ in range(K + 1)]
        for i in range(L):
            tp = stage_tp(i, L - 1, 1)
            if tp is not None:
                best[1][i] = stage_time(i, L - 1, tp)
                choice[1][i] = (L - 1, tp)
        for k in range(2, K + 1):
            for i in range(L - k + 1):
                b, ch = INF, None
                for j in range(i, L - k + 1):
                    rest = best[k - 1][j + 1]
                    if rest >= b:
                        continue
                    tp = stage_tp(i, j, k)
                    if tp is None:
                        continue
                    t = stage_time(i, j, tp)
                    if t >= b:
                        if t > rest:
                            break  # longer first stages only get slower
                        continue
                    v = max(t, rest)
                    if v < b:
                        b, ch = v, (j, tp)
                best[k][i], choice[k][i] = b, ch
        out = []
        for P in range(1, K + 1):
            if best[P][0] == INF:
                continue
            stages, i = [], 0
            for k in range(P, 0, -1):
                j, tp = choice[k][i]  # type: ignore[misc]
                stages.append((i, j, tp))
                i = j + 1
            out.append((tuple(stages), best[P][0]))
        return out

    def enumerate_all(self, mbs_values: list[int], limit: int) -> list[tuple[int, tuple]] | None:
        """Every (mbs, stages) whose stages fit in memory and in one node, or None if more than ``limit``."""
        L = self.L
        shapes = sum(math.comb(L - 1, P - 1) * len(self.tps) ** P for P in range(1, self.max_stages + 1))
        if shapes * len(mbs_values) > limit:
            return None
        out = []
        for mbs in mbs_values:
            for P in range(1, self.max_stages + 1):
                for cuts in itertools.combinations(range(1, L), P - 1):
                    bounds = list(zip((0, *cuts), (*[c - 1 for c in cuts], L - 1)))
                    for tps in itertools.product(self.tps, repeat=P):
                        if sum(tps) > self.max_gpus:
                            continue
                        if all(self._fits_mem(mbs, tp, i, j, P - s) for s, ((i, j), tp) in enumerate(zip(bounds, tps))):
                            out.append((mbs, tuple((i, j, tp) for (i, j), tp in zip(bounds, tps))))
        return out

    def uniform(self, mbs: int) -> list[tuple[tuple[int, int, int], ...]]:
        """Sailor's shape for every P: uniform split, each stage at the smallest TP that fits."""
        out = []
        for P in range(1, self.max_stages + 1):
            stages = []
            for s, (i, j) in enumerate(uniform_split(self.L, P)):
                tp = next((t for t in self.tps if self._fits_mem(mbs, t, i, j, P - s)), None)
                if tp is None:
                    break
                stages.append((i, j, tp))
            else:
                out.append(tuple(stages))
        return out

    def period_estimate(self, mbs: int, stages: tuple[tuple[int, int, int], ...]) -> float:
        """The DP's objective for a given split: the busiest stage with its exchanges."""
        bnd = self._boundaries(mbs)
        return max(self._stage_time(mbs, tp, i, j, bnd) for i, j, tp in stages)

    def finish(self, mbs: int, stages: tuple[tuple[int, int, int], ...]) -> Template:
        """Exact per-stage numbers (placement-aware transfers) and flush times for m = 1..max_m."""
        costs = [self._cost(mbs, tp, i, j) for i, j, tp in stages]
        ends = endpoints(stages, self.part)
        x = self.ev.exchanges(costs, ends)  # buffered or blocking per boundary, as simulate() prices it
        F = np.array([c.fwd_s for c in costs])
        B = np.array([c.bwd_s for c in costs])
        A, G, Z = np.array(x.act), np.array(x.grad), np.array(x.asynchronous, dtype=bool)
        # exact flush for m = 1 .. past the transient; beyond it each micro-batch adds the same period
        M = max(1, min(self.max_m // mbs, 2 * len(stages) + 4))
        ms = np.arange(1, M + 1)
        sched = self.ev.pipeline_times(np.tile(F, (M, 1)), np.tile(B, (M, 1)), np.tile(A, (M, 1)),
                                       np.tile(G, (M, 1)), ms, np.tile(Z, (M, 1)))
        flush = sched.makespan
        slope = float(flush[-1] - flush[-2]) if M >= 2 else float(sched.steady_period[0])
        return Template(self.part.name, self.part.gpu_type, mbs, stages, float(sched.steady_period[0]),
                        flush, slope)


def uniform_split(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Sailor's partition: L div P layers per stage, the remainder to the last stages."""
    base, extra = divmod(num_layers, num_stages)
    out, first = [], 0
    for s in range(num_stages):
        n = base + (1 if s >= num_stages - extra else 0)
        out.append((first, first + n - 1))
        first += n
    return out


SHALLOW_STAGES = 2


def build_templates(builder: TemplateBuilder, mbs_values: list[int], *, sailor_shape: bool,
                    keep: int, exhaustive_limit: int = 0) -> list[Template]:
    """Candidate templates of one partition: every feasible split and TP vector when there are at most
    ``exhaustive_limit`` of them (small models, small nodes); otherwise Sailor's uniform splits for
    every P and the DP's splits (every P and TP policy), of which the ``3 * keep`` best by steady-state
    efficiency are kept."""
    every = builder.enumerate_all(mbs_values, exhaustive_limit)
    if every is not None:  # small enough to try every split and TP vector
        return sorted((builder.finish(mbs, stages) for mbs, stages in every),
                      key=lambda t: (-t.efficiency(), t.gpus, t.key))
    found: dict[tuple, float] = {}
    for mbs in mbs_values:
        for stages in builder.uniform(mbs):  # Sailor's shape, also a candidate of the full space
            found.setdefault((mbs, stages), builder.period_estimate(mbs, stages))
        if sailor_shape:
            continue
        for policy in [None, *builder.tps]:
            for stages, period in builder.build(mbs, policy):
                found.setdefault((mbs, stages), period)
    # a pipeline wider than the GPUs a plan may use is never placed, so it is not priced either (it could
    # cross nodes, and a one-node site has no fit for that)
    found = {k: v for k, v in found.items() if sum(t for _, _, t in k[1]) <= builder.max_gpus}

    # rank by the DP's estimate first, so only the promising few are timed exactly
    def estimate(item: tuple) -> tuple:
        (mbs, stages), period = item
        gpus = sum(t for _, _, t in stages)
        return (-(mbs / (period * gpus)) if period > 0 else 0.0, gpus, mbs, stages)

    ranked = [k for k, _ in sorted(found.items(), key=estimate)]
    uniform = [(mbs, stages) for mbs in mbs_values for stages in builder.uniform(mbs) if (mbs, stages) in found]
    # efficiency per GPU favours deep pipelines; with few micro-batches per pipeline (a small global
    # batch on many GPUs) the bubble dominates and one or two stages at a higher TP are faster: keep
    # the DP's 1- and 2-stage splits at every TP degree as well
    shallow = [(mbs, stages) for mbs, stages in found if len(stages) <= SHALLOW_STAGES]
    shortlist = ranked[:3 * keep] + uniform + shallow
    templates = [builder.finish(mbs, stages) for mbs, stages in dict.fromkeys(shortlist)]
    templates.sort(key=lambda t: (-t.efficiency(), t.gpus, t.key))
    return templates
