"""``make demo`` as a new user reads it: a mixed plan, its charts, the job script's header and command without a
line of 320 numbers, the steps it trains and where they came from, a legend of the table and the next commands."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_plan_table import plan_blocks, read_table
from tests.conftest import slurm_missing

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    if shutil.which("make") is None or not (VENV / "bin" / "sailor-hpc").exists():
        slurm_missing("needs make and the sailor-hpc of this interpreter's venv")
    out = tmp_path_factory.mktemp("demo") / "out"
    # -o: the venv is installed already (make would reinstall it when setup.cfg is newer than its stamp)
    r = subprocess.run(["make", "--no-print-directory", "-C", str(REPO), "-o", f"{VENV}/.installed", "demo",
                        f"VENV={VENV}", f"DEMO_OUT={out}"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout, out


def test_the_demo_plans_a_mixed_job_and_says_the_steps_it_trains(demo: tuple[str, Path]) -> None:
    text, out = demo
    table = text[text.index("OPT-350M on a100-v100"):]
    best = plan_blocks(read_table(table))[0]
    plan = json.loads((out / "plan.json").read_text())
    assert {s["gpu_type"] for p in plan["pipelines"] for s in p["stages"]} == {"A100-40", "V100-16"}
    assert best[0]["GPUs"].startswith("64 A100-40 + ")  # the 64 free A100s, then V100s
    assert f"its sbatch script written to {out}/train.sbatch; the job trains 1000 steps (--steps)" in text
    script = (out / "train.sbatch").read_text()
    (launch,) = [line for line in script.splitlines() if line.startswith("LAUNCH=")]
    assert launch.endswith("--steps 1000)") and launch in text.splitlines()


def test_the_script_head_shortens_the_rank_layout(demo: tuple[str, Path]) -> None:
    text, out = demo
    ranks = sum(s["tp"] for p in json.loads((out / "plan.json").read_text())["pipelines"] for s in p["stages"])
    full = next(line for line in (out / "train.sbatch").read_text().splitlines() if line.startswith("# Rank layout"))
    shown = next(line for line in text.splitlines() if line.startswith("# Rank layout"))
    assert len(full.split()) > ranks and len(shown) <= 120 < len(full)
    assert " ... " in shown and shown.endswith(f" {ranks - 1}") and full.startswith(shown.split(" ... ")[0])
    sbatch_lines = [line for line in (out / "train.sbatch").read_text().splitlines() if line.startswith("#SBATCH")]
    assert sbatch_lines and all(line in text.splitlines() for line in sbatch_lines)


def test_the_demo_ends_with_a_legend_and_the_next_commands(demo: tuple[str, Path]) -> None:
    text, out = demo
    legend = text[text.index("--- reading the plan table"):text.index("--- next")]
    for words in ("Nx: N copies", "TP (GPUs per tensor-parallel group)", "layer 0: embedding", "mbs x micro-batches",
                  "fewer GPUs first"):
        assert words in legend, words
    after = text[text.index("--- next"):]
    assert f"sbatch {out}/train.sbatch" in after and "submit" in after and " run --site" in after
    for chart in ("front.png", "timeline.png"):
        path = out / chart
        assert str(path) in after and path.read_bytes()[:8] == PNG and path.stat().st_size < 200_000
