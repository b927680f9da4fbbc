"""Planner search time on this machine, against Sailor's measured search times.

Scenarios (OPT-350M, max throughput, all GPUs of every partition available):
* 512 GPUs of 2 types: site_configs/a100-v100.toml (Sailor: 17.4 s; target <= 2 s), gbs 1024;
* 3 types x 256 GPUs: A100-40, V100-16, RTX-3090 (Sailor: 4,900 s; target <= 30 s);
* 4 types x 1024 GPUs: A100-40, V100-16, RTX-3090, GH-96 (target <= 60 s).
The extra partitions take their network fits from the shipped site configs (Sailor's measurements).
``search s`` is wall time, ``CPU s`` the process's CPU time (steadier on a shared machine); with
``--repeat N`` each scenario runs N times and the fastest run is shown (others' load only slows a run).

    .venv/bin/python benchmarks/planner_speed.py [--repeat N] [--only 512]
"""
from __future__ import annotations

import argparse
import time
import tomllib
from pathlib import Path

from planner import PlanRequest
from planner.search import search
from sailor_hpc.core.archive import open_archive
from sailor_hpc.core.site import Site, load_site, load_site_dict

ROOT = Path(__file__).resolve().parents[1]
SITES = ROOT / "site_configs"
SOURCES = {"A100-40": ("a100-v100.toml", "a100"), "V100-16": ("a100-v100.toml", "v100"),
           "RTX-3090": ("mit-mixed.toml", "rtx3090"), "GH-96": ("clariden.toml", "normal")}


def mixed_site(gpus_per_type: int, types: list[str]) -> Site:
    """A site with one partition of ``gpus_per_type`` GPUs for each GPU type."""
    doc: dict = {"name": f"{len(types)}x{gpus_per_type}", "gpu_types": {}, "partitions": []}
    for gpu in types:
        file, part = SOURCES[gpu]
        src = tomllib.loads((SITES / file).read_text())
        doc["gpu_types"][gpu] = src["gpu_types"][gpu]
        p = dict(next(x for x in src["partitions"] if x["name"] == part))
        p["name"] = gpu.lower().replace("-", "")
        p["nodes"] = gpus_per_type // p["gpus_per_node"]
        p["max_nodes_per_job"] = p["nodes"]
        doc["partitions"].append(p)
    return load_site_dict(doc, source=f"<benchmark {doc['name']}>")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=1, help="Runs per scenario; the fastest is shown.")
    ap.add_argument("--only", default=None, help="Run only the scenarios whose name contains this.")
    args = ap.parse_args()
    scenarios = [
        ("512 GPUs, 2 types (a100-v100.toml)", load_site(SITES / "a100-v100.toml"), 17.4, 2.0),
        ("3 types x 256 GPUs", mixed_site(256, ["A100-40", "V100-16", "RTX-3090"]), 4900.0, 30.0),
        ("4 types x 1024 GPUs", mixed_site(1024, ["A100-40", "V100-16", "RTX-3090", "GH-96"]), None, 60.0),
    ]
    print(f"{'scenario':38} {'search s':>9} {'CPU s':>7} {'target s':>9} {'Sailor s':>9} {'allocations':>12} "
          f"{'best samples/s':>15}  best plan GPUs")
    for name, site, sailor, target in scenarios:
        if args.only and args.only not in name:
            continue
        archive = open_archive(site=site)
        wall = cpu = float("inf")
        for _ in range(max(1, args.repeat)):
            t0, c0 = time.perf_counter(), time.process_time()
            result = search(site, archive, PlanRequest("OPT-350M", 1024))
            wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
        best = result.candidates[0]
        print(f"{name:38} {wall:9.2f} {cpu:7.2f} {target:9.1f} {sailor if sailor else '-':>9} "
              f"{result.allocations_scored:12d} {best.throughput:15.1f}  {best.plan.gpus_by_type()}", flush=True)


if __name__ == "__main__":
    main()
