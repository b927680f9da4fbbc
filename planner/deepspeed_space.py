"""The plans DeepSpeed's own engine can run, searched with the ZeRO stage as a dimension.

DeepSpeed trains one grid (:mod:`sailor_hpc.core.deepspeed_plan`): D identical replicas of one pipeline
of P stages, every stage at TP 1, one micro-batch size and count. A stage's GPU type may differ from
its neighbours' (the engine does not know about GPU types), so a pipeline may run its first stages on
one partition and the rest on another. The search enumerates

* P (1 to the stage limit) and the stages' partitions: one partition, or two in either order with
  every cut between them (at most two GPU types per pipeline keeps the space small);
* the micro-batch size (every size profiled at TP 1 on those GPU types) and the replica count D, with
  ``global batch = mbs x micro-batches x D`` exactly (DeepSpeed's rule);
* the layer split: the one that minimises the slowest stage's forward + backward time on its GPU type
  (exact dynamic programming over the profiles' prefix sums);
* the ZeRO stage: 0 and 1 with pipelining, 0 to 3 without.

Shapes are ranked by an estimate (the 1F1B flush ``(m + P - 1) x slowest stage``, which is what the
simulator's schedule gives for balanced blocking stages, plus nothing for the tail); the best
``simulate_top`` are simulated whole under every ZeRO stage they may use (:func:`simulator.simulate`,
runtime ``deepspeed``), which decides memory, constraints and the ranking.
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from planner.candidates import (
    Candidate,
    SearchResult,
    best_over_dtypes,
    candidate_dtypes,
    default_available,
    infeasible,
    partition_gpus,
    ranking,
    usable_gpus,
)
from planner.request import PlanRequest
from sailor_hpc.core.archive import ProfileArchive
from sailor_hpc.core.deepspeed_plan import with_zero_stage, zero_stages_for
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import get_model
from sailor_hpc.core.placement import place_plan
from sailor_hpc.core.plan import Pipeline, Plan, Stage, validate_plan
from sailor_hpc.core.site import Partition, Site
from simulator import SimOptions, SimResult, StageEvaluator, simulate

RUNTIME = "deepspeed"


@dataclass(frozen=True)
class Shape:
    """One engine-expressible plan before its ZeRO stage: D replicas of one pipeline."""

    parts: tuple[Partition, ...]  # per stage
    bounds: tuple[tuple[int, int], ...]  # per stage: first, last layer
    mbs: int
    micro_batches: int
    replicas: int
    estimate_s: float

    @property
    def gpus(self) -> int:
        return len(self.parts) * self.replicas

    def cost_per_hour(self) -> float:
        return self.replicas * sum(p.cost_per_gpu_hour for p in self.parts)

    def plan(self, request: PlanRequest, model: str) -> Plan:
        stages = tuple(Stage(a, b, 1, p.gpu_type, p.name) for p, (a, b) in zip(self.parts, self.bounds))
        pipes = tuple(Pipeline(self.mbs, self.micro_batches, stages) for _ in range(self.replicas))
        return Plan(model, request.global_batch_size, pipes, seq_len=request.seq_len, dtype=request.dtype,
                    notes={"planner": {"objective": request.objective, "space": "deepspeed"}})


def balanced_split(times: list[np.ndarray]) -> tuple[float, tuple[tuple[int, int], ...]]:
    """Cut L layers into len(times) consecutive non-empty stages minimising the slowest stage, where
    ``times[s][l]`` is layer l's seconds on stage s's GPU type. Returns (slowest, bounds)."""
    P, L = len(times), len(times[0])
    cum = [np.concatenate(([0.0], np.cumsum(t))) for t in times]
    best = np.full((P, L), math.inf)  # best[s, j]: layers 0..j on stages 0..s
    cut = np.zeros((P, L), dtype=np.int64)
    best[0] = cum[0][1:]
    i = np.arange(L)[:, None]  # stage s holds layers i..j
    j = np.arange(L)[None, :]
    for s in range(1, P):
        prev = np.concatenate(([math.inf], best[s - 1, :-1]))[:, None]  # best[s - 1, i - 1]
        cand = np.where((i >= s) & (i <= j), np.maximum(prev, cum[s][j + 1] - cum[s][i]), math.inf)
        cut[s] = np.argmin(cand, axis=0)
        best[s] = cand[cut[s], np.arange(L)]
    bounds = []
    end = L - 1
    for s in range(P - 1, 0, -1):
        start = int(cut[s, end])
        bounds.append((start, end))
        end = start - 1
    bounds.append((0, end))
    return float(best[P - 1, L - 1]), tuple(reversed(bounds))


def _assignments(parts: list[Partition], gpus: dict[str, int], P: int) -> Iterator[tuple[Partition, ...]]:
    """Stage partitions of a P-stage pipeline: one partition, or a block of one then a block of another."""
    for a in parts:
        if gpus[a.name] >= P:
            yield (a,) * P
    for a in parts:
        for b in parts:
            if a is not b:
                for k in range(1, P):
                    if gpus[a.name] >= k and gpus[b.name] >= P - k:
                        yield (a,) * k + (b,) * (P - k)


def shapes(ev: StageEvaluator, archive: ProfileArchive, request: PlanRequest, max_stages: int) -> list[Shape]:
    """Every engine-expressible shape within the request's GPUs and budget, with its flush estimate."""
    site, model, gbs = ev.site, ev.model, request.global_batch_size
    available, capacity = usable_gpus(site, request), default_available(site)
    for name in available:
        site.partition(name)  # unknown partition names are errors
    gpus: dict[str, int] = {}
    mbs_of: dict[str, set[int]] = {}
    for part in site.partitions:
        n, _ = partition_gpus(part, available.get(part.name, 0), capacity[part.name], request)
        if (n > 0 and request.dtype in site.gpu(part.gpu_type).dtypes
                and archive.has_compute(model.name, part.gpu_type, request.dtype)):
            points = archive.compute_points(model.name, part.gpu_type, request.dtype)
            sizes = {b for b, t in points if t == 1 and b <= gbs}
            if sizes:
                gpus[part.name], mbs_of[part.name] = n, sizes
    parts = [p for p in site.partitions if p.name in gpus]
    L = model.num_pipeline_layers
    c = request.constraints
    out: list[Shape] = []
    times: dict[tuple[str, int], np.ndarray] = {}
    for P in range(1, min(max_stages, L) + 1):
        for assign in _assignments(parts, gpus, P):
            used = {p.name: sum(1 for q in assign if q is p) for p in assign}
            for mbs in sorted(set.intersection(*(mbs_of[n] for n in used))):
                for p in used_parts(assign):
                    if (p.gpu_type, mbs) not in times:
                        times[(p.gpu_type, mbs)] = _layer_times(ev, p.gpu_type, mbs, L)
                slowest, bounds = balanced_split([times[(p.gpu_type, mbs)] for p in assign])
                max_d = min(gpus[n] // k for n, k in used.items())
                for d in range(1, max_d + 1):
                    if gbs % (mbs * d):
                        continue
                    m = gbs // (mbs * d)
                    shape = Shape(assign, bounds, mbs, m, d, (m + P - 1) * slowest)
                    if c.max_gpus is not None and shape.gpus > c.max_gpus:
                        continue
                    if c.max_cost_per_hour is not None and shape.cost_per_hour() > c.max_cost_per_hour:
                        continue
                    out.append(shape)
    return out


def used_parts(assign: tuple[Partition, ...]) -> list[Partition]:
    """The distinct partitions of a stage assignment, in order."""
    return list({p.name: p for p in assign}.values())


def _layer_times(ev: StageEvaluator, gpu: str, mbs: int, L: int) -> np.ndarray:
    """Forward + backward seconds of every layer alone on ``gpu`` at TP 1 (the profile's prefix sums)."""
    table = ev.compute_table(gpu, mbs, 1)
    per = np.diff(table.cum_fwd) + np.diff(table.cum_bwd)
    return per[:L]


def _score(shape: Shape, request: PlanRequest) -> float:
    """Smaller is better: estimated seconds per sample, or cost per sample."""
    per_sample = shape.estimate_s / request.global_batch_size
    return per_sample * shape.cost_per_hour() if request.objective == "cost" else per_sample


def _rejection(res: SimResult, request: PlanRequest) -> str | None:
    """The first bound a simulated plan misses (memory, then the request's constraints), or None."""
    c = request.constraints
    misses = (("memory", not res.fits),
              ("min_throughput", c.min_throughput is not None and res.throughput_samples_per_s < c.min_throughput),
              ("max_cost_per_iteration",
               c.max_cost_per_iteration is not None and res.cost_per_iteration > c.max_cost_per_iteration))
    return next((name for name, missed in misses if missed), None)


def deepspeed_search(site: Site, archive: ProfileArchive, request: PlanRequest, *, simulate_top: int = 40,
                     simulate_limit: int = 400, max_stages: int = 16) -> SearchResult:
    """Best engine-expressible plans for ``request``, best first, each with its ZeRO stage in its notes."""
    if request.dtype == "auto":  # each dtype the GPUs train in and the archive has, the best plans of all
        dtypes = candidate_dtypes(site, archive, request)
        if not dtypes:
            raise SailorError("no dtype to plan in: no partition has profiles of the model",
                              field="--dtype", fix="profile the model, or pass --dtype")
        return best_over_dtypes(request, dtypes, lambda one: deepspeed_search(
            site, archive, one, simulate_top=simulate_top, simulate_limit=simulate_limit, max_stages=max_stages))
    t0 = time.perf_counter()
    ev = StageEvaluator(archive, site, get_model(request.model), dtype=request.dtype,
                        options=SimOptions(runtime=RUNTIME))
    found = shapes(ev, archive, request, request.max_stages or max_stages)
    if not found:
        raise SailorError(f"no partition of site {site.name!r} has GPUs and TP-1 {request.dtype} profiles of "
                          f"{ev.model.name} for a DeepSpeed plan", file=site.source, field="partitions",
                          fix="check the available GPUs and the archive (sailor-hpc profiles list)")
    found.sort(key=lambda s: (_score(s, request), s.gpus))
    out: list[Candidate] = []
    fitting: list[Candidate] = []
    rejected: dict[str, int] = {}
    simulated = 0
    for shape in found:
        if (simulated >= simulate_top and len(out) >= max(1, request.top_k)) or simulated >= simulate_limit:
            break
        base = shape.plan(request, ev.model.name)
        try:
            base = place_plan(base, site)
            validate_plan(base, site, check_placement=True)
        except SailorError:
            rejected["placement"] = rejected.get("placement", 0) + 1
            continue
        for zero in zero_stages_for(len(shape.parts)):
            plan = with_zero_stage(base, zero)
            res = simulate(plan, site, archive, options=SimOptions(runtime=RUNTIME))
            simulated += 1
            plan = replace(plan, notes={**plan.notes, "simulator": {"iteration_time_s": res.iteration_time_s}})
            reason = _rejection(res, request)
            if res.fits:
                fitting.append(Candidate(plan, res))
            if reason:
                rejected[reason] = rejected.get(reason, 0) + 1
                continue
            out.append(Candidate(plan, res))
    if not out:
        raise infeasible(request, site, rejected, fitting, len(found))
    out.sort(key=ranking(request))
    return SearchResult(request, out, time.perf_counter() - t0, len(found), simulated, rejected, fitting)


__all__ = ["RUNTIME", "Shape", "balanced_split", "deepspeed_search", "shapes"]
