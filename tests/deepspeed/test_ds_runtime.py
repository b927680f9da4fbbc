"""DeepSpeed trains what megatron_patch trains, and a run moves between the two runtimes.

One chain of real launches (tiny-gpt, fp32, clipping and weight decay active): megatron_patch on a
uniform PP2 x DP2 plan for 10 steps (the reference: megatron_patch is itself checked against a single
process in tests/megatron_patch); DeepSpeed ZeRO 1 on the same plan for 10 steps; its step-5 checkpoint
continued by megatron_patch on a heterogeneous plan DeepSpeed cannot express; and megatron_patch's step-5
checkpoint continued by DeepSpeed (steps 6-10, saved at 10) under ZeRO 1 on the same plan and, on two
ranks, under ZeRO 2 and ZeRO 3 on a one-stage DP 2 plan (DeepSpeed's pipeline engine runs ZeRO 0 and 1
only). The checkpoints are layout-free, so every run is compared with the reference's step 10 whatever
its plan. Each launch costs process start-up and imports far more than its steps, so the chain shares
them. Parameters and both Adam moments are compared after step 10 (1e-6, the runtime's fp32 bound; Adam's
eps is 1e-5 for the reason given in tests/megatron_patch/test_exactness.py).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_patch import local
from sailor_hpc.core.checkpoint import step_dir
from sailor_hpc.core.deepspeed_plan import with_zero_stage
from sailor_hpc.core.ds_config import write_ds_config
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from tests.conftest import slurm_missing
from tests.megatron_patch.conftest import ADAM, PLAN_A

# found, not imported: DeepSpeed is imported by the ranks only, never by the test process (collection stays fast)
if importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("megatron") is None:
    slurm_missing("needs the deepspeed and runtime extras (make install-test)", module=True)

TOL = 1e-6
STEPS = 10
_STAGES = (Stage(0, 2, 1, "A100-40"), Stage(3, 5, 1, "A100-40"))
UNIFORM = Plan("tiny-gpt", 8, (Pipeline(2, 2, _STAGES),) * 2)  # PP2 x DP2, the tied embedding split
ONE_STAGE = Plan("tiny-gpt", 8, (Pipeline(2, 2, (Stage(0, 5, 1, "A100-40"),)),) * 2)  # DP 2: ZeRO 2 and 3


def _launch(module: str, plan: Plan, root: Path, name: str, steps: int, *extra: str) -> list[local.RankResult]:
    path = root / f"{name}.json"
    plan.save(path)
    argv = ["-m", module, "--plan", str(path), "--model", plan.model, "--data", str(root / "data"),
            "--save", str(root / name), "--steps", str(steps), *ADAM, *extra]
    results = local.run(argv, plan.num_gpus, timeout=600, fork=True)
    for r in results:
        assert r.returncode == 0, f"{name} rank {r.rank} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return results


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory, shipped_data: str) -> dict[str, object]:
    root = tmp_path_factory.mktemp("ds_chain")
    for suffix in (".bin", ".idx"):
        (root / f"data{suffix}").symlink_to(shipped_data + suffix)
    logs = {
        "mp": _launch("megatron_patch.launch", UNIFORM, root, "mp", STEPS, "--save-interval", "5"),
        "ds1": _launch("megatron_patch.ds_runtime.launch", with_zero_stage(UNIFORM, 1), root, "ds1", STEPS,
                       "--save-interval", "5"),
    }
    logs["resized"] = _launch("megatron_patch.launch", PLAN_A, root, "resized", STEPS, "--load",
                              str(step_dir(root / "ds1", 5)))
    resumed = {"back": with_zero_stage(UNIFORM, 1), "zero2": with_zero_stage(ONE_STAGE, 2),
               "zero3": with_zero_stage(ONE_STAGE, 3)}
    for name, plan in resumed.items():
        logs[name] = _launch("megatron_patch.ds_runtime.launch", plan, root, name, STEPS, "--load",
                             str(step_dir(root / "mp", 5)))
    return {"root": root, "logs": logs}


def events(result: local.RankResult, kind: str) -> list[dict]:
    """The runtime's JSON events (DeepSpeed prints lines of its own on stdout too)."""
    return [e for e in map(json.loads, (x for x in result.stdout.splitlines() if x.startswith("{")))
            if e.get("event") == kind]


