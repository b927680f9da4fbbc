"""The time objective against independent references: a second-by-second scan of the queue for the start
model, a brute force over the throughput search's plans for the ranking, hand arithmetic for restarts."""
from __future__ import annotations

import math
import random

import pytest

from planner import PlanRequest
from planner.search import search
from planner.start_model import StartModel, fits
from planner.time_goal import TimeGoal, grace_s, plan_shape
from planner.time_pareto import time_front
from planner.time_strategy import choose
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.start_times import Hold, QueueSnapshot, StartEstimate, WaitHistory, request_shape
from tests.planner.conftest import small_site

NODES = {"a100": {"a100-0": 2, "a100-1": 2}, "v100": {"v100-0": 2, "v100-1": 2}}


def busy_a100(until_s: float) -> QueueSnapshot:
    """Both A100 nodes held until ``until_s``; the V100s idle."""
    return QueueSnapshot(0.0, NODES, tuple(Hold("a100", n, 2, 0.0, until_s, "b") for n in NODES["a100"]))


def scan_start(snap: QueueSnapshot, shape, need: int, horizon: int) -> int | None:
    """The first whole second from which ``shape`` fits for ``need`` seconds, checked second by second."""
    def free(part: str, t: int) -> dict[str, int]:
        out = dict(snap.node_gpus[part])
        for h in snap.holds:
            if h.partition == part and h.start_s <= t < h.end_s:
                out[h.node] -= h.gpus
        return out

    ok = [all(fits(g, free(p, t)) for p, g in shape) for t in range(horizon + need)]
    return next((t for t in range(horizon) if all(ok[t:t + need])), None)


def test_start_model_matches_a_second_by_second_scan() -> None:
    rng = random.Random(7)
    shapes = [request_shape(d) for d in ({"a100": [2]}, {"a100": [1, 1]}, {"a100": [2, 2]}, {"v100": [1]},
                                          {"a100": [1], "v100": [2, 2]}, {"v100": [2, 1]})]
    checked = 0
    for _ in range(40):
        holds = []
        for _ in range(rng.randint(0, 6)):
            part = rng.choice(["a100", "v100"])
            start = rng.choice([0, rng.randint(0, 120)])
            holds.append(Hold(part, rng.choice(list(NODES[part])), rng.randint(1, 2), start, start + rng.randint(5, 90)))
        snap = QueueSnapshot(0.0, NODES, tuple(holds))
        model = StartModel(snap)
        for shape in shapes:
            for need in (1, 20, 60):
                want = scan_start(snap, shape, need, 400)
                got = model.window(shape, need).estimate.start_s
                assert want is not None and got == want, (holds, shape, need)
                checked += 1
    assert checked == 40 * len(shapes) * 3


@pytest.mark.parametrize("gpus, expect", [({"a100": [3]}, False), ({"a100": [2, 2, 2]}, False), ({"a100": [2, 2]}, True)])
def test_a_request_larger_than_the_nodes_never_starts(gpus, expect) -> None:
    window = StartModel(busy_a100(30)).window(request_shape(gpus), 60)
    assert math.isfinite(window.estimate.start_s) is expect


def test_time_min_starts_in_a_backfill_hole() -> None:
    # an A100 node free for 300 s, then a pending job Slurm has planned takes it for an hour
    snap = QueueSnapshot(0.0, {"a100": {"a100-0": 2}}, (Hold("a100", "a100-0", 2, 300, 3900, "pending"),))
    shape = request_shape({"a100": [2]})
    model = StartModel(snap)
    assert model.window(shape, 3600).estimate.start_s == 3900  # the whole limit fits only after the reservation
    hole = model.window(shape, 3600, 240)
    assert (hole.estimate.start_s, hole.granted_s) == (0, 300)  # --time-min 4 min: now, cut at the reservation


def test_tested_answer_wins_and_history_fills_an_open_end() -> None:
    shape = request_shape({"a100": [2]})
    tested = StartEstimate(42.0, "sbatch --test-only")
    snap = QueueSnapshot(0.0, {"a100": {"a100-0": 2}}, (Hold("a100", "a100-0", 2, 0, math.inf, "no limit"),),
                         tested={(shape, 600): tested}, history=(WaitHistory("a100", 1, 900.0, 12),))
    model = StartModel(snap)
    assert model.window(shape, 600).estimate == tested
    est = model.window(shape, 1200).estimate  # not tested at that limit; the holder has no end: the history
    assert (est.start_s, est.source) == (900.0, "sacct history")
    # a request that fits now keeps "idle now": --test-only answers later for a node planned for a pending job
    idle = QueueSnapshot(0.0, {"a100": {"a100-0": 2}}, tested={(shape, 600): tested})
    assert StartModel(idle).window(shape, 600).estimate.source == "idle now"


def test_restarts_follow_the_time_limit() -> None:
    site = small_site(1, 1, 2)
    goal = TimeGoal.for_site(site, 3600, QueueSnapshot.all_idle(NODES), time_limit_s=600.0, restart_cost_s=60.0)
    o = goal.outlook(request_shape({"v100": [2]}), 1.0, 2)
    per_job = 600 - grace_s(600) - 60  # 480 s of training per job
    assert o.restarts == math.ceil((3600 - per_job) / per_job) == 7
    assert o.finish_s == 3600 + 7 * 60
    assert o.gpu_hours == pytest.approx(2 * (3600 + 7 * 60) / 3600)
    short = goal.outlook(request_shape({"v100": [2]}), 1.0, 2, steps=100)
    assert short.restarts == 0 and short.job_time_s <= 600


