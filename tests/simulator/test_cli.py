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
    kinds = {e["kind"] for e in events["events"]}
    assert kinds >= {"fwd", "bwd", "grads", "optimizer"} and kinds & {"exchange", "post_act", "send_act"}
    assert out["runtime"] == "megatron_patch"  # plans are simulated as this project's runtime runs them


def test_simulate_runtime_option_selects_the_runtime_model(tmp_path):
    """--runtime deepspeed-pipe is what validate-sim uses for Sailor's runs; the default is megatron_patch."""
    def sim(*extra):
        r = run("simulate", validation_dir() / PLAN, "--site", SITES / "clariden.toml", "--model", "OPT-350M",
                "--json", *extra)
        assert r.exit_code == 0, r.output
        return json.loads(r.output)

    ds, mp = sim("--runtime", "deepspeed-pipe"), sim()
    r = run("validate-sim", validation_dir() / PLAN, "--site", SITES / "clariden.toml", "--model", "OPT-350M", "--json")
    assert json.loads(r.output)["files"][0]["est_s"] == pytest.approx(ds["iteration_time_s"], rel=1e-12)
    assert ds["runtime"] == "deepspeed-pipe" and mp["runtime"] == "megatron_patch"
    assert ds["iteration_time_s"] != mp["iteration_time_s"]
    r = run("simulate", validation_dir() / PLAN, "--site", SITES / "clariden.toml", "--model", "OPT-350M",
            "--runtime", "pytorch")
    assert r.exit_code == 2 and "deepspeed-pipe" in r.output
    # a CPU lab's ranks talk gloo: DeepSpeed's 4-stage N4_D1 sends 2 MiB per rank, buffered on NCCL, blocking
    four = validation_dir() / "clariden/OPT-350/N4/plan_config_N4_D1.json"
    args = ("simulate", four, "--site", SITES / "clariden.toml", "--model", "OPT-350M", "--runtime", "deepspeed-pipe",
            "--json")
    nccl, gloo = (json.loads(run(*args, *extra).output) for extra in ((), ("--backend", "gloo")))
    assert (nccl["backend"], gloo["backend"]) == ("nccl", "gloo")
    assert gloo["iteration_time_s"] > nccl["iteration_time_s"]
    r = run("simulate", validation_dir() / PLAN, "--site", SITES / "clariden.toml", "--model", "OPT-350M",
            "--backend", "mpi")
    assert r.exit_code == 2 and "gloo" in r.output


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
    longer = tmp_path / "seq.json"
    longer.write_text(json.dumps({"model": "OPT-350M", "global_batch_size": 4, "seq_len": 4096, "pipelines": [
        {"micro_batch_size": 1, "num_micro_batches": 4, "stages": [{"layers": [0, 25], "tp": 4, "gpu_type": "GH-96"}]}]}))
    r = run("simulate", longer, "--site", SITES / "clariden.toml")
    assert r.exit_code == 2 and f"{longer}: seq_len: profiles of OPT-350M are taken at sequence length 2048" in r.output


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


def _edited(tmp_path, name, **changes):
    raw = json.loads((validation_dir() / PLAN).read_text())
    raw.update(changes)
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return path


def test_validate_sim_refuses_what_cannot_be_compared(tmp_path):
    good = _edited(tmp_path, "good.json")
    _edited(tmp_path, "red.json", red_grads="n/a")  # not a number: that file's error, no traceback
    _edited(tmp_path, "neg.json", real=-1)  # a negative measurement is no measurement
    _edited(tmp_path, "none.json", real=0)  # 0 = not measured: kept out with a reason, not silently
    r = run("validate-sim", tmp_path, good, "--site", SITES / "clariden.toml", "--model", "OPT-350M", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    rows = {Path(f["file"]).name: f for f in out["files"]}
    assert len(out["files"]) == 4  # good.json named twice, counted once
    assert "red_grads" in rows["red.json"]["error"] and "real" in rows["neg.json"]["error"]
    assert rows["none.json"]["time_excluded"].startswith("no measured")
    assert out["summary"]["time_files"] == 1 and out["summary"]["time_mape_pct"] == rows["good.json"]["time_err_pct"]
    unknown = run("validate-sim", good, "--site", SITES / "clariden.toml", "--model", "nosuch")
    assert unknown.exit_code == 2 and "unknown model" in unknown.output
    wrong_site = run("validate-sim", validation_dir() / "mit", "--site", SITES / "clariden.toml", "--model", "OPT-350M")
    assert wrong_site.exit_code == 2 and "none of the 5 file(s) can be evaluated" in wrong_site.output


def test_simulate_names_the_plan_file_and_reports_plain_booleans(tmp_path):
    raw = json.loads((validation_dir() / PLAN).read_text())
    raw["pipeline_list"][0]["tmp_per_stage"][0][0][0][0][0] = "H100"
    h100 = tmp_path / "h100.json"
    h100.write_text(json.dumps(raw))
    r = run("simulate", h100, "--site", SITES / "clariden.toml", "--model", "OPT-350M")
    assert r.exit_code == 2 and f"{h100}: pipeline_list[*].tmp_per_stage[0]: unknown GPU type 'H100'" in r.output
    del raw["mbs"]
    raw["pipeline_list"][0]["tmp_per_stage"][0][0][0][0][0] = "GH-96"
    h100.write_text(json.dumps(raw))
    r = run("simulate", h100, "--site", SITES / "clariden.toml", "--model", "OPT-350M")
    assert r.exit_code == 2 and "mbs: is missing" in r.output and "rename 'gbs'" not in r.output
    # an out-of-memory plan: every stage's fits is a JSON boolean, not the string "False"
    oom = tmp_path / "oom.json"
    oom.write_text(json.dumps({"model": "GPT-Neo-2.7B", "global_batch_size": 8, "pipelines": [
        {"micro_batch_size": 8, "num_micro_batches": 1, "stages": [{"layers": [0, 33], "tp": 1, "gpu_type": "GH-96"}]}]}))
    r = run("simulate", oom, "--site", SITES / "clariden.toml", "--json", "--timeline", tmp_path / "no" / "dir" / "t.png")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["fits"] is False and [s["fits"] for s in out["stages"]] == [False]
    assert (tmp_path / "no" / "dir" / "t.png").read_bytes()[:4] == b"\x89PNG"