def _max_diff(a: Path, b: Path) -> dict[str, float]:
    import torch

    from megatron_patch.checkpoint_io import FIELDS, CheckpointReader
    x, y = CheckpointReader(str(a)).full_state(), CheckpointReader(str(b)).full_state()
    assert set(x) == set(y), sorted(set(x) ^ set(y))
    return {k: max(float(torch.max(torch.abs(x[n][k] - y[n][k]))) for n in x) for k in FIELDS}


@pytest.mark.parametrize("run", ["ds1", "resized", "back", "zero2", "zero3"])
def test_deepspeed_and_resize_match_megatron_patch(chain: dict, run: str) -> None:
    root: Path = chain["root"]  # type: ignore[assignment]
    diff = _max_diff(step_dir(root / run, STEPS), step_dir(root / "mp", STEPS))
    print(f"{run} after step {STEPS}: max |delta| vs megatron_patch {diff}")
    assert max(diff.values()) <= TOL


def test_logged_losses_match(chain: dict) -> None:
    logs: dict = chain["logs"]  # type: ignore[assignment]

    def losses(name: str) -> list[float]:
        return [e["loss"] for e in events(logs[name][0], "step")]
    ref = losses("mp")
    assert len(ref) == STEPS
    assert losses("ds1") == pytest.approx(ref, abs=1e-5)
    for name in ("back", "zero2", "zero3"):
        assert losses(name) == pytest.approx(ref[5:], abs=1e-5), name
    assert [e["deepspeed"] for e in events(logs["ds1"][0], "start")][0].startswith("0.19")


def test_deepspeed_refuses_a_plan_it_cannot_run(tmp_path: Path) -> None:
    PLAN_A.save(tmp_path / "a.json")
    res = subprocess.run([sys.executable, "-m", "megatron_patch.ds_runtime.launch", "--plan", str(tmp_path / "a.json"),
                          "--model", "tiny-gpt", "--data", "x", "--steps", "1", "--dry-run"],
                         cwd=local.REPO, env=local.rank_env(0, 4, local.free_port()), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and "DeepSpeed cannot run" in res.stderr and "micro-batch" in res.stderr


CHECK = r"""
import importlib, json, sys, torch, deepspeed
# on the CPU, skip DeepSpeed's compile of its inference-only shm all-reduce op (tests/jobs/user_entry_script.py)
vars(importlib.import_module("deepspeed.comm.torch"))["build_shm_op"] = lambda: None
from sailor_hpc.core.training import LrSchedule
steps = int(sys.argv[1])
ref = LrSchedule(lr=1e-3, min_lr=0.0, style="linear", warmup=2 * 8, decay=steps * 8)
for cfg_path in sys.argv[2:]:
    cfg = json.load(open(cfg_path))
    model = torch.nn.Linear(4, 4)
    engine, opt, _, sched = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg_path)
    got = []
    for step in range(steps):
        got.append(opt.param_groups[0]["lr"])
        for _ in range(cfg["gradient_accumulation_steps"]):
            loss = engine(torch.ones(cfg["train_micro_batch_size_per_gpu"], 4)).pow(2).mean()
            engine.backward(loss)
            engine.step()
    print(json.dumps({"got": got, "want": [ref.lr_at(s * 8) for s in range(steps)],
                      "zero": engine.zero_optimization_stage()}), flush=True)
"""


def test_written_config_runs_in_a_users_deepspeed_script(tmp_path: Path) -> None:
    """The ds_config as written (ZeRO 0 and 3), in a plain DeepSpeed script (one rank): DeepSpeed accepts it,
    and its scheduler gives Megatron's curve (warm-up then linear decay) one step later: DeepSpeed applies
    the first rate after the first optimizer step (step 0 runs at the warm-up's start, 0)."""
    paths = []
    for zero in (0, 3):
        one = with_zero_stage(Plan("tiny-gpt", 8, (Pipeline(2, 4, (Stage(0, 5, 1, "A100-40"),)),)), zero)
        paths.append(tmp_path / f"ds{zero}.json")
        write_ds_config(paths[-1], one, {"lr_warmup_iters": 2, "lr_decay_style": "linear"}, steps=6)
    res = subprocess.run([sys.executable, "-c", CHECK, "6", *map(str, paths)], cwd=local.REPO,
                         env=local.rank_env(0, 1, local.free_port(), {"DS_ACCELERATOR": "cpu"}),
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    outs = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert [o["zero"] for o in outs] == [0, 3]
    for out in outs:
        assert out["got"] == pytest.approx([0.0, *out["want"][:-1]], abs=1e-12)
