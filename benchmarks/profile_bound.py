"""How close to Sailor's measured runs can *any* simulator get on Sailor's published profile?

Two measurements, both independent of how a simulator models schedules and networks:

1. **Compute floor per file** (:func:`simulator.validation.compute_floor`): whatever its schedule,
   overlap and network model, a simulator that takes a stage's compute from the profile cannot end
   an iteration before every stage has done its own forwards and backwards. When the floor exceeds
   the measured time, that file's error is at least (floor - real) / real.
2. **Implied compute per micro-batch of single-stage runs.** For runs with one stage, measured time
   minus what our simulator adds beyond compute (gradient all-reduce, optimizer step) divided by m,
   against the profile's forward + backward of the whole model at that micro-batch size. A ratio that
   goes up and down with the micro-batch size is the profile disagreeing with the runs, which no
   model of the hardware can repair; only a per-micro-batch correction fitted to these files could.

    .venv/bin/python benchmarks/profile_bound.py [--data DIR]  (default: the copy shipped in sailor_hpc/core/data/sailor)
"""
from __future__ import annotations

import statistics
from pathlib import Path

from simulator_accuracy import set_reports, validation_dir  # the sibling benchmark (same folder)

from simulator.validation import compute_floor


def main() -> None:
    for folder, report in set_reports(validation_dir(__doc__)):
        print(f"{folder}: {'file':34s} {'real s':>8s} {'ours s':>8s} {'err %':>6s} {'floor s':>8s} "
              f"{'forced %':>8s} {'mbs':>4s} {'1-stage ratio':>13s}")
        forced, errors, ratios = [], [], {}
        for r in report.rows:
            if r.result is None or r.time_excluded or r.real_s is None:
                continue
            res = r.result
            floor = compute_floor(res)
            least = max(0.0, (floor - r.real_s) / r.real_s * 100)
            forced.append(least)
            errors.append(r.time_err_pct)
            mbs = res.plan.pipelines[0].micro_batch_size
            ratio = ""
            if all(s.stage == 0 for s in res.stages):
                m = res.plan.pipelines[0].num_micro_batches
                per_mb = max(s.fwd_s + s.bwd_s for s in res.stages)  # the slowest replica
                beyond = res.iteration_time_s - m * per_mb  # all-reduce, optimizer step, straggler wait
                ratio = (r.real_s - beyond) / m / per_mb
                ratios.setdefault(mbs, []).append(ratio)
                ratio = f"{ratio:.3f}"
            print(f"{'':{len(folder) + 2}s}{Path(r.file).name:34s} {r.real_s:8.4f} {r.est_s:8.4f} "
                  f"{r.time_err_pct:6.1f} {floor:8.4f} {least:8.1f} {mbs:4d} {ratio:>13s}")
        print(f"  mean |error| ours {statistics.fmean(errors):.1f} %; the compute floor alone forces a mean of at "
              f"least {statistics.fmean(forced):.1f} % over these {len(forced)} files")
        if ratios:
            print("  single-stage runs, measured compute per micro-batch / profile's, by micro-batch size: "
                  + ", ".join(f"mbs {b}: {statistics.fmean(v):.3f} ({len(v)} runs)" for b, v in sorted(ratios.items())))
        print()


if __name__ == "__main__":
    main()
