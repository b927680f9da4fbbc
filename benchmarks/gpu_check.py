"""The GPU check: profile a ~1B model on this machine's GPU, simulate a 1-GPU plan from that profile, train it
with megatron_patch, and compare: measured vs predicted step time, MFU, and megatron-core's own MFU.

Run by ``benchmarks/gpu_check.sh`` on a machine with one NVIDIA GPU (no network: megatron-core and submitit
arrive as wheels in ``.whl/`` beside the checkout). ``--smoke`` runs the same steps on the CPU with tiny-gpt
in fp32 (seconds; MFU is then meaningless), which is how the script is kept working without a GPU.

Steps, each what a user of sailor-hpc runs:

1. ``profiler.jobs.compute_job``: the profiling job's own function, in this process (TP 1), into a fresh
   archive: per-layer times, memory and the GPU's fixed overhead, in the plan's dtype.
2. A one-partition site of this GPU (its memory from the driver), the planner on 1 GPU, the simulator's
   predicted iteration time of the chosen plan.
3. ``python -m megatron_patch.launch`` trains the plan ``--steps`` steps; the median step time after
   ``--warmup`` steps is the measurement.
4. megatron-core's own path on the same model, micro-batch size and count (its ``GPTModel`` with its local
   layer spec, its DDP with overlapped reduction, its mixed-precision optimizer): median step time.

MFU = model FLOPs per step (3 x the forward's matrix products, attention scores included, no recompute)
/ (step time x the GPU's dense peak in the plan's dtype).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner import PlanRequest, search  # noqa: E402
from profiler.jobs import ComputeTask, compute_job  # noqa: E402
from sailor_hpc.core.archive import read_archive  # noqa: E402
from sailor_hpc.core.models import ModelSpec, get_model  # noqa: E402
from sailor_hpc.core.site import Site, load_site_dict  # noqa: E402
from simulator import SimOptions, simulate  # noqa: E402

# dense tensor-core peak, TFLOP/s, by dtype (vendor data sheets, SXM parts)
PEAK_TFLOPS = {"H100": {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7},
               "H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7},
               "GH200": {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7},
               "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}}


@dataclass(frozen=True)
class Device:
    kind: str  # "cuda" or "cpu"
    gpu_type: str  # the site's (and archive's) name for it
    memory_gib: float
    peak_tflops: float | None


def say_torch() -> None:
    """The torch build and device this check runs on, first thing (in this process: another interpreter
    only to print it cost seconds of torch import)."""
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda,
          torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU", flush=True)


def detect(smoke: bool, dtype: str, peak: float | None) -> Device:
    import torch
    if smoke:
        return Device("cpu", "cpu-smoke", 16.0, peak)
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --smoke for the CPU check")
    name = torch.cuda.get_device_name()
    total = torch.cuda.mem_get_info()[1] / 2**30
    family = next((k for k in sorted(PEAK_TFLOPS, key=len, reverse=True) if k in name.upper()), None)
    gpu_type = f"{family or 'GPU'}-{round(total)}"
    return Device("cuda", gpu_type, total, peak or (PEAK_TFLOPS[family][dtype] if family else None))


def step_flops(spec: ModelSpec, tokens: int) -> float:
    """Training FLOPs of ``tokens`` tokens: 3 x (2 x weights' multiply-adds + attention scores and mixing)."""
    h, f, s, v = spec.hidden_size, spec.ffn_hidden_size, spec.seq_len, spec.vocab_size
    kv = (spec.num_kv_heads or spec.num_heads) * spec.head_dim
    per_layer = 2 * (h * (h + 2 * kv) + h * h + (3 if spec.family == "llama" else 2) * h * f) + 4 * s * h
    return 3.0 * tokens * (spec.num_layers * per_layer + 2 * h * v)


def site_of(dev: Device) -> Site:
    return load_site_dict({"name": "gpu-check", "gpu_types": {dev.gpu_type: {"memory_gib": dev.memory_gib,
                                                                             "dtypes": ["fp32", "bf16", "fp16"]}},
                           "partitions": [{"name": "gpu", "gpu_type": dev.gpu_type, "gres": "gpu:gpu", "nodes": 1,
                                           "gpus_per_node": 1, "cost_per_gpu_hour": 1.0}]}, source="<gpu-check>")


def profile(spec: ModelSpec, dev: Device, archive: Path, mbs: list[int], dtype: str) -> dict[str, Any]:
    res = compute_job(ComputeTask(model=spec.name, partition="gpu", gpu_key=dev.gpu_type, tp=1, mbs=tuple(mbs),
                                  archive=str(archive), cpu=dev.kind == "cpu", sweep="gpu-check", dtype=dtype,
                                  warmup=3, iters=10))
    assert res is not None  # rank 0
    return res


def fmt(value: float | None) -> str:
    return f"{value:8.3f}" if value is not None else f"{'-':>8}"


def median_after(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:] if len(times) > warmup else times)


def train_ours(plan_path: Path, spec: ModelSpec, data: str, steps: int, dev: Device) -> list[dict[str, Any]]:
    """The step events of a megatron_patch run of the plan (iter_s, mem_bytes, loss, ...)."""
    cmd = [sys.executable, "-m", "megatron_patch.launch", "--plan", str(plan_path), "--model", spec.name,
           "--data", data, "--steps", str(steps), "--device", dev.kind]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT),
                                                                                         os.environ.get("PYTHONPATH"))))})
    if out.returncode != 0:
        raise SystemExit(f"megatron_patch.launch failed ({out.returncode}):\n{out.stderr[-4000:]}")
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return [e for e in events if e.get("event") == "step"]


