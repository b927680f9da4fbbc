"""The plans the planner chooses, dumped exactly: a speed-up of the search's internals must leave them alone.

For each scenario (the speed benchmark's three, and the other objectives, spaces, runtimes and constraints on
``site_configs/a100-v100.toml``) it writes every returned candidate (placed plan, iteration time, throughput,
cost per hour, in ranking order) and the search's counters (allocations scored, plans simulated, rejections).
``--compare`` checks a dump taken before a change against the current code, float for float:

    .venv/bin/python benchmarks/planner_plans.py --out /tmp/before.json          # before the change
    .venv/bin/python benchmarks/planner_plans.py --compare /tmp/before.json      # after it: exit 1 on a difference

``--quick`` leaves out the 4 x 1024-GPU scenario (the slowest).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from planner import Constraints, PlanRequest, SearchResult
from planner.deepspeed_space import deepspeed_search
from planner.search import search
from planner.time_goal import TimeGoal
from sailor_hpc.core.archive import open_archive
from sailor_hpc.core.site import Site, load_site
from sailor_hpc.core.start_times import Hold, QueueSnapshot

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_speed import mixed_site  # noqa: E402  (a sibling script, not a package)

ROOT = Path(__file__).resolve().parents[1]
Searcher = Callable[[], SearchResult]


def _busy_goal(site: Site) -> TimeGoal:
    """Half the A100 nodes held for an hour, the rest idle (benchmarks/time_to_result.py's speed line)."""
    nodes = {p.name: {f"{p.name}-{i}": p.gpus_per_node for i in range(p.nodes)} for p in site.partitions}
    holds = tuple(Hold("a100", f"a100-{i}", 4, 0.0, 3600.0) for i in range(32))
    return TimeGoal.for_site(site, 20000, QueueSnapshot(0.0, nodes, holds))


def scenarios(quick: bool) -> list[tuple[str, Searcher]]:
    site = load_site(ROOT / "site_configs" / "a100-v100.toml")
    archive = open_archive(site=site)
    mixed3 = mixed_site(256, ["A100-40", "V100-16", "RTX-3090"])
    out: list[tuple[str, Searcher]] = [
        ("512 GPUs OPT-350M throughput", lambda: search(site, archive, PlanRequest("OPT-350M", 1024))),
        ("3x256 OPT-350M throughput", lambda: search(mixed3, open_archive(site=mixed3), PlanRequest("OPT-350M", 1024))),
        ("512 GPUs OPT-350M time", lambda: search(site, archive, PlanRequest("OPT-350M", 1024, objective="time",
                                                                             time_goal=_busy_goal(site)))),
        ("512 GPUs OPT-350M cost", lambda: search(site, archive, PlanRequest("OPT-350M", 1024, objective="cost"))),
        ("80+240 OPT-350M sailor space", lambda: search(site, archive, PlanRequest(
            "OPT-350M", 1024, available={"a100": 80, "v100": 240}, space="sailor"))),
        ("32+96 GPT-Neo-2.7B homogeneous", lambda: search(site, archive, PlanRequest(
            "GPT-Neo-2.7B", 2048, available={"a100": 32, "v100": 96}, space="homogeneous"))),
        ("64+192 GPT-Neo-2.7B throughput", lambda: search(site, archive, PlanRequest(
            "GPT-Neo-2.7B", 2048, available={"a100": 64, "v100": 192}))),
        ("512 GPUs OPT-350M gbs 64", lambda: search(site, archive, PlanRequest("OPT-350M", 64))),
        ("512 GPUs OPT-350M cost, min throughput 300", lambda: search(site, archive, PlanRequest(
            "OPT-350M", 1024, objective="cost", constraints=Constraints(min_throughput=300.0)))),
        ("512 GPUs OPT-350M max 64 GPUs", lambda: search(site, archive, PlanRequest(
            "OPT-350M", 1024, constraints=Constraints(max_gpus=64)))),
        ("512 GPUs OPT-350M runtime deepspeed-pipe", lambda: search(site, archive, PlanRequest(
            "OPT-350M", 1024, runtime="deepspeed-pipe"))),
        ("512 GPUs OPT-350M --runtime deepspeed", lambda: deepspeed_search(site, archive, PlanRequest(
            "OPT-350M", 1024, runtime="deepspeed"))),
    ]
    if not quick:
        mixed4 = mixed_site(1024, ["A100-40", "V100-16", "RTX-3090", "GH-96"])
        out.append(("4x1024 OPT-350M throughput",
                    lambda: search(mixed4, open_archive(site=mixed4), PlanRequest("OPT-350M", 1024))))
    return out


def dump(result: SearchResult) -> dict[str, Any]:
    """Everything a search returns that a faster search must reproduce (not its time)."""
    return {"allocations_scored": result.allocations_scored, "plans_simulated": result.plans_simulated,
            "rejected": dict(sorted(result.rejected.items())),
            "candidates": [{"plan": c.plan.to_dict(), "iteration_time_s": c.result.iteration_time_s,
                            "throughput": c.throughput, "cost_per_hour": c.result.cost_per_hour}
                           for c in result.candidates],
            "simulated": len(result.simulated)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="Write the dump here.")
    ap.add_argument("--compare", type=Path, help="Compare against this dump; exit 1 on any difference.")
    ap.add_argument("--quick", action="store_true", help="Leave out the 4 x 1024-GPU scenario.")
    args = ap.parse_args()
    before = json.loads(args.compare.read_text()) if args.compare else None
    found: dict[str, Any] = {}
    differ = []
    for name, run in scenarios(args.quick):
        t0 = time.perf_counter()
        found[name] = dump(run())
        dt = time.perf_counter() - t0
        status = ""
        if before is not None:
            # through JSON, as the dump was: floats compare exactly after the round trip
            same = before.get(name) == json.loads(json.dumps(found[name]))
            status = "same" if same else ("not in the dump" if name not in before else "DIFFERENT")
            if status == "DIFFERENT":
                differ.append(name)
        best = found[name]["candidates"][0]
        print(f"{name:44} {dt:7.2f} s  {best['throughput']:9.2f} samples/s  {status}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(found, indent=1))
    if differ:
        print(f"different plans: {', '.join(differ)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
