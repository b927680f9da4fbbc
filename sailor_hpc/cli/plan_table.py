"""The table ``sailor-hpc plan`` prints: one block per plan, one line per pipeline shape, so that two plans of
the same GPUs show what tells them apart (the GPU type, TP and layers of every stage, the micro-batches)."""
from __future__ import annotations

from collections.abc import Sequence

from planner import Candidate
from sailor_hpc.cli.output import memory_by_gpu_type_rows, table
from sailor_hpc.core.plan import Pipeline

HEADERS = ("#", "GPUs", "iteration s", "samples/s", "{unit}/hour", "vs #1", "pipelines",
           "stages: GPU type TP layers", "mbs x micro-batches", "peak memory / capacity")


def stages_cell(pipe: Pipeline) -> str:
    """A pipeline's stages, consecutive stages of one GPU type and TP together: ``A100-40 TP2 0-12,13-25``
    (two stages of TP 2 on A100s, layers 0-12 and 13-25), groups split by `` | ``."""
    groups: list[tuple[str, int, list[str]]] = []
    for s in pipe.stages:
        layers = f"{s.first_layer}-{s.last_layer}"
        if groups and groups[-1][:2] == (s.gpu_type, s.tp):
            groups[-1][2].append(layers)
        else:
            groups.append((s.gpu_type, s.tp, [layers]))
    return " | ".join(f"{gpu} TP{tp} {','.join(layers)}" for gpu, tp, layers in groups)


def pipeline_shapes(pipes: Sequence[Pipeline]) -> list[tuple[int, str, str]]:
    """(copies, stages, micro-batches) of each distinct pipeline shape, in plan order; the micro-batch counts
    of one shape's copies as a range when the global batch's remainder spreads over some of them."""
    shapes: dict[tuple, list[int]] = {}
    for p in pipes:
        shapes.setdefault((stages_cell(p), p.micro_batch_size), []).append(p.num_micro_batches)
    out = []
    for (stages, mbs), counts in shapes.items():
        lo, hi = min(counts), max(counts)
        out.append((len(counts), stages, f"{mbs}x{lo}" if lo == hi else f"{mbs}x{lo}-{hi}"))
    return out


def _versus(c: Candidate, first: Candidate) -> str:
    """Iteration time and cost per hour against the best plan, in percent."""
    if c is first:
        return "-"
    dt = c.result.iteration_time_s / first.result.iteration_time_s - 1
    dc = c.result.cost_per_hour / first.result.cost_per_hour - 1 if first.result.cost_per_hour else 0.0
    return f"{dt:+.1%} time, {dc:+.1%} cost"


def plan_table(shown: Sequence[Candidate], cost_unit: str) -> str:
    """The ranked plans, best first: a plan's first line holds its numbers, the lines under it its other pipeline
    shapes and GPU types."""
    rows: list[tuple] = []
    for i, c in enumerate(shown):
        r = c.result
        shapes = pipeline_shapes(c.plan.pipelines)
        memory = [f"{gpu} {peak} / {cap}" for gpu, peak, cap in memory_by_gpu_type_rows(r)]
        head = (i + 1, c.plan.gpus_label(), f"{r.iteration_time_s:.4g}", f"{r.throughput_samples_per_s:.1f}",
                f"{r.cost_per_hour:.2f}", _versus(c, shown[0]))
        for k in range(max(len(shapes), len(memory))):
            copies, stages, micro = shapes[k] if k < len(shapes) else ("", "", "")
            rows.append((*(head if k == 0 else ("",) * len(head)), f"{copies}x" if copies else "", stages, micro,
                         memory[k] if k < len(memory) else ""))
    return table([h.format(unit=cost_unit) for h in HEADERS], rows)
