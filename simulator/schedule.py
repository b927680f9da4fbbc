"""Time of one pipeline's 1F1B schedule with blocking stage-to-stage transfers.

The schedule is DeepSpeed's ``TrainSchedule`` (the runtime of Sailor's measured runs), which is also
what megatron-core's non-interleaved 1F1B does: stage ``s`` of ``P`` runs ``min(P - s, m)`` forwards,
then alternates backward/forward, then drains its backwards. Time is cut into *steps*
``t = 0 .. 2(m + P - 1) - 1``; at step ``t`` stage ``s`` does

* a forward of micro-batch ``(t - s) / 2`` when ``t - s`` is even, after one exchange with stage
  ``s - 1`` (receive that micro-batch's activation, send the gradient of its previous backward);
* a backward of micro-batch ``(t - 2P + s + 1) / 2`` when ``t - s`` is odd, after one exchange with
  stage ``s + 1`` (receive the gradient, send the activation of its previous forward).

Exchanges are blocking and paired (NCCL send/recv: both sides wait until the bytes have moved), so the
two stages of an exchange start it together, at the later of their ready times, and both leave it
after the activation time plus the gradient time of that boundary (whichever of the two is due).
The measured runs need exactly this: on Clariden the 67 MB activations of OPT-350M at micro-batch 8
add their transfer time to every micro-batch of both stages next to a boundary, which is most of the
15 % that Sailor's formula misses on its 4-stage runs.

That gives a max-plus recurrence over steps, evaluated here for a batch of pipelines at once (numpy,
stage-major arrays) so the planner can score thousands of candidates per call. Inside the steady
window (every stage busy, ``2P - 1 <= t <= 2m - 2``) the two-step map is the same at every step, so as
soon as the state advances by the same amount on every stage it will keep doing so: the remaining
steady periods are skipped exactly (taken off ``m``, their time added at the end). The result is
exact, not a bound; a pipeline whose stages keep advancing at different rates (two nearly equal
bottlenecks) is simply stepped to the end.

:mod:`simulator.timeline` re-derives the same schedule instruction by instruction with an event-driven
engine (the independent check used by the tests, and the ``--timeline`` chart).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_REL_TOL = 1e-12


@dataclass(frozen=True)
class ScheduleResult:
    """Per pipeline (rows) and stage (columns): when the stage finishes its last instruction."""

    finish: np.ndarray  # (N, P) seconds from the start of the iteration
    steady_period: np.ndarray  # (N,) seconds per micro-batch once the pipeline is full

    @property
    def makespan(self) -> np.ndarray:
        return self.finish.max(axis=1)


def stage_cycles(F: np.ndarray, B: np.ndarray, act: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """(N, P): seconds one stage needs per micro-batch in the steady state: its forward and backward
    plus both exchanges with each neighbour (all blocking)."""
    F, B = np.atleast_2d(F), np.atleast_2d(B)
    w = F + B
    if w.shape[1] > 1:
        c = np.atleast_2d(act) + np.atleast_2d(grad)
        w = w.copy()
        w[:, 1:] += c
        w[:, :-1] += c
    return w


def steady_period(F: np.ndarray, B: np.ndarray, act: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """Seconds per micro-batch once the pipeline is full: the busiest stage's cycle (the max-plus cycle
    mean of the steady state; cycles through several stages average their stages' cycles)."""
    return stage_cycles(F, B, act, grad).max(axis=1)


def _as_batch(F, B, act, grad, m) -> tuple[np.ndarray, ...]:
    F = np.atleast_2d(np.asarray(F, dtype=np.float64))
    B = np.atleast_2d(np.asarray(B, dtype=np.float64))
    n, P = F.shape
    if B.shape != (n, P):
        raise ValueError(f"F and B must have the same shape, got {F.shape} and {B.shape}")
    act = np.asarray(act, dtype=np.float64).reshape(n, max(P - 1, 0))
    grad = np.asarray(grad, dtype=np.float64).reshape(n, max(P - 1, 0))
    m = np.broadcast_to(np.asarray(m, dtype=np.int64), (n,)).copy()
    if (m < 1).any():
        raise ValueError("every pipeline needs at least one micro-batch")
    return F, B, act, grad, m


