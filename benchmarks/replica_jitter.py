"""Where a site's ``replica_jitter`` comes from: measured gradient-reduction times against the model.

Sailor's Clariden runs record ``red_grads``, the seconds rank 0 (stage 0) spent in DeepSpeed's
data-parallel gradient reduction. That is the all-reduce itself plus the wait for the slowest replica.
With the jitter switched off, the simulator gives the all-reduce alone; the rest, divided by the
expected maximum of D standard normals and by the compute before the reduction, is one estimate of
the coefficient of variation of a replica's step time. The table prints it per run, then what the
site's configured value predicts for ``red_grads`` (all-reduce + modelled wait).

Runs whose ``red_grads`` is a copied value (over half the iteration) or that have one replica are
skipped. On the MIT runs the 1-Gbit all-reduce dominates and the model of it is already ~5-10 % above
``red_grads``, so no jitter can be read from them (their site leaves it at 0).

    .venv/bin/python benchmarks/replica_jitter.py [--data DIR]  (default: the copy shipped in sailor_hpc/core/data/sailor)
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from sailor_hpc.core.archive import open_archive
from sailor_hpc.core.plan_io import load_run
from sailor_hpc.core.sailor_compat import SAILOR_DATA
from sailor_hpc.core.site import load_site
from simulator import plan_timeline
from simulator.iteration import expected_max_normal
from simulator.validation import find_runs

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = SAILOR_DATA  # shipped with the package
SETS = [("clariden.toml", "OPT-350M", "clariden/OPT-350"), ("clariden.toml", "GPT-Neo-2.7B", "clariden/GPT-NEO"),
        ("mit-mixed.toml", "OPT-350M", "mit")]


def stage0_reduction(plan, site, archive) -> tuple[float, float]:
    """From the event-driven timeline: the seconds rank (0, 0) spends from being ready for its gradient
    all-reduces to their end (what ``red_grads`` times), and when it ended its pipeline work (flush)."""
    timeline = plan_timeline(plan, site, archive)
    events = [e for e in timeline.events if (e.pipeline, e.stage) == (0, 0)]
    grads = [e for e in events if e.kind == "grads"]
    ready = max(e.end for e in events if e.kind not in ("grads", "wait", "optimizer") and e.end <= grads[0].start)
    return grads[-1].end - ready, timeline.flush_times()[(0, 0)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DEFAULT_DATA)
    args = ap.parse_args()
    print(f"{'run':48s} {'D':>3s} {'red_grads':>9s} {'allreduce':>9s} {'flush':>6s} {'jitter est':>10s}"
          f" {'configured':>10s} {'predicted':>9s}")
    for site_file, model, folder in SETS:
        site = load_site(ROOT / "site_configs" / site_file)
        calm = replace(site, partitions=tuple(replace(p, replica_jitter=0.0) for p in site.partitions))
        archive = open_archive(site=site)
        estimates = []
        for path in find_runs([Path(args.data) / "validation" / folder]):
            raw = json.loads(path.read_text())
            red, real = raw.get("red_grads"), raw.get("real")
            run = load_run(path, model=model, site=site)
            D = len(run.plan.pipelines)
            if red is None or D < 2 or red > 0.5 * real:
                continue
            comm, flush = stage0_reduction(run.plan, calm, archive)
            est = (red - comm) / (flush * expected_max_normal(D))
            estimates.append(est)
            configured = site.partition(run.plan.pipelines[0].stages[0].partition).replica_jitter
            predicted, _ = stage0_reduction(run.plan, site, archive)
            name = str(path).split("validation/")[-1]
            print(f"{name:48s} {D:3d} {red:9.4f} {comm:9.4f} {flush:6.2f} {est * 100:9.2f}% {configured * 100:9.2f}%"
                  f" {predicted:9.4f}")
        if estimates:
            print(f"{folder}: jitter estimate median {statistics.median(estimates) * 100:.2f} %, "
                  f"mean {statistics.fmean(estimates) * 100:.2f} % over {len(estimates)} runs\n")


if __name__ == "__main__":
    main()
