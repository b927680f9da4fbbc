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
    lo = max(s.flush[0] for s, _ in groups)  # every pipeline runs at least one micro-batch: time(1)
    capacity = _Capacity(groups)
    if capacity.counts(lo)[1] < global_batch:
        step = max(s.slope if s.slope > 0 else s.flush[0] for s, _ in groups)
        hi = lo + step * global_batch
        # bracket around the deadline the pipelines' steady rates give, to bisect a narrow interval
        rate = sum(n * s.mbs / s.slope for s, n in groups if s.slope > 0)
        if rate > 0:
            guess = (global_batch + sum(n * s.mbs * s.flush[0] / s.slope for s, n in groups if s.slope > 0)) / rate
            if guess + 2 * step < hi and capacity.counts(guess + 2 * step)[1] >= global_batch:
                hi = guess + 2 * step
            if lo < guess - 2 * step and capacity.counts(guess - 2 * step)[1] < global_batch:
                lo = guess - 2 * step
        steps_lo, steps_hi = capacity.counts(lo)[0], capacity.counts(hi)[0]
        for _ in range(200):
            if steps_hi - steps_lo == 1:
                break  # the shares are known: see _Capacity
            mid = 0.5 * (lo + hi)
            steps, samples = capacity.counts(mid)
            if samples >= global_batch:
                hi, steps_hi = mid, steps
            else:
                lo, steps_lo = mid, steps
            if hi - lo <= 1e-7 * hi:
                break
        lo = hi
    shares = [Share(max(1, s.fits(lo)), n, n) for s, n in groups]
    if not _trim(groups, shares, global_batch):
        return None
    flush = max(s.time(sh.m) for (s, _), sh in zip(groups, shares))
    return flush, shares


class _Capacity:
    """Micro-batches each group's pipelines finish by a deadline (:meth:`PipelineSpeed.fits`, each
    group's numbers unpacked once: the bisection asks a few dozen times per call, and the planner
    balances thousands of allocations per search), and the samples they make.

    Why the bisection may stop once the counts at ``hi`` exceed those at ``lo`` by one in all: each
    group's count is a nondecreasing step function of the deadline (a bisection over the sorted table,
    then the floor of a quotient by a positive slope), so a total rise of one is one group's single
    step, at one deadline D in (lo, hi]. The bisection keeps the smallest deadline whose samples reach
    the batch inside (lo, hi]; only D can be it, so every later ``hi`` lies in [D, hi], where every
    group's count is the one at ``hi``: the shares it would end with (tests/planner/test_balance.py
    checks them against an exhaustive reference)."""

    __slots__ = ("groups",)

    def __init__(self, groups: Sequence[tuple[PipelineSpeed, int]]) -> None:
        self.groups = [(s.flush, len(s.flush), s.flush[-1], s.slope, s.mbs * n) for s, n in groups]

    def counts(self, deadline: float) -> tuple[int, int]:
        """The micro-batches of all groups by ``deadline`` (one pipeline of each), and the samples of all."""
        steps = samples = 0
        for flush, size, last, slope, per_micro_batch in self.groups:
            n = bisect_right(flush, deadline)
            if n == size and slope > 0:  # past the table: whole steady periods (PipelineSpeed.fits)
                n += int((deadline - last) // slope)
            steps += n
            samples += n * per_micro_batch
        return steps, samples


def _trim(groups: Sequence[tuple[PipelineSpeed, int]], shares: list[Share], global_batch: int) -> bool:
    """Take surplus micro-batches from the pipelines that finish last until the samples are exact."""
    # sum(sh.counts()) without the list: high copies run m micro-batches, the others m - 1
    excess = sum((sh.m * sh.copies - (sh.copies - sh.high)) * s.mbs for (s, _), sh in zip(groups, shares)) - global_batch
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
