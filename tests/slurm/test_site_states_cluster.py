"""The time objective on the states a real site is in, on the local cluster: a DOWN partition, a pending job
Slurm has not planned (it waits on a dependency), a maintenance reservation ending soon and one starting
soon. Each predicted start is compared with the start Slurm gives the submitted request: the start it
really took. (Slurm's backfill plans starts on a 60-s grid, bf_resolution: a start it plans past a
reservation can read up to a minute later than the one it gives when the reservation ends.)

Blockers run to a few seconds before their time limit, the figure every prediction is made from."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from planner.time_goal import TimeGoal
from sailor_hpc.core.site import load_site
from sailor_hpc.core.start_times import request_shape
from sailor_hpc.slurm.commands import parse_kv_line
from sailor_hpc.slurm.discover import live_availability
from sailor_hpc.slurm.start_estimate import StartEstimator, request_script
from tests.data.tiny_archive import write_tiny_archive

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "site_configs" / "local-lab.toml"
TOLERANCE_S = 10.0


def _info(cluster, job: str) -> dict[str, str]:
    return parse_kv_line(cluster.run(["scontrol", "-o", "show", "job", job]).stdout.strip())


def _epoch(text: str) -> float | None:
    return datetime.fromisoformat(text).timestamp() if text[:2].isdigit() else None


def _started(cluster, job: str, timeout: float) -> float:
    """When ``job`` started running (epoch seconds), waiting for it up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        kv = _info(cluster, job)
        if kv.get("JobState") in ("RUNNING", "COMPLETING", "COMPLETED"):
            start = _epoch(kv.get("StartTime", ""))
            assert start is not None, kv
            return start
        assert time.monotonic() < deadline, f"job {job} did not start: {kv.get('JobState')} {kv.get('Reason')}"
        time.sleep(0.5)


def _block(cluster, args: list[str]) -> str:
    return cluster.sbatch(["-o", "/dev/null", "-J", "state-block", *args])


@pytest.fixture()
def site_state(slurm_cluster) -> Iterator:
    """The cluster, restored afterwards: partitions UP, the tests' reservations deleted, their jobs cancelled."""
    try:
        yield slurm_cluster
    finally:
        for part in ("a100", "v100"):
            slurm_cluster.run(["scontrol", "update", f"PartitionName={part}", "State=UP"])
        for name in ("state-maint", "state-soon"):
            slurm_cluster.run(["scontrol", "delete", f"ReservationName={name}"])
        for name in ("state-block", "state-run"):
            slurm_cluster.run(["scancel", f"--name={name}"])


def test_down_partition_is_left_out_and_an_unplanned_job_is_waited_for(site_state, tmp_path) -> None:
    """V100s DOWN (their nodes idle), both A100 nodes held for a minute, and a job that waits on that one
    (a dependency: Slurm plans no start for it) wants them next. ``plan --objective time`` must leave the
    V100s out with the reason and put the run after the dependent job; Slurm starts it then."""
    cluster = site_state
    cluster.run(["scontrol", "update", "PartitionName=v100", "State=DOWN"])
    hold = _block(cluster, ["-p", "a100", "-N", "2", "--gres=gpu:a100:4", "-t", "1", "--wrap", "sleep 57"])
    _started(cluster, hold, 30)
    # afterany: a hold whose batch script starts late under load runs into its limit (TIMEOUT), which afterok
    # would take for a failure and never start the dependent job
    after = _block(cluster, ["-p", "a100", "-N", "2", "--gres=gpu:a100:4", "-t", "1", "-d", f"afterany:{hold}",
                             "--wrap", "sleep 57"])
    archive = write_tiny_archive(tmp_path / "tiny.h5")
    proc = cluster.run(["sailor-hpc", "plan", "--site", str(LAB), "--profiles", str(archive), "--model", "tiny-gpt",
                        "--gbs", "64", "--dtype", "fp32", "--objective", "time", "--steps", "12", "--top", "3",
                        "--json"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    left = out["queue"]["left_out"]
    assert list(left) == ["v100"] and "DOWN" in left["v100"], left
    assert out["queue"]["unplanned_pending_jobs"] == [after]
    first = out["time"][0]
    assert first["request"].startswith("a100:") and f"pending job {after}" in first["start_reason"], first
    predicted = out["queue"]["taken_at"] + first["expected_start_s"]
    assert first["expected_start_s"] > 90  # behind the held minute and the dependent job's minute

    site = load_site(LAB)
    shape = tuple((p, tuple(g)) for p, g in first["shape"])
    run = cluster.sbatch(["-o", "/dev/null"], request_script(site, shape, int(first["job_time_s"]), "sleep 1",
                                                            name="state-run"))
    on_v100 = cluster.sbatch(["-o", "/dev/null"], request_script(site, request_shape({"v100": [8]}), 60, "true",
                                                                name="state-run"))
    started = _started(cluster, run, 200)
    assert abs(started - predicted) <= TOLERANCE_S, (started - out["queue"]["taken_at"], first)
    kv = _info(cluster, on_v100)  # what the plan left out: the V100 request never started
    assert (kv["JobState"], kv["Reason"]) == ("PENDING", "PartitionDown"), kv
    # what `run` and `--available live` plan on: the DOWN partition's idle nodes are no free GPUs
    live = live_availability(cluster.env)
    assert live["v100"]["state"] == "DOWN" and live["v100"]["gpus_idle"] == 0 and live["v100"]["nodes"] == 2


def test_reservations_are_waited_for_or_fitted_before(site_state) -> None:
    """A maintenance reservation on the A100s ends in a minute; one on the V100s starts in 70 s for a
    minute. An A100 request starts when the first ends; a 1-minute V100 request fits before the second
    and starts now; a 2-minute one would cross into it and starts after it."""
    cluster = site_state
    cluster.run(["scontrol", "create", "reservation", "ReservationName=state-maint", "StartTime=now", "Duration=1",
                 "Nodes=a100-[1-2]", "Users=root", "Flags=MAINT"], check=True)
    cluster.run(["scontrol", "create", "reservation", "ReservationName=state-soon", "StartTime=now+70",
                 "Duration=1", "Nodes=v100-[1-2]", "Users=nobody"], check=True)
    site = load_site(LAB)
    snap = StartEstimator(cluster.env, history=False).site_snapshot(site)
    assert {r.name for r in snap.reservations} >= {"state-maint", "state-soon"}
    assert set(snap.node_gpus["a100"]) == {"a100-1", "a100-2"}  # in maintenance, not left out
    goal = TimeGoal.for_site(site, 10, snap)
    requests = {"a100": (request_shape({"a100": [4, 4]}), 120), "v100 short": (request_shape({"v100": [8]}), 60),
                "v100 long": (request_shape({"v100": [8]}), 120)}
    predicted = {k: goal.model.window(shape, limit).estimate for k, (shape, limit) in requests.items()}
    assert "reservation state-maint" in predicted["a100"].detail
    assert predicted["v100 short"].start_s == 0
    assert predicted["v100 long"].start_s > 120 and "reservation state-soon" in predicted["v100 long"].detail
    jobs = {k: cluster.sbatch(["-o", "/dev/null"], request_script(site, shape, limit, "sleep 1", name="state-run"))
            for k, (shape, limit) in requests.items()}
    for name, timeout in (("v100 short", 30), ("a100", 120), ("v100 long", 120)):
        started = _started(cluster, jobs[name], timeout) - snap.taken_at
        assert abs(started - predicted[name].start_s) <= TOLERANCE_S, (name, started, predicted[name])
