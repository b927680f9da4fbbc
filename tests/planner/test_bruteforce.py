"""On a small site the planner's best plan equals a brute-force optimum under the same simulator.

The brute force knows nothing of the planner: it enumerates every plan in the planner's space (per
partition, any number of copies of one pipeline shape -- any split, any TP per stage, any micro-batch
size -- and every way to share the global batch among the pipelines), simulates each whole and keeps
the best.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from planner import Constraints, PlanRequest
from planner.search import search
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.placement import place_plan
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from simulator import SimOptions, simulate
from tests.planner.conftest import small_site

GBS = 16


def shapes(site, archive, partition: str) -> Iterator[tuple[int, tuple[Stage, ...]]]:
    part = site.partition(partition)
    points = archive.compute_points("tiny-gpt", part.gpu_type)
    L = 6
    for mbs in sorted({b for b, _ in points}):
        tps = sorted(t for b, t in points if b == mbs and t <= part.gpus_per_node)
        for P in (1, 2):
            for cuts in itertools.combinations(range(1, L), P - 1):
                bounds = list(zip((0, *cuts), (*[c - 1 for c in cuts], L - 1)))
                for tp in itertools.product(tps, repeat=P):
                    if sum(tp) <= part.gpus_per_node * part.nodes:
                        yield mbs, tuple(Stage(i, j, t, part.gpu_type, partition) for (i, j), t in zip(bounds, tp))


def shares(mbs_list: list[int], total: int) -> Iterator[tuple[int, ...]]:
    """Every way to give each pipeline >= 1 micro-batch so that the samples add up to ``total``."""
    if not mbs_list:
        if total == 0:
            yield ()
        return
    first, rest = mbs_list[0], mbs_list[1:]
    for m in range(1, total // first + 1):
        for tail in shares(rest, total - m * first):
            yield (m, *tail)


def every_plan(site, archive) -> list[tuple[float, float]]:
    """(iteration time, cost per iteration) of every plan of the space that fits."""
    options = {}
    for p in site.partitions:
        opts = [None]
        for mbs, stages in shapes(site, archive, p.name):
            gpus = sum(s.tp for s in stages)
            for n in range(1, p.gpus_per_node * p.nodes // gpus + 1):
                opts.append((mbs, stages, n))
        options[p.name] = opts
    found = []
    for combo in itertools.product(*options.values()):
        chosen = [c for c in combo if c is not None]
        if not chosen:
            continue
        groups = [(mbs, stages) for mbs, stages, n in chosen for _ in range(n)]
        seen = set()
        for ms in shares([g[0] for g in groups], GBS):
            canon = tuple(sorted((mbs, tuple((s.first_layer, s.last_layer, s.tp, s.partition) for s in stages), m)
                                 for (mbs, stages), m in zip(groups, ms)))
            if canon in seen:
                continue
            seen.add(canon)
            plan = Plan("tiny-gpt", GBS, tuple(Pipeline(mbs, m, stages) for (mbs, stages), m in zip(groups, ms)))
            try:
                placed = place_plan(plan, site)
                res = simulate(placed, site, archive, options=SimOptions.megatron_patch())  # the planner's runtime
            except SailorError:
                continue  # a placement the site cannot hold
            if res.fits:
                found.append((res.iteration_time_s, res.cost_per_iteration))
    return found


@pytest.fixture(scope="module")
def space(tiny_archive) -> list[tuple[float, float]]:
    return every_plan(small_site(), tiny_archive)


def test_planner_matches_brute_force(tiny_archive, space) -> None:
    site = small_site()
    expected = {"throughput": min(t for t, _ in space), "cost": min(c for _, c in space)}
    for objective in ("throughput", "cost"):
        result = search(site, tiny_archive, PlanRequest("tiny-gpt", GBS, objective=objective, max_stages=2))
        best = result.candidates[0].result
        got = best.iteration_time_s if objective == "throughput" else best.cost_per_iteration
        assert got == pytest.approx(expected[objective], rel=1e-9), objective


def test_bounds_on_throughput_and_cost_per_iteration_match_brute_force(tiny_archive, space) -> None:
    """The cheapest plan at least this fast, and the fastest plan at most this costly, as the brute force
    finds them: a bound that the objective's best plans miss must not hide the plans that meet it."""
    site = small_site()
    fastest = min(t for t, _ in space)
    floor = 0.9 * GBS / fastest  # samples/s only the fastest plans reach
    cheapest_fast = min(c for t, c in space if GBS / t >= floor)
    got = search(site, tiny_archive, PlanRequest("tiny-gpt", GBS, objective="cost", max_stages=2,
                                                 constraints=Constraints(min_throughput=floor))).candidates[0].result
    assert got.throughput_samples_per_s >= floor and got.cost_per_iteration == pytest.approx(cheapest_fast, rel=1e-9)
    cheapest = min(c for _, c in space)
    ceiling = 1.1 * cheapest  # only the cheapest plans stay under it
    fastest_cheap = min(t for t, c in space if c <= ceiling)
    got = search(site, tiny_archive, PlanRequest("tiny-gpt", GBS, max_stages=2,
                                                 constraints=Constraints(max_cost_per_iteration=ceiling))).candidates[0].result
    assert got.cost_per_iteration <= ceiling and got.iteration_time_s == pytest.approx(fastest_cheap, rel=1e-9)
