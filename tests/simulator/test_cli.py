"""The simulate and validate-sim commands."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from sailor_hpc.cli import main
from tests.simulator.conftest import SITES, validation_dir

PLAN = "clariden/OPT-350/N4/plan_config_N4_D2.json"


def run(*args):
    return CliRunner().invoke(main, list(map(str, args)), catch_exceptions=False)


def test_simulate_json_and_timelines(tmp_path):
    png, js = tmp_path / "t.png", tmp_path / "t.json"
    r = run("simulate", validation_dir() / PLAN, "--site", SITES / "clariden.toml", "--model", "OPT-350M", "--json",
            "--timeline", png)
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    for key in ("iteration_time_s", "peak_memory_bytes", "throughput_samples_per_s", "cost_per_iteration", "fits",
                "tokens_per_s", "cost_per_hour", "memory_by_gpu_type", "stages"):
        assert key in out
    assert out["fits"] is True and out["cost_unit"] == "GPU-hours"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = run("simulate", validation_dir() / PLAN, "--site", SITES / "clariden.toml", "--model", "OPT-350M",
            "--timeline", js)
    assert r.exit_code == 0 and "iteration time" in r.output and "peak memory" in r.output
    events = json.loads(js.read_text())
    assert events["iteration_time_s"] == pytest.approx(out["iteration_time_s"], rel=1e-12)
    assert {e["kind"] for e in events["events"]} >= {"fwd", "bwd", "send_act", "recv_grad", "grads", "optimizer"}


def test_simulate_bad_input_exits_2(tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps({"model": "OPT-350M", "global_batch_size": 4, "pipelines": [
        {"micro_batch_size": 1, "num_micro_batches": 4, "stages": [{"layers": [0, 10], "tp": 4, "gpu_type": "GH-96"}]}]}))
    exe = Path(sys.executable).with_name("sailor-hpc")
    proc = subprocess.run([str(exe), "simulate", str(bad), "--site", str(SITES / "clariden.toml")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "pipelines[0].stages" in proc.stderr and "fix:" in proc.stderr
    r = CliRunner().invoke(main, ["simulate", str(validation_dir() / PLAN), "--site", str(SITES / "clariden.toml"),
                                  "--model", "OPT-350M", "--timeline", str(tmp_path / "t.svg")])
    assert r.exit_code == 2


def test_validate_sim_json(tmp_path):
    r = run("validate-sim", validation_dir() / "mit", "--site", SITES / "mit-mixed.toml", "--model", "OPT-350M",
            "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert len(out["files"]) == 5
    row = out["files"][0]
    for key in ("file", "real_s", "est_s", "time_err_pct", "real_mem_bytes", "est_mem_bytes", "mem_err_pct"):
        assert key in row
    assert set(out["summary"]) >= {"time_mape_pct", "mem_mape_pct"}
    text = run("validate-sim", validation_dir() / "mit/N4", "--site", SITES / "mit-mixed.toml", "--model", "OPT-350M")
    assert "mean" in text.output and "median" in text.output and "max" in text.output
