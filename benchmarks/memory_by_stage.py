"""Which rank a measured peak is: every stage of Sailor's measured pipeline runs against the run's one figure.

A run's ``max_mem`` is the only memory figure Sailor published per run: the largest of the nvidia-smi
readings in the last line of each rank's memory log, over the logs its parser could read. No per-rank log
is published, so which ranks a figure covers can only be read from the figures themselves. For every run
of more than one stage this prints each stage's predicted peak (GPU type, micro-batches in flight) and its
difference from the measured figure, the stage the simulator calls busiest (what ``simulator_accuracy.py``
compares, the peak of every rank) and the stage nearest the figure. Where every rank's log was read, the
busiest stage is the nearest one and the others lie below the figure.

"anchored": what a stage must read by a measured one-stage run of the same set on the same GPU type, TP
degree and micro-batch size whose busiest replica is of that type: its figure less the predicted
difference of the two ranks' terms. The fixed overhead (context, communicators, other ranks' contexts on
GPU 0) is the same on both and cancels, so this does not rest on the overhead estimate.

    .venv/bin/python benchmarks/memory_by_stage.py [--data DIR]  (default: the copy shipped in sailor_hpc/core/data/sailor)
"""
from __future__ import annotations

import statistics
from pathlib import Path

from simulator_accuracy import set_reports, validation_dir  # the sibling benchmark (same folder)

from simulator.api import SimResult
from simulator.memory import in_flight
from simulator.validation import ValidationReport

GIB = 2**30


def anchors(report: ValidationReport) -> dict[tuple[str, int, int], list[tuple[float, float]]]:
    """(GPU type, TP, mbs) -> (measured figure, predicted peak) of the one-stage runs whose busiest replica
    is of that type (a figure is that replica's reading only there)."""
    out: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    for row in report.rows:
        res: SimResult | None = row.result
        if res is None or row.real_mem_bytes is None or row.mem_excluded or len(res.plan.pipelines[0].stages) > 1:
            continue
        top = max(res.stages, key=lambda s: float(s.memory.total))
        key = (top.gpu_type, top.tp, res.plan.pipelines[top.pipeline].micro_batch_size)
        out.setdefault(key, []).append((row.real_mem_bytes, float(top.memory.total)))
    return out


def main() -> None:
    val = validation_dir(__doc__)
    for _, report in set_reports(val):
        anchored = anchors(report)
        for row in report.rows:
            res, real = row.result, row.real_mem_bytes
            if res is None or real is None or len(res.plan.pipelines[0].stages) < 2:
                continue
            pipe = res.plan.pipelines[0]
            # one row per stage and GPU type: the replicas of a type hold the same
            by_stage = {(s.stage, s.gpu_type): s for s in res.stages if s.pipeline == 0}
            busiest = max(by_stage.values(), key=lambda s: float(s.memory.total))
            nearest = min(by_stage.values(), key=lambda s: abs(float(s.memory.total) - real))
            rel = Path(row.file).resolve().relative_to(val.resolve()).as_posix()
            note = f"  ({row.mem_excluded})" if row.mem_excluded else ""
            print(f"{rel}: measured {real / GIB:.2f} GiB, m = {pipe.num_micro_batches}{note}")
            for (stage, gpu), s in sorted(by_stage.items()):
                total = float(s.memory.total)
                tags = [t for t, hit in (("busiest", s is busiest), ("nearest", s is nearest)) if hit]
                ref = anchored.get((gpu, s.tp, pipe.micro_batch_size), [])
                anchor = (f"anchored {statistics.fmean(fig - pred + total for fig, pred in ref) / GIB:6.2f} GiB"
                          if ref else " " * 21)
                print(f"   stage {stage} {gpu:10s} {int(in_flight(stage, len(pipe.stages), pipe.num_micro_batches))}"
                      f" in flight  {total / GIB:6.2f} GiB  {(total - real) / real * 100:+6.1f} %  {anchor}  "
                      f"{' '.join(tags)}")


if __name__ == "__main__":
    main()
