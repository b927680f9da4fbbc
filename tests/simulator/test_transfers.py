"""Stage-to-stage transfers as the runtimes run them: asynchronous below the staging buffer, blocking
above it, in each runtime's order, sharing a node's link; checked against timelines worked out by hand,
and the step recurrence against the event-driven engine."""
from __future__ import annotations

import random

import pytest

from planner import PlanRequest
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from simulator import SimOptions, StageEvaluator, simulate
from simulator.network import Endpoint
from simulator.runtimes import NCCL_BUFFSIZE
from simulator.schedule import pipeline_schedule
from simulator.timeline import build_programs, run_programs
from simulator.validation import validate_runs
from tests.simulator.conftest import TINY_OUT, validation_dir


def flush_by_events(F, B, act, grad, m, asynchronous, serial):
    """Per-stage end of one pipeline from the event engine (in-flight messages are not their sender's work)."""
    progs = build_programs([F], [B], [act], [grad], [m], [], {(0, s): 0.0 for s in range(len(F))}, [asynchronous],
                           serial)
    ends: dict[int, float] = {}
    for e in run_programs(progs):
        if not e.kind.startswith("post_"):
            ends[e.stage] = max(ends.get(e.stage, 0.0), e.end)
    return [ends[s] for s in range(len(F))]


# two stages, two micro-batches, F = 1, B = 2, 0.5 s each way (worked out in the test's docstring)
TWO = ([1.0, 1.0], [2.0, 2.0], [0.5], [0.5], 2)


@pytest.mark.parametrize("asynchronous, serial, want", [
    (True, True, [11.0, 8.5]),    # DeepSpeed, buffered
    (False, True, [11.0, 9.0]),   # DeepSpeed, blocking (the model before runtimes were told apart)
    (True, False, [10.0, 7.5]),   # megatron's batched exchange, buffered
    (False, False, [10.5, 8.5]),  # megatron's batched exchange, blocking: both directions at once
], ids=["deepspeed-async", "deepspeed-blocking", "megatron-async", "megatron-blocking"])
def test_two_stage_timelines_by_hand(asynchronous, serial, want):
    """DeepSpeed buffered: s0 F0 0-1, posts act0 (arrives 1.5) and goes on: F1 1-2. s1 F0 1.5-2.5,
    B0 2.5-4.5, posts grad0 (arrives 5.0). s0 waits for it until 5.0 and only then sends act1 (DeepSpeed's
    order), arriving 5.5: s1 waited 4.5 -> 5.5, the round trip lands on the stage downstream of the link.
    s1 F1 5.5-6.5, B1 6.5-8.5 and posts grad1 (its last work ends at 8.5). s0 B0 5-7, grad1 at 9.0, B1 9-11.
    Blocking: both stages sit through every transfer: s0 F1 1.5-2.5, s1 ends with the grad1 send at 9.0.
    Megatron buffered: s0 posts act1 right after F1 (arrives 2.5), so s1 runs F1 4.5-5.5, B1 5.5-7.5; s0
    gets grad0 at 5.0, B0 5-7, grad1 at 8.0, B1 8-10. Megatron blocking: each batched exchange takes
    max(0.5, 0.5): s0 F1 1.5-2.5, exchange 4.5-5.0, B0 5-7, exchange 8.0-8.5, B1 8.5-10.5."""
    F, B, act, grad, m = TWO
    got = pipeline_schedule(F, B, act, grad, m, [asynchronous], serial).finish[0]
    assert list(got) == pytest.approx(want, abs=1e-12)
    assert flush_by_events(F, B, act, grad, m, [asynchronous], serial) == pytest.approx(want, abs=1e-12)


