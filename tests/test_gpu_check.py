"""benchmarks/gpu_check.sh runs on lent GPU machines only; its CPU smoke mode runs the same code path in between:
setup, profile, plan on a one-node site without any network section, megatron_patch and megatron-core's own
path, for two models smallest first, within a time budget that skips what would not fit."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.data import REPO


def _benchmark(name: str) -> ModuleType:
    """A benchmarks/ script as a module (the folder is not a package); registered first, as dataclasses need."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


gpu_check = _benchmark("gpu_check")
runtime_speed = _benchmark("runtime_speed")


def run_check(out: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], float]:
    """gpu_check.sh --smoke as on a GPU machine ($OUT set); its output, JSON and wall time."""
    env = {k: v for k, v in os.environ.items() if k != "GPU_CHECK_STARTED"}
    t0 = time.time()
    res = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--smoke", "--steps", "4", "--warmup", "1",
                          "--workdir", str(out / "work"), *args], cwd=REPO, env={**env, "OUT": str(out),
                                                                                   "PYTHON": sys.executable},
                         capture_output=True, text=True, timeout=600)
    return res, json.loads((out / "gpu_check.json").read_text()), time.time() - t0


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], float]:
    return run_check(tmp_path_factory.mktemp("gpu-check"))


def _failed_phases(doc: dict[str, Any]) -> str:
    """Each phase that did not finish, with its detail (a child's stderr tail): what the check's exit 1 means."""
    return "\n".join(f"{m['model']} {p['name']}: {p['status']}: {p.get('detail', '')}"
                     for m in doc["models"] for p in m["phases"] if p["status"] != "ok")


def test_smoke_checks_both_models_smallest_first(smoke: Any) -> None:
    out, doc, _ = smoke
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:] + _failed_phases(doc)
    assert [m["model"] for m in doc["models"]] == ["tiny-llama", "tiny-gpt"] and doc["skipped"] == []
    for m in doc["models"]:
        assert m["dtype"] == "fp32" and m["gbs"] == 4 and m["mbs"] * m["micro_batches"] == 4  # the plan covers it
        assert {p["mbs"] for p in m["profiled"] if p["ok"]} == {1, 2}  # by the profiling job's own function
        assert m["predicted_s"] > 0 and m["measured_s"] > 0 and m["megatron_s"] > 0
        assert m["error_pct"] == pytest.approx((m["predicted_s"] - m["measured_s"]) / m["measured_s"] * 100)
        assert m["rate_ratio"] == pytest.approx(m["megatron_s"] / m["measured_s"])
        assert m["predicted"]["device"] > 0 and m["measured"]["rss"] > 0
        assert m["mfu_ours"] is None  # no peak FLOP/s on the CPU
        # the baseline's own figures: same canonical init, data and Adam, so the same first loss
        assert m["megatron"]["rss"] > 0 and m["megatron"]["allocated"] is None  # CUDA-only figures stay empty
        ours, theirs = m["losses"]["megatron_patch"], m["losses"]["megatron-core"]
        assert all(math.isfinite(x) for x in ours + theirs) and ours[0] == pytest.approx(theirs[0], abs=1e-4)
        assert m["attention"]["megatron_patch"].startswith("SdpaAttention")
        assert "SdpaAttention" in m["attention"]["megatron-core"]
        assert f"{m['model']} on 1 x cpu-smoke (cpu), fp32, global batch 4" in out.stdout
    assert out.stdout.count("step rate megatron_patch / megatron-core:") == 2
    assert "attention: megatron_patch SdpaAttention" in out.stdout


def test_smoke_times_every_phase(smoke: Any) -> None:
    out, doc, wall = smoke
    phases = [doc["setup"]] + [p for m in doc["models"] for p in m["phases"]]
    assert [p["name"] for m in doc["models"] for p in m["phases"]] == list(gpu_check.PHASES) * 2
    assert all(p["status"] == "ok" and p["seconds"] > 0 and p["estimate_s"] > 0 for p in phases)
    assert sum(p["seconds"] for p in phases) <= doc["elapsed_s"] <= min(wall, doc["budget_s"])
    for m in doc["models"]:  # every phase says when it starts and ends, so a slow one is visible
        for name in gpu_check.PHASES:
            assert f"{m['model']} {name}: start (estimate ~" in out.stdout
            assert f"{m['model']} {name}: done in " in out.stdout


