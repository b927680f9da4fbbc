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
import statistics
from pathlib import Path

from sailor_hpc.core.archive import open_archive
from sailor_hpc.core.plan_io import load_run
from sailor_hpc.core.sailor_compat import SAILOR_DATA
from sailor_hpc.core.site import load_site
from simulator.calibration import jitter_estimate, stage0_reduction, with_jitter
from simulator.validation import find_runs

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = SAILOR_DATA  # shipped with the package
SETS = [("clariden.toml", "OPT-350M", "clariden/OPT-350"), ("clariden.toml", "GPT-Neo-2.7B", "clariden/GPT-NEO"),
        ("mit-mixed.toml", "OPT-350M", "mit")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DEFAULT_DATA)
    args = ap.parse_args()
    print(f"{'run':48s} {'D':>3s} {'red_grads':>9s} {'allreduce':>9s} {'flush':>6s} {'jitter est':>10s}"
          f" {'configured':>10s} {'predicted':>9s}")
    for site_file, model, folder in SETS:
        site = load_site(ROOT / "site_configs" / site_file)
        archive = open_archive(site=site)
        estimates = []
        for path in find_runs([Path(args.data) / "validation" / folder]):
            est = jitter_estimate(path, site, model, archive)
            if est is None:
                continue
            estimates.append(est)
            run = load_run(path, model=model, site=site)
            D, red = len(run.plan.pipelines), run.red_grads_s
            comm, flush = stage0_reduction(run.plan, with_jitter(site, 0.0), archive)
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