def test_a_stage_sends_to_both_neighbours_over_one_link_by_hand():
    """Megatron order, everything buffered, three stages of F = B = 1, a 10 s link from stage 1 to 2 and a
    1 s gradient link from stage 1 to 0. Stage 1 posts act0 at 2 (on its link 2-12) and act1 at 3 (queued:
    12-22). Stage 2 runs F0 12-13, B0 13-14, then waits for act1 until 22: F1 22-23, B1 23-24. Stage 1 gets
    grad0 at 14, B0 14-15, and posts grad0 to stage 0 at 15 -- but its link is busy with act1 until 22, so
    grad0 arrives at 23 (not 16); grad1 (posted at 25 after B1 24-25) arrives 26. Stage 0: B0 23-24, B1 26-27."""
    F, B, act, grad, m = [1.0] * 3, [1.0] * 3, [0.0, 10.0], [1.0, 0.0], 2
    want = [27.0, 25.0, 24.0]
    assert list(pipeline_schedule(F, B, act, grad, m, [True, True], False).finish[0]) == pytest.approx(want)
    assert flush_by_events(F, B, act, grad, m, [True, True], False) == pytest.approx(want)


def test_a_stage_takes_in_from_both_neighbours_over_one_link_by_hand():
    """Megatron order, everything buffered, three stages of F = B = 1, m = 3: a 3 s activation link into
    stage 1 and a 3 s gradient link from stage 2 into stage 1 (the others free). Stage 0 posts act0 at 1
    (1-4) and act1 (4-7). Stage 2 gets act0 at 5, F0 5-6, B0 6-7 and posts grad0 7-10 into stage 1's link.
    act2 is next on stage 0's link at 7, but stage 1's incoming side takes its messages in step order and
    grad0 (step 4) comes before act2 (step 5): act2 moves 10-13, not 7-10. Stage 1: B0 10-11, F2 13-14;
    stage 2: grad1 13-16, grad2 16-19; stage 1 ends B2 19-20, stage 0 B2 20-21, stage 2 at 16. Without the
    shared incoming side each would end 2 s earlier (19, 18, 14)."""
    F, B, act, grad, m = [1.0] * 3, [1.0] * 3, [3.0, 0.0], [0.0, 3.0], 3
    want = [21.0, 20.0, 16.0]
    assert list(pipeline_schedule(F, B, act, grad, m, [True, True], False).finish[0]) == pytest.approx(want)
    assert flush_by_events(F, B, act, grad, m, [True, True], False) == pytest.approx(want)


def test_steady_period_counts_both_sides_of_a_node_link():
    """Stage 1 takes in a 1 s activation and a 1 s gradient per micro-batch, and computes 0.2 s: megatron's
    order settles at 2 s per micro-batch (the slope of the recurrence from 100 to 200 micro-batches), which
    the steady period gives; in random link-heavy pipelines it is never above that slope (a lower bound)."""
    args = [0.1] * 3, [0.1] * 3, [1.0, 0.0], [0.0, 1.0]
    r100, r200 = (pipeline_schedule(*args, m, [True, True], False) for m in (100, 200))
    assert r100.steady_period[0] == pytest.approx(2.0)
    assert (r200.makespan[0] - r100.makespan[0]) / 100 == pytest.approx(2.0)
    rng = random.Random(5)
    for _ in range(40):
        P = rng.randint(2, 6)
        F = [rng.uniform(0.2, 1.0) for _ in range(P)]
        rand = ([rng.uniform(0.0, 3.0) for _ in range(P - 1)] for _ in range(2))
        args = F, [f * rng.uniform(1.2, 2.0) for f in F], next(rand), next(rand)
        asy, serial = [rng.random() < 0.8 for _ in range(P - 1)], rng.random() < 0.5
        r100, r200 = (pipeline_schedule(*args, m, asy, serial) for m in (100, 200))
        assert r100.steady_period[0] <= (r200.makespan[0] - r100.makespan[0]) / 100 + 1e-9


def test_recurrence_matches_event_engine_in_every_mode():
    """Random heterogeneous pipelines, each boundary buffered or blocking, either runtime order."""
    rng = random.Random(7)
    for _ in range(150):
        P, m = rng.randint(1, 6), rng.choice([1, 2, 3, 5, 9, 60])
        F = [rng.uniform(0.5, 2.0) for _ in range(P)]
        B = [f * rng.uniform(1.2, 3.0) for f in F]
        act = [rng.uniform(0.0, 1.5) for _ in range(P - 1)]
        grad = [rng.uniform(0.0, 1.5) for _ in range(P - 1)]
        asy = [rng.random() < 0.5 for _ in range(P - 1)]
        serial = rng.random() < 0.5
        got = pipeline_schedule(F, B, act, grad, m, asy, serial).finish[0]
        assert list(got) == pytest.approx(flush_by_events(F, B, act, grad, m, asy, serial), rel=1e-10)


