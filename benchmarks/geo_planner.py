"""Geo planning on Sailor's multi-zone setting: ours against Sailor's heuristics, scored by our simulator.

Site: site_configs/gcp-multizone.toml (5 GCP zones, A100-40, Sailor's measured zone links and egress
prices). Availability: the rows of Sailor's ``configs/gpu_trace_multizone.csv`` (32, 80, 128 GPUs in
every zone). Models and batches of Sailor's training configs; the two requests of its planner
experiments: max throughput, and min cost per iteration at >= 0.2 iterations/s
(``configs/min_throughput_iters_per_s.json``).

Columns, all scored by ``simulator.simulate`` (throughput; cost per iteration = GPUs held + egress):

* **ours**: ``planner.geo.geo_search`` (partition-local pipelines with data parallelism across zones,
  and chains that cross zones with each stage's replicas in one zone or one fast-linked group);
* **Sailor's heuristics, re-implemented**: ``chain_search`` over regions named by the zones (H6: zones of
  a region merged), the greedy fill only, Sailor's plan shape (uniform split, one TP and mbs, the same D
  for every stage; H5: a stage's replicas stay in one region). Sailor's own geo plans are *not* in its
  published data (``planner_results/`` holds only the A100+V100 runs), so this is our code following its
  paper and planner description, not its output;
* **DP across zones**: ``planner.search.search`` alone (pipelines inside a zone).

    .venv/bin/python benchmarks/geo_planner.py [--models OPT-350M] [--rows 0,2]
"""
from __future__ import annotations

import argparse
import csv
import json
import time
from collections.abc import Callable
from pathlib import Path

from planner import Candidate, Constraints, PlanRequest
from planner.geo import chain_search, geo_search, gpus_per_cluster, region_groups
from planner.search import search
from sailor_hpc.core.archive import open_archive
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.sailor_compat import SAILOR_DATA
from sailor_hpc.core.site import Site, load_site

ROOT = Path(__file__).resolve().parents[1]
MODELS = [("OPT-350M", 1024), ("GPT-Neo-2.7B", 2048)]


def _region(zone: str) -> str:
    return zone.rsplit("-", 1)[0]  # us-central1-a -> us-central1


def _trace_rows() -> list[dict[str, int]]:
    with (SAILOR_DATA / "configs" / "gpu_trace_multizone.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    return [{f"a100-{k.split('_', 1)[1]}": int(v) for k, v in r.items() if k.startswith("A100-40_")} for r in rows]


def _timed(fn: Callable[[], list[Candidate]]) -> tuple[Candidate | None, float]:
    t0 = time.perf_counter()
    try:
        found = fn()
    except SailorError:
        found = []
    return (found[0] if found else None), time.perf_counter() - t0


def _cell(site: Site, c: Candidate | None, seconds: float) -> str:
    if c is None:
        return f"{'none':>8} {'':>7} {'':>7} {seconds:6.1f}s  -"
    r = c.result
    zones = "+".join(str(n) for n in gpus_per_cluster(c.plan, site).values())
    p0 = c.plan.pipelines[0]
    shape = f"P{len(p0.stages)} t{p0.stages[0].tp} D{len(c.plan.pipelines)} b{p0.micro_batch_size}"
    return (f"{r.throughput_samples_per_s:8.1f} {r.cost_per_iteration:7.3f} {r.egress_cost:7.3f} {seconds:6.1f}s  "
            f"{zones} {shape}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(m for m, _ in MODELS))
    ap.add_argument("--rows", default="0,1,2", help="rows of gpu_trace_multizone.csv")
    args = ap.parse_args()
    site = load_site(ROOT / "site_configs" / "gcp-multizone.toml")
    archive = open_archive(site=site)
    min_iters = json.loads((SAILOR_DATA / "configs" / "min_throughput_iters_per_s.json").read_text())[0]
    rows = _trace_rows()
    sailor_groups = region_groups(site, _region)
    print("per cell: samples/s, USD/iteration (all), of which egress, search time, GPUs per zone used, shape "
          "(P stages, TP, D pipelines, micro-batch)")
    for model, gbs in MODELS:
        if model not in args.models.split(","):
            continue
        for i in (int(x) for x in args.rows.split(",")):
            avail = rows[i]
            for objective, cons in (("throughput", Constraints()),
                                    ("cost", Constraints(min_throughput=min_iters * gbs))):
                req = PlanRequest(model, gbs, objective=objective, constraints=cons, available=avail)
                ours = _timed(lambda: geo_search(site, archive, req).candidates)  # noqa: B023
                sailor = _timed(lambda: chain_search(site, archive, req, sailor_groups, greedy_only=True))  # noqa: B023
                local = _timed(lambda: search(site, archive, req).candidates)  # noqa: B023
                for c, _ in (ours, sailor, local):  # never more GPUs than a zone offers (Sailor once took 132 of 128)
                    held = gpus_per_cluster(c.plan, site) if c else {}
                    assert all(n <= avail[f"a100-{zone}"] for zone, n in held.items()), held
                head = f"{model} gbs {gbs}, {next(iter(avail.values()))}/zone, {objective}"
                print(f"{head}\n  ours          {_cell(site, *ours)}\n  Sailor heur.  {_cell(site, *sailor)}"
                      f"\n  DP across     {_cell(site, *local)}", flush=True)


if __name__ == "__main__":
    main()
