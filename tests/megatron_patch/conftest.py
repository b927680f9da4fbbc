"""Shared pieces of the runtime tests: the dataset, the three heterogeneous plans, the reference run.

Training runs in subprocesses (``megatron_patch.local`` starts gloo ranks with torchrun's variables),
so the pytest process never initialises torch.distributed or megatron's globals; building a dataset
needs neither and runs in process. The ranks and reference runs are forked from a zygote that imported
torch and megatron-core once (``megatron_patch.zygote``; ``fork=True``), not started as new interpreters:
the same programs, 3-4 s of CPU less each; a process that checks its own imports or memory starts anew.
One reference run (``REF_STEPS`` steps, snapshots up to ``REF_SNAPSHOTS``) serves every test that compares
with the single-process trajectory from the initialisation. All runs use Adam with eps = 1e-5 (see
test_exactness.py for why) and OMP_NUM_THREADS=1.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_patch import local
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from sailor_hpc.core.plan_io import load_plan
from tests.shared_inputs import built_once, shipped_dataset

MODEL = "tiny-gpt"  # 4 blocks: pipeline layers 0 (embedding), 1..4, 5 (final norm + head + loss)
GLOBAL_BATCH = 8
ADAM = ["--adam-eps", "1e-5", "--lr", "1e-3", "--clip-grad", "1.0", "--weight-decay", "0.01"]
REF_STEPS = 50  # losses of every step (test_precision compares 50-step curves)
REF_SNAPSHOTS = 20  # full states (ref_step_N.pt) of steps 1..20


def _stage(first: int, last: int, tp: int) -> Stage:
    return Stage(first, last, tp, "A100-40")


# A: different stage counts (2 | 1), uneven split (2|4 layers), TP 2 in pipeline 1, micro-batches 3 vs 1
PLAN_A = Plan(MODEL, GLOBAL_BATCH, (Pipeline(2, 3, (_stage(0, 1, 1), _stage(2, 5, 1))),
                                    Pipeline(2, 1, (_stage(0, 5, 2),))))
# B: a TP mismatch inside a pipeline (TP2 -> TP1, tied embedding split over both), micro-batches 2x2 vs 4x1
PLAN_B = Plan(MODEL, GLOBAL_BATCH, (Pipeline(2, 2, (_stage(0, 3, 2), _stage(4, 5, 1))),
                                    Pipeline(1, 4, (_stage(0, 5, 1),))))
# C: three stages (embedding alone) vs one, micro-batches 1x2 vs 3x2
PLAN_C = Plan(MODEL, GLOBAL_BATCH, (Pipeline(2, 1, (_stage(0, 0, 1), _stage(1, 3, 1), _stage(4, 5, 1))),
                                    Pipeline(2, 3, (_stage(0, 5, 1),))))
# two ranks: two one-stage pipelines, micro-batches 3x2 vs 1x2 (the smallest world that still has a non-zero rank)
PLAN_2 = Plan(MODEL, GLOBAL_BATCH, (Pipeline(2, 3, (_stage(0, 5, 1),)), Pipeline(1, 2, (_stage(0, 5, 1),))))
PLANS = {"A": PLAN_A, "B": PLAN_B, "C": PLAN_C, "2": PLAN_2}


@dataclass
class Env:
    root: Path
    data: str
    plans: dict[str, Path]
    ref: Path  # ref_step_N.pt for N in 1..REF_SNAPSHOTS, losses.json (REF_STEPS losses)


def python(*args: str, timeout: float = 300, fork: bool = False) -> subprocess.CompletedProcess:
    """``python *args`` as one rank would run (``fork``: forked from the zygote)."""
    if fork:
        res = local.run(list(args), 1, timeout=timeout, fork=True)[0]
        return subprocess.CompletedProcess([sys.executable, *args], res.returncode, res.stdout, res.stderr)
    return subprocess.run([sys.executable, *args], cwd=local.REPO, env=local.rank_env(0, 1, local.free_port()),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def shipped_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    pytest.importorskip("megatron.core")
    return shipped_dataset(tmp_path_factory)


@pytest.fixture(scope="session")
def runtime_env(tmp_path_factory: pytest.TempPathFactory, shipped_data: str) -> Env:
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp("runtime")
    data = shipped_data
    snapshots = ",".join(map(str, range(1, REF_SNAPSHOTS + 1)))

    def reference(out: Path) -> None:
        res = python("-m", "megatron_patch.reference", "--model", MODEL, "--data", data, "--global-batch",
                     str(GLOBAL_BATCH), "--steps", str(REF_STEPS), "--snapshots", snapshots, "--out", str(out),
                     *ADAM, timeout=600, fork=True)
        assert res.returncode == 0, res.stderr[-3000:]

    ref = built_once(tmp_path_factory, "runtime-reference", reference)  # the same run for every worker
    env = Env(root, data, {}, ref)
    for name, plan in PLANS.items():
        add_plan(env, name, plan)
    return env


def add_plan(env: Env, name: str, plan: Plan) -> None:
    env.plans[name] = env.root / f"plan_{name}.json"
    plan.save(env.plans[name])


def launch_args(env: Env, plan: str, steps: int, save: Path, *extra: str) -> list[str]:
    return ["-m", "megatron_patch.launch", "--plan", str(env.plans[plan]), "--model", MODEL, "--data", env.data,
            "--save", str(save), "--steps", str(steps), *ADAM, *extra]


def launch(env: Env, plan: str, steps: int, save: Path, *extra: str, expect: int | None = 0,
           program: list[str] | None = None, extra_env: dict[str, str] | None = None,
           grace: float = 20, timeout: float = 300) -> list[local.RankResult]:
    """Train ``plan`` with local gloo ranks (one per GPU of the plan); each must exit with ``expect``."""
    argv = launch_args(env, plan, steps, save, *extra)
    if program is not None:
        argv = [*program, *argv[2:]]
    results = local.run(argv, load_plan(env.plans[plan]).num_gpus, extra_env, timeout=timeout, grace=grace,
                        fork=True)
    for r in results if expect is not None else ():
        assert r.returncode == expect, f"rank {r.rank} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return results


def events(result: local.RankResult, kind: str) -> list[dict]:
    return [e for e in map(json.loads, filter(None, result.stdout.splitlines())) if e.get("event") == kind]


def max_diff(ckpt: Path, ref_file: Path) -> dict[str, float]:
    """max |checkpoint - reference| over all parameters, per field (param, exp_avg, exp_avg_sq)."""
    import torch

    from megatron_patch.checkpoint_io import FIELDS, CheckpointReader
    got = CheckpointReader(str(ckpt)).full_state()
    ref = torch.load(ref_file, weights_only=True)
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    return {k: max(float((got[n][k] - ref[n][k]).abs().max()) for n in ref) for k in FIELDS}


@pytest.fixture(scope="session")
def ref_file(runtime_env: Env) -> Callable[[int], Path]:
    return lambda step: runtime_env.ref / f"ref_step_{step}.pt"


def memory_growth(setup: str, measured: str, timeout: float = 300) -> dict[str, int]:
    """How a fresh Python process's memory grows while running ``measured`` (after ``setup``), in bytes.

    ``peak``: highest RSS above the RSS before (the high-water mark is reset after ``setup``), file pages
    of memory maps included; ``private``: anonymous RSS after minus before (what ``measured`` keeps
    materialised itself; its temporaries are gone)."""
    code = (setup + "\nfrom megatron_patch import memory as _m\n_m.reset_peak()\n_b, _p = _m.rss(), _m.private_rss()\n"
            + measured + "\nprint(_m.peak_rss() - _b, _m.private_rss() - _p)")
    res = python("-c", code, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    peak, private = map(int, res.stdout.strip().splitlines()[-1].split())
    return {"peak": peak, "private": private}