def _boundary(ev: StageEvaluator, tp0: int, tp1: int):
    c0, c1 = ev.stage("G1", tp0, 1, 0, 2), ev.stage("G1", tp1, 1, 3, 5)
    return ev.exchanges([c0, c1], [Endpoint("p1", 0, tp0), Endpoint("p1", 1, tp1)]), c0.out_bytes


def test_messages_streams_and_the_staging_buffer(tiny_site, tiny):
    """tiny-gpt's boundary carries 2048 fp32 words = 8192 B per micro-batch over p1's 10 GB/s inter-node
    link. DeepSpeed: each of the sender's 2 ranks sends 4096 B, together at one stream's rate -> 8192 B / 10
    GB/s; buffered when 4096 B fit. megatron_patch: the receiving stage's 2 ranks get a full copy each ->
    16384 B / 10 GB/s; buffered only when 8192 B fit."""
    A = TINY_OUT[2] * 4
    ds = StageEvaluator(tiny, tiny_site, "tiny-gpt", options=SimOptions.deepspeed_pipe(staging_bytes=A / 2))
    x, out = _boundary(ds, 2, 1)
    assert out == A
    assert x.act == pytest.approx([A / 10e9]) and x.asynchronous == [False]  # the gradient: 1 rank sends 8192 B
    x, _ = _boundary(ds, 2, 2)
    assert x.act == pytest.approx([A / 10e9]) and x.grad == pytest.approx([A / 10e9]) and x.asynchronous == [True]
    mp = StageEvaluator(tiny, tiny_site, "tiny-gpt", options=SimOptions.megatron_patch(staging_bytes=A))
    x, _ = _boundary(mp, 1, 2)
    assert x.act == pytest.approx([2 * A / 10e9]) and x.grad == pytest.approx([A / 10e9]) and x.asynchronous == [True]
    x, _ = _boundary(StageEvaluator(tiny, tiny_site, "tiny-gpt", options=SimOptions.megatron_patch(staging_bytes=A - 1)),
                     1, 2)
    assert x.asynchronous == [False]
    assert SimOptions().staging_bytes == NCCL_BUFFSIZE == 4 * 2**20


def test_gloo_stages_nothing(tiny_site, tiny):
    """Without CUDA the runtime talks gloo, whose sends wait for their receiver at any size
    (tests/megatron_patch/test_p2p_backend.py): even tiny-gpt's 8192 B boundary is blocking, and the
    blocking exchange makes the step longer than NCCL's buffered one. An unknown backend is refused."""
    plan = Plan("tiny-gpt", 8, (Pipeline(1, 8, (Stage(0, 2, 1, "G1"), Stage(3, 5, 1, "G1"))),))
    gloo = SimOptions.megatron_patch(backend="gloo")
    assert gloo.staging_bytes == 0
    x, _ = _boundary(StageEvaluator(tiny, tiny_site, "tiny-gpt", options=gloo), 1, 1)
    assert x.asynchronous == [False]
    x, _ = _boundary(StageEvaluator(tiny, tiny_site, "tiny-gpt", options=SimOptions.megatron_patch()), 1, 1)
    assert x.asynchronous == [True]
    blocking = simulate(plan, tiny_site, tiny, options=gloo).iteration_time_s
    assert blocking > simulate(plan, tiny_site, tiny, options=SimOptions.megatron_patch()).iteration_time_s
    with pytest.raises(SailorError, match="backend"):
        SimOptions(backend="mpi")


