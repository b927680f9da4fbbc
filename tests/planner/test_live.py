"""`sailor-hpc plan --available live` plans on what sinfo says is idle (whole idle nodes)."""
from __future__ import annotations

import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "site_configs" / "local-lab.toml"


def _plan_gpus(cluster) -> dict[str, int]:
    out = cluster.run(["sailor-hpc", "plan", "--site", str(LAB), "--model", "OPT-350M", "--gbs", "64",
                       "--available", "live", "--json"], timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["plans"][0]["plan"]


def _nodes_by_partition(plan: dict) -> dict[str, int]:
    nodes: dict[str, set] = {}
    for p in plan["pipelines"]:
        for s in p["stages"]:
            nodes.setdefault(s["partition"], set()).add(s["placement"]["node"])
    return {k: len(v) for k, v in nodes.items()}


def test_live_availability_limits_the_plan(slurm_cluster) -> None:
    free = _nodes_by_partition(_plan_gpus(slurm_cluster))
    assert free == {"a100": 2, "v100": 2}  # everything idle: the best plan takes every node
    # hold one a100 node: the live plan may use at most the other one
    blocker = slurm_cluster.sbatch(["-p", "a100", "-N", "1", "--gres=gpu:a100:1", "--wrap", "sleep 120"])
    try:
        deadline = time.monotonic() + 30
        while slurm_cluster.job_states(blocker) != ["RUNNING"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert slurm_cluster.job_states(blocker) == ["RUNNING"]
        held = _nodes_by_partition(_plan_gpus(slurm_cluster))
        assert held.get("a100", 0) <= 1
    finally:
        slurm_cluster.run(["scancel", blocker])
