"""Jobs that fail: bad input stops the run at once; a crash loop backs off and gives up after --max-restarts."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.resize.scenario import Scenario, build_inputs


@pytest.fixture(scope="module")
def inputs(slurm_cluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return build_inputs(tmp_path_factory.mktemp("fail-inputs"))


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
    # an interpreter that cannot start the ranks (exit 1): every job fails before its first step
    rc, recs = _run(slurm_cluster, tmp_path, inputs, "--python", "/bin/false", "--max-restarts", "1")
    assert rc == 1
    assert [r["attempt"] for r in recs if r["kind"] == "failure"] == [1, 2]
    assert [r["seconds"] for r in recs if r["kind"] == "backoff"] == [2.0, 4.0]  # --backoff 2, doubled
    second = next(r for r in recs if r["kind"] == "submit_intent" and r["attempt"] == 2)
    first_backoff = next(r for r in recs if r["kind"] == "backoff")
    assert second["t"] >= first_backoff["until"]  # it waited
    assert recs[-1]["kind"] == "gave_up" and "restarts used" in recs[-1]["reason"]
