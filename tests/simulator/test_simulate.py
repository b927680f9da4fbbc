"""Whole plans: composition by hand, heterogeneous plans against the event-driven timeline, bad plans."""
from __future__ import annotations

from dataclasses import replace

import pytest

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from sailor_hpc.core.plan_io import load_run
from simulator import plan_timeline, simulate
from simulator.iteration import Collective, expected_max_normal, finish_iteration, gradient_segments
from simulator.network import Endpoint, ring_allreduce_seconds
from simulator.validation import compute_floor
from tests.simulator.conftest import TINY_BWD, TINY_FWD, validation_dir


def tiny_plan(*pipes: Pipeline, **kw) -> Plan:
    return Plan(model="tiny-gpt", global_batch_size=sum(p.samples for p in pipes), pipelines=tuple(pipes), **kw)


HETERO = tiny_plan(
    Pipeline(2, 5, (Stage(0, 2, 2, "G1"), Stage(3, 5, 1, "G2"))),
    Pipeline(1, 7, (Stage(0, 0, 1, "G2"), Stage(1, 3, 2, "G1"), Stage(4, 5, 1, "G1"))),
    Pipeline(1, 3, (Stage(0, 5, 2, "G1"),)),
)


def test_finish_iteration_by_hand():
    flush = {(0, 0): 5.0, (0, 1): 3.0, (1, 0): 4.0, (1, 1): 6.0}
    colls = [Collective("tied", ((0, 0), (0, 1)), 1.0, 0, 5), Collective("grads", ((0, 0), (1, 0)), 2.0, 0, 2),
             Collective("grads", ((0, 1), (1, 1)), 0.5, 3, 5)]
    end = finish_iteration(flush, colls, {k: 0.1 for k in flush})
    assert end.collective_start == (5.0, 6.0, 6.0)
    assert end.stage_end == {(0, 0): pytest.approx(8.1), (1, 0): pytest.approx(8.1), (0, 1): pytest.approx(6.6),
                             (1, 1): pytest.approx(6.6)}
    assert end.time_s == pytest.approx(8.1)


def test_straggler_wait_by_hand():
    """A collective waits skew * (compute since its ranks last met); the tied all-reduce inside pipeline 0
    does not synchronise the replicas, the first gradient all-reduce does."""
    flush = {(0, 0): 5.0, (0, 1): 3.0, (1, 0): 4.0, (1, 1): 6.0}
    colls = [Collective("tied", ((0, 0), (0, 1)), 1.0, 0, 5),
             Collective("grads", ((0, 0), (1, 0)), 2.0, 0, 2, skew=0.1),
             Collective("grads", ((0, 0), (1, 0)), 1.0, 0, 2, skew=0.1)]
    end = finish_iteration(flush, colls, {k: 0.0 for k in flush})
    # tied: 5 -> 6; first grads: arrive 6, wait 0.1 * 6 (never met before); second: met at 8.6, arrives 8.6
    assert end.collective_start == pytest.approx((5.0, 6.6, 8.6))
    assert end.time_s == pytest.approx(9.6)


def test_expected_max_of_normals_matches_sampling():
    import numpy as np

    rng = np.random.default_rng(0)
    for n in (2, 4, 16, 64):
        sampled = rng.standard_normal((200_000, n)).max(axis=1).mean()
        assert expected_max_normal(n) == pytest.approx(sampled, rel=0.015)
    assert expected_max_normal(1) == 0.0


def test_replica_jitter_delays_gradient_syncs_in_both_engines(tiny, tiny_site):
    from sailor_hpc.core.site import load_site_dict
    from tests.simulator.conftest import TINY_SITE

    doc = {**TINY_SITE, "partitions": [{**p, "replica_jitter": 0.05} for p in TINY_SITE["partitions"]]}
    jittery = load_site_dict(doc, source="<tiny jitter>")
    calm, res = simulate(HETERO, tiny_site, tiny), simulate(HETERO, jittery, tiny)
    tl = plan_timeline(HETERO, jittery, tiny)
    assert res.iteration_time_s > calm.iteration_time_s
    assert res.iteration_time_s == pytest.approx(tl.iteration_time_s, rel=1e-12)
    waits = [e for e in tl.events if e.kind == "wait"]
    assert {(e.pipeline, e.stage) for e in waits} == {(i, s) for i, p in enumerate(HETERO.pipelines)
                                                     for s in range(len(p.stages))}
    grads = [c for c in res.collectives if c.kind == "grads"]
    assert all(c.skew == pytest.approx(0.05 * expected_max_normal(len(c.holders))) for c in grads)
    assert all(c.skew == 0.0 for c in res.collectives if c.kind == "tied")