def test_smoke_site_is_one_node_without_network(smoke: Any) -> None:
    _, doc, _ = smoke
    (part,) = doc["site"]["partitions"]
    assert part["nodes"] == 1 and part["gpus_per_node"] == 1
    assert "network" not in part and "network" not in doc["site"]  # no inter-node (nor any) fit: still plans


def test_too_small_budget_skips_cleanly(tmp_path: Path) -> None:
    out, doc, wall = run_check(tmp_path, "--budget-s", "30")
    assert out.returncode == 0, out.stderr[-3000:]
    assert doc["models"] == [] and doc["elapsed_s"] <= 30 and wall < 40
    assert {s["model"] for s in doc["skipped"]} >= {"tiny-llama", "tiny-gpt"}
    assert all(s["need_s"] > s["left_s"] for s in doc["skipped"])
    assert "skipped tiny-llama: needs ~" in out.stdout


def test_estimates_scale_the_work_and_keep_the_start_up() -> None:
    runs = {r.spec.name: r for r in gpu_check.model_runs(gpu_check.parse_args([]))}
    assert list(runs) == ["OPT-350M", "GPT-1.3B", "GPT-Neo-2.7B"]  # smallest first
    assert (runs["GPT-1.3B"].gbs, runs["GPT-Neo-2.7B"].mbs) == (32, (1, 2, 4))
    est = gpu_check.Estimator("cuda")
    first = est.estimate("train", runs["OPT-350M"])
    assert first == pytest.approx(gpu_check.SAFETY * est.reference["train"].seconds)  # never below the reference
    est.record("train", runs["GPT-1.3B"], seconds=45.0, fixed_s=15.0)  # 30 s of steps
    ratio = gpu_check.phase_work("train", runs["GPT-Neo-2.7B"]) / gpu_check.phase_work("train", runs["GPT-1.3B"])
    assert 0.9 < ratio < 1.2  # 2.1x the parameters, half the batch
    assert est.estimate("train", runs["GPT-Neo-2.7B"]) == pytest.approx(gpu_check.SAFETY * (15.0 + 30.0 * ratio))
    assert gpu_check.model_runs(gpu_check.parse_args(["--model", "GPT-Neo-2.7B,OPT-350M", "--gbs", "8"]))[0].gbs == 8


def test_phases_that_do_not_fit_or_end_early_are_recorded(tmp_path: Path) -> None:
    check = gpu_check.Check(gpu_check.Budget(60.0, time.time()), True, "fp32", 1, tmp_path, tmp_path / "g.json", None,
                            gpu_check.Estimator("cpu"))
    records: list[Any] = []

    def never(timeout_s: float) -> float:
        raise AssertionError("a phase that does not fit must not start")

    def sleeper(timeout_s: float) -> float:  # a child past its budget is killed and reported as a timeout
        gpu_check.run_child([sys.executable, "-c", "import time; time.sleep(60)"], 1.5, tmp_path / "sleeper")
        return 0.0

    def crash(timeout_s: float) -> float:
        raise ValueError("boom")

    assert not check.phase("train", "m", 100.0, never, records)
    assert not check.phase("baseline", "m", 1.0, sleeper, records)
    assert not check.failed  # a timeout is the budget's doing, not a crash
    assert not check.phase("profile", "m", 1.0, crash, records)
    assert check.failed and records[2].detail.startswith("ValueError: boom")
    assert [(r.name, r.status) for r in records] == [("train", "skipped"), ("baseline", "timeout"), ("profile", "failed")]
    assert records[1].seconds < 10 and records[1].detail.startswith("killed after 2 s")
    doc = json.loads((tmp_path / "g.json").read_text())  # rewritten after every phase
    assert doc["skipped"] == [{"model": "m", "phase": "train", "need_s": 100.0, "left_s": doc["skipped"][0]["left_s"]}]
    assert doc["skipped"][0]["left_s"] < 60


