"""No plan shape deadlocks: the group discipline (every group created up front in one global order,
stage-boundary sends in per-pipeline groups, gradient buckets launched in one global order) trains
plans that mix a one-stage pipeline with multi-stage ones, change TP between adjacent stages and
give pipelines different micro-batch counts.

Real gloo ranks with a 60 s collective timeout and tiny gradient buckets (about one per parameter,
so launch order is stressed): a wrong order on any group fails or hangs within a minute instead of
passing by luck. Each plan trains 2 steps from the initialisation and must match the single-process
reference. (gloo cannot show NCCL's lazy-communicator hang itself; it checks the order every rank
follows, which is what NCCL needs.)
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from sailor_hpc.core.checkpoint import step_dir
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from tests.megatron_patch.conftest import GLOBAL_BATCH, MODEL, Env, add_plan, launch, max_diff

PARAM_TOL = 1e-6
SMALL_BUCKETS = ["--grad-bucket-mb", "0.002"]  # 500 fp32 elements: ~1 bucket per tiny-gpt parameter


def _st(first: int, last: int, tp: int) -> Stage:
    return Stage(first, last, tp, "A100-40")


SHAPES = {
    # one stage (2 micro-batches) next to three stages TP1 -> TP2 -> TP1 (3 micro-batches)
    "one-and-three": Plan(MODEL, GLOBAL_BATCH, (Pipeline(1, 2, (_st(0, 5, 1),)),
                                                Pipeline(2, 3, (_st(0, 1, 1), _st(2, 3, 2), _st(4, 5, 1))))),
    # three pipelines: one stage TP2 (1 micro-batch), one stage TP1 (3), two stages TP1 -> TP1 (2)
    "three-pipelines": Plan(MODEL, GLOBAL_BATCH, (Pipeline(1, 1, (_st(0, 5, 2),)), Pipeline(1, 3, (_st(0, 5, 1),)),
                                                  Pipeline(2, 2, (_st(0, 2, 1), _st(3, 5, 1))))),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_plan_shape_trains_without_deadlock(runtime_env: Env, ref_file: Callable[[int], Path], name: str) -> None:
    add_plan(runtime_env, name, SHAPES[name])
    root = runtime_env.root / f"shape-{name}"
    launch(runtime_env, name, 2, root, "--timeout-min", "1", *SMALL_BUCKETS, timeout=180)
    diff = max_diff(step_dir(root, 2), ref_file(2))
    print(f"plan {name} after 2 steps: max |delta| {diff}")
    assert diff["param"] <= PARAM_TOL
