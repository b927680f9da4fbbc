"""Peak memory per GPU, component by component, on the tiny synthetic profile."""
from __future__ import annotations

import pytest

from sailor_hpc.core.models import get_model
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from simulator import SimOptions, simulate
from simulator.memory import ALLOCATOR_SLACK, in_flight, stage_memory
from simulator.tables import ProfileTables
from tests.simulator.conftest import OVERHEAD, TINY_ACT, TINY_OUT, TINY_PARAMS


def table(tiny, tp=1):
    return ProfileTables(tiny, get_model("tiny-gpt")).memory(tp)


def test_in_flight_is_capped_by_micro_batches():
    assert in_flight(0, 4, 16) == 4 and in_flight(3, 4, 16) == 1
    assert in_flight(0, 8, 3) == 3  # Sailor charged P - s = 8 here


def test_stage_memory_by_hand(tiny):
    mem = table(tiny)
    # stage 1 of 3 holding blocks 2..3, mbs 2, 10 micro-batches: 2 in flight
    got = stage_memory(mem, 2, 3, stage=1, num_stages=3, mbs=2, micro_batches=10, dtype="fp32", optimizer="adam",
                       recompute=False, input_bytes=1000.0, overhead=OVERHEAD)
    params = TINY_PARAMS[2] + TINY_PARAMS[3]
    acts = 2 * (2 * (TINY_ACT[2] + TINY_ACT[3]) + 1000.0)
    working = 2 * TINY_ACT[2]
    assert got.state == 16 * params
    assert got.optimizer_temp == 4 * params
    assert got.reduce_buffer == 4 * params
    assert got.activations == pytest.approx(acts)
    assert got.working == pytest.approx(working)
    assert got.allocator_slack == pytest.approx(ALLOCATOR_SLACK * (acts + working))
    assert got.total == pytest.approx(24 * params + (1 + ALLOCATOR_SLACK) * (acts + working) + OVERHEAD)


def test_dtype_optimizer_and_recompute(tiny):
    mem = table(tiny)
    kw = dict(stage=0, num_stages=2, mbs=1, micro_batches=8, input_bytes=0.0, overhead=0.0)
    fp32 = stage_memory(mem, 0, 2, dtype="fp32", optimizer="adam", recompute=False, **kw)
    bf16 = stage_memory(mem, 0, 2, dtype="bf16", optimizer="adam", recompute=False, **kw)
    sgd = stage_memory(mem, 0, 2, dtype="fp32", optimizer="sgd", recompute=False, **kw)
    rec = stage_memory(mem, 0, 2, dtype="fp32", optimizer="adam", recompute=True, **kw)
    params = TINY_PARAMS[:3].sum()
    assert bf16.state == 18 * params and sgd.state == 12 * params and sgd.optimizer_temp == 0
    assert bf16.activations == pytest.approx(fp32.activations / 2)  # profile in fp32, plan in bf16
    # recomputation, 2 micro-batches in flight: the embedding's activations (not recomputed), the input of
    # block 2 (block 1's input is the embedding's output, kept as block 1's input too), and one layer
    # (the largest) being recomputed
    keep = TINY_ACT[0] + 4 * TINY_OUT[1] + 4 * TINY_OUT[2]  # act_input = TINY_OUT in the tiny profile
    assert rec.activations == pytest.approx(2 * keep + TINY_ACT[1]) and rec.activations < fp32.activations
    later = stage_memory(mem, 2, 4, dtype="fp32", optimizer="adam", recompute=True, **{**kw, "input_bytes": 500.0})
    # blocks 2..4 from a received input: the inputs of blocks 3 and 4, plus the received one, per micro-batch
    assert later.activations == pytest.approx(2 * (4 * TINY_OUT[2] + 4 * TINY_OUT[3] + 500.0) + TINY_ACT[2])


def test_bucket_caps_the_reduce_buffer(tiny):
    mem = table(tiny)
    got = stage_memory(mem, 0, 5, stage=0, num_stages=1, mbs=1, micro_batches=1, dtype="fp32", optimizer="adam",
                       recompute=False, input_bytes=0.0, overhead=0.0, bucket_elems=1000)
    assert got.reduce_buffer == 4 * 1000


def test_tp_halves_sharded_memory(tiny):
    one = stage_memory(table(tiny, 1), 1, 4, stage=0, num_stages=1, mbs=1, micro_batches=1, dtype="fp32",
                       optimizer="adam", recompute=False, input_bytes=0.0, overhead=0.0)
    two = stage_memory(table(tiny, 2), 1, 4, stage=0, num_stages=1, mbs=1, micro_batches=1, dtype="fp32",
                       optimizer="adam", recompute=False, input_bytes=0.0, overhead=0.0)
    assert two.state == one.state / 2 and two.activations == pytest.approx(one.activations / 2)


def test_a_sent_output_is_freed_as_each_runtime_frees_it(tiny_site, tiny):
    """Two TP-2 stages, 4 micro-batches: stage 0 holds 2 in flight, each its layers' activations (the profile
    counts the output among them) minus what its runtime frees once the 8192-byte output is sent: DeepSpeed
    keeps the rank's half (frees 4096 B), megatron_patch frees it all. The last stage sends nothing: it keeps
    its layers plus the received input of its one micro-batch in flight."""
    plan = Plan("tiny-gpt", 4, (Pipeline(1, 4, (Stage(0, 2, 2, "G1"), Stage(3, 5, 2, "G1"))),))
    out = TINY_OUT[2] * 4
    first, last = TINY_ACT[:3].sum() / 2, TINY_ACT[3:].sum() / 2
    for options, freed in ((SimOptions.deepspeed_pipe(), out / 2), (SimOptions.megatron_patch(), out)):
        s0, s1 = simulate(plan, tiny_site, tiny, options=options).stages
        assert s0.memory.activations == pytest.approx(2 * (first - freed))
        assert s1.memory.activations == pytest.approx(last + out)
