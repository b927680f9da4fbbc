"""Bucketed gradient sync: the bucket size changes nothing, and the buckets overlap the backward.

Real gloo ranks, plan A of conftest (a 2-stage pipeline with 3 micro-batches next to a 1-stage TP2
pipeline with 1), trained 3 steps with one bucket per rank set and with ~one bucket per parameter.
The small-bucket run goes through ``overlap_worker.py`` (the runtime's launch, timing its backward)
so that one run shows both its checkpoint and when its buckets launched.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from megatron_patch.checkpoint_io import CheckpointReader
from sailor_hpc.core.checkpoint import step_dir
from tests.megatron_patch.conftest import Env, events, launch, max_diff

PARAM_TOL = 1e-6
BUCKET_MB = {"one": "0", "small": "0.002"}  # one bucket per rank set; 500 fp32 elements, ~one per parameter
OVERLAP = [str(Path(__file__).with_name("overlap_worker.py"))]


@pytest.fixture(scope="module")
def runs(runtime_env: Env) -> dict[str, tuple[Path, list]]:
    out = {}
    for name, mb in BUCKET_MB.items():
        root = runtime_env.root / f"buckets-{name}"
        out[name] = (root, launch(runtime_env, "A", 3, root, "--grad-bucket-mb", mb,
                                  program=OVERLAP if name == "small" else None))
    return out


def test_many_small_buckets_train_what_one_bucket_trains(runs: dict, ref_file: Callable[[int], Path]) -> None:
    one, many = (CheckpointReader(str(step_dir(runs[name][0], 3))).full_state() for name in ("one", "small"))
    worst = max(float((one[n][k] - many[n][k]).abs().max()) for n in one for k in one[n])
    print(f"plan A, 3 steps, one bucket vs 500-element buckets: max |delta| {worst}")
    assert worst <= PARAM_TOL
    for name, (root, _) in runs.items():
        assert max_diff(step_dir(root, 3), ref_file(3))["param"] <= PARAM_TOL, name


def test_buckets_launch_during_the_last_backward(runs: dict) -> None:
    """Every rank launches all its buckets but the last from the backward's hooks, before it ends."""
    results = runs["small"][1]
    assert len(results) == 4
    for r in results:
        got = events(r, "overlap")[-1]
        launches = got["launches"]
        assert len(launches) > 5
        early = [at < got["backward_end"] and by_hook for _, _, at, by_hook in launches]
        print(f"rank {got['rank']}: {sum(early)} of {len(launches)} buckets launched before the backward ended")
        assert all(early[:-1]), launches