def brute_force_finish(snapshot_until: float, steps: int, candidates) -> float:
    """Each plan's finish by hand: it waits for the A100s if it uses any, then trains; no limits on small_site."""
    def finish(c):
        uses_a100 = any(s.partition == "a100" for p in c.plan.pipelines for s in p.stages)
        return (snapshot_until if uses_a100 else 0.0) + steps * c.result.iteration_time_s
    return min(finish(c) for c in candidates)


@pytest.mark.parametrize("steps", [50, 40000])
def test_time_objective_finds_the_soonest_finish(tiny_archive, steps) -> None:
    site = small_site(2, 2, 2)
    busy = 600.0
    goal = TimeGoal.for_site(site, steps, busy_a100(busy))
    timed = search(site, tiny_archive, PlanRequest("tiny-gpt", 64, objective="time", time_goal=goal, dtype="fp32"))
    fastest = search(site, tiny_archive, PlanRequest("tiny-gpt", 64, dtype="fp32"))
    best = timed.candidates[0]
    got = goal.plan_outlook(best.plan, best.result.iteration_time_s).finish_s
    # no plan the throughput search simulated (its whole space, A100s included) finishes sooner
    assert got <= brute_force_finish(busy, steps, fastest.simulated) * (1 + 1e-9)
    assert got == pytest.approx(brute_force_finish(busy, steps, timed.simulated))
    uses = {s.partition for p in best.plan.pipelines for s in p.stages}
    # a short run starts now on the idle V100s; a long one waits for the A100s (the throughput plan's GPUs)
    assert ("a100" in uses) is (steps == 40000)


def test_deadline_and_gpu_hour_budget_are_constraints(tiny_archive) -> None:
    site = small_site(2, 2, 2)
    goal = TimeGoal.for_site(site, 1000, busy_a100(600), deadline_s=10.0)
    with pytest.raises(SailorError) as err:
        search(site, tiny_archive, PlanRequest("tiny-gpt", 64, objective="time", time_goal=goal, dtype="fp32"))
    assert err.value.field == "--deadline"
    goal = TimeGoal.for_site(site, 1000, busy_a100(600), max_gpu_hours=1e-3)
    with pytest.raises(SailorError) as err:
        search(site, tiny_archive, PlanRequest("tiny-gpt", 64, objective="time", time_goal=goal, dtype="fp32"))
    assert err.value.field == "--max-gpu-hours"
    with pytest.raises(SailorError):
        PlanRequest("tiny-gpt", 64, objective="time")


def test_grow_later_against_waiting(tiny_archive) -> None:
    site = small_site(2, 2, 2)
    steps, busy = 3000, 600.0
    goal = TimeGoal.for_site(site, steps, busy_a100(busy), restart_cost_s=60.0)
    result = search(site, tiny_archive, PlanRequest("tiny-gpt", 64, objective="time", time_goal=goal, dtype="fp32"))
    s = choose(result, goal)
    assert s.grow_from is not None and s.grow_to is not None
    assert plan_shape(s.grow_from.plan)[0][0] == "v100" and len(plan_shape(s.grow_from.plan)) == 1
    # by hand: train on the V100 plan until the A100s free, restart once, finish on the fastest plan
    t0, t1 = s.grow_from.result.iteration_time_s, s.grow_to.result.iteration_time_s
    done = int(busy / t0)
    assert s.grow_finish_s == pytest.approx(busy + 60.0 + (steps - done) * t1)
    assert s.chosen == ("grow" if s.grow_finish_s < s.wait.finish_s else "wait")
    assert s.chosen == "grow"  # 600 s on the V100s beat idling them while the A100s are busy
    # the finish / GPU-hours front: exactly the plans no other beats on both, by brute force
    looks = [(c, goal.plan_outlook(c.plan, c.result.iteration_time_s)) for c in result.simulated]
    front = {id(c) for c, _ in time_front(goal, result.simulated)}
    for c, o in looks:
        beaten = any(p.gpu_hours <= o.gpu_hours and p.finish_s <= o.finish_s and
                     (p.gpu_hours, p.finish_s) != (o.gpu_hours, o.finish_s) for _, p in looks)
        tied_earlier = any(p.gpu_hours == o.gpu_hours and p.finish_s == o.finish_s and id(d) in front
                           for d, p in looks if d is not c)
        assert (id(c) in front) is (not beaten and not tied_earlier)


def test_sorted_fit_is_first_fit_node_by_node() -> None:
    """The start model's fit test (each demand against the node of its rank by free GPUs) equals first-fit
    done node by node, on random demands and nodes (orders included)."""
    def first_fit(demands: tuple[int, ...], free: dict[str, int]) -> bool:
        slots = sorted(free.values(), reverse=True)
        for need in demands:
            for i, have in enumerate(slots):
                if have >= need:
                    slots[i] = -1
                    break
            else:
                return False
        return True

    rng = random.Random(7)
    for _ in range(5000):
        free = {f"n{i}": rng.randint(0, 8) for i in range(rng.randint(0, 6))}
        demands = tuple(rng.randint(1, 8) for _ in range(rng.randint(1, 6)))
        assert fits(demands, free) == first_fit(demands, free), (demands, free)
