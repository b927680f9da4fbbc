"""benchmarks/gpu_check.sh is run on lent GPU machines only; its CPU smoke mode keeps it working in between:
profile, plan, simulate, train with megatron_patch and megatron-core's own path, end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.data import REPO


def test_gpu_check_smoke_runs_every_step(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    out = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--smoke", "--steps", "4", "--warmup", "1",
                          "--workdir", str(tmp_path / "work")], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["model"] == "tiny-gpt" and res["dtype"] == "fp32" and res["gbs"] == 4
    assert res["mbs"] * res["micro_batches"] == 4  # the planner's plan for the one GPU covers the batch
    assert {p["mbs"] for p in res["profiled"] if p["ok"]} == {1, 2}  # profiled by the profiling job's function
    assert res["predicted_s"] > 0 and res["measured_s"] > 0 and res["megatron_s"] > 0
    assert res["error_pct"] == (res["predicted_s"] - res["measured_s"]) / res["measured_s"] * 100
    assert res["memory_predicted_gib"] > 0 and res["memory_measured_gib"] > 0
    assert "megatron_patch (measured)" in out.stdout and "megatron-core own path" in out.stdout
