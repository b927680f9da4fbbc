"""The site's states in the time objective, against independent references: a second-by-second scheduler
for the pending jobs Slurm has not planned and for reservations, the search itself for what is left out,
and ``json`` for the output. Real-cluster checks of the same states: tests/slurm/test_site_states_cluster.py."""
from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest

from planner import PlanRequest
from planner.on_queue import QueueState, plan_on_state, startable
from planner.search import search
from planner.start_model import StartModel
from planner.time_goal import TimeGoal, plan_shape
from planner.time_queue import TimeTerms
from sailor_hpc.cli.time_planning import plan_time_json, time_json
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.start_times import (
    SITE_STATE,
    TEST_ONLY,
    Hold,
    PartitionState,
    PendingJob,
    QueueSnapshot,
    Reservation,
    StartEstimate,
    request_shape,
)
from tests.planner.conftest import small_site
from tests.planner.test_time_objective import NODES, busy_a100, scan_start


def reference_schedule(snap: QueueSnapshot, horizon: int) -> list[Hold]:
    """The pending jobs Slurm has not planned, started second by second: highest priority first, each at the
    first whole second after it is eligible from which enough nodes keep its GPUs free for its whole limit
    (fullest nodes first), after every job ahead of it is placed; reservations are taken like jobs."""
    holds = list(snap.holds)
    for r in snap.reservations:
        holds += [Hold(p, n, snap.node_gpus[p][n], max(0.0, r.start_s), r.end_s, f"reservation {r.name}")
                  for p in snap.node_gpus for n in r.nodes if n in snap.node_gpus[p]]

    def free(part: str, node: str, t: int) -> int:
        return snap.node_gpus[part][node] - sum(h.gpus for h in holds if h.partition == part and h.node == node
                                                and h.start_s <= t < h.end_s)

    for job in sorted(snap.unplanned, key=lambda j: (-j.priority, int(j.job))):
        begin = job.eligible_s
        for dep in job.after_end:
            begin = max(begin, max(h.end_s for h in holds if h.job == dep))
        placed = None
        for t in range(math.ceil(begin), horizon):
            for part in job.partitions:
                ok = [n for n in snap.node_gpus[part]
                      if all(free(part, n, s) >= job.gpus_per_node for s in range(t, t + int(job.limit_s)))]
                if len(ok) >= job.nodes and (placed is None or t < placed[0]):
                    placed = (t, part, sorted(ok, key=lambda n: (free(part, n, t), n))[:job.nodes])
            if placed is not None:
                break
        assert placed is not None, job
        t, part, nodes = placed
        holds += [Hold(part, n, job.gpus_per_node, t, t + job.limit_s, job.job) for n in nodes]
    return holds


def test_unplanned_jobs_are_placed_as_a_second_by_second_scheduler_would() -> None:
    rng = random.Random(11)
    shapes = [request_shape(d) for d in ({"a100": [2]}, {"a100": [1, 1]}, {"v100": [2, 2]},
                                          {"a100": [1], "v100": [2]})]
    checked = 0
    for _ in range(30):
        holds = tuple(Hold(p, n, rng.randint(1, 2), 0.0, float(rng.randint(5, 60)), f"r{i}")
                      for i, (p, n) in enumerate(rng.sample([(p, n) for p in NODES for n in NODES[p]], rng.randint(0, 3))))
        jobs = []
        for i in range(rng.randint(1, 4)):
            dep = rng.choice([None, *(h.job for h in holds)])
            jobs.append(PendingJob(str(100 + i), tuple(rng.sample(["a100", "v100"], rng.randint(1, 2))),
                                   rng.randint(1, 2), rng.randint(1, 2), float(rng.randint(5, 40)), rng.randint(1, 9),
                                   float(rng.choice([0, rng.randint(1, 30)])), (), (dep,) if dep else ()))
        res = () if rng.random() < 0.5 else (Reservation("m", float(rng.randint(0, 30)), float(rng.randint(31, 80)),
                                                         (rng.choice(list(NODES["a100"])),)),)
        snap = QueueSnapshot(0.0, NODES, holds, unplanned=tuple(jobs), reservations=res)
        model = StartModel(snap)
        reference = replace(snap, holds=tuple(reference_schedule(snap, 400)), unplanned=(), reservations=())
        for shape in shapes:
            for need in (1, 15, 45):
                want = scan_start(reference, shape, need, 500)
                got = model.window(shape, need).estimate.start_s
                assert want is not None and got == want, (holds, jobs, res, shape, need)
                checked += 1
    assert checked == 30 * len(shapes) * 3


