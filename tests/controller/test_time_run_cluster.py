"""``run --objective time`` on the real local Slurm cluster: the controller plans on the queue and re-plans as it changes.

tiny-gpt, global batch 64, at most 2 GPUs: its simulated iteration takes 1.25 s on 2 A100 and 4.64 s on 2 V100
(the tiny archive's profiles), so for 30 steps the A100s finish first if they free within about 100 s. Both
A100 nodes are held whole by blocker jobs with a 1-minute limit:

(a) the blockers end after 40 s: the controller submits the A100 plan, which pends, and keeps it pending
    (waiting finishes first); its job starts no later than the plan's predicted start and the run finishes;
(b) the blockers' limit is raised to 30 minutes (``scontrol update``) while the job pends: the next re-plan
    on the queue finds the idle V100s finish first by far more than --min-gain, cancels the pending job and
    submits the V100 plan, which finishes the run.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sailor_hpc.core.start_times import TEST_ONLY
from tests.controller.scenario import Scenario, build_inputs, kind

STEPS = 30
LIMIT_MIN = 1  # the blockers' time limit, minutes


@pytest.fixture(scope="module")
def inputs(slurm_cluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return build_inputs(tmp_path_factory, tmp_path_factory.mktemp("time-inputs"))


@pytest.fixture()
def scenario(slurm_cluster, inputs, tmp_path: Path) -> Iterator[Scenario]:
    sc = Scenario(slurm_cluster, tmp_path, *inputs, steps=STEPS, extra_args=["--objective", "time"])
    try:
        yield sc
    finally:
        sc.cleanup()


def hold_a100(sc: Scenario, sleep_s: int) -> list[str]:
    """Both A100 nodes held whole for ``sleep_s`` by jobs with a LIMIT_MIN limit (what Slurm plans with)."""
    jobs = [sc.cluster.sbatch(["-p", "a100", "-w", node, "--gres=gpu:a100:4", "-t", str(LIMIT_MIN), "--no-requeue",
                               "-o", "/dev/null", "-J", f"blocker-{node}", "--wrap", f"sleep {sleep_s}"])
            for node in ("a100-1", "a100-2")]
    sc.blockers += jobs
    deadline = time.monotonic() + 60
    while any(sc.cluster.job_states(j) != ["RUNNING"] for j in jobs):
        assert time.monotonic() < deadline, "blockers did not start"
        time.sleep(0.2)
    return jobs


def test_waits_for_the_busy_a100s_when_that_finishes_first(scenario: Scenario) -> None:
    sc = scenario
    held_t = time.time()
    hold_a100(sc, 40)
    sc.start_controller()
    assert sc.wait_exit(timeout=240) == 0, sc.controller_output()
    recs = sc.records()
    chosen = [r for r in recs if r["kind"] == "plan"]
    assert len(chosen) == 1 and chosen[0]["gpus"] == {"a100": 2}, chosen
    plan = chosen[0]
    # Slurm's own answer for the request: the blockers' limit from when they started
    assert plan["start_source"] == TEST_ONLY, plan
    assert 0 < plan["expected_start_s"] <= LIMIT_MIN * 60 + 2, plan
    v100_now = 4.64 * STEPS  # the idle V100 plan's run (its start is now)
    assert plan["expected_finish_s"] < v100_now, plan
    keep = next(r for r in recs if r["kind"] == "decision" and r["trigger"] == "queue")
    assert keep["action"] == "keep", keep  # re-planned while pending: still the best
    running = next(r for r in recs if r["kind"] == "job_running")
    started = running["t"] - plan["queue_read_t"]
    # the blockers end 40 s after they started, before their limit: the real start is earlier than predicted
    assert running["t"] - held_t >= 35 and started <= plan["expected_start_s"] + 5, (started, plan)
    assert [r["kind"] for r in recs].count("submitted") == 1
    assert next(r for r in recs if r["kind"] == "finished")["step"] == STEPS


def test_moves_to_the_idle_v100s_when_the_a100s_stay_busy(scenario: Scenario) -> None:
    sc = scenario
    blockers = hold_a100(sc, 3000)
    sc.start_controller()
    first = sc.wait_for("the A100 plan", kind("plan"))
    assert first["gpus"] == {"a100": 2}, first
    sc.wait_for("a wait judged on the queue", kind("decision", trigger="queue", action="keep"))
    for job in blockers:  # the blockers will hold the A100s much longer than Slurm planned
        sc.slurm("scontrol", "update", f"jobid={job}", "timelimit=30")
    move = sc.wait_for("a move", kind("decision", trigger="queue", action="resize"), timeout=60)
    assert move["attempt"] == 1 and move["candidate"]["gpus"] == {"v100": 2}, move
    assert move["gain"] > 0.10 and move["candidate"]["start_source"] == "idle now", move
    assert sc.wait_exit(timeout=240) == 0, sc.controller_output()
    recs = sc.records()
    gone = next(r for r in recs if r["kind"] == "job_gone" and r.get("attempt") == 1)
    assert gone["state"] == "CANCELLED", gone
    intents = [r for r in recs if r["kind"] == "submit_intent"]
    assert [i["gpus"] for i in intents] == [{"a100": 2}, {"v100": 2}] and intents[1]["reason"] == "queue", intents
    assert all(r["attempt"] == 2 for r in recs if r["kind"] == "job_running")  # the A100 job never ran
    assert all(sc.cluster.job_states(j) == ["RUNNING"] for j in blockers)  # the A100s were still held
    assert next(r for r in recs if r["kind"] == "finished")["step"] == STEPS