def test_batch_scoring_uses_the_same_transfers(tiny_site, tiny):
    """score_batch (the planner's path) and simulate agree on a 2-stage TP-2 -> TP-1 plan in both runtimes,
    buffered (8192 B messages fit 10 kB) or not."""
    import numpy as np

    from simulator import CandidateBatch

    plan = Plan("tiny-gpt", 8, (Pipeline(1, 8, (Stage(0, 2, 2, "G1"), Stage(3, 5, 1, "G1"))),))
    for options in (SimOptions.deepspeed_pipe(staging_bytes=10_000), SimOptions.megatron_patch(staging_bytes=10_000),
                    SimOptions.megatron_patch(staging_bytes=5000)):  # buffered, buffered, blocking
        ev = StageEvaluator(tiny, tiny_site, "tiny-gpt", options=options)
        res = simulate(plan, tiny_site, tiny, options=options)
        s0, s1 = res.plan.pipelines[0].stages
        assert s0.placement is not None and s1.placement is not None
        batch = CandidateBatch(mbs=1, micro_batches=np.array([8]), first=np.array([[0, 3]]), last=np.array([[2, 5]]),
                               kind=np.array([[0, 1]]), stage_kinds=[("G1", 2, "p1"), ("G1", 1, "p1")],
                               same_node=np.array([[s0.placement.node == s1.placement.node]]))
        flush = ev.score_batch(batch).flush[0]
        assert list(flush) == pytest.approx([s.flush_s for s in res.stages], rel=1e-12)


def test_runtime_is_an_explicit_named_choice(mit, sailor_archive):
    assert SimOptions().runtime == "deepspeed-pipe"
    mp, ds = SimOptions.megatron_patch(), SimOptions.deepspeed_pipe()
    assert (mp.overlap_grad_sync, mp.extra_reduce_buffer) == (True, False)
    assert (ds.overlap_grad_sync, ds.extra_reduce_buffer) == (False, True)
    assert SimOptions(runtime="megatron_patch") == mp
    with pytest.raises(SailorError, match="deepspeed-pipe, megatron_patch"):
        SimOptions(runtime="pytorch")
    assert PlanRequest("OPT-350M", 64).runtime == "megatron_patch"  # the planner ranks as our runtime runs
    with pytest.raises(SailorError, match="--runtime"):
        PlanRequest("OPT-350M", 64, runtime="pytorch")
    # validate-sim simulates Sailor's runs as DeepSpeed's pipeline engine ran them
    report = validate_runs([validation_dir() / "mit" / "N4"], mit, "OPT-350M", sailor_archive)
    for row in report.rows:
        assert row.result is not None
        assert row.est_s == simulate(row.result.plan, mit, sailor_archive, options=ds).iteration_time_s


@pytest.mark.parametrize("asynchronous, serial, idle", [
    # DeepSpeed buffered: s1 waits for act0 (arrives 1.5) and act1 (sent only after grad0 came, 5.5); s0 waits
    # for grad0 (5.0) and grad1 (9.0)
    (True, True, {(1, 0.0, 1.5), (0, 2.0, 5.0), (1, 4.5, 5.5), (0, 7.0, 9.0)}),
    (False, False, {(1, 0.0, 1.0), (0, 2.5, 4.5), (0, 7.0, 8.0)}),  # megatron blocking: each side waits for the other
], ids=["deepspeed-async", "megatron-blocking"])
def test_waiting_is_drawn_as_waiting_not_as_link_time(asynchronous, serial, idle):
    """The by-hand timelines above: a rank that waits for a message or for its peer to reach a blocking
    exchange gets an ``idle`` event over exactly that wait; the link's own seconds stay transfers."""
    F, B, act, grad, m = TWO
    progs = build_programs([F], [B], [act], [grad], [m], [], {(0, s): 0.0 for s in range(len(F))}, [[asynchronous]],
                           serial)
    events = run_programs(progs)
    waits = {(e.stage, round(e.start, 9), round(e.end, 9)) for e in events if e.kind == "idle" and e.end > e.start}
    assert waits == idle
    transfers = [e for e in events if e.kind in ("exchange", "send_act", "recv_act", "send_grad", "recv_grad")]
    assert all(e.end - e.start == pytest.approx(0.5) for e in transfers)
