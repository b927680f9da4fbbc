"""The resize policy by hand, and re-planning with the real planner on the tiny-gpt archive (no cluster)."""
from __future__ import annotations

import pytest

from planner.search import search
from sailor_hpc.controller.planning import misfit, node_demands, plan_on
from sailor_hpc.controller.policy import DEFAULT_RESTART_COST_S, Score, judge, plan_shape, restart_cost
from sailor_hpc.controller.spec import RunSpec
from sailor_hpc.core.archive import EMBEDDED_ARCHIVE, read_archive
from sailor_hpc.core.plan import plan_from_dict
from sailor_hpc.core.site import load_site
from tests.controller.scenario import GBS, LOCAL_LAB, MODEL
from tests.data.tiny_archive import write_tiny_archive
from tests.jobs.conftest import PLANS


def test_throughput_gain_by_hand():
    # keep: 1000 / 10 = 100 s; move: 10 + 1000 / 20 = 60 s; gain = 100 / 60 - 1 = 2/3
    v = judge("throughput", Score(10, 1), Score(20, 2), 1000, 10.0, 0.10)
    assert v.resize and v.keep == 100 and v.move == 60 and v.gain == pytest.approx(2 / 3)
    assert not judge("throughput", Score(10, 1), Score(20, 2), 1000, 10.0, 0.70).resize
    # near the end the restart is not worth it: keep 100 / 10 = 10 s, move 10 + 5 = 15 s
    near_end = judge("throughput", Score(10, 1), Score(20, 2), 100, 10.0, 0.10)
    assert not near_end.resize and near_end.gain == pytest.approx(10 / 15 - 1)
    assert not judge("throughput", Score(10, 1), Score(20, 2), 0, 10.0, 0.10).resize


def test_cost_gain_by_hand():
    # keep: 100 s at 1/h; move: (10 + 50) s at 4/h -> 100 / 240 - 1 < 0
    v = judge("cost", Score(10, 1.0), Score(20, 4.0), 1000, 10.0, 0.10)
    assert not v.resize and v.gain == pytest.approx(100 / 240 - 1)
    # at 1.5/h: move costs 90 units-seconds -> gain 100 / 90 - 1 = 11.1 %
    v = judge("cost", Score(10, 1.0), Score(20, 1.5), 1000, 10.0, 0.10)
    assert v.resize and v.gain == pytest.approx(100 / 90 - 1)


def test_restart_cost_fixed_measured_default():
    assert restart_cost(5.0, [30.0, 50.0]) == 5.0
    assert restart_cost(None, [30.0, 50.0]) == 40.0
    assert restart_cost(None, []) == DEFAULT_RESTART_COST_S


def test_misfit_checks_nodes_not_totals():
    plan = plan_from_dict(PLANS["het-mixed"])  # v100: one node of 2 ranks; a100: nodes of 3 and 1 ranks
    assert node_demands(plan) == {"v100": [2], "a100": [3, 1]}
    assert misfit(plan, {"a100": {"a-1": 3, "a-2": 1}, "v100": {"v-1": 2}}) is None
    assert misfit(plan, {"a100": {"a-1": 4}, "v100": {"v-1": 2}}) is None  # 3 + 1 on one node of 4
    assert misfit(plan, {"a100": {"a-1": 2, "a-2": 2}, "v100": {"v-1": 8}}) == "a100"  # 4 free, no node has 3
    assert misfit(plan, {"a100": {"a-1": 4}, "v100": {"v-1": 1, "v-2": 1}}) == "v100"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    path = write_tiny_archive(tmp_path_factory.mktemp("tiny") / "tiny.h5")
    site = load_site(LOCAL_LAB)
    spec = RunSpec.of(run_id="abc123", site=str(LOCAL_LAB), model=MODEL, objective="throughput", data="/d", save="/s",
                   steps=60, gbs=GBS, profiles=str(path), max_gpus=2, max_stages=2)
    return spec, site, read_archive(path, EMBEDDED_ARCHIVE)


def test_plans_of_the_cluster_scenario(tiny):
    """The three plans tests/controller/test_resize_cluster.py expects, from the real planner."""
    spec, site, archive = tiny
    het = plan_on(spec, site, archive, {"a100": {"a100-1": 1}, "v100": {"v100-1": 8}})
    v100 = plan_on(spec, site, archive, {"a100": {}, "v100": {"v100-1": 8, "v100-2": 8}})
    a100 = plan_on(spec, site, archive, {"a100": {"a100-1": 4}, "v100": {"v100-1": 6, "v100-2": 8}})
    assert het.plan.gpus_by_partition() == {"a100": 1, "v100": 1}
    assert v100.plan.gpus_by_partition() == {"v100": 2}
    assert a100.plan.gpus_by_partition() == {"a100": 2}
    assert a100.score.throughput > het.score.throughput > v100.score.throughput
    # the grow-back decision the scenario makes, and the one it would not make near the end
    remaining = 50 * GBS
    assert judge("throughput", v100.score, a100.score, remaining, 25.0, 0.10).resize
    assert not judge("throughput", v100.score, a100.score, GBS, 25.0, 0.10).resize
    # more idle V100 while running 1 A100 + 1 V100: the best plan is the same, nothing to gain
    more_v100 = plan_on(spec, site, archive, {"a100": {"a100-1": 1}, "v100": {"v100-1": 8, "v100-2": 8}})
    assert plan_shape(more_v100.plan) == plan_shape(het.plan)


def test_replanning_respects_free_gpus_per_node(tiny):
    spec, site, archive = tiny
    free = {"a100": {"a100-1": 1, "a100-2": 1}, "v100": {}}
    unconstrained = search(site, archive, spec.planning.request({"a100": 2, "v100": 0})).candidates[0].plan
    assert misfit(unconstrained, free) == "a100"  # its 2 ranks share one node: cannot start on 1 + 1
    got = plan_on(spec, site, archive, free)
    assert misfit(got.plan, free) is None
    expected = search(site, archive, spec.planning.request({"a100": 1, "v100": 0})).candidates[0]
    assert plan_shape(got.plan) == plan_shape(expected.plan)
    assert got.score.throughput == pytest.approx(expected.result.throughput_samples_per_s)


def test_no_free_gpu_is_an_explained_error(tiny):
    from sailor_hpc.core.errors import SailorError
    spec, site, archive = tiny
    with pytest.raises(SailorError, match="no plan fits the free GPUs"):
        plan_on(spec, site, archive, {"a100": {}, "v100": {}})


def test_plan_shape_ignores_placement_only():
    plan = plan_from_dict(PLANS["het-mixed"])
    moved = plan_from_dict({**PLANS["het-mixed"], "pipelines": [
        {**p, "stages": [{**s, "placement": {"node": 1 - s["placement"]["node"], "gpus": s["placement"]["gpus"]}}
                         for s in p["stages"]]} for p in PLANS["het-mixed"]["pipelines"]]})
    assert plan_shape(moved) == plan_shape(plan) and moved != plan
    assert plan_shape(plan_from_dict(PLANS["a100-only"])) != plan_shape(plan)
