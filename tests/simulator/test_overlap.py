"""megatron_patch's overlapped gradient sync in the simulator, against a hand-written replay of the runtime."""
from __future__ import annotations

import pytest

from sailor_hpc.core.plan import Pipeline, Plan, Stage
from simulator import SimOptions, StageEvaluator, simulate
from simulator.network import Endpoint

# two pipelines of one stage each (G1, TP 1): every layer's gradients are all-reduced between them
PLAN = Plan(model="tiny-gpt", global_batch_size=4,
            pipelines=(Pipeline(1, 2, (Stage(0, 5, 1, "G1"),)), Pipeline(1, 2, (Stage(0, 5, 1, "G1"),))))
ONE_LAYER = 1.0  # bytes: every layer is a bucket of its own


def test_buckets_start_during_the_last_backward(tiny_site, tiny) -> None:
    options = SimOptions.megatron_patch(overlap_bucket_bytes=ONE_LAYER)
    res = simulate(PLAN, tiny_site, tiny, options=options)
    serial = simulate(PLAN, tiny_site, tiny)  # DeepSpeed: every all-reduce after the flush
    # the runtime, by hand: layer l's gradients are complete once the backward of layers l..5 ran (it goes
    # from the last layer down); bucket l's all-reduce starts then, or when the previous bucket ended
    ev = StageEvaluator(tiny, tiny_site, "tiny-gpt", options=options)
    placed = res.plan.pipelines[0].stages[0]
    flush = res.stages[0].flush_s
    free = 0.0
    for layer in range(5, -1, -1):
        ready = flush - (ev.stage("G1", 1, 1, 0, layer - 1).bwd_s if layer else 0.0)
        per_gpu = ev.memory_table(1).params(layer, layer) * 4
        ends = [Endpoint.of(p.stages[0]) for p in res.plan.pipelines]
        assert ends[0] == Endpoint.of(placed)
        free = max(ready, free) + ev.allreduce(ends, [per_gpu, per_gpu], 4)
    update = res.stages[0].end_s - max(flush, free)
    assert update == pytest.approx(ev.stage("G1", 1, 1, 0, 5).update_s)
    assert res.iteration_time_s == pytest.approx(max(flush, free) + update, rel=1e-12)
    assert [c.last_layer for c in res.collectives] == [5, 4, 3, 2, 1, 0]
    assert res.iteration_time_s < serial.iteration_time_s
    # the last bucket (layer 0's) cannot start before the flush: what is left after it is its all-reduce alone
    assert res.collective_starts[-1] >= flush - 1e-12


def test_one_bucket_is_the_serial_sync(tiny_site, tiny) -> None:
    """A bucket holding every layer starts at the flush, as DeepSpeed's single all-reduce does."""
    whole = simulate(PLAN, tiny_site, tiny, options=SimOptions.megatron_patch(overlap_bucket_bytes=1e18))
    serial = simulate(PLAN, tiny_site, tiny, options=SimOptions(extra_reduce_buffer=False))
    assert whole.iteration_time_s == pytest.approx(serial.iteration_time_s, rel=1e-12)


def test_megatron_patch_holds_no_flattened_reduce_buffer(tiny_site, tiny) -> None:
    ours = simulate(PLAN, tiny_site, tiny, options=SimOptions.megatron_patch())
    flattened = simulate(PLAN, tiny_site, tiny, options=SimOptions.megatron_patch(extra_reduce_buffer=True))
    deepspeed = simulate(PLAN, tiny_site, tiny)
    params = StageEvaluator(tiny, tiny_site, "tiny-gpt").memory_table(1).params(0, 5)
    held = ours.stages[0].memory.state / 16  # fp32 Adam; megatron_patch holds the tied embedding once
    assert ours.stages[0].memory.reduce_buffer == 0
    assert deepspeed.stages[0].memory.reduce_buffer == pytest.approx(4 * params)  # DeepSpeed: as profiled
    # the other runtime differences (optimizer temporary, working set) aside, the buffer is all that changes
    assert flattened.peak_memory_bytes - ours.peak_memory_bytes == pytest.approx(4 * held)
