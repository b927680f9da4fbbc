"""Is a profile monotonic in the micro-batch size, within what its measurements can tell apart?

More samples never take less time on the same GPU: a point whose whole-model forward or backward is
faster than a smaller micro-batch size's is a measurement gone wrong (on the first H100 run: clocks
dropped while the GPU idled between per-layer timings, so mbs 4 ran its forward in 63 ms and mbs 2 in
66 ms). Two points disagree only when the gap is larger than both points' interquartile ranges together:
a gap inside the spread is noise the medians cannot resolve, and flagging it would cry wolf on every
launch-bound profile, where small micro-batch sizes take nearly the same time.

Torch-free: the profiling job (:func:`profiler.compute.profile_compute`, over the sizes it measured) and
the sweep driver (:mod:`profiler.sweep`, over every job's points in the archive) both use it.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from sailor_hpc.core.archive import PointSpread

DIRECTIONS = ("forward", "backward")
MONOTONIC = "not monotonic"  # the kind of flag a violation gives (profiler.noise.flag_parts)


@dataclass(frozen=True)
class ModelTotals:
    """A point's whole-model seconds (sum over pipeline layers) and their spreads, both directions."""

    mbs: int
    seconds: tuple[float, float]  # forward, backward
    spread: tuple[float, float] = (0.0, 0.0)  # interquartile range / median of each (0: not recorded)

    @classmethod
    def of(cls, mbs: int, times: np.ndarray, spread: PointSpread | None) -> ModelTotals:
        """From a point's (L, 3) per-layer seconds and its spread (None: a profile without one)."""
        sums = np.asarray(times, dtype=np.float64)[:, :2].sum(axis=0)
        return cls(mbs, (float(sums[0]), float(sums[1])), spread.model if spread is not None else (0.0, 0.0))

    def band(self, direction: int) -> float:
        """Seconds this point's median may be off by: its interquartile range."""
        return self.seconds[direction] * self.spread[direction]


def violations(points: Iterable[ModelTotals]) -> dict[int, str]:
    """micro-batch size -> why, for both points of every pair (smaller b, larger a) in which a's whole-model
    forward or backward is below b's by more than their two interquartile ranges together. Both are named:
    the pair is inconsistent, and either one may be the wrong measurement."""
    pts = sorted(points, key=lambda p: p.mbs)
    why: dict[int, list[str]] = {}
    for i, small in enumerate(pts):
        for large in pts[i + 1:]:
            for d, name in enumerate(DIRECTIONS):
                gap = small.seconds[d] - large.seconds[d]
                allowed = small.band(d) + large.band(d)
                if gap > allowed:
                    text = (f"{name} {large.seconds[d] * 1e3:.3g} ms at mbs {large.mbs} is below "
                            f"{small.seconds[d] * 1e3:.3g} ms at mbs {small.mbs} by {gap * 1e3:.3g} ms, more than "
                            f"their spreads allow ({allowed * 1e3:.3g} ms)")
                    why.setdefault(small.mbs, []).append(text)
                    why.setdefault(large.mbs, []).append(text)
    return {mbs: f"{MONOTONIC}: " + "; ".join(texts) for mbs, texts in why.items()}
