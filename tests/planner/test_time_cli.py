"""``sailor-hpc plan --objective time`` without Slurm (``--queue idle``): the output and the refusals."""
from __future__ import annotations

import json
import math
from pathlib import Path

from click.testing import CliRunner

from planner.time_goal import grace_s
from sailor_hpc.cli import main
from tests.data.tiny_archive import write_tiny_archive

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "site_configs" / "local-lab.toml"


def plan(archive: Path, *extra: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, ["plan", "--site", str(LAB), "--profiles", str(archive), "--model", "tiny-gpt",
                                    "--gbs", "64", "--dtype", "fp32", "--objective", "time", "--queue", "idle",
                                    "--top", "2", *extra])
    return res.exit_code, res.output


def test_plan_time_json_and_refusals(tmp_path) -> None:
    archive = write_tiny_archive(tmp_path / "tiny.h5")
    chart = tmp_path / "finish.png"
    code, out = plan(archive, "--steps", "400", "--time", "00:02:00", "--restart-cost", "10", "--json",
                     "--pareto", str(chart))
    assert code == 0, out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # finish against GPU-hours
    doc = json.loads(out)
    assert doc["steps"] == 400 and len(doc["time"]) == 2
    for t, p in zip(doc["time"], doc["plans"]):
        assert t["start_source"] == "idle now" and t["expected_start_s"] == 0
        run = 400 * p["iteration_time_s"]
        per_job = 120 - grace_s(120) - 10  # 98 s of training per 2-minute job
        assert t["run_s"] == run and t["restarts"] == max(0, math.ceil((run - per_job) / per_job))
        assert t["expected_finish_s"] == run + 10 * t["restarts"]
    finishes = [t["expected_finish_s"] for t in doc["time"]]
    assert finishes == sorted(finishes)
    assert doc["strategy"]["chosen"] == "start now"
    # tokens: 64 x 32 tokens per step for tiny-gpt
    code, out = plan(archive, "--tokens", str(400 * 64 * 32), "--json")
    assert code == 0 and json.loads(out)["steps"] == 400, out
    for extra, field in ((("--steps", "10", "--tokens", "100"), "--steps/--tokens"), ((), "--steps/--tokens"),
                         (("--steps", "10", "--deadline", "yesterday"), "--deadline")):
        code, out = plan(archive, *extra)
        assert code == 2 and field in out, out


def test_the_sbatch_job_asks_for_the_limit_its_finish_was_computed_with(tmp_path) -> None:
    """``plan --objective time --sbatch``: the job's --time is the first job's limit of the best plan's outlook
    (whole minutes), not the default hour; --time-min goes with it while the job is longer than it."""
    archive = write_tiny_archive(tmp_path / "tiny.h5")
    job = ["--sbatch", str(tmp_path / "job.sbatch"), "-o", str(tmp_path / "plan.json"), "--data",
           str(tmp_path / "data/tokens"), "--save", str(tmp_path / "ckpt"), "--skip-path-check", "--json"]
    for extra, floor in ((("--steps", "400", "--time", "00:02:00", "--time-min", "00:01:00"), True),
                         (("--steps", "3"), False)):
        code, out = plan(archive, *extra, *job)
        assert code == 0, out
        want_min = math.ceil(json.loads(out)["time"][0]["job_time_s"] / 60)
        lines = (tmp_path / "job.sbatch").read_text().splitlines()
        assert f"#SBATCH --time=00:{want_min:02d}:00" in lines
        assert ("#SBATCH --time-min=00:01:00" in lines) == (floor and want_min > 1)
        # 400 steps outlast --time: each job asks for all of it; 3 steps ask for far less than the default hour
        assert want_min == 2 if floor else want_min < 60


def test_tokens_set_the_steps_the_sbatch_job_trains(tmp_path) -> None:
    """``--tokens`` without ``--steps``: the job trains the steps its finish was computed for, not the default."""
    archive = write_tiny_archive(tmp_path / "tiny.h5")
    script = tmp_path / "job.sbatch"
    code, out = plan(archive, "--tokens", "2000000", "--sbatch", str(script), "--data", str(tmp_path / "data/tokens"),
                     "--save", str(tmp_path / "ckpt"), "--skip-path-check", "--json")
    assert code == 0, out
    steps = math.ceil(2_000_000 / (64 * 32))  # tiny-gpt: 32 tokens a sample
    assert json.loads(out)["steps"] == steps
    assert f"--steps {steps}" in script.read_text()
