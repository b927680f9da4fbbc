"""When a job request would start, from a queue snapshot: the backfill rule on a GPU timeline.

A job starts at the first moment its per-node GPU demands fit the nodes' free GPUs and keep fitting for
its whole time limit (backfill never delays a job that Slurm has already planned, so the pending jobs'
planned holds count as taken from their expected start). With ``--time-min`` the window need only last
that long, and the job is granted the time up to the next moment it would no longer fit. A het request
needs every partition at once. Slurm's own answer for the exact request (``sbatch --test-only``) wins
where the snapshot has one, except for a request that fits the free GPUs now for its whole time without
touching a planned job: backfill starts that one at once, while ``--test-only`` answers "now + the job's
limit" for a node Slurm has planned for a pending job (measured on the local cluster). The site's
history of waits is the fallback where the timeline has no end (a job holding GPUs without a time limit).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from sailor_hpc.core.start_times import (
    HISTORY,
    IDLE_NOW,
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


def fits(demands: tuple[int, ...], free: Mapping[str, int]) -> bool:
    """First-fit of per-node GPU demands into the nodes' free GPUs (one node per demand)."""
    return fits_sorted(demands, sorted(free.values(), reverse=True))


def fits_sorted(demands: tuple[int, ...], slots: list[int]) -> bool:
    """:func:`fits` on the free GPUs sorted largest first. First-fit over sorted nodes takes the largest
    unused node every time (a smaller one fits no demand the largest refuses), so the k-th demand lands on
    the k-th largest node: the request fits when each of those holds it."""
    return len(demands) <= len(slots) and all(have >= need for have, need in zip(slots, demands))


class StartModel:
    """Expected starts of request shapes on one snapshot (cached: the search asks for few distinct shapes)."""

    def __init__(self, snapshot: QueueSnapshot):
        self.snapshot = snapshot
        self._cache: dict[tuple, Window] = {}
        self._fit_cache: dict[tuple[RequestShape, int], bool] = {}
        self._intervals: dict[RequestShape, list[tuple[float, float]]] = {}
        self._times = sorted({0.0, *(t for h in snapshot.holds for t in (h.start_s, h.end_s) if math.isfinite(t))})
        # free GPUs per node of each partition on each segment [times[i], times[i + 1]), largest first
        self._free = {p: [sorted(self.free_at(p, t).values(), reverse=True) for t in self._times]
                      for p in snapshot.node_gpus}

    def free_at(self, partition: str, t: float) -> dict[str, int]:
        """Free GPUs per usable node of ``partition`` at ``t`` seconds from the snapshot."""
        free = dict(self.snapshot.node_gpus.get(partition, {}))
        for h in self.snapshot.holds:
            if h.partition == partition and h.node in free and h.start_s <= t < h.end_s:
                free[h.node] -= h.gpus
        return free

    def _fits_at(self, shape: RequestShape, i: int) -> bool:
        key = (shape, i)
        hit = self._fit_cache.get(key)
        if hit is None:
            hit = self._fit_cache[key] = all(p in self._free and fits_sorted(gpus, self._free[p][i]) for p, gpus in shape)
        return hit

    def intervals(self, shape: RequestShape) -> list[tuple[float, float]]:
        """The stretches of time ``[start, end)`` over which ``shape`` fits, in order (end math.inf: for good)."""
        hit = self._intervals.get(shape)
        if hit is None:
            hit = []
            for i, t in enumerate(self._times):
                if not self._fits_at(shape, i):
                    continue
                end = self._times[i + 1] if i + 1 < len(self._times) else math.inf
                if hit and hit[-1][1] == t:
                    hit[-1] = (hit[-1][0], end)
                else:
                    hit.append((t, end))
            self._intervals[shape] = hit
        return hit

    def window(self, shape: RequestShape, limit_s: float, min_s: float | None = None) -> Window:
        """The first start of ``shape`` with ``limit_s`` to run (or at least ``min_s`` under --time-min)."""
        key = (shape, round(limit_s), None if min_s is None else round(min_s))
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._window(shape, limit_s, min_s)
        return hit

    def _window(self, shape: RequestShape, limit_s: float, min_s: float | None) -> Window:
        need = limit_s if min_s is None else min(min_s, limit_s)
        tested = self.snapshot.tested.get((shape, round(limit_s))) if min_s is None else None
        for start, end in self.intervals(shape):
            if end - start >= need:
                if start > 0 and tested is not None:
                    return Window(tested, limit_s)
                return Window(StartEstimate(start, IDLE_NOW if start == 0 else TIMELINE), min(limit_s, end - start))
        if tested is not None:
            return Window(tested, limit_s)
        return self._from_history(shape, limit_s)

    def _from_history(self, shape: RequestShape, limit_s: float) -> Window:
        """No start on the timeline (GPUs held with no end, or more than the nodes have): the history."""
        waits = [self.snapshot.history_wait(part, len(gpus)) for part, gpus in shape]
        if not waits or any(w is None for w in waits) or not all(self._could_ever_fit(p, g) for p, g in shape):
            return Window(StartEstimate(math.inf, TIMELINE, "never fits the usable nodes, or held without end"),
                          limit_s)
        worst = max((w for w in waits if w is not None), key=lambda w: w.median_wait_s)
        return Window(StartEstimate(worst.median_wait_s, HISTORY,
                                    f"median of {worst.jobs} past jobs on {worst.partition}"), limit_s)

    def _could_ever_fit(self, partition: str, gpus: tuple[int, ...]) -> bool:
        return fits(gpus, self.snapshot.node_gpus.get(partition, {}))


__all__ = ["StartModel", "Window", "fits", "HISTORY", "IDLE_NOW", "TEST_ONLY", "TIMELINE"]
