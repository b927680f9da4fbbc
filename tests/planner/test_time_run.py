"""``run --objective time``: the controller's re-plan on the free GPUs ranks plans by expected finish,
restarts at the run's time limit included, against a brute force over the throughput search's plans."""
from __future__ import annotations

from pathlib import Path

import pytest

from planner import PlanRequest
from planner.search import search
from planner.time_goal import TimeGoal
from planner.time_queue import TimeTerms, queue_goal
from sailor_hpc.controller.planning import plan_on
from sailor_hpc.controller.spec import RunSpec
from sailor_hpc.core.checkpoint import publish, start_tmp, write_file
from sailor_hpc.core.start_times import QueueSnapshot
from tests.planner.conftest import small_site


def free_now_goal(site, steps: int, free, time_limit: str | None) -> TimeGoal:
    """The goal on the GPUs free now: every one idle, each plan starting now."""
    return queue_goal(site, TimeTerms(steps, time_limit=time_limit, restart_cost_s=60.0), QueueSnapshot.all_idle(free))


def spec(objective: str, steps: int, time_limit: str | None, save: str = "/s") -> RunSpec:
    return RunSpec.of(run_id="t", site="small.toml", model="tiny-gpt", objective=objective, data="/d", save=save,
                   steps=steps, gbs=64, dtype="fp32", time_limit=time_limit, restart_cost_s=60.0)


@pytest.mark.parametrize("steps, limit", [(200, None), (20000, "00:10:00")])
def test_controller_plans_the_soonest_finish_on_free_gpus(tiny_archive, steps, limit) -> None:
    site = small_site(2, 2, 2)
    free = {"a100": {"a100-0": 2, "a100-1": 2}, "v100": {"v100-0": 2}}  # one V100 node is busy
    planned = plan_on(spec("time", steps, limit), site, tiny_archive, free)
    goal = free_now_goal(site, steps, free, limit)
    got = goal.plan_outlook(planned.plan, planned.iteration_s)
    assert got.start.start_s == 0  # the controller plans on what is free now
    pool = search(site, tiny_archive, PlanRequest("tiny-gpt", 64, dtype="fp32", available={"a100": 4, "v100": 2})).simulated
    best = min(goal.plan_outlook(c.plan, c.result.iteration_time_s).finish_s for c in pool)
    assert got.finish_s <= best * (1 + 1e-9)
    if limit is not None:  # 20000 steps outlast a 10-minute limit: the finish counts each restart
        assert got.restarts > 0 and got.finish_s == pytest.approx(got.run_s + got.restarts * 60.0)


def test_a_resumed_run_plans_for_the_steps_it_has_left(tiny_archive, tmp_path: Path, monkeypatch) -> None:
    """A run of 20000 steps that has checkpointed step 19900 has 100 left: its re-plan weighs the finish of
    those 100 (no restart within a 10-minute limit), as a fresh 100-step run's brute force does."""
    tmp = start_tmp(tmp_path, 19900)
    entry = write_file(tmp / "rank0.bin", b"x" * 16)
    publish(tmp, {"step": 19900, "consumed_samples": 19900 * 64, "files": {"rank0.bin": entry},
                  "params": {"w": {"file": "rank0.bin", "shape": [4]}}})
    site = small_site(2, 2, 2)
    free = {"a100": {"a100-0": 2, "a100-1": 2}, "v100": {"v100-0": 2}}
    asked: list[int] = []  # the steps each goal the controller builds is for (the real goal is built)

    def recording_goal(site, terms, snapshot):
        asked.append(terms.steps)
        return queue_goal(site, terms, snapshot)
    monkeypatch.setattr("planner.on_queue.queue_goal", recording_goal)
    planned = plan_on(spec("time", 20000, "00:10:00", save=str(tmp_path)), site, tiny_archive, free)
    assert asked and set(asked) == {100}
    left = free_now_goal(site, 100, free, "00:10:00")
    got = left.plan_outlook(planned.plan, planned.iteration_s)
    pool = search(site, tiny_archive, PlanRequest("tiny-gpt", 64, dtype="fp32", available={"a100": 4, "v100": 2})).simulated
    assert got.restarts == 0
    assert got.finish_s <= min(left.plan_outlook(c.plan, c.result.iteration_time_s).finish_s for c in pool) * (1 + 1e-9)
