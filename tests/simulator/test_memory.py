"""Peak memory per GPU, component by component, on the tiny synthetic profile."""
from __future__ import annotations

import numpy as np
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


def test_optimizer_implementation_follows_runtime_and_device():
    """megatron_patch steps with torch's fused AdamW on CUDA (NCCL) and the foreach one on the CPU (gloo)."""
    from sailor_hpc.core.errors import SailorError
    assert SimOptions.megatron_patch().optimizer_impl == "fused"
    assert SimOptions.megatron_patch(backend="gloo").optimizer_impl == "foreach"
    assert SimOptions.deepspeed_pipe().optimizer_impl == "deepspeed"
    with pytest.raises(SailorError, match="optimizer implementation"):
        SimOptions.megatron_patch(optimizer_impl="apex")


def test_two_phases_never_add_up(tiny):
    """A step that runs after the backward freed the activations is a peak of its own: allocated is the larger
    phase, device memory adds the slack to the activation phase and the fixed overhead to both."""
    from simulator.runtimes import OPTIMIZER_IMPLS
    mem = table(tiny)
    kw = dict(stage=0, num_stages=1, mbs=1, micro_batches=1, dtype="fp32", optimizer="adam", recompute=False,
              input_bytes=0.0, overhead=OVERHEAD)
    foreach = stage_memory(mem, 0, 5, optimizer_impl=OPTIMIZER_IMPLS["foreach"], **kw)
    fused = stage_memory(mem, 0, 5, optimizer_impl=OPTIMIZER_IMPLS["fused"], **kw)
    summed = stage_memory(mem, 0, 5, **kw)  # DeepSpeed's calibrated model: the temporary at the activation peak
    params = TINY_PARAMS.sum()
    act_phase = 16 * params + 4 * params + foreach.activations + foreach.working  # + DeepSpeed's reduce buffer
    assert fused.optimizer_temp == 0 and foreach.optimizer_temp == 4 * params
    assert foreach.peak_allocated == pytest.approx(max(act_phase, 24 * params))
    assert summed.peak_allocated == pytest.approx(act_phase + 4 * params)
    assert foreach.peak_device == pytest.approx(max(act_phase + foreach.allocator_slack, 24 * params) + OVERHEAD)
    assert foreach.total == foreach.peak_device and fused.peak_allocated == pytest.approx(act_phase)


def test_tied_embedding_once_on_a_stage_holding_both_ends(tiny_site, tiny):
    """megatron_patch's head reads the embedding's weight: one tensor on a stage holding both ends (the profile
    counts it on layer 0 and on the head); a last stage alone holds its own copy. DeepSpeed: as profiled."""
    from simulator.api import StageEvaluator
    ev = StageEvaluator(tiny, tiny_site, "tiny-gpt", options=SimOptions.megatron_patch())
    tied = ev.head_shape(1).tied_params
    assert tied == min(TINY_PARAMS[5] - 2 * 64, TINY_PARAMS[0])  # the head beyond its LayerNorm
    one = Plan("tiny-gpt", 4, (Pipeline(1, 4, (Stage(0, 5, 1, "G1"),)),))
    two = Plan("tiny-gpt", 4, (Pipeline(1, 4, (Stage(0, 2, 1, "G1"), Stage(3, 5, 1, "G1"))),))
    (whole,) = simulate(one, tiny_site, tiny, options=SimOptions.megatron_patch()).stages
    assert whole.memory.state == 16 * (TINY_PARAMS.sum() - tied)
    assert sum(s.memory.state for s in simulate(two, tiny_site, tiny, options=SimOptions.megatron_patch()).stages) == (
        16 * TINY_PARAMS.sum())
    (ds,) = simulate(one, tiny_site, tiny).stages
    assert ds.memory.state == 16 * TINY_PARAMS.sum()


def test_one_stage_backward_working_set_is_the_many_stage_one() -> None:
    """The planner's bisection asks for one stage at a time (a float path); batches ask for arrays: the two
    paths give the same working set for every layer range of a shipped profile, heads tied or padded."""
    from sailor_hpc.core.archive import open_archive
    from sailor_hpc.core.site import load_site
    from simulator import SimOptions, StageEvaluator
    from simulator.memory import HeadShape, backward_working
    from tests.simulator.conftest import SITES
    site = load_site(SITES / "a100-v100.toml")
    mem = StageEvaluator(open_archive(site=site), site, "OPT-350M", options=SimOptions.megatron_patch()).memory_table(1)
    L = mem.cum_act.size - 1
    firsts, lasts = map(np.array, zip(*[(i, j) for i in range(L) for j in range(i, L)]))
    for head in (HeadShape(), HeadShape(tied_params=1e6, logits_per_sample=5e5, padded_vocab=True)):
        for freed in (0.0, 123.0):
            kw = dict(mbs=4, scale=0.5, elem=2, head=head, freed_output_bytes=freed)
            many = backward_working(mem, firsts, lasts, **kw)
            one = [backward_working(mem, int(f), int(la), **kw) for f, la in zip(firsts, lasts)]
            np.testing.assert_allclose(many, one, rtol=1e-12)


@pytest.mark.parametrize(("options", "recompute"), [(SimOptions.megatron_patch(), False),
                                                    (SimOptions.megatron_patch(), True),
                                                    (SimOptions.deepspeed_pipe(), False),
                                                    (SimOptions(runtime="deepspeed", zero_stage=3, zero_dp=4), False)],
                         ids=["megatron_patch", "megatron_patch-recompute", "deepspeed-pipe", "deepspeed-zero3"])
def test_first_stage_totals_are_stage_memory_for_every_layer_range(options: SimOptions, recompute: bool) -> None:
    """The planner's fit checks read one array pass per (mbs, TP, in-flight count); every entry must be the
    per-stage path's total exactly (a fit decision at the capacity's edge must not move)."""
    from sailor_hpc.core.archive import open_archive
    from sailor_hpc.core.site import load_site
    from simulator import StageEvaluator
    from tests.simulator.conftest import SITES
    site = load_site(SITES / "a100-v100.toml")
    archive = open_archive(site=site)
    ev = StageEvaluator(archive, site, "OPT-350M", options=options, recompute=recompute)
    L = ev.model.num_pipeline_layers
    for gpu in ("A100-40", "V100-16"):
        points = sorted(archive.compute_points("OPT-350M", gpu, "fp32"))
        for mbs, tp in (points[0], points[-1]):  # the smallest and largest micro-batch, TP 1 and the widest
            counts = (1, 2, 5)
            tables = ev.first_stage_totals(gpu, tp, mbs, counts)
            assert tables.shape == (len(counts), L, L)
            for k, totals in zip(counts, tables):
                for i in range(L):
                    want = [float(ev.stage_memory(ev.stage(gpu, tp, mbs, i, j), stage=0, num_stages=k,
                                                  micro_batches=k).total) for j in range(i, L)]
                    assert totals[i, i:].tolist() == want, (gpu, mbs, tp, k, i)
                    assert np.isinf(totals[i, :i]).all()