def baseline_steps(spec: ModelSpec, data: str, mbs: int, micro: int, steps: int, device: str,
                   dtype: str) -> list[float]:
    """Step times of megatron-core's own path (its local spec's attention), in a process of its own."""
    cmd = [sys.executable, __file__, "--baseline", json.dumps({"model": spec.name, "data": data, "mbs": mbs,
                                                                "micro": micro, "steps": steps, "device": device,
                                                                "dtype": dtype})]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"megatron-core's baseline failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["times"]


def run_baseline(spec_json: str) -> int:
    """The baseline process: one rank, megatron-core's DDP and optimizer (benchmarks/runtime_speed.py)."""
    import time

    import torch
    import torch.distributed as dist
    from runtime_speed import SEED, megatron_core_step  # the sibling benchmark (same folder)

    from megatron_patch.data import GlobalSamples
    a = json.loads(spec_json)
    spec = get_model(a["model"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    if a["device"] == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if a["device"] == "cuda" else "gloo", rank=0, world_size=1)
    step = megatron_core_step(spec, 1, GlobalSamples(a["data"], spec.seq_len, SEED), mbs=a["mbs"], micro=a["micro"],
                              device=a["device"], dtype=a["dtype"], attention="megatron")
    times = []
    for _ in range(a["steps"]):
        if a["device"] == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()  # returns the loss as a float: the step has ended on the device
        times.append(time.perf_counter() - t0)
    print(json.dumps({"times": times}))
    dist.destroy_process_group()
    return 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--baseline":
        return run_baseline(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny-gpt on the CPU in fp32 (keeps the script working)")
    ap.add_argument("--model", default=None, help="catalog model (default GPT-1.3B; tiny-gpt with --smoke)")
    ap.add_argument("--dtype", default=None, help="default bf16 (fp32 with --smoke)")
    ap.add_argument("--mbs", default=None, help="micro-batch sizes to profile (default 1,2,4,8; 1,2 with --smoke)")
    ap.add_argument("--gbs", type=int, default=None, help="global batch (default 32; 4 with --smoke)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense peak when it is not known")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    say_torch()
    smoke = args.smoke
    spec = get_model(args.model or ("tiny-gpt" if smoke else "GPT-1.3B"))
    dtype = args.dtype or ("fp32" if smoke else "bf16")
    mbs = [int(x) for x in (args.mbs or ("1,2" if smoke else "1,2,4,8")).split(",")]
    gbs = args.gbs or (4 if smoke else 32)
    dev = detect(smoke, dtype, args.peak_tflops)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    from megatron_patch.data import build_dataset, shipped_texts
    data = str(work / "data")
    build_dataset(data, shipped_texts())  # here, not in a child process: torch and megatron are loaded already

    prof = profile(spec, dev, work / "profiles.h5", mbs, dtype)
    site, archive = site_of(dev), read_archive(work / "profiles.h5")
    best = search(site, archive, PlanRequest(model=spec.name, global_batch_size=gbs, dtype=dtype,
                                             available={"gpu": 1}, top_k=1)).candidates[0]
    plan_path = work / "plan.json"
    best.plan.save(plan_path)
    pipe = best.plan.pipelines[0]
    predicted_run = simulate(best.plan, site, archive, options=SimOptions.megatron_patch())  # the runtime's model
    predicted = predicted_run.iteration_time_s

    steps = train_ours(plan_path, spec, data, args.steps, dev)
    ours = median_after([e["iter_s"] for e in steps], args.warmup)
    memory = max(e["mem_bytes"] for e in steps)
    theirs = median_after(baseline_steps(spec, data, pipe.micro_batch_size, pipe.num_micro_batches, args.steps,
                                         dev.kind, dtype), args.warmup)

    flops = step_flops(spec, gbs * spec.seq_len)
    mfu = {k: (flops / t / (dev.peak_tflops * 1e12) if dev.peak_tflops else None)
           for k, t in (("ours", ours), ("megatron", theirs))}
    result = {"device": dev.gpu_type, "model": spec.name, "dtype": dtype, "gbs": gbs, "mbs": pipe.micro_batch_size,
              "micro_batches": pipe.num_micro_batches, "profiled": prof["points"], "predicted_s": predicted,
              "measured_s": ours, "error_pct": (predicted - ours) / ours * 100, "megatron_s": theirs,
              "mfu_ours": mfu["ours"], "mfu_megatron": mfu["megatron"], "peak_tflops": dev.peak_tflops,
              "memory_predicted_gib": predicted_run.peak_memory_bytes / 2**30, "memory_measured_gib": memory / 2**30}
    print(f"{spec.name} on 1 x {dev.gpu_type} ({dev.kind}), {dtype}, global batch {gbs} = "
          f"{pipe.num_micro_batches} x micro-batch {pipe.micro_batch_size}, median of steps {args.warmup + 1}.."
          f"{args.steps}")
    print(f"{'':28}{'step s':>9}{'MFU':>8}")
    print(f"{'simulator (predicted)':28}{predicted:9.3f}{'':>8}")
    print(f"{'megatron_patch (measured)':28}{ours:9.3f}{fmt(mfu['ours'])}   prediction off by "
          f"{result['error_pct']:+.1f} %")
    print(f"{'megatron-core own path':28}{theirs:9.3f}{fmt(mfu['megatron'])}")
    print(f"peak memory: predicted {result['memory_predicted_gib']:.2f} GiB, measured {result['memory_measured_gib']:.2f}"
          f" GiB ({'max_memory_allocated' if dev.kind == 'cuda' else 'peak RSS'})")
    if mfu["ours"] and mfu["megatron"]:
        print(f"ours / megatron-core MFU: {mfu['ours'] / mfu['megatron']:.2f} (target >= 0.9); prediction target 5 %")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