def test_a_reservation_is_waited_for_or_fitted_before() -> None:
    snap = QueueSnapshot(0.0, NODES, reservations=(Reservation("maint", 150.0, 750.0, tuple(NODES["a100"])),))
    model = StartModel(snap)
    a100 = request_shape({"a100": [2, 2]})
    crossing = model.window(a100, 161).estimate  # would run into the reservation: after it
    assert crossing.start_s == 750.0 and "reservation maint" in crossing.detail
    assert any("reservation maint" in c for c in crossing.considered)
    assert model.window(a100, 120).estimate.start_s == 0.0  # fits before it
    # the job asks for it (--reservation) and may use it: it runs in it, not before and not elsewhere
    ours = StartModel(replace(snap, reservations=(replace(snap.reservations[0], ours=True),)))
    assert ours.window(a100, 300).estimate.start_s == 150.0
    assert not math.isfinite(ours.window(request_shape({"v100": [1]}), 60).estimate.start_s)


def test_a_reservation_without_end_is_never_and_says_so() -> None:
    snap = QueueSnapshot(0.0, NODES, reservations=(Reservation("forever", 0.0, math.inf, ("a100-0",)),),
                         tested={(request_shape({"a100": [2, 2]}), 60): StartEstimate(5.0, TEST_ONLY)})
    est = StartModel(snap).window(request_shape({"a100": [2, 2]}), 60).estimate
    assert (est.start_s, est.source) == (math.inf, SITE_STATE) and "forever" in est.detail
    assert StartModel(snap).window(request_shape({"a100": [2]}), 60).estimate.start_s == 0.0


def test_a_partition_that_starts_no_job_is_never_even_when_slurm_answers_a_start() -> None:
    shape = request_shape({"v100": [2]})
    for state in ("DOWN", "DRAIN", "INACTIVE"):
        snap = QueueSnapshot(0.0, NODES, partitions={"v100": PartitionState("v100", state)},
                             tested={(shape, 60): StartEstimate(0.0, TEST_ONLY)})
        est = StartModel(snap).window(shape, 60).estimate
        assert (est.start_s, est.source) == (math.inf, SITE_STATE) and state in est.detail
    limits = QueueSnapshot(0.0, NODES, partitions={"a100": PartitionState("a100", "UP", 600.0, 1)})
    est = StartModel(limits).window(request_shape({"a100": [2, 2]}), 60).estimate
    assert not math.isfinite(est.start_s) and "MaxNodes 1" in est.detail
    goal = TimeGoal.for_site(small_site(2, 2, 2), 10, limits)
    assert goal.limit_s(request_shape({"a100": [2]})) == 600.0  # Slurm's MaxTime below the site file's none
    unknown = QueueSnapshot(0.0, {"a100": NODES["a100"], "v100": {}}, unknown_partitions=("v100",))
    assert "no partition v100" in StartModel(unknown).window(shape, 60).estimate.detail


