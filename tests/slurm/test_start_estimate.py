"""Start estimates on the real local cluster, made busy by blocker jobs holding the A100 partition.

The A100s are held by jobs with a 2-minute limit (they would end a few seconds before it). The time objective
must then start a short run now on the idle V100s, while the throughput plan (8 A100s) waits; the plan
the time objective picks must actually finish first, and its predicted start is compared with the start
Slurm gave the submitted job.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from planner.time_goal import TimeGoal, plan_shape
from sailor_hpc.core.errors import SlurmUnavailable
from sailor_hpc.core.plan import plan_from_dict
from sailor_hpc.core.site import load_site
from sailor_hpc.core.start_times import IDLE_NOW, TEST_ONLY, request_shape
from sailor_hpc.slurm.commands import parse_kv_line
from sailor_hpc.slurm.start_estimate import Budget, SlurmBudgetSpent, StartEstimator, request_script
from tests.data.tiny_archive import write_tiny_archive

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "site_configs" / "local-lab.toml"
HOLD_S = 115  # the blockers' run; their limit is 2 minutes (they are cancelled once a test is done)


@pytest.fixture()
def busy_a100(slurm_cluster) -> Iterator[list[str]]:
    """Both A100 nodes held whole for HOLD_S seconds by jobs with a 2-minute limit."""
    jobs = [slurm_cluster.sbatch(["-p", "a100", "-w", node, "--gres=gpu:a100:4", "-t", "2", "-o", "/dev/null",
                                  "-J", f"hold-{node}", "--wrap", f"sleep {HOLD_S}"]) for node in ("a100-1", "a100-2")]
    try:
        deadline = time.monotonic() + 30
        while any(slurm_cluster.job_states(j) != ["RUNNING"] for j in jobs):
            assert time.monotonic() < deadline, "blockers did not start"
            time.sleep(0.2)
        yield jobs
    finally:
        for j in jobs:
            slurm_cluster.run(["scancel", j])
        for j in jobs:
            slurm_cluster.wait_job(j, timeout=60)


def job_times(cluster, job: str) -> dict[str, float | None]:
    kv = parse_kv_line(cluster.run(["scontrol", "-o", "show", "job", job]).stdout.strip())

    def epoch(key: str) -> float | None:
        v = kv.get(key, "")
        return datetime.fromisoformat(v).timestamp() if v[:2].isdigit() else None
    return {"submit": epoch("SubmitTime"), "start": epoch("StartTime"), "state": kv.get("JobState")}  # type: ignore[dict-item]


def test_snapshot_sees_the_holds_and_slurm_answers(slurm_cluster, busy_a100) -> None:
    site = load_site(LAB)
    est = StartEstimator(slurm_cluster.env)
    snap = est.snapshot(["a100", "v100"])
    held = {(h.node, h.gpus) for h in snap.holds if h.job in busy_a100}
    assert held == {("a100-1", 4), ("a100-2", 4)}
    ends = [h.end_s for h in snap.holds if h.job in busy_a100]
    assert all(90 < e <= 121 for e in ends), ends  # their 2-minute limit, from now
    assert snap.node_gpus["v100"] == {"v100-1": 8, "v100-2": 8}
    a100, v100 = request_shape({"a100": [2]}), request_shape({"v100": [4, 4]})
    snap = est.test_only(site, snap, [(a100, 300), (v100, 300)])
    assert snap.tested[(v100, 300)].start_s <= 2 and snap.tested[(v100, 300)].source == TEST_ONLY
    assert snap.tested[(a100, 300)].start_s >= min(ends) - 5  # Slurm too waits for the blockers' limit
    assert snap.slurm_seconds <= 5.0


def _plan(cluster, archive: Path, objective: str) -> dict:
    proc = cluster.run(["sailor-hpc", "plan", "--site", str(LAB), "--profiles", str(archive), "--model", "tiny-gpt",
                        "--gbs", "64", "--dtype", "fp32", "--objective", objective, "--steps", "12", "--top", "3",
                        "--json"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_time_plan_finishes_first_on_a_busy_cluster(slurm_cluster, busy_a100, tmp_path) -> None:
    archive = write_tiny_archive(tmp_path / "tiny.h5")
    site = load_site(LAB)
    timed = _plan(slurm_cluster, archive, "time")
    fastest = _plan(slurm_cluster, archive, "throughput")["plans"][0]
    t_plan = plan_from_dict(timed["plans"][0]["plan"])
    f_plan = plan_from_dict(fastest["plan"])
    assert {p for p, _ in plan_shape(t_plan)} == {"v100"}, timed["time"][0]  # the A100s are busy: start now
    assert "a100" in {p for p, _ in plan_shape(f_plan)}
    assert timed["time"][0]["expected_start_s"] <= 2 and timed["time"][0]["start_source"] in (IDLE_NOW, TEST_ONLY)
    # the throughput plan, under the same queue model: it waits for the blockers' limit
    goal = TimeGoal.for_site(site, 12, StartEstimator(slurm_cluster.env).snapshot(["a100", "v100"]))
    f_look = goal.plan_outlook(f_plan, fastest["iteration_time_s"])
    assert f_look.finish_s > timed["time"][0]["expected_finish_s"]

    # submit both requests; each job runs for its plan's predicted run time
    jobs = {}
    for name, plan, run_s in (("time", t_plan, timed["time"][0]["run_s"]), ("throughput", f_plan, f_look.run_s)):
        script = request_script(site, plan_shape(plan), 120, body=f"sleep {run_s:.1f}", name=f"ttr-{name}")
        jobs[name] = slurm_cluster.sbatch(["-o", "/dev/null"], script)
    try:
        slurm_cluster.wait_job(jobs["time"], timeout=120)
        done = time.time()
        t = job_times(slurm_cluster, jobs["time"])
        f_states = slurm_cluster.job_states(jobs["throughput"])
        # the time plan is done while the throughput plan still waits for the A100s: it finishes later
        assert f_states and all(s == "PENDING" for s in f_states), f_states
        assert any(slurm_cluster.job_states(b) == ["RUNNING"] for b in busy_a100)
        waited = t["start"] - t["submit"]  # predicted: 0 (idle now)
        assert 0 <= waited <= 3, t
        assert done - t["submit"] >= timed["time"][0]["run_s"]
    finally:
        for j in jobs.values():
            slurm_cluster.run(["scancel", j])


def test_a_backfill_hole_is_planned_and_taken(slurm_cluster, tmp_path) -> None:
    """a100-1 held for 3 minutes, a pending job wants both A100 nodes after it: a100-2 is idle until then
    (Slurm marks it PLANNED). The time objective puts a short run in that hole, and Slurm starts it now."""
    from planner import PlanRequest
    from planner.search import search
    from sailor_hpc.core.archive import EMBEDDED_ARCHIVE, read_archive

    cluster = slurm_cluster
    # 3 minutes: the hole outlasts a search slowed down by a loaded machine (cancelled at the end)
    hold = cluster.sbatch(["-p", "a100", "-w", "a100-1", "--gres=gpu:a100:4", "-t", "3", "-o", "/dev/null",
                           "-J", "hole-hold", "--wrap", "sleep 170"])
    jobs = [hold]
    try:
        deadline = time.monotonic() + 30
        while cluster.job_states(hold) != ["RUNNING"]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        wide = cluster.sbatch(["-p", "a100", "-N", "2", "--gres=gpu:a100:4", "-t", "1", "-o", "/dev/null",
                               "-J", "hole-wide", "--wrap", "sleep 5"])
        jobs.append(wide)
        while "SchedNodeList=a100" not in cluster.run(["scontrol", "-o", "show", "job", wide]).stdout:
            assert time.monotonic() < deadline, "the backfill pass did not plan the wide job"
            time.sleep(0.3)
        site = load_site(LAB)
        snap = StartEstimator(cluster.env).snapshot(["a100", "v100"])
        assert set(snap.node_gpus["a100"]) == {"a100-1", "a100-2"}  # a100-2 is PLANNED, yet free until then
        wide_holds = [h for h in snap.holds if h.job == wide]
        assert {h.node for h in wide_holds} == {"a100-1", "a100-2"} and min(h.start_s for h in wide_holds) > 120
        goal = TimeGoal.for_site(site, 60, snap, restart_cost_s=5.0)
        archive = read_archive(write_tiny_archive(tmp_path / "tiny.h5"), EMBEDDED_ARCHIVE)
        best = search(site, archive, PlanRequest("tiny-gpt", 64, objective="time", time_goal=goal, dtype="fp32")).candidates[0]
        look = goal.plan_outlook(best.plan, best.result.iteration_time_s)
        assert plan_shape(best.plan) == request_shape({"a100": [4]}) and look.start.start_s == 0, look
        assert look.job_time_s <= min(h.start_s for h in wide_holds)  # it fits the hole
        job = cluster.sbatch(["-o", "/dev/null"], request_script(site, plan_shape(best.plan), int(look.job_time_s),
                                                                body="sleep 2", name="hole-run"))
        jobs.append(job)
        cluster.wait_job(job, timeout=60)
        t = job_times(cluster, job)
        assert t["start"] - t["submit"] <= 3, t  # backfilled at once, as predicted
        assert cluster.job_states(wide) == ["PENDING"]  # and the wide job was not delayed past its plan
    finally:
        for j in jobs:
            cluster.run(["scancel", j])


def test_a_spent_budget_asks_slurm_nothing_more_and_says_so(slurm_cluster) -> None:
    """Once the plan's seconds of Slurm calls are spent, no Slurm command runs: each request keeps the queue's
    estimate and the snapshot's notes count what was left unasked; the error is a Slurm-unavailable one
    (exit 3, try again), never bad input."""
    site = load_site(LAB)
    est = StartEstimator(slurm_cluster.env, history=False)
    snap = est.snapshot(["a100", "v100"])
    est.budget.used = est.budget.total
    shapes = [(request_shape({"a100": [4, 4]}), 600), (request_shape({"v100": [4]}), 600)]
    got = est.test_only(site, snap, shapes)
    assert got.tested == {} and got.notes[-1] == "2 request(s) not tested: Slurm-call budget spent"
    with pytest.raises(SlurmBudgetSpent) as err:
        Budget(0.0).run(["sinfo"], slurm_cluster.env)
    assert isinstance(err.value, SlurmUnavailable) and err.value.exit_code == 3
