"""Submission records are per cluster: job ids are (both clusters' first job is 1), so a record is found by
the id *and* the SLURM_CONF that reached the job's cluster."""
from __future__ import annotations

import json
from pathlib import Path

from sailor_hpc.slurm.submit import JobRecord, load_record, record_job


def _rec(conf: str, log: str) -> JobRecord:
    return JobRecord(job_id="1", name="n", script="s", log=log, submitted="t", slurm_conf=conf)


def test_same_job_id_on_two_clusters_keeps_two_records(tmp_path: Path) -> None:
    envs = {c: {"SAILOR_HPC_STATE_DIR": str(tmp_path), "SLURM_CONF": f"/{c}/slurm.conf"} for c in ("lab", "lab2")}
    for c, env in envs.items():
        record_job(_rec(env["SLURM_CONF"], f"/logs/{c}.out"), env)
    assert {c: load_record("1", env).log for c, env in envs.items()} == {  # type: ignore[union-attr]
        "lab": "/logs/lab.out", "lab2": "/logs/lab2.out"}
    assert load_record("2", envs["lab"]) is None


def test_a_record_written_before_records_were_per_cluster_is_still_found(tmp_path: Path) -> None:
    (tmp_path / "7.json").write_text(json.dumps({"job_id": "7", "log": "/old.out"}))
    rec = load_record("7", {"SAILOR_HPC_STATE_DIR": str(tmp_path), "SLURM_CONF": "/x"})
    assert rec is not None and rec.log == "/old.out" and rec.slurm_conf == ""
