"""Quiet by default, and a status that names what the job log says, on the real local cluster, in one story:

a run trains and is stopped (every rank checkpoints); its newest checkpoint is then truncated (a full disk, say);
``run --resume`` goes on. The resumed job passes over the corrupt checkpoint and loads the one before:

- the journal has the runtime's ``checkpoint_skipped`` as a ``checkpoint_passed_over`` record, and
  ``run status`` says "checkpoint step N passed over: <why>";
- ``sailor-hpc logs JOB`` shows rank 0's lines for a person (steps, losses, the passed-over warning, the load,
  the saves), no JSON; ``--json`` every rank's events; ``--rank 1`` rank 1's lines (no step lines: rank 0 logs
  them); a library warning every rank would print is in the job's log once.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from sailor_hpc.core.checkpoint import latest_complete, read_manifest, step_dir
from tests.controller.scenario import Scenario, build_inputs, kind

pytestmark = pytest.mark.slurm

STEPS = 100
MCORE_WARNING = "full scope is deprecated"  # megatron-core's UserWarning, printed by every rank that builds a model


def _cli(sc: Scenario, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sailor-hpc", *args], cwd=sc.cluster.shared, env=sc.env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def story(slurm_cluster, tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp("quiet-logs")
    data, archive = build_inputs(tmp_path_factory, root)
    sc = Scenario(slurm_cluster, root, data, archive, steps=STEPS, save_interval=5)
    out: dict[str, Any] = {"sc": sc}
    try:
        sc.start_controller()
        sc.wait_for("a checkpoint past step 5", lambda r: r["kind"] == "checkpoint" and r["step"] > 5, timeout=240)
        assert _cli(sc, "run", "stop", str(sc.run_dir)).returncode == 0
        assert sc.wait_exit(timeout=180) == 0, sc.controller_output()
        newest = latest_complete(sc.save)
        assert newest is not None
        out["stopped_at"] = read_manifest(newest)["step"]
        out["layer"] = layer = sorted(newest.glob("layer_*.pt"))[-1]
        layer.write_bytes(layer.read_bytes()[:64])
        sc.start_controller(resume=True)
        sc.wait_for("the resumed run's job", kind("submit_intent", reason="run_resumed"), timeout=120)
        assert sc.wait_exit(timeout=400) == 0, sc.controller_output()
        out["records"] = sc.records()
        out["status"] = _cli(sc, "run", "status", str(sc.run_dir), "--no-events")
        job = [r for r in out["records"] if r["kind"] == "submitted"][-1]
        out["job"], out["raw"] = job["job_id"], Path(job["log"]).read_text()
        out["logs"] = _cli(sc, "logs", job["job_id"])
        out["json"] = _cli(sc, "logs", job["job_id"], "--json")
        out["rank1"] = _cli(sc, "logs", job["job_id"], "--rank", "1")
    finally:
        sc.cleanup()
    return out


def test_a_checkpoint_passed_over_is_journaled_and_in_the_status(story):
    stopped_at, layer = story["stopped_at"], story["layer"]
    (passed,) = [r for r in story["records"] if r["kind"] == "checkpoint_passed_over"]
    resumed = [r for r in story["records"] if r["kind"] == "submitted"][-1]
    assert passed["attempt"] == resumed["attempt"] and passed["step"] == stopped_at, passed
    assert passed["path"] == str(step_dir(story["sc"].save, stopped_at))
    assert passed["reason"].startswith(f"{layer.name}: size 64 != "), passed
    assert passed["using"] is not None and Path(passed["using"]).name < f"step_{stopped_at:08d}"
    status = story["status"]
    assert status.returncode == 0, status.stderr
    assert f"checkpoint step {stopped_at} passed over: {layer.name}: size 64 != " in status.stdout, status.stdout


def test_logs_show_rank_0s_lines_for_a_person(story):
    logs = story["logs"]
    assert logs.returncode == 0 and logs.stderr == "", logs.stderr
    lines = logs.stdout.splitlines()
    assert not any(line.startswith(("{", "[rank")) for line in lines), logs.stdout[:2000]
    steps = [line for line in lines if line.startswith("step ") and "| loss " in line and " tok/s " in line]
    assert steps and steps[-1].startswith(f"step    {STEPS}/{STEPS} | loss "), logs.stdout[-2000:]
    assert f"warning: checkpoint {step_dir(story['sc'].save, story['stopped_at'])} is unusable" in logs.stdout
    assert any(line.startswith("resumed from step ") for line in lines)
    assert any(line.startswith(f"saved step {STEPS} (") for line in lines) and f"done: step {STEPS}" in logs.stdout
    assert len(lines) < len(story["raw"].splitlines()) / 2  # every rank's events are left out


def test_logs_json_and_another_rank(story):
    events = [json.loads(line) for line in story["json"].stdout.splitlines()]
    assert events and {e["rank"] for e in events} == {0, 1} and {"start", "step", "saved"} <= {e["event"] for e in events}
    rank1 = story["rank1"]
    assert rank1.returncode == 0 and "| loss " not in rank1.stdout and "sailor-hpc: job " in rank1.stdout


def test_a_library_warning_is_said_once_per_job(story):
    raw = story["raw"]
    assert any(line.startswith("[rank 0] step ") for line in raw.splitlines())  # the ranks label their lines
    assert raw.count(MCORE_WARNING) <= 1 and story["logs"].stdout.count(MCORE_WARNING) == raw.count(MCORE_WARNING)
