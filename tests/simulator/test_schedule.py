"""The 1F1B schedule: small cases by hand, and the step recurrence against the event-driven engine."""
from __future__ import annotations

import random

import numpy as np
import pytest

from simulator.schedule import pipeline_schedule, stage_cycles, steady_period
from simulator.timeline import build_programs, deepspeed_steps, run_programs


def pipeline_time(F, B, act, grad, m: int, asynchronous=None, serial: bool = True) -> float:
    """Makespan of one pipeline."""
    return float(pipeline_schedule(F, B, act, grad, m, asynchronous, serial).makespan[0])


def deepspeed_instructions(num_stages: int, stage: int, micro_batches: int) -> list[tuple[str, int]]:
    """DeepSpeed's TrainSchedule of one stage as one list."""
    return [op for step in deepspeed_steps(num_stages, stage, micro_batches) for op in step]


def events_flush(F, B, act, grad, m):
    """Per-stage finish of one pipeline from the event engine (no collectives, no optimizer)."""
    progs = build_programs([F], [B], [act], [grad], [m], [], {(0, s): 0.0 for s in range(len(F))})
    ends = {}
    for e in run_programs(progs):
        ends[e.stage] = max(ends.get(e.stage, 0.0), e.end)
    return [ends[s] for s in range(len(F))]


def test_single_stage_is_m_forward_backward():
    assert pipeline_time([1.0], [2.0], [], [], 5) == pytest.approx(15.0)


def test_two_stages_one_micro_batch_by_hand():
    # F0, act 0->1, F1, B1, grad 1->0, B0: nothing overlaps with one micro-batch
    t = pipeline_time([1.0, 2.0], [3.0, 4.0], [0.5], [0.25], 1)
    assert t == pytest.approx(1 + 0.5 + 2 + 4 + 0.25 + 3)


def test_two_stages_two_micro_batches_by_hand():
    # unit forwards, backwards of 2, free transfers: stage 1 runs F0 B0 F1 B1 back to back from t=1,
    # stage 0 ends with B1 after stage 1's B1: 1 + 6 + 2 = 9 = (m-1)*max(F+B) + sum(F+B)
    assert pipeline_time([1.0, 1.0], [2.0, 2.0], [0.0], [0.0], 2) == pytest.approx(9.0)


def test_blocking_exchange_charges_both_neighbours():
    # two equal stages, transfers of 0.1 each way: every steady period of both stages carries one
    # exchange (activation + gradient) -> cycle = F + B + 0.2
    F, B, c = [1.0, 1.0], [2.0, 2.0], 0.1
    assert stage_cycles(F, B, [c], [c]).tolist() == [[3.2, 3.2]]
    t50, t51 = (pipeline_time(F, B, [c], [c], m) for m in (50, 51))
    assert t51 - t50 == pytest.approx(3.2)


def test_steady_period_is_busiest_stage_with_its_exchanges():
    F, B = [1.0, 2.0, 1.0], [2.0, 3.0, 2.0]
    act, grad = [0.1, 0.3], [0.2, 0.4]
    # middle stage: 2 + 3 + (0.1 + 0.2) + (0.3 + 0.4)
    assert steady_period(F, B, act, grad)[0] == pytest.approx(6.0)


def test_deepspeed_instructions_have_1f1b_shape():
    ops = deepspeed_instructions(num_stages=4, stage=1, micro_batches=6)
    compute = [(k, mb) for k, mb in ops if k in ("fwd", "bwd")]
    # stage 1 of 4 keeps P - s = 3 forwards in flight before its first backward
    assert compute[:4] == [("fwd", 0), ("fwd", 1), ("fwd", 2), ("bwd", 0)]
    assert [k for k, _ in compute].count("fwd") == 6 and [k for k, _ in compute].count("bwd") == 6
    sends = [mb for k, mb in ops if k == "send_act"]
    assert sends == list(range(6))


def _random_pipeline(rng: random.Random):
    P = rng.randint(1, 7)
    m = rng.randint(1, 40)
    F = [rng.uniform(0.5, 2.0) for _ in range(P)]
    B = [f * rng.uniform(1.2, 3.0) for f in F]
    act = [rng.uniform(0.0, 0.6) for _ in range(P - 1)]
    grad = [rng.uniform(0.0, 0.6) for _ in range(P - 1)]
    return F, B, act, grad, m


def test_recurrence_matches_event_engine_on_random_heterogeneous_pipelines():
    rng = random.Random(11)
    for _ in range(120):
        F, B, act, grad, m = _random_pipeline(rng)
        got = pipeline_schedule(F, B, act, grad, m).finish[0]
        want = events_flush(F, B, act, grad, m)
        assert got == pytest.approx(want, rel=1e-10)


def test_steady_skip_is_exact_for_long_pipelines():
    # many micro-batches: the recurrence skips the steady window; the event engine runs every op
    rng = random.Random(3)
    for _ in range(6):
        F, B, act, grad, _ = _random_pipeline(rng)
        m = 400
        assert pipeline_schedule(F, B, act, grad, m).finish[0] == pytest.approx(events_flush(F, B, act, grad, m),
                                                                                rel=1e-10)
    # two nearly equal bottlenecks: no early skip, still exact
    F, B = [1.0, 1.0005, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0005]
    assert pipeline_schedule(F, B, [0.01] * 3, [0.01] * 3, 300).finish[0] == pytest.approx(
        events_flush(F, B, [0.01] * 3, [0.01] * 3, 300), rel=1e-10)


def test_batch_equals_one_by_one():
    rng = np.random.default_rng(5)
    N, P = 64, 5
    F = rng.uniform(0.5, 2, (N, P))
    B = F * rng.uniform(1.2, 3, (N, P))
    act, grad = rng.uniform(0, 0.3, (N, P - 1)), rng.uniform(0, 0.3, (N, P - 1))
    m = rng.integers(1, 90, N)
    batch = pipeline_schedule(F, B, act, grad, m).finish
    for i in range(N):
        assert batch[i] == pytest.approx(pipeline_schedule(F[i], B[i], act[i], grad[i], int(m[i])).finish[0], rel=1e-12)


def test_fewer_micro_batches_than_stages():
    F, B = [1.0] * 6, [2.0] * 6
    t = pipeline_time(F, B, [0.0] * 5, [0.0] * 5, 2)
    assert t == pytest.approx(events_flush(F, B, [0.0] * 5, [0.0] * 5, 2)[0])
    # fill and drain only: 6 forwards + 6 backwards on the path of the last micro-batch, plus one more F+B
    assert t == pytest.approx(6 * 3 + 3)


def test_rejects_no_micro_batches():
    with pytest.raises(ValueError):
        pipeline_schedule([1.0], [1.0], [], [], 0)