def test_step_memory_reads_old_and_new_step_events() -> None:
    old = [{"mem_bytes": 5}, {"mem_bytes": 7}]  # before the runtime reported reserved and device memory
    assert gpu_check.step_memory(old, cuda=True) == gpu_check.Memory(allocated=7)
    assert gpu_check.step_memory(old, cuda=False) == gpu_check.Memory(rss=7)
    new = [{"mem_bytes": 5, "mem_allocated_bytes": 5, "mem_reserved_bytes": 8, "mem_device_bytes": 9,
            "mem_device_peak_bytes": 10}, {"mem_bytes": 6, "mem_allocated_bytes": 6, "mem_reserved_bytes": 8,
                                           "mem_device_bytes": 9, "mem_device_peak_bytes": 11}]
    assert gpu_check.step_memory(new, cuda=True) == gpu_check.Memory(allocated=6, reserved=8, device=11)
    assert gpu_check.step_memory([{k: v for k, v in e.items() if k != "mem_device_peak_bytes"} for e in new],
                                 cuda=True).device == 9


def test_optimizer_guard_names_every_offending_parameter() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=torch.bfloat16), torch.nn.LayerNorm(4))
    model[0].bias.requires_grad_(False)  # not given to the optimizer: not checked
    bad = runtime_speed.optimizer_param_problems(model.named_parameters(), "cuda", torch.bfloat16)
    assert bad == ["0.weight: on cpu, not cuda", "1.weight: on cpu, not cuda, torch.float32, not torch.bfloat16",
                   "1.bias: on cpu, not cuda, torch.float32, not torch.bfloat16"]
    assert runtime_speed.optimizer_param_problems(model[:1].named_parameters(), "cpu", torch.bfloat16) == []
    with pytest.raises(RuntimeError, match="takes CUDA tensors only"):  # as megatron's own type check
        runtime_speed.check_optimizer_params(model, "cpu", torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"^1 parameter\(s\) not on cpu in torch.float32.*: 0\.weight: "
                                           r"torch.bfloat16, not torch.float32$"):
        runtime_speed.check_optimizer_params(model, "cpu", torch.float32)
    runtime_speed.check_optimizer_params(model[1:], "cpu", torch.float32)  # fp32 on the CPU: megatron's FP32Optimizer


BF16_WORKER = """
import os, torch, torch.distributed as dist
from megatron.core import parallel_state
from megatron_patch import patch
from megatron_patch.local import free_port
from megatron_patch.reference import gpt_model
from sailor_hpc.core.models import get_model
from runtime_speed import optimizer_param_problems
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
dist.init_process_group("gloo", rank=0, world_size=1)
parallel_state.initialize_model_parallel(1, 1)
patch.apply(cpu=True)
patch.seed_model_parallel_rng(1234, 0)
spec = get_model("tiny-gpt")
model = gpt_model(spec, 1234, dtype=torch.bfloat16)
assert type(model).__name__ == "Float16Module", type(model)
assert optimizer_param_problems(model.named_parameters(), "cpu", torch.bfloat16) == []
names = [n for n, _ in model.named_parameters()]
assert "module.embedding.position_embeddings.weight" in names and "module.decoder.final_layernorm.weight" in names
tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_len + 1))
pos = torch.arange(spec.seq_len).expand(2, -1)
mask = torch.triu(torch.ones(spec.seq_len, spec.seq_len, dtype=torch.bool), 1)[None, None]
loss = model(tokens[:, :-1], pos, mask, labels=tokens[:, 1:])
assert loss.dtype == torch.float32, loss.dtype
loss.mean().backward()
assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())
print("ok")
"""


def test_megatron_bf16_model_is_what_its_optimizer_takes() -> None:
    """gpt_model in bf16 as Megatron's training makes it (Float16Module): the LayerNorms and the learned
    position embedding, which megatron builds with torch in fp32, are bf16 too; on CUDA it also moves them."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(REPO), str(REPO / "benchmarks")))}
    res = subprocess.run([sys.executable, "-c", BF16_WORKER], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