def test_gradient_segments_follow_every_pipeline_split():
    segs = gradient_segments([[(0, 2), (3, 5)], [(0, 0), (1, 3), (4, 5)], [(0, 5)]])
    assert segs == [(0, 0, ((0, 0), (1, 0), (2, 0))), (1, 2, ((0, 0), (1, 1), (2, 0))),
                    (3, 3, ((0, 1), (1, 1), (2, 0))), (4, 5, ((0, 1), (1, 2), (2, 0)))]


def test_one_stage_plan_by_hand(tiny_site, tiny):
    res = simulate(tiny_plan(Pipeline(1, 4, (Stage(0, 5, 1, "G1"),))), tiny_site, tiny)
    update = 0.003 * 4000 / 3000  # profiled step over embedding + 2 blocks + head, scaled to the whole model
    assert res.iteration_time_s == pytest.approx(4 * (TINY_FWD.sum() + TINY_BWD.sum()) + update)
    assert res.throughput_samples_per_s == pytest.approx(4 / res.iteration_time_s)
    assert res.tokens_per_s == pytest.approx(4 * 32 / res.iteration_time_s)
    assert res.cost_per_hour == 2.0 and res.cost_per_iteration == pytest.approx(2.0 * res.iteration_time_s / 3600)
    assert res.collectives == ()


def test_heterogeneous_plan_matches_the_event_driven_timeline(tiny_site, tiny):
    res = simulate(HETERO, tiny_site, tiny)
    tl = plan_timeline(HETERO, tiny_site, tiny)
    assert res.iteration_time_s == pytest.approx(tl.iteration_time_s, rel=1e-12)
    flush = tl.flush_times()
    for s in res.stages:
        assert s.flush_s == pytest.approx(flush[(s.pipeline, s.stage)], rel=1e-12)
        assert s.end_s == pytest.approx(tl.stage_end()[(s.pipeline, s.stage)], rel=1e-12)
    kinds = [c.kind for c in res.collectives]
    assert kinds == ["tied", "tied", "grads", "grads", "grads", "grads"]
    # the 3-stage pipeline runs its stage-1 TP-2 block layers on G1 at micro-batch 1
    st = next(s for s in res.stages if (s.pipeline, s.stage) == (1, 1))
    assert st.fwd_s == pytest.approx(TINY_FWD[1:4].sum() / 2)


def test_compute_floor_by_hand_and_below_the_estimate(tiny_site, tiny):
    res = simulate(HETERO, tiny_site, tiny)
    fb = TINY_FWD + TINY_BWD  # per micro-batch at mbs 1, tp 1 on G1; G2 is twice as slow
    pipe0 = [2 * fb[0:3].sum() / 2, 2 * 2 * fb[3:6].sum()]  # mbs 2: tp 2 on G1, then tp 1 on G2
    pipe1 = [2 * fb[0], fb[1:4].sum() / 2, fb[4:6].sum()]
    pipe2 = [fb.sum() / 2]
    by_hand = max(5 * pipe0[0], pipe0[0] + 5 * pipe0[1],
                  7 * pipe1[0], pipe1[0] + 7 * pipe1[1], pipe1[0] + pipe1[1] + 7 * pipe1[2], 3 * pipe2[0])
    assert compute_floor(res) == pytest.approx(by_hand, rel=1e-12)
    assert compute_floor(res) < res.iteration_time_s


@pytest.mark.parametrize("name", ["clariden/OPT-350/N16/plan_config_N16_D4.json",
                                  "clariden/GPT-NEO/N4/plan_config_N4_D1.json", "mit/N4/plan_config_N4_D1.json",
                                  "mit/N2/plan_config_N2_D2.json"])
