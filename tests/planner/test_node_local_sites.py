"""A site needs a network fit only for the links its plans can use: a one-GPU machine plans with no network
section at all, a one-node machine with only its intra-node fit, and a plan that could cross nodes asks for
the inter-node fit by name (the GPU check's one-node, one-GPU site is the first case)."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from planner import PlanRequest
from planner.search import search
from sailor_hpc.core.archive import open_archive
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.plan import validate_plan
from sailor_hpc.core.site import load_site_dict
from sailor_hpc.core.toml_writer import dump_toml

INTRA = {"1": {"constant_gbps": 200.0}, "2": {"constant_gbps": 300.0}, "4": {"constant_gbps": 400.0}}
INTER = {"1": {"constant_gbps": 2.0}, "4": {"constant_gbps": 6.0}}


def site_doc(nodes: int, gpus_per_node: int, network: dict[str, Any] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"name": "gpu", "gpu_type": "A100-40", "gres": "gpu:a100", "nodes": nodes,
                            "gpus_per_node": gpus_per_node, "cost_per_gpu_hour": 1.0}
    if network is not None:
        part["network"] = network
    return {"schema_version": 1, "name": "node-local", "gpu_types": {"A100-40": {"memory_gib": 39.43}},
            "partitions": [part]}


@pytest.fixture(scope="module")
def archive():
    return open_archive()  # the embedded Sailor profiles (A100-40 among them)


def plan_on(doc: dict[str, Any], archive, gpus: int):
    site = load_site_dict(copy.deepcopy(doc), source="node-local.toml")
    result = search(site, archive, PlanRequest("OPT-350M", 32, available={"gpu": gpus}, top_k=3))
    for c in result.candidates:
        validate_plan(c.plan, site)
    return result


def test_one_gpu_site_without_any_network_plans(archive) -> None:
    best = plan_on(site_doc(1, 1, None), archive, 1).candidates[0]
    (pipe,) = best.plan.pipelines
    assert [s.tp for s in pipe.stages] == [1] and pipe.micro_batch_size * pipe.num_micro_batches == 32
    assert best.result.iteration_time_s > 0


def test_a_plan_inside_one_node_is_the_same_with_or_without_an_inter_node_fit(archive) -> None:
    """Nothing of a one-node plan crosses nodes, so an inter-node fit (here a slow one) must change nothing:
    the reference is the same search on the same site with the fit added."""
    alone = plan_on(site_doc(1, 4, {"intra_node": INTRA}), archive, 4)
    with_fit = plan_on(site_doc(1, 4, {"intra_node": INTRA, "inter_node": INTER}), archive, 4)
    assert [c.plan.to_dict()["pipelines"] for c in alone.candidates] == \
           [c.plan.to_dict()["pipelines"] for c in with_fit.candidates]
    assert [c.throughput for c in alone.candidates] == [c.throughput for c in with_fit.candidates]
    # the search did consider pipelines of several stages (their boundaries priced inside the node)
    assert any(len(p.stages) > 1 for c in alone.simulated for p in c.plan.pipelines) or \
        any(len(p.stages) > 1 for c in alone.candidates for p in c.plan.pipelines)
    for c in alone.candidates:
        assert {s.placement.node for p in c.plan.pipelines for s in p.stages} == {0}


def test_a_plan_that_could_cross_nodes_names_the_missing_fit(archive) -> None:
    doc = site_doc(2, 4, {"intra_node": INTRA})
    plan_on(doc, archive, 4)  # one node's worth plans
    with pytest.raises(SailorError) as err:
        plan_on(doc, archive, 8)
    text = str(err.value)
    assert "node-local.toml" in text and "partitions[gpu].network.inter_node" in text and "fix:" in text


def test_cli_plans_a_one_gpu_site_and_refuses_a_two_node_one_with_exit_2(tmp_path: Path) -> None:
    from sailor_hpc.cli import main  # the CLI with every command registered
    runner = CliRunner()
    one = tmp_path / "one-gpu.toml"
    one.write_text(dump_toml(site_doc(1, 1, None)))
    ok = runner.invoke(main, ["plan", "--site", str(one), "--model", "OPT-350M", "--gbs", "32", "--dtype", "fp32",
                             "-o", str(tmp_path / "plan.json")])
    assert ok.exit_code == 0, ok.output
    assert (tmp_path / "plan.json").exists()
    two = tmp_path / "two-nodes.toml"
    two.write_text(dump_toml(site_doc(2, 4, {"intra_node": INTRA})))
    bad = runner.invoke(main, ["plan", "--site", str(two), "--model", "OPT-350M", "--gbs", "32", "--dtype", "fp32",
                              "-o", str(tmp_path / "bad.json")])
    assert bad.exit_code == 2, bad.output
    assert "two-nodes.toml" in bad.output and "network.inter_node" in bad.output
    assert not (tmp_path / "bad.json").exists()
