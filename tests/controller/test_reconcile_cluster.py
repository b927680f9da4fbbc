"""A controller killed between ``sbatch`` and journaling the job id: the resumed one finds the job by name.

The journal ends with the intent to submit attempt 1 (as a controller killed right after ``sbatch``
leaves it); the job exists in Slurm under the attempt's name. ``reconcile`` must adopt it (no second
submission) and cancel any other job carrying the run's name (never two jobs writing checkpoints).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from sailor_hpc.controller import Controller, RunDir
from sailor_hpc.controller.state import job_name
from tests.controller.scenario import started_run, wire


@pytest.fixture()
def run_dir(tmp_path: Path) -> RunDir:
    return started_run(tmp_path, steps=10)[0]


def _held_job(cluster, name: str, log: Path) -> str:
    return cluster.sbatch(["-J", name, "--hold", "-p", "v100", "--gres=gpu:v100:1", "-o", str(log), "--wrap", "sleep 300"])


def test_resume_adopts_the_job_submitted_before_the_kill(slurm_cluster, run_dir: RunDir, tmp_path: Path):
    run_id = run_dir.spec().run_id
    job = _held_job(slurm_cluster, job_name(run_id, 1), tmp_path / "job.out")
    stray = _held_job(slurm_cluster, job_name(run_id, 7), tmp_path / "stray.out")
    other = _held_job(slurm_cluster, "someone-elses-job", tmp_path / "other.out")
    try:
        ctl = Controller(run_dir, env=slurm_cluster.env)
        with run_dir.lock():
            ctl.ctx.begin()
            ctl.attempts.reconcile()
        recs = wire(run_dir.records())
        adopted = [r for r in recs if r["kind"] == "adopted"]
        assert [(r["attempt"], r["job_id"]) for r in adopted] == [(1, job)]
        assert adopted[0]["log"] == str(tmp_path / "job.out")
        assert [r["job_id"] for r in recs if r["kind"] == "cancel"] == [stray]
        assert ctl.state.current.job_id == job and not [r for r in recs if r["kind"] == "submitted"]
        assert slurm_cluster.job_states(stray) == ["CANCELLED"]
        assert slurm_cluster.job_states(job) == ["PENDING"] and slurm_cluster.job_states(other) == ["PENDING"]
    finally:
        for j in (job, stray, other):
            slurm_cluster.run(["scancel", j])


def test_an_intent_without_a_job_is_closed_not_adopted(slurm_cluster, run_dir: RunDir):
    ctl = Controller(run_dir, env=slurm_cluster.env)
    with run_dir.lock():
        ctl.ctx.begin()
        ctl.attempts.reconcile()
    gone = [r for r in wire(run_dir.records()) if r["kind"] == "job_gone"]
    assert [(r["attempt"], r["state"]) for r in gone] == [(1, "NOT_SUBMITTED")]
    assert ctl.state.current is None  # the next loop round plans and submits attempt 2
