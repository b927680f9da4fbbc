"""From the pipelines' flush to the end of the iteration: gradient syncs, then the optimizer step.

After its last backward, every GPU runs (DeepSpeed's order, which the measured runs used):

1. the tied-embedding all-reduce between the first and the last stage of its pipeline (models whose
   LM head shares the embedding, when the profile says the last stage holds that copy);
2. one ring all-reduce per *gradient segment* it holds: a segment is a maximal run of layers that the
   same stage of every pipeline holds (for Sailor's plans, whose pipelines share one split, a segment
   is a stage, and this is Sailor's per-stage data-parallel all-reduce);
3. its optimizer step.

A collective starts when its last participant arrives and ends for all of them together. Replicas of
the same layers run on different nodes whose speed varies a little (``replica_jitter`` of the site's
partitions: the coefficient of variation of a replica's step time); a profile gives the mean, and a
gradient all-reduce waits for the slowest of its H replicas, on average ``jitter * E[max of H standard
normals] * span`` after the mean arrival, where span is the compute since those ranks last met. On
Clariden the measured gradient-reduction times of Sailor's runs (``red_grads``) show this wait: 1-2 %
of the iteration, growing with H, in both models' runs.

Under DeepSpeed nothing overlaps with compute except what the schedule allows naturally: a late stage
of a pipeline finishes its cool-down earlier than stage 0 and starts reducing while stage 0 still
computes. megatron_patch overlaps more (``SimOptions.overlap_grad_sync``): its gradients go in size-capped
buckets whose all-reduce starts, in one global order, as soon as the last micro-batch's backward has
produced them, so a collective carries each holder's *lead*: how long before that holder's flush its
part is ready (the backward of the stage's layers below the bucket). A GPU runs one collective at a time
(one communication stream), in the given order, and its optimizer step waits for its flush and its last
collective. With every lead 0 this is the DeepSpeed order above. The iteration ends when the last GPU
ends its optimizer step (the grad-norm all-reduce and the next iteration's first exchange make every
GPU wait for it).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np

StageKey = tuple[int, int]  # (pipeline, stage)


@dataclass(frozen=True)
class Collective:
    """One all-reduce: who takes part and how long it takes once all have arrived."""

    kind: str  # "tied" or "grads"
    holders: tuple[StageKey, ...]
    seconds: float
    first_layer: int
    last_layer: int
    skew: float = 0.0  # straggler wait per second of compute since the holders last met (jitter * E[max])
    lead: tuple[float, ...] = ()  # per holder: seconds before its flush that its part is ready (empty: 0)


@cache
def expected_max_normal(n: int) -> float:
    """E[max of n standard normal draws] = integral of x * n * pdf(x) * cdf(x)^(n-1); 0 for n <= 1.
    Trapezoid rule on [-9, 9], the cdf integrated on the same grid (error below 1e-6)."""
    if n <= 1:
        return 0.0
    x = np.linspace(-9.0, 9.0, 7201)
    dx = x[1] - x[0]
    pdf = np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi)
    cdf = np.concatenate(([0.0], np.cumsum((pdf[1:] + pdf[:-1]) * dx / 2)))
    y = x * n * pdf * cdf ** (n - 1)
    return float(((y[1:] + y[:-1]) * dx).sum() / 2)


@dataclass(frozen=True)
class IterationEnd:
    time_s: float
    collective_start: tuple[float, ...]  # same order as the collectives given
    stage_sync_end: dict[StageKey, float]  # when each stage finished its collectives
    stage_end: dict[StageKey, float]  # ... and its optimizer step


def last_met(history: Sequence[tuple[frozenset, float]], ranks: Sequence) -> float:
    """When all of ``ranks`` last ended a collective together (0: the iteration's start)."""
    group = set(ranks)
    return max((end for members, end in history if group <= members), default=0.0)


def finish_iteration(flush: dict[StageKey, float], collectives: Sequence[Collective],
                     update: dict[StageKey, float]) -> IterationEnd:
    """Run the collectives in the given (global) order, then each stage's optimizer step."""
    comm_free: dict[StageKey, float] = {}  # when each stage's communication stream is next free
    met: list[tuple[frozenset, float]] = []  # (ranks, end) of every collective so far
    starts = []
    for c in collectives:
        lead = c.lead or (0.0,) * len(c.holders)
        arrive = max(max(flush[h] - lag, comm_free.get(h, 0.0)) for h, lag in zip(c.holders, lead))
        start = arrive + c.skew * (arrive - last_met(met, c.holders))
        starts.append(start)
        for h in c.holders:
            comm_free[h] = start + c.seconds
        met.append((frozenset(c.holders), start + c.seconds))
    ready = {k: max(t, comm_free.get(k, t)) for k, t in flush.items()}
    ends = {k: ready[k] + update[k] for k in ready}
    return IterationEnd(time_s=max(ends.values()), collective_start=tuple(starts), stage_sync_end=dict(ready),
                        stage_end=ends)


def gradient_segments(stage_ranges: Sequence[Sequence[tuple[int, int]]]) -> list[tuple[int, int, tuple[StageKey, ...]]]:
    """Maximal layer runs held by the same stage of every pipeline.

    ``stage_ranges[i]`` lists pipeline i's stages as (first, last) layers covering the same 0..L-1.
    Returns (first, last, holders) with holders = ((pipeline, stage), ...) for every pipeline.
    """
    cuts = sorted({first for ranges in stage_ranges for first, _ in ranges})
    last_layer = stage_ranges[0][-1][1]
    bounds = cuts + [last_layer + 1]
    out = []
    for lo, nxt in zip(bounds[:-1], bounds[1:]):
        holders = []
        for i, ranges in enumerate(stage_ranges):
            s = next(j for j, (a, b) in enumerate(ranges) if a <= lo <= b)
            holders.append((i, s))
        out.append((lo, nxt - 1, tuple(holders)))
    return out
