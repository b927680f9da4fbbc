"""Which rank a measured peak is: every stage of Sailor's measured pipeline runs against the run's one figure.

A run's ``max_mem`` is the only memory figure Sailor published per run: the largest of the nvidia-smi
readings in the last line of each rank's memory log, over the logs its parser could read. No per-rank log
is published, so which ranks a figure covers can only be read from the figures themselves. For every run
of more than one stage this prints each stage's predicted peak (GPU type, micro-batches in flight) and its
difference from the measured figure, the stage the simulator calls busiest (what ``simulator_accuracy.py``
compares, the peak of every rank) and the stage nearest the figure. Where every rank's log was read, the
busiest stage is the nearest one and the others lie below the figure.

    .venv/bin/python benchmarks/memory_by_stage.py [--data DIR]  (default: the copy shipped in sailor_hpc/core/data/sailor)
"""
from __future__ import annotations

from pathlib import Path

from simulator_accuracy import set_reports, validation_dir  # the sibling benchmark (same folder)

from simulator.memory import in_flight

GIB = 2**30


def main() -> None:
    val = validation_dir(__doc__)
    for _, report in set_reports(val):
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
                print(f"   stage {stage} {gpu:10s} {int(in_flight(stage, len(pipe.stages), pipe.num_micro_batches))}"
                      f" in flight  {total / GIB:6.2f} GiB  {(total - real) / real * 100:+6.1f} %  {' '.join(tags)}")


if __name__ == "__main__":
    main()