def test_measured_plans_match_the_timeline(name, clariden, mit, sailor_archive):
    site = mit if name.startswith("mit") else clariden
    model = "GPT-Neo-2.7B" if "GPT-NEO" in name else "OPT-350M"
    plan = load_run(validation_dir() / name, model=model, site=site).plan
    res = simulate(plan, site, sailor_archive)
    assert res.iteration_time_s == pytest.approx(plan_timeline(plan, site, sailor_archive).iteration_time_s, rel=1e-12)


def test_sailor_replicas_reduce_per_stage(clariden, sailor_archive):
    run = load_run(validation_dir() / "clariden/OPT-350/N16/plan_config_N16_D4.json", model="OPT-350M", site=clariden)
    res = simulate(run.plan, clariden, sailor_archive)
    grads = [c for c in res.collectives if c.kind == "grads"]
    stages = run.plan.pipelines[0].stages
    assert [(c.first_layer, c.last_layer) for c in grads] == [(s.first_layer, s.last_layer) for s in stages]
    table = sailor_archive.memory["OPT-350M"][4].table
    for s, c in enumerate(grads):
        assert c.holders == tuple((i, s) for i in range(4))
        eps = [Endpoint("normal", p.stages[s].placement.node, 4) for p in run.plan.pipelines]
        per_gpu = table[stages[s].first_layer:stages[s].last_layer + 1, 0].sum() * 4
        assert c.seconds == pytest.approx(ring_allreduce_seconds(clariden, eps, [per_gpu] * 4, [2e9] * 4))


def test_memory_report_and_out_of_memory(tiny_site, tiny):
    res = simulate(HETERO, tiny_site, tiny)
    assert not res.fits  # TP-2 stages on the 1 GiB G1 carry 1.5 GB of fixed overhead
    oom = res.to_dict()["out_of_memory"]
    assert "pipeline 0 stage 0" in oom and "pipeline 0 stage 1" not in oom
    assert res.peak_memory_bytes == max(res.stage_memory)
    by_type = res.memory_by_gpu_type()
    assert set(by_type) == {"G1", "G2"} and by_type["G1"]["capacity_bytes"] == 2**30
    ok = simulate(tiny_plan(Pipeline(1, 4, (Stage(0, 5, 1, "G2"),))), tiny_site, tiny)
    assert ok.fits


def test_recompute_adds_a_forward_to_every_backward(tiny_site, tiny):
    plain = tiny_plan(Pipeline(1, 4, (Stage(0, 2, 1, "G1"), Stage(3, 5, 1, "G1"))))
    rec = simulate(replace(plain, recompute=True), tiny_site, tiny)
    base = simulate(plain, tiny_site, tiny)
    for a, b in zip(rec.stages, base.stages):
        assert a.bwd_s == pytest.approx(b.bwd_s + b.fwd_s)
        assert a.memory.activations < b.memory.activations
    assert rec.iteration_time_s > base.iteration_time_s


@pytest.mark.parametrize("plan, match", [
    (tiny_plan(Pipeline(1, 2, (Stage(0, 2, 1, "G1"), Stage(4, 5, 1, "G1")))), "layer 3 is missing"),
    (tiny_plan(Pipeline(1, 2, (Stage(0, 5, 1, "H100"),))), "unknown GPU type"),
    (tiny_plan(Pipeline(4, 2, (Stage(0, 5, 1, "G1"),))), "no profile of tiny-gpt on G1 at micro-batch 4"),
    (tiny_plan(Pipeline(1, 2, (Stage(0, 5, 1, "G1"),)), dtype="bf16"), "profiled in fp32, not bf16"),
    (tiny_plan(Pipeline(1, 2, (Stage(0, 5, 1, "G2"),)), dtype="bf16"), r"G2 \(pipelines\[0\].stages\[0\]\) does not "
                                                                    "train in bf16"),
    (tiny_plan(Pipeline(1, 2, (Stage(0, 5, 1, "G1"),)), seq_len=64), "sequence length"),
    (tiny_plan(Pipeline(1, 2, (Stage(0, 5, 8, "G1"),))), "TP 8"),
])
def test_bad_plans_raise_clear_errors(plan, match, tiny_site, tiny):
    with pytest.raises(SailorError, match=match):
        simulate(plan, tiny_site, tiny)
