"""Time of one pipeline's 1F1B schedule with each runtime's stage-to-stage transfers.

The schedule is DeepSpeed's ``TrainSchedule`` (the runtime of Sailor's measured runs), which is also
what megatron-core's non-interleaved 1F1B does: stage ``s`` of ``P`` runs ``min(P - s, m)`` forwards,
then alternates backward/forward, then drains its backwards. Time is cut into *steps*
``t = 0 .. 2(m + P - 1) - 1``; at step ``t`` stage ``s`` does

* a forward of micro-batch ``(t - s) / 2`` when ``t - s`` is even, after one exchange with stage
  ``s - 1`` (receive that micro-batch's activation, send the gradient of its previous backward);
* a backward of micro-batch ``(t - 2P + s + 1) / 2`` when ``t - s`` is odd, after one exchange with
  stage ``s + 1`` (receive the gradient, send the activation of its previous forward).

How an exchange costs time depends on the message and the runtime (:mod:`simulator.runtimes`,
:func:`_exchange`):

* *blocking* (a rank's message larger than NCCL's staging buffer): the two stages start it together, at
  the later of their ready times, and both leave after the activation plus the gradient time in
  DeepSpeed's order (the activation goes out only after the gradient came in), or the longer of the two
  in megatron's batched send/recv. On Clariden the 67 MB activations of OPT-350M at micro-batch 8 add
  their transfer time to every micro-batch of both stages next to a boundary, which is most of the 15 %
  that Sailor's formula misses on its 4-stage runs.
* *asynchronous* (the message fits the buffer): the sender posts it and goes on; the bytes leave once
  the sender's link is free (one NIC carries a stage's sends to both neighbours, in order) and the
  receiver's incoming side is free (the same NIC takes in the activation from upstream and the gradient
  from downstream: on the MIT cluster's 1-Gbit NICs a middle stage receives two messages per micro-batch
  on one 0.11 GB/s link), and a receive ends when they have arrived. In DeepSpeed's order the round
  trip then lands on the stage downstream of a link and is hidden while that stage has slack: on the MIT
  cluster's 0.11 GB/s links between GPU types a blocking model overestimates a 4-stage TP-8 run by a third.

That gives a max-plus recurrence over steps, evaluated here for a batch of pipelines at once (numpy,
stage-major arrays) so the planner can score thousands of candidates per call; its state is every stage's
clock and, with asynchronous boundaries, every stage's two links (out, in). Inside the steady window
(every stage busy, ``2P - 1 <= t <= 2m - 2``) the two-step map is the same at every step, so as soon as the state
advances by the same amount everywhere it will keep doing so: the remaining steady periods are skipped
exactly (taken off ``m``, their time added at the end). The result is exact, not a bound; a pipeline whose
stages keep advancing at different rates (two nearly equal bottlenecks) is simply stepped to the end.

:mod:`simulator.timeline` re-derives the same schedule instruction by instruction with an event-driven
engine (the independent check used by the tests, and the ``--timeline`` chart).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

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


def stage_cycles(F: np.ndarray, B: np.ndarray, act: np.ndarray, grad: np.ndarray, asynchronous=None,
                 serial: bool = True) -> np.ndarray:
    """(N, P): seconds one stage needs per micro-batch in the steady state: its forward and backward
    plus what its exchanges cost it. A blocking exchange costs both neighbours the activation plus the
    gradient time (``serial``: DeepSpeed sends the activation after receiving the gradient) or the longer
    of the two (a batched, full-duplex exchange); an asynchronous one costs the stage downstream of the
    link the round trip when serial, and neither stage anything otherwise (the transfer is hidden while
    the link keeps up: :func:`steady_period` adds the link's own occupancy)."""
    F, B = np.atleast_2d(F), np.atleast_2d(B)
    w = F + B
    if w.shape[1] > 1:
        a, g = np.atleast_2d(act), np.atleast_2d(grad)
        both = a + g if serial else np.maximum(a, g)
        asy = np.zeros(a.shape, dtype=bool) if asynchronous is None else np.atleast_2d(asynchronous)
        w = w.copy()
        w[:, 1:] += np.where(asy, a + g if serial else 0.0, both)
        w[:, :-1] += np.where(asy, 0.0, both)
    return w


def steady_period(F: np.ndarray, B: np.ndarray, act: np.ndarray, grad: np.ndarray, asynchronous=None,
                  serial: bool = True) -> np.ndarray:
    """Seconds per micro-batch once the pipeline is full: the busiest stage's cycle (the max-plus cycle
    mean of the steady state; cycles through several stages average their stages' cycles), and at least
    each node link's busy time per micro-batch with buffered messages: a stage's outgoing side carries its
    activation and its gradient to the previous stage, its incoming side the two it receives."""
    period = stage_cycles(F, B, act, grad, asynchronous, serial).max(axis=1)
    if asynchronous is not None and np.size(act):
        asy = np.atleast_2d(asynchronous)
        a, g = np.where(asy, np.atleast_2d(act), 0.0), np.where(asy, np.atleast_2d(grad), 0.0)
        pad = np.zeros((a.shape[0], 1))
        out_side = np.hstack([a, pad]) + np.hstack([pad, g])  # stage s sends act s and grad s - 1
        in_side = np.hstack([pad, a]) + np.hstack([g, pad])  # stage s receives act s - 1 and grad s
        period = np.maximum(period, np.maximum(out_side, in_side).max(axis=1))
    return period


def _as_batch(F, B, act, grad, m, asynchronous) -> tuple[np.ndarray, ...]:
    F = np.atleast_2d(np.asarray(F, dtype=np.float64))
    B = np.atleast_2d(np.asarray(B, dtype=np.float64))
    n, P = F.shape
    if B.shape != (n, P):
        raise ValueError(f"F and B must have the same shape, got {F.shape} and {B.shape}")
    act = np.asarray(act, dtype=np.float64).reshape(n, max(P - 1, 0))
    grad = np.asarray(grad, dtype=np.float64).reshape(n, max(P - 1, 0))
    asy = np.zeros((n, max(P - 1, 0)), dtype=bool)
    if asynchronous is not None and P > 1:
        asy |= np.asarray(asynchronous, dtype=bool).reshape(-1, P - 1)
    m = np.broadcast_to(np.asarray(m, dtype=np.int64), (n,)).copy()
    if (m < 1).any():
        raise ValueError("every pipeline needs at least one micro-batch")
    return F, B, act, grad, asy, m


def _exchange(yL, yR, oL, oR, iL, iR, a, g, va, vg, asy, serial: bool):
    """One step's exchanges at the boundaries j (stage j = ``yL``, stage j + 1 = ``yR``): stage j
    receives the gradient of its next backward and sends the activation of its last forward, stage
    j + 1 sends the gradient of its last backward and receives the activation of its next forward.
    ``va`` / ``vg``: whether each is due; ``oL`` / ``oR``: when each stage's outgoing network link (its
    node's NIC, shared by its sends to both neighbours) is next free; ``iL`` / ``iR``: the same for the
    incoming side (shared by the activation from upstream and the gradient from downstream).

    Blocking: both start at the later ready time and leave together. Asynchronous (below the staging
    buffer): a send is posted and its sender goes on; the bytes leave once the sender's outgoing and the
    receiver's incoming link are free (each serves its messages in the schedule's step order); a
    receive ends when its bytes have arrived. ``serial`` is DeepSpeed's order (the activation is sent
    only after the gradient was received); otherwise both are posted at once (megatron's batched
    send/recv). Returns the new (yL, yR, oL, oR, iL, iR)."""
    due, e = _blocking_end(yL, yR, a, g, va, vg, serial)
    g_arr = np.maximum(np.maximum(yR, oR), iL) + g
    rL = np.where(vg, np.maximum(yL, g_arr), yL)
    a_arr = np.maximum(np.maximum(rL if serial else yL, oL), iR) + a
    rR = np.where(va, np.maximum(yR, a_arr), yR)

    def pick(async_value, old):  # a blocking exchange leaves the links free when it ends (kept in the
        return np.where(asy, async_value, np.where(due, np.maximum(old, e), old))  # state: it advances evenly

    # a blocking message holds its receiver's incoming link until it has moved (DeepSpeed: the gradient first)
    got_g, got_a = (vg, va) if serial else (due, due)
    g_end = np.maximum(yL, yR) + g if serial else e
    iL_new = np.where(asy, np.where(vg, g_arr, iL), np.where(got_g, np.maximum(iL, g_end), iL))
    iR_new = np.where(asy, np.where(va, a_arr, iR), np.where(got_a, np.maximum(iR, e), iR))
    return (pick(rL, yL), pick(rR, yR), pick(np.where(va, a_arr, oL), oL), pick(np.where(vg, g_arr, oR), oR),
            iL_new, iR_new)


def _blocking_end(yL, yR, a, g, va, vg, serial: bool) -> tuple[np.ndarray, np.ndarray]:
    """Which boundaries exchange at this step, and when a blocking exchange there ends (both stages leave
    it then): the later ready time plus the activation and gradient, one after the other when ``serial``."""
    due = va | vg
    if serial:
        return due, np.maximum(yL, yR) + a * va + g * vg
    return due, np.maximum(yL, yR) + np.maximum(a * va, g * vg)


def pipeline_schedule(F, B, act, grad, m, asynchronous=None, serial: bool = True) -> ScheduleResult:
    """Finish time of every stage of N pipelines that have the same stage count P.

    F, B: (N, P) forward / backward seconds of one micro-batch per stage; act, grad: (N, P-1) seconds
    to move the activation from stage j to j+1 / its gradient back; m: (N,) micro-batches (>= 1).
    ``asynchronous``: (N, P-1) bools, boundaries whose messages fit the staging buffer (default: none);
    ``serial``: the runtime's exchange order (see :func:`_exchange`). 1-D inputs describe one pipeline.
    """
    F, B, act, grad, asy, m = _as_batch(F, B, act, grad, m, asynchronous)
    period = steady_period(F, B, act, grad, asy if asy.any() else None, serial)
    buffered = asy.any(axis=1)  # pipelines with link states to carry, apart from the others
    finish = np.empty(F.shape)
    for k in (~buffered, buffered):
        if k.any():
            finish[k] = _recurrence(F[k], B[k], act[k], grad[k], asy[k], m[k], serial)
    return ScheduleResult(finish=finish, steady_period=period)


def _recurrence(F: np.ndarray, B: np.ndarray, act: np.ndarray, grad: np.ndarray, asy: np.ndarray, m: np.ndarray,
                serial: bool) -> np.ndarray:
    """The step recurrence over a batch. Its state is every stage's clock and, when a boundary of the batch
    is asynchronous, every stage's links (when each is free for the next message); without any, the steady
    window's exchanges are known to carry both transfers and skip the masks (the planner's hot path)."""
    n, P = F.shape
    links = bool(asy.any())
    finish = np.empty((n, P))
    # stage-major working copies of the still-running pipelines
    idx = np.arange(n)
    Ft, Bt, At, Gt, St = F.T.copy(), B.T.copy(), act.T.copy(), grad.T.copy(), asy.T.copy()
    m_cur = m.copy()
    offset = np.zeros(n)
    x = np.zeros((3 * P if links else P, n))  # stage clocks, then (with links) when each stage's outgoing
    # and incoming link is free
    prev1 = prev2 = None
    t = 0
    while idx.size:
        y, out, inn = x[:P], x[P:2 * P], x[2 * P:]
        j0 = (t + 1) % 2
        L, R = slice(j0, P - 1, 2), slice(j0 + 1, P, 2)  # boundaries exchanging now: stage j with j+1
        new = x.copy()
        ny, nout, ninn = new[:P], new[P:2 * P], new[2 * P:]
        if not links and 2 * P - 1 <= t <= 2 * int(m_cur.min()) - 2:
            # steady window of every running pipeline: every stage computes, every exchange carries both
            if P > 1 and j0 < P - 1:
                e = np.maximum(y[L], y[R]) + (At[L] + Gt[L] if serial else np.maximum(At[L], Gt[L]))
                ny[L] = e
                ny[R] = e
            sf, sb = slice(t % 2, P, 2), slice(1 - t % 2, P, 2)  # stages doing a forward / backward now
            ny[sf] += Ft[sf]
            ny[sb] += Bt[sb]
        else:
            mc = m_cur[None, :]
            if P > 1 and j0 < P - 1:
                va, vg = _due(t, P, j0, mc)
                if links:
                    ny[L], ny[R], nout[L], nout[R], ninn[L], ninn[R] = _exchange(
                        y[L], y[R], out[L], out[R], inn[L], inn[R], At[L], Gt[L], va, vg, St[L], serial)
                else:  # every exchange blocks: both stages leave it at its end (_exchange without links)
                    due, e = _blocking_end(y[L], y[R], At[L], Gt[L], va, vg, serial)
                    ny[L] = np.where(due, np.maximum(y[L], e), y[L])
                    ny[R] = np.where(due, np.maximum(y[R], e), y[R])
            _compute(ny, t, P, Ft, Bt, mc)
        prev2, prev1, x = prev1, x, new
        t += 1
        m_cur, offset = _skip_steady(x, prev2, t, P, m_cur, offset)
        done = 2 * (m_cur + P - 1) <= t
        if done.any():
            idx, offset, m_cur, x, prev1, prev2, Ft, Bt, At, Gt, St = _retire(
                done, finish, idx, x[:P], offset, m_cur, x, prev1, prev2, Ft, Bt, At, Gt, St)
    return finish


def _due(t: int, P: int, j0: int, mc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Whether the activation / the gradient of each boundary j0, j0 + 2, ... is due at step t."""
    ka, kg = _boundary_micro_batches(t, P, j0)
    return (ka >= 0) & (ka < mc), (kg >= 0) & (kg < mc)


@lru_cache(maxsize=4096)
def _boundary_micro_batches(t: int, P: int, j0: int) -> tuple[np.ndarray, np.ndarray]:
    """Columns of the micro-batch whose activation / gradient crosses boundary j0, j0 + 2, ... at step t
    (the same for every batch of P stages: cached, read-only)."""
    js = np.arange(j0, P - 1, 2)
    return _frozen(((t - js - 1) // 2)[:, None]), _frozen(((t - 2 * P + js + 1) // 2)[:, None])


def _compute(y: np.ndarray, t: int, P: int, Ft: np.ndarray, Bt: np.ndarray, mc: np.ndarray) -> None:
    """Add step t's forwards and backwards (of valid micro-batches) to the stage clocks ``y`` in place."""
    sf, sb = slice(t % 2, P, 2), slice(1 - t % 2, P, 2)
    kf, kb = _stage_micro_batches(t, P)
    y[sf] += Ft[sf] * ((kf >= 0) & (kf < mc))
    y[sb] += Bt[sb] * ((kb >= 0) & (kb < mc))


@lru_cache(maxsize=4096)
def _stage_micro_batches(t: int, P: int) -> tuple[np.ndarray, np.ndarray]:
    """Columns of the micro-batch of each forward / backward at step t (valid if 0 <= k < m; cached, read-only)."""
    kf = (t - np.arange(t % 2, P, 2)) // 2
    kb = (t - 2 * P + np.arange(1 - t % 2, P, 2) + 1) // 2
    return _frozen(kf[:, None]), _frozen(kb[:, None])


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def _retire(done: np.ndarray, finish: np.ndarray, idx: np.ndarray, clocks: np.ndarray, offset: np.ndarray,
            *arrays):
    """Record the finish of the pipelines that are ``done``; return ``idx``, ``offset`` and every given
    per-pipeline array (pipelines are the last axis; None stays None) cut to the pipelines still running."""
    finish[idx[done]] = (clocks[:, done] + offset[done]).T
    keep = ~done
    return [None if a is None else a[..., keep] for a in (idx, offset, *arrays)]


def _skip_steady(x: np.ndarray, prev2: np.ndarray | None, t: int, P: int, m_cur: np.ndarray,
                 offset: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inside the steady window the two-step map is the same max-plus map at every step: once the whole
    state (every clock, every link) advanced by one amount over a period it keeps doing so, and the
    remaining whole periods are taken off ``m`` with their time added to ``offset``."""
    if prev2 is None or t <= 2 * P or t % 2:
        return m_cur, offset
    room = (2 * m_cur - 1 - t) // 2  # whole periods left inside the steady window
    cand = room >= 1
    if not cand.any():
        return m_cur, offset
    diff = x - prev2
    spread = diff.max(axis=0) - diff.min(axis=0)
    jump = cand & (spread <= _REL_TOL * np.maximum(1.0, np.abs(x).max(axis=0)))
    if not jump.any():
        return m_cur, offset
    skip = np.where(jump, room, 0)
    return m_cur - skip, offset + skip * diff.max(axis=0)
