"""The one planner entry point: it runs the search each request and site need, with the same answers as
calling that search directly, and it is the only place in sailor_hpc that chooses one."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from planner import PlanRequest
from planner.deepspeed_space import deepspeed_search
from planner.entry import plan_search, search_kind
from planner.geo import geo_search
from planner.search import search
from sailor_hpc.core.deepspeed_plan import engine_refusals
from sailor_hpc.core.site import load_site_dict
from tests.planner.conftest import small_site
from tests.simulator.conftest import TINY_SITE, tiny_archive, two_cluster_site

REPO = Path(__file__).resolve().parents[2]


def _answers(result) -> list[tuple]:
    return [(c.plan, c.result.iteration_time_s, c.result.cost_per_iteration) for c in result.candidates]


def test_one_cluster_runs_the_single_cluster_search() -> None:
    site, archive = load_site_dict(TINY_SITE, source="<tiny>"), tiny_archive()
    request = PlanRequest("tiny-gpt", 8, dtype="fp32", available={"p1": 2, "p2": 2})
    assert search_kind(site, request) == "single"
    assert _answers(plan_search(site, archive, request)) == _answers(search(site, archive, request))


def test_several_clusters_run_the_geo_search() -> None:
    site, archive = two_cluster_site(), tiny_archive()
    request = PlanRequest("tiny-gpt", 8, dtype="fp32", available={"p1": 2, "p2": 2})
    assert search_kind(site, request) == "geo"
    got = plan_search(site, archive, request)
    assert _answers(got) == _answers(geo_search(site, archive, request))
    calls: list[tuple[int, int]] = []
    plan_search(site, archive, request, progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1][0] == calls[-1][1]  # the progress callback reaches the geo search


def test_deepspeed_runtime_runs_the_engine_search(tiny_archive) -> None:
    site = small_site(a100_nodes=2, v100_nodes=2)
    request = PlanRequest("tiny-gpt", 16, dtype="fp32", runtime="deepspeed")
    assert search_kind(site, request) == "deepspeed"
    got = plan_search(site, tiny_archive, request)
    assert _answers(got) == _answers(deepspeed_search(site, tiny_archive, request))
    assert all(engine_refusals(c.plan) == [] for c in got.candidates)


@pytest.mark.parametrize("name", ["search", "geo_search", "deepspeed_search"])
def test_no_other_module_of_sailor_hpc_chooses_a_search(name: str) -> None:
    """`plan`, `plan --sbatch` and the controller's re-plans all go through planner.entry.plan_search."""
    callers = []
    for path in sorted((REPO / "sailor_hpc").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("planner"):
                if any(a.name == name for a in node.names):
                    callers.append(str(path.relative_to(REPO)))
    assert callers == []