def test_slurms_answer_is_not_taken_where_unplanned_jobs_move_the_start() -> None:
    """``--test-only`` does not see a job pending on a dependency: where that job takes the GPUs first, the
    timeline's later start stands; where it does not touch the request, Slurm's answer does."""
    holds = tuple(Hold("a100", n, 2, 0.0, 60.0, "1") for n in NODES["a100"])
    dep = PendingJob("2", ("a100",), 2, 2, 120.0, 5, after_end=("1",))
    a100, v100 = request_shape({"a100": [2]}), request_shape({"v100": [2]})
    tested = {(a100, 60): StartEstimate(59.0, TEST_ONLY), (v100, 60): StartEstimate(3.0, TEST_ONLY)}
    snap = QueueSnapshot(0.0, NODES, holds, tested=tested, unplanned=(dep,))
    model = StartModel(snap)
    est = model.window(a100, 60).estimate
    assert est.start_s == 180.0 and "pending job 2" in est.detail
    assert model.window(v100, 60).estimate.start_s == 0.0  # idle now: backfill starts it at once
    alone = StartModel(replace(snap, unplanned=()))
    assert alone.window(a100, 60).estimate == replace(tested[(a100, 60)], detail="when job 1 ends",
                                                      considered=())


def test_a_down_partition_is_left_out_of_the_plan_with_the_reason(tiny_archive) -> None:
    site = small_site(2, 2, 2)
    snap = replace(busy_a100(120), partitions={"v100": PartitionState("v100", "DOWN"),
                                               "a100": PartitionState("a100", "UP")})

    def request_for(available, goal):
        return PlanRequest("tiny-gpt", 64, objective="time", time_goal=goal, dtype="fp32", available=available)
    result = plan_on_state(site, tiny_archive, QueueState({}, snap), request_for, TimeTerms(50), top_k=3)
    assert set(result.left_out) == {"v100"} and "DOWN" in result.left_out["v100"]
    assert all({p for p, _ in plan_shape(c.plan)} == {"a100"} for c in result.candidates)
    out = json.loads(json.dumps(time_json(result, result.candidates[:3]), allow_nan=False))
    assert out["queue"]["left_out"] == result.left_out
    assert out["time"][0]["start_considered"] == ["partition a100 UP"]
    both_down = replace(snap, partitions={p: PartitionState(p, "DOWN") for p in NODES})
    goal = TimeGoal.for_site(site, 50, both_down)
    with pytest.raises(SailorError) as err:
        startable(site, goal, {})
    assert "a100 is DOWN" in err.value.message and "v100 is DOWN" in err.value.message

    class Waits(SailorError):  # how the controller names "no plan now": it waits instead of stopping
        pass
    with pytest.raises(Waits):
        plan_on_state(site, tiny_archive, QueueState({}, both_down), request_for, TimeTerms(50), top_k=3,
                      no_plan=lambda exc: Waits(exc.message))


def test_a_plan_that_can_never_start_has_null_times_with_the_reason(tiny_archive) -> None:
    site = small_site(2, 2, 2)
    plans = search(site, tiny_archive, PlanRequest("tiny-gpt", 64, dtype="fp32")).candidates
    down = QueueSnapshot(0.0, NODES, partitions={p: PartitionState(p, "DOWN") for p in NODES})
    row = plan_time_json(TimeGoal.for_site(site, 50, down), plans[0])
    assert row["expected_start_s"] is None and row["expected_finish_s"] is None and "DOWN" in row["start_reason"]
    json.dumps(row, allow_nan=False)


def test_an_unmeetable_deadline_names_the_soonest_finish_of_any_plan(tiny_archive) -> None:
    site = small_site(2, 2, 2)
    free = TimeGoal.for_site(site, 2000, busy_a100(300))
    best = search(site, tiny_archive, PlanRequest("tiny-gpt", 64, objective="time", time_goal=free, dtype="fp32"))
    soonest = min(free.plan_outlook(c.plan, c.result.iteration_time_s).finish_s for c in best.simulated)
    with pytest.raises(SailorError) as err:
        search(site, tiny_archive, PlanRequest("tiny-gpt", 64, objective="time", dtype="fp32",
                                               time_goal=replace(free, deadline_s=10.0)))
    s = round(soonest)
    assert f"soonest expected finish is {s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" in err.value.message

