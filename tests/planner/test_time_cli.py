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
