"""Bucketed gradient sync: the bucket size changes nothing, and the buckets overlap the backward.

Real gloo ranks (``megatron_patch.local``), plan A of conftest (a 2-stage pipeline with 3
micro-batches next to a 1-stage TP2 pipeline with 1).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from megatron_patch import local
from megatron_patch.checkpoint_io import CheckpointReader
from sailor_hpc.core.checkpoint import step_dir
from sailor_hpc.core.plan_io import load_plan
from tests.megatron_patch.conftest import Env, launch, max_diff

PARAM_TOL = 1e-6


def test_many_small_buckets_train_what_one_bucket_trains(runtime_env: Env, ref_file: Callable[[int], Path]) -> None:
    roots = {}
    for mb in ("0", "0.002"):  # one bucket per rank set; ~one per parameter
        roots[mb] = runtime_env.root / f"buckets-{mb}"
        launch(runtime_env, "A", 3, roots[mb], "--grad-bucket-mb", mb)
    one, many = (CheckpointReader(str(step_dir(roots[mb], 3))).full_state() for mb in ("0", "0.002"))
    worst = max(float((one[n][k] - many[n][k]).abs().max()) for n in one for k in one[n])
    print(f"plan A, 3 steps, one bucket vs 500-element buckets: max |delta| {worst}")
    assert worst <= PARAM_TOL
    for mb, root in roots.items():
        assert max_diff(step_dir(root, 3), ref_file(3))["param"] <= PARAM_TOL, mb


def test_buckets_launch_during_the_last_backward(runtime_env: Env) -> None:
    """Every rank launches all its buckets but the last from the backward's hooks, before it ends."""
    worker = str(Path(__file__).with_name("overlap_worker.py"))
    plan = runtime_env.plans["A"]
    results = local.run([worker, "--plan", str(plan), "--data", runtime_env.data, "--grad-bucket-mb", "0.002"],
                        load_plan(plan).num_gpus, timeout=300)
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
        launches = got["launches"]
        assert len(launches) > 5
        early = [at < got["backward_end"] and by_hook for _, _, at, by_hook in launches]
        print(f"rank {got['rank']}: {sum(early)} of {len(launches)} buckets launched before the backward ended")
        assert all(early[:-1]), launches
