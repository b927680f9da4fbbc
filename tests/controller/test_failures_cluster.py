"""Jobs that fail, and nothing free: bad input stops the run at once; a crash loop backs off and gives up after
--max-restarts; with every GPU taken the controller waits (saying so once) and submits when GPUs free up."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.controller.scenario import Scenario, build_inputs


@pytest.fixture(scope="module")
def inputs(slurm_cluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return build_inputs(tmp_path_factory, tmp_path_factory.mktemp("fail-inputs"))


def _run(cluster, root: Path, inputs: tuple[str, Path], *extra: str) -> tuple[int, list[dict]]:
    sc = Scenario(cluster, root, *inputs, steps=5)
    cmd = sc.command() + list(extra)
    try:
        sc.command = lambda resume=False: cmd  # type: ignore[method-assign]
        sc.start_controller()
        rc = sc.wait_exit(timeout=180)
        return rc, sc.records()
    finally:
        sc.cleanup()


def test_bad_input_gives_up_without_retrying(slurm_cluster, inputs, tmp_path: Path):
    rc, recs = _run(slurm_cluster, tmp_path, inputs, "--train-arg=--seed=abc")
    assert rc == 1
    kinds = [r["kind"] for r in recs]
    assert kinds.count("submitted") == 1 and kinds[-1] == "gave_up", kinds
    assert "invalid int value" in recs[-1]["reason"]


def test_crash_loop_backs_off_and_gives_up_after_max_restarts(slurm_cluster, inputs, tmp_path: Path):
    # an interpreter that is whole on the login node (the pre-queue check finds torch and megatron-core) but cannot
    # start the ranks inside a job (exit 1), as a compute node's broken install: every job fails before its first step
    python = tmp_path / "python-broken-on-compute"
    python.write_text(f'#!/bin/sh\n[ -n "$SLURM_JOB_ID" ] && exit 1\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    rc, recs = _run(slurm_cluster, tmp_path, inputs, "--python", str(python), "--max-restarts", "1")
    assert rc == 1
    assert [r["attempt"] for r in recs if r["kind"] == "failure"] == [1, 2]
    assert [r["seconds"] for r in recs if r["kind"] == "backoff"] == [2.0, 4.0]  # --backoff 2, doubled
    second = next(r for r in recs if r["kind"] == "submit_intent" and r["attempt"] == 2)
    first_backoff = next(r for r in recs if r["kind"] == "backoff")
    assert second["t"] >= first_backoff["until"]  # it waited
    assert recs[-1]["kind"] == "gave_up" and "restarts used" in recs[-1]["reason"]


def test_waits_for_free_gpus_and_says_so_once(slurm_cluster, inputs, tmp_path: Path):
    sc = Scenario(slurm_cluster, tmp_path, *inputs, steps=5)
    try:
        blockers = {node: sc.blocker(node, gpus) for node, gpus in
                    (("a100-1", 4), ("a100-2", 4), ("v100-1", 8), ("v100-2", 8))}
        sc.start_controller()
        sc.wait_for("no plan", lambda r: r["kind"] == "no_plan")
        time.sleep(6 * sc.poll_s)
        assert [r["kind"] for r in sc.records()].count("no_plan") == 1  # journaled once, not every poll
        sc.slurm("scancel", blockers["v100-2"])
        sub = sc.wait_for("a job once GPUs are free", lambda r: r["kind"] == "submit_intent")
        assert sub["gpus"] == {"v100": 2}
    finally:
        sc.cleanup()


def test_sbatch_refusing_backs_off_and_gives_up(slurm_cluster, inputs, tmp_path: Path):
    # more memory than any node has: sbatch itself refuses the job, so no attempt ever gets a job id
    rc, recs = _run(slurm_cluster, tmp_path, inputs, "--extra-sbatch=--mem=99999999", "--max-restarts", "1")
    assert rc == 1
    assert [(r["attempt"], r["state"]) for r in recs if r["kind"] == "job_gone"] == [(1, "NOT_SUBMITTED"),
                                                                                     (2, "NOT_SUBMITTED")]
    assert any(r["kind"] == "error" and "sbatch" in r["message"] for r in recs), recs
    assert [r["seconds"] for r in recs if r["kind"] == "backoff"] == [2.0, 4.0]  # not a resubmission every poll
    assert recs[-1]["kind"] == "gave_up" and "without a new checkpoint" in recs[-1]["reason"]
