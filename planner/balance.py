"""Share a global batch among pipelines that run at different speeds.

Pipeline j with m_j micro-batches of mbs_j samples flushes after ``time_j(m_j)`` seconds (the
simulator's exact 1F1B schedule, tabulated per template). The iteration's pipelines end when the
slowest one ends, so the best split gives every pipeline as many micro-batches as finish under a common
deadline: the smallest deadline whose capacity reaches the global batch (bisection over the tabulated
times), trimmed to exactly the global batch.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class PipelineSpeed:
    """Flush time of a pipeline for m = 1..len(flush) micro-batches, extended by ``slope`` per extra one
    (past its transient, a 1F1B schedule adds exactly one steady period per micro-batch)."""

    __slots__ = ("flush", "slope", "mbs", "_last")

    def __init__(self, flush: np.ndarray | list[float], slope: float, mbs: int) -> None:
        self.flush = [float(x) for x in flush]  # plain floats: bisect beats numpy on a few dozen values
        self.slope = slope
        self.mbs = mbs
        self._last = self.flush[-1]

    def time(self, m: int) -> float:
        n = len(self.flush)
        return self.flush[m - 1] if m <= n else self._last + (m - n) * self.slope

    def fits(self, deadline: float) -> int:
        """How many micro-batches finish by ``deadline`` (0 if not even one)."""
        n = bisect_right(self.flush, deadline)
        if n < len(self.flush) or self.slope <= 0:
            return n
        return n + int((deadline - self._last) // self.slope)


@dataclass
class Share:
    """Micro-batches of one group of identical pipelines: ``high`` copies run ``m``, the rest ``m - 1``."""

    m: int
    high: int
    copies: int

    def counts(self) -> list[int]:
        return [self.m] * self.high + [self.m - 1] * (self.copies - self.high)


def balance(groups: Sequence[tuple[PipelineSpeed, int]], global_batch: int) -> tuple[float, list[Share]] | None:
    """Share ``global_batch`` samples among groups of identical pipelines ((speed, copies) each).

    Every pipeline runs at least one micro-batch; the slowest flush is minimised. Returns that flush
    time and each group's share, or None if impossible (more pipelines than samples, or micro-batch
    sizes that cannot add up to the global batch exactly).
    """
    if not groups or sum(s.mbs * n for s, n in groups) > global_batch:
        return None
    lo = max(s.time(1) for s, _ in groups)  # every pipeline runs at least one micro-batch
    if _capacity(groups, lo) < global_batch:
        step = max(s.slope if s.slope > 0 else s.time(1) for s, _ in groups)
        hi = lo + step * global_batch
        # bracket around the deadline the pipelines' steady rates give, to bisect a narrow interval
        rate = sum(n * s.mbs / s.slope for s, n in groups if s.slope > 0)
        if rate > 0:
            guess = (global_batch + sum(n * s.mbs * s.time(1) / s.slope for s, n in groups if s.slope > 0)) / rate
            if guess + 2 * step < hi and _capacity(groups, guess + 2 * step) >= global_batch:
                hi = guess + 2 * step
            if lo < guess - 2 * step and _capacity(groups, guess - 2 * step) < global_batch:
                lo = guess - 2 * step
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if _capacity(groups, mid) >= global_batch:
                hi = mid
            else:
                lo = mid
            if hi - lo <= 1e-7 * hi:
                break
        lo = hi
    shares = [Share(max(1, s.fits(lo)), n, n) for s, n in groups]
    if not _trim(groups, shares, global_batch):
        return None
    flush = max(s.time(sh.m) for (s, _), sh in zip(groups, shares))
    return flush, shares


def _capacity(groups: Sequence[tuple[PipelineSpeed, int]], deadline: float) -> int:
    return sum(s.fits(deadline) * s.mbs * n for s, n in groups)


def _trim(groups: Sequence[tuple[PipelineSpeed, int]], shares: list[Share], global_batch: int) -> bool:
    """Take surplus micro-batches from the pipelines that finish last until the samples are exact."""
    excess = sum(sum(sh.counts()) * s.mbs for (s, _), sh in zip(groups, shares)) - global_batch
    while excess > 0:
        order = sorted(range(len(groups)), key=lambda j: (-groups[j][0].time(shares[j].m), j))
        for j in order:
            sh, mbs = shares[j], groups[j][0].mbs
            if sh.m <= 1 or mbs > excess:
                continue
            take = min(sh.high, excess // mbs)
            sh.high -= take
            excess -= take * mbs
            if sh.high == 0:
                sh.m -= 1
                sh.high = sh.copies
            break
        else:
            return False
    return True
