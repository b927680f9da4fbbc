"""Plan quality on the paper's heterogeneous scenarios, all plans scored by our simulator.

Site: site_configs/a100-v100.toml (256 + 256 GPUs); availability mixes of A100-40 + V100-16 (50/50, 25/75 and the
mixes of Sailor's measured planner runs); OPT-350M at gbs 1024 and GPT-Neo-2.7B at gbs 2048. Columns:
our best plan (full space), the best homogeneous plan (one partition), the best Sailor-shaped plan
(one micro-batch size, the same micro-batch count on every pipeline, uniform split: our planner
restricted to Sailor's space), and the plan Sailor's own planner chose
(planner_results of the shipped Sailor data) re-scored by our simulator.

    .venv/bin/python benchmarks/planner_quality.py
"""
from __future__ import annotations

import time
from pathlib import Path

from planner import PlanRequest
from planner.search import search
from sailor_hpc.core.archive import open_archive
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.sailor_compat import SAILOR_DATA
from sailor_hpc.core.site import load_site
from simulator import simulate

ROOT = Path(__file__).resolve().parents[1]
SAILOR_RESULTS = SAILOR_DATA / "planner_results"
MIXES = [(256, 256), (64, 192), (32, 96), (80, 240), (128, 0)]  # 50/50, 25/75, Sailor's mixes
MODELS = [("OPT-350M", "OPT-350", 1024), ("GPT-Neo-2.7B", "GPT-Neo-2.7", 2048)]


def sailor_plan_throughput(site, archive, sailor_name: str, model: str, a: int, v: int) -> str:
    name = f"{sailor_name}_A{a}" + (f"V{v}" if v else "") + ".json"
    path = SAILOR_RESULTS / name
    if not path.exists():
        return "-"
    try:
        plan = load_plan(path, model=model, site=site)
        res = simulate(plan, site, archive)
    except SailorError as exc:
        return f"error: {exc.message[:30]}"
    return f"{res.throughput_samples_per_s:.1f}" + ("" if res.fits else " (OOM)")


def main() -> None:
    site = load_site(ROOT / "site_configs" / "a100-v100.toml")
    archive = open_archive(site=site)
    print(f"{'model':13} {'A100+V100':>10} {'ours':>8} {'homog.':>8} {'Sailor-sh.':>10} {'Sailor plan':>12} "
          f"{'ours/homog':>10} {'ours/Sailor-sh':>14} {'search s':>8}  our best plan")
    for model, sailor_name, gbs in MODELS:
        for a, v in MIXES:
            avail = {"a100": a, "v100": v}
            t0 = time.perf_counter()
            best = search(site, archive, PlanRequest(model, gbs, available=avail)).candidates[0]
            dt = time.perf_counter() - t0
            homo = search(site, archive, PlanRequest(model, gbs, available=avail, space="homogeneous")).candidates[0]
            try:
                sh = search(site, archive, PlanRequest(model, gbs, available=avail, space="sailor")).candidates[0]
                sh_thr = sh.throughput
            except SailorError:
                sh_thr = float("nan")
            shapes = sorted({(p.stages[0].gpu_type, len(p.stages), p.micro_batch_size) for p in best.plan.pipelines})
            print(f"{model:13} {f'{a}+{v}':>10} {best.throughput:8.1f} {homo.throughput:8.1f} {sh_thr:10.1f} "
                  f"{sailor_plan_throughput(site, archive, sailor_name, model, a, v):>12} "
                  f"{best.throughput / homo.throughput:10.3f} {best.throughput / sh_thr:14.3f} {dt:8.2f}  "
                  f"{best.plan.gpus_by_type()} {len(best.plan.pipelines)} pipelines (gpu, stages, mbs): {shapes}")


if __name__ == "__main__":
    main()
