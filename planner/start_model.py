"""When a job request would start, from a queue snapshot: the backfill rule on a GPU timeline.

A job starts at the first moment its per-node GPU demands fit the nodes' free GPUs and keep fitting for
its whole time limit (backfill never delays a job that Slurm has already planned, so the pending jobs'
planned holds count as taken from their expected start). With ``--time-min`` the window need only last
that long, and the job is granted the time up to the next moment it would no longer fit. A het request
needs every partition at once.

The site's states shape the timeline before any request is asked about (:mod:`planner.site_timeline`):
a partition that starts no job (DOWN, DRAIN, INACTIVE), a request over its MaxNodes, or one the
usable nodes can never hold never starts, with the reason; a reservation takes its nodes over its
whole time (so a request that would cross into it starts after it, or fits before it); the pending jobs
Slurm has not planned yet are placed first, by priority, where backfill would put them.

Slurm's own answer for the exact request (``sbatch --test-only``) wins where the snapshot has one, except
(a) for a request that fits the free GPUs now for its whole time without touching a planned job: backfill
starts that one at once, while ``--test-only`` answers "now + the job's limit" for a node Slurm has planned
for a pending job (measured on the local cluster); (b) where the pending jobs Slurm has not planned moved
the start: ``--test-only`` does not see them; (c) where the request can never start: ``--test-only``
answers a start for a DOWN partition too. The site's history of waits is the fallback where the timeline
has no end (a job holding GPUs without a time limit).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from planner.site_timeline import SiteTimeline, fits, fits_sorted
from sailor_hpc.core.start_times import (
    HISTORY,
    IDLE_NOW,
    SITE_STATE,
    TEST_ONLY,
    TIMELINE,
    QueueSnapshot,
    RequestShape,
    StartEstimate,
)


@dataclass(frozen=True)
class Window:
    """Where a request fits: its start and the time it is granted there (its limit, or less with --time-min)."""

    estimate: StartEstimate
    granted_s: float


class _Segments:
    """The free GPUs of every node on each stretch between two hold boundaries, and where a shape fits."""

    def __init__(self, timeline: SiteTimeline, with_unplanned: bool):
        holds = timeline.holds if with_unplanned else timeline.holds_without_unplanned
        self.times = sorted({0.0, *(t for h in holds for t in (h.start_s, h.end_s) if math.isfinite(t))})
        self._free = {p: [sorted(timeline.free_at(p, t, holds).values(), reverse=True) for t in self.times]
                      for p in timeline.node_gpus}
        self._fit_cache: dict[tuple[RequestShape, int], bool] = {}
        self._intervals: dict[RequestShape, list[tuple[float, float]]] = {}

    def _fits_at(self, shape: RequestShape, i: int) -> bool:
        key = (shape, i)
        hit = self._fit_cache.get(key)
        if hit is None:
            hit = self._fit_cache[key] = all(p in self._free and fits_sorted(gpus, self._free[p][i]) for p, gpus in shape)
        return hit

    def intervals(self, shape: RequestShape) -> list[tuple[float, float]]:
        hit = self._intervals.get(shape)
        if hit is None:
            hit = []
            for i, t in enumerate(self.times):
                if not self._fits_at(shape, i):
                    continue
                end = self.times[i + 1] if i + 1 < len(self.times) else math.inf
                if hit and hit[-1][1] == t:
                    hit[-1] = (hit[-1][0], end)
                else:
                    hit.append((t, end))
            self._intervals[shape] = hit
        return hit

    def first(self, shape: RequestShape, need: float) -> tuple[float, float] | None:
        """The first stretch of at least ``need`` seconds over which ``shape`` fits."""
        return next(((s, e) for s, e in self.intervals(shape) if e - s >= need), None)


class StartModel:
    """Expected starts of request shapes on one snapshot (cached: the search asks for few distinct shapes)."""

    def __init__(self, snapshot: QueueSnapshot):
        self.snapshot = snapshot
        self.timeline = SiteTimeline(snapshot)
        self._full = _Segments(self.timeline, with_unplanned=True)
        self._base: _Segments | None = None  # without the unplanned jobs, asked only when they exist
        self._cache: dict[tuple, Window] = {}

    def free_at(self, partition: str, t: float) -> dict[str, int]:
        """Free GPUs per usable node of ``partition`` at ``t`` seconds from the snapshot."""
        return self.timeline.free_at(partition, t, self.timeline.holds)

    def intervals(self, shape: RequestShape) -> list[tuple[float, float]]:
        """The stretches of time ``[start, end)`` over which ``shape`` fits, in order (end math.inf: for good)."""
        return self._full.intervals(shape)

    def window(self, shape: RequestShape, limit_s: float, min_s: float | None = None) -> Window:
        """The first start of ``shape`` with ``limit_s`` to run (or at least ``min_s`` under --time-min)."""
        key = (shape, round(limit_s), None if min_s is None else round(min_s))
        hit = self._cache.get(key)
        if hit is None:
            window = self._window(shape, limit_s, min_s)
            hit = self._cache[key] = replace(window, estimate=replace(
                window.estimate, considered=self.timeline.considered(shape)))
        return hit

    def _window(self, shape: RequestShape, limit_s: float, min_s: float | None) -> Window:
        refusal = self.timeline.refusal(shape)
        if refusal:
            return Window(StartEstimate(math.inf, SITE_STATE, refusal), limit_s)
        need = limit_s if min_s is None else min(min_s, limit_s)
        tested = self.snapshot.tested.get((shape, round(limit_s))) if min_s is None else None
        found = self._full.first(shape, need)
        if found is not None:
            start, end = found
            moved = self._moved_by_unplanned(shape, need, start)
            if start > 0 and tested is not None and not moved:  # Slurm's start; what frees the GPUs, the timeline's
                return Window(replace(tested, detail=self.timeline.freed_by(shape, start)), limit_s)
            source = IDLE_NOW if start == 0 else TIMELINE
            return Window(StartEstimate(start, source, self.timeline.freed_by(shape, start)), min(limit_s, end - start))
        never = next((why for p, g in shape if (why := self.timeline.never_fits(p, g))), "")
        if never:  # --test-only may still answer a start: a reservation without end is never over
            return Window(StartEstimate(math.inf, SITE_STATE, never), limit_s)
        if tested is not None:
            return Window(tested, limit_s)
        return self._from_history(shape, limit_s)

    def _moved_by_unplanned(self, shape: RequestShape, need: float, start: float) -> bool:
        """Whether the pending jobs Slurm has not planned push ``shape``'s start later (``--test-only`` does
        not see them, so its answer is not taken then)."""
        if not self.timeline.unplanned_holds:
            return False
        if self._base is None:
            self._base = _Segments(self.timeline, with_unplanned=False)
        base = self._base.first(shape, need)
        return base is None or base[0] < start

    def _from_history(self, shape: RequestShape, limit_s: float) -> Window:
        """No start on the timeline (GPUs held by a job with no end): the history."""
        waits = [self.snapshot.history_wait(part, len(gpus)) for part, gpus in shape]
        if not waits or any(w is None for w in waits):
            return Window(StartEstimate(math.inf, TIMELINE, "held without end, and no wait history"), limit_s)
        worst = max((w for w in waits if w is not None), key=lambda w: w.median_wait_s)
        return Window(StartEstimate(worst.median_wait_s, HISTORY,
                                    f"median of {worst.jobs} past jobs on {worst.partition}"), limit_s)


__all__ = ["StartModel", "Window", "fits", "HISTORY", "IDLE_NOW", "SITE_STATE", "TEST_ONLY", "TIMELINE"]