def pipeline_schedule(F, B, act, grad, m) -> ScheduleResult:
    """Finish time of every stage of N pipelines that have the same stage count P.

    F, B: (N, P) forward / backward seconds of one micro-batch per stage; act, grad: (N, P-1) seconds
    to move the activation from stage j to j+1 / its gradient back; m: (N,) micro-batches (>= 1).
    1-D inputs describe one pipeline.
    """
    F, B, act, grad, m = _as_batch(F, B, act, grad, m)
    n, P = F.shape
    period = steady_period(F, B, act, grad)
    finish = np.empty((n, P))
    # stage-major working copies of the still-running pipelines
    idx = np.arange(n)
    Ft, Bt, At, Gt = F.T.copy(), B.T.copy(), act.T.copy(), grad.T.copy()
    m_cur = m.copy()
    offset = np.zeros(n)
    y = np.zeros((P, n))
    prev1 = prev2 = None
    stages = np.arange(P)
    t = 0
    while idx.size:
        par = t % 2
        sf, sb = slice(par, P, 2), slice(1 - par, P, 2)  # stages doing a forward / backward now
        j0 = (t + 1) % 2
        L, R = slice(j0, P - 1, 2), slice(j0 + 1, P, 2)  # boundaries exchanging now: stage j with j+1
        new = y.copy()
        if 2 * P - 1 <= t <= 2 * int(m_cur.min()) - 2:
            # steady window of every running pipeline: every stage computes, every exchange carries both
            if P > 1 and j0 < P - 1:
                e = np.maximum(y[L], y[R]) + (At[L] + Gt[L])
                new[L] = e
                new[R] = e
            new[sf] += Ft[sf]
            new[sb] += Bt[sb]
        else:
            mc = m_cur[None, :]
            kf = (t - stages[sf]) // 2  # micro-batch of each forward (valid if 0 <= k < m)
            kb = (t - 2 * P + stages[sb] + 1) // 2
            if P > 1 and j0 < P - 1:
                js = np.arange(j0, P - 1, 2)
                ka = ((t - js - 1) // 2)[:, None]
                kg = ((t - 2 * P + js + 1) // 2)[:, None]
                va = (ka >= 0) & (ka < mc)
                vg = (kg >= 0) & (kg < mc)
                e = np.maximum(y[L], y[R]) + At[L] * va + Gt[L] * vg
                e = np.where(va | vg, e, 0.0)  # no exchange due: no wait (times are >= 0)
                new[L] = np.maximum(y[L], e)
                new[R] = np.maximum(y[R], e)
            new[sf] += Ft[sf] * ((kf[:, None] >= 0) & (kf[:, None] < mc))
            new[sb] += Bt[sb] * ((kb[:, None] >= 0) & (kb[:, None] < mc))
        prev2, prev1, y = prev1, y, new
        t += 1
        if prev2 is not None and t > 2 * P and t % 2 == 0:
            room = (2 * m_cur - 1 - t) // 2  # whole periods left inside the steady window
            cand = room >= 1
            if cand.any():
                diff = y - prev2
                spread = diff.max(axis=0) - diff.min(axis=0)
                jump = cand & (spread <= _REL_TOL * np.maximum(1.0, np.abs(y).max(axis=0)))
                if jump.any():
                    skip = np.where(jump, room, 0)
                    m_cur = m_cur - skip
                    offset = offset + skip * diff.max(axis=0)
        done = 2 * (m_cur + P - 1) <= t
        if done.any():
            finish[idx[done]] = (y[:, done] + offset[done]).T
            keep = ~done
            idx, m_cur, offset = idx[keep], m_cur[keep], offset[keep]
            y, prev1 = y[:, keep], prev1[:, keep]
            prev2 = None if prev2 is None else prev2[:, keep]
            Ft, Bt, At, Gt = Ft[:, keep], Bt[:, keep], At[:, keep], Gt[:, keep]
    return ScheduleResult(finish=finish, steady_period=period)


def pipeline_time(F, B, act, grad, m: int) -> float:
    """Makespan of one pipeline (convenience for scalars and tests)."""
    return float(pipeline_schedule(F, B, act, grad, m).makespan[0])
