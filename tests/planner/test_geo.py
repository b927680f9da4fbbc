"""Plans across clusters: the chain search against a brute force over every shape and stage-to-cluster
assignment, capacity never exceeded, and the geo search keeping the best of both shapes."""
from __future__ import annotations

import itertools

import pytest

from planner import PlanRequest
from planner.geo import (
    Chain,
    ChainSettings,
    Estimator,
    assign,
    chain_plan,
    chain_search,
    cluster_groups,
    geo_search,
    gpus_per_cluster,
    linked_groups,
)
from planner.search import search
from planner.templates import uniform_split
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import get_model
from sailor_hpc.core.placement import place_plan
from sailor_hpc.core.plan import validate_plan
from sailor_hpc.core.site import load_site
from simulator import SimOptions, StageEvaluator, simulate
from tests.data import SITE_CONFIGS
from tests.simulator.conftest import TINY_L, tiny_archive, two_cluster_site

AVAILABLE = {"p1": 2, "p2": 2}  # small: room decides which assignments exist, and crossing pays
GBS = 8


@pytest.fixture(scope="module")
def world():
    return two_cluster_site(), tiny_archive()


def _brute_force(site, archive, request):
    """Every (mbs, tp, P, D) and every assignment of stages to clusters that fits the GPUs, simulated."""
    groups = cluster_groups(site)
    slots = {tp: {p: AVAILABLE[p] // tp for p in AVAILABLE} for tp in (1, 2)}
    best = None
    for mbs, tp, P in itertools.product((1, 2), (1, 2), range(1, TINY_L + 1)):
        for D in range(1, GBS // mbs + 1):
            for a in itertools.product(range(len(groups)), repeat=P):
                chain = Chain(mbs, tp, tuple(uniform_split(TINY_L, P)), D, a)
                where = assign(chain, groups, slots[tp])
                if where is None:
                    continue
                try:
                    plan = place_plan(chain_plan(site, request, chain, where), site)
                    validate_plan(plan, site, check_placement=True)
                except SailorError:
                    continue
                res = simulate(plan, site, archive)
                if res.fits and (best is None or res.throughput_samples_per_s > best.throughput_samples_per_s):
                    best = res
    return best


def test_chain_search_matches_brute_force_and_stays_within_every_cluster(world) -> None:
    site, archive = world
    request = PlanRequest("tiny-gpt", GBS, available=AVAILABLE)
    found = chain_search(site, archive, request, cluster_groups(site),
                         settings=ChainSettings(exhaustive_assignments=64, exhaustive_chains=10**6))
    best = _brute_force(site, archive, request)
    assert set(gpus_per_cluster(best.plan, site)) == {"c1", "c2"}  # here the best pipeline crosses the link
    assert found[0].throughput == pytest.approx(best.throughput_samples_per_s, rel=1e-9)
    for c in found:
        held = gpus_per_cluster(c.plan, site)
        assert held.get("c1", 0) <= AVAILABLE["p1"] and held.get("c2", 0) <= AVAILABLE["p2"]


def test_assign_refuses_more_replicas_than_a_cluster_holds(world) -> None:
    site, _ = world
    groups = cluster_groups(site)
    chain = Chain(1, 1, ((0, 5),), 5, (0,))
    assert assign(chain, groups, {"p1": 4, "p2": 4}) is None
    assert assign(Chain(1, 1, ((0, 5),), 4, (0,)), groups, {"p1": 4, "p2": 4}) == ((("p1", 4),),)
    # two stages of 3 replicas: the first takes 3 of c1's 4 slots, the second cannot fit in the last one
    assert assign(Chain(1, 1, ((0, 2), (3, 5)), 3, (0, 0)), groups, {"p1": 4, "p2": 4}) is None


def test_geo_search_keeps_the_best_of_both_shapes(world) -> None:
    site, archive = world
    request = PlanRequest("tiny-gpt", GBS, available=AVAILABLE)
    seen: list[tuple[int, int]] = []
    geo = geo_search(site, archive, request, progress=lambda done, total: seen.append((done, total)))
    # one progress over the local search and every chain search: from the start to the end
    assert seen[-1] == (1000, 1000) and min(d for d, _ in seen) < 500 and {t for _, t in seen} == {1000}
    local = search(site, archive, request).candidates[0].throughput
    chain = chain_search(site, archive, request, cluster_groups(site))[0].throughput
    assert geo.candidates[0].throughput == pytest.approx(max(local, chain))
    assert all(c.result.fits for c in geo.candidates)


def test_fast_links_merge_clusters_like_sailors_regions() -> None:
    site = load_site(SITE_CONFIGS / "gcp-multizone.toml")
    assert [g.partitions for g in linked_groups(site)] == [
        ("a100-us-central1-a", "a100-us-central1-b", "a100-us-central1-c", "a100-us-central1-f"), ("a100-us-west1-b",)]


def test_the_estimators_cost_is_the_simulators_for_every_assignment(world) -> None:
    """chain_search prunes on Estimator.cost: GPU-hours plus the egress of activations and gradient rings,
    priced as simulate() prices the placed plan (the same transfers, through simulator.cost.egress)."""
    site, archive = world
    request = PlanRequest("tiny-gpt", GBS, available=AVAILABLE)
    groups = cluster_groups(site)
    estimate = Estimator(StageEvaluator(archive, site, get_model("tiny-gpt"),
                                        options=SimOptions(runtime=request.runtime)))
    crossing = 0
    for mbs, tp, P, D in itertools.product((1, 2), (1, 2), (1, 2, 3), (1, 2)):
        for a in itertools.product(range(len(groups)), repeat=P):
            chain = Chain(mbs, tp, tuple(uniform_split(TINY_L, P)), D, a)
            where = assign(chain, groups, {p: AVAILABLE[p] // tp for p in AVAILABLE})
            if where is None:
                continue
            try:
                plan = place_plan(chain_plan(site, request, chain, where), site)
            except SailorError:
                continue
            res = simulate(plan, site, archive, options=SimOptions(runtime=request.runtime))
            crossing += res.egress_cost > 0
            assert estimate.cost(chain, where, res.iteration_time_s, GBS) == pytest.approx(res.cost_per_iteration,
                                                                                          rel=1e-9), chain
    assert crossing > 0
