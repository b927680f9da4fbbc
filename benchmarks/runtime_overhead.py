"""Overhead of the heterogeneous runtime on homogeneous plans, against plain torch, on CPU (gloo).

Same model, same data, same optimizer (AdamW + global-norm clip), 2 ranks, time per training step:

- data parallel, 2 pipelines x 1 stage: ``megatron_patch`` (1F1B schedule + sample-weighted per-chunk
  sync) vs ``torch.nn.parallel.DistributedDataParallel`` with gradient accumulation (no_sync);
- pipeline parallel, 1 pipeline x 2 stages: ``megatron_patch`` (megatron's 1F1B + the plan's p2p) vs
  ``torch.distributed.pipelining.Schedule1F1B``.

Both sides run the same megatron-core layers (``megatron_patch.model.build_stage_module``), so the
ratio measures the runtime around them. The model is a GPT of 4 blocks, hidden 128, 4 heads, ffn 512,
vocab 256, sequence 64 (``--model tiny-gpt`` for the catalog's smaller one). Both sides live in the
same two processes and alternate (one step each by default), and the ratio is the median of the
ratios of neighbouring blocks, so a busy host slows both alike. NCCL/GPU is not
measured: no GPU in this environment.

    .venv/bin/python benchmarks/runtime_overhead.py [--steps 1] [--rounds 40] [--model tiny-gpt]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_patch import local  # noqa: E402
from sailor_hpc.core.models import ModelSpec, get_model  # noqa: E402
from sailor_hpc.core.plan import Pipeline, Plan, Stage  # noqa: E402

BENCH = ModelSpec("bench-gpt", num_layers=4, hidden_size=128, num_heads=4, ffn_hidden_size=512, vocab_size=256,
                  seq_len=64, family="gpt")
MBS, MICRO = 8, 4  # per pipeline: 4 micro-batches of 8 samples


def spec_of(name: str) -> ModelSpec:
    return BENCH if name == BENCH.name else get_model(name)


def plan_for(kind: str, spec: ModelSpec) -> Plan:
    last = spec.num_pipeline_layers - 1
    st = lambda a, b: Stage(a, b, 1, "CPU")  # noqa: E731
    if kind == "dp":
        return Plan("tiny-gpt", 2 * MBS * MICRO, (Pipeline(MBS, MICRO, (st(0, last),)),) * 2)
    return Plan("tiny-gpt", MBS * MICRO, (Pipeline(MBS, MICRO, (st(0, last // 2), st(last // 2 + 1, last))),))


# ---------------------------------------------------------------- rank side

def _ours(kind: str, spec: ModelSpec, samples: object) -> Callable[[], float]:
    from megatron_patch.engine import Trainer
    trainer = Trainer(plan_for(kind, spec), samples, spec=spec)
    return lambda: trainer.train_step().seconds


def _adam(params: list) -> tuple:
    import torch

    from megatron_patch.options import AdamConfig
    c = AdamConfig()
    return torch.optim.AdamW(params, lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps, weight_decay=c.weight_decay,
                             foreach=False), c.clip_grad


def _ddp(spec: ModelSpec, samples: object) -> Callable[[], float]:
    import torch
    import torch.distributed as dist

    from megatron_patch import patch
    from megatron_patch.model import build_stage_module
    patch.apply(cpu=True)
    patch.seed_model_parallel_rng(1234, 0)
    module = build_stage_module(spec, 0, spec.num_pipeline_layers - 1, device="cpu")
    ddp = torch.nn.parallel.DistributedDataParallel(module)
    opt, clip = _adam(list(ddp.parameters()))
    rank, g = dist.get_rank(), 2 * MBS * MICRO
    consumed = 0

    def step() -> float:
        nonlocal consumed
        t0 = time.perf_counter()
        data = samples.batch(consumed + rank * MBS * MICRO, MBS * MICRO)
        for m in range(MICRO):
            chunk = data[m * MBS:(m + 1) * MBS]
            ctx = ddp.no_sync() if m < MICRO - 1 else torch.enable_grad()
            with ctx:
                loss = ddp(tokens=chunk[:, :-1], labels=chunk[:, 1:]).mean() / MICRO
                loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        consumed += g
        return time.perf_counter() - t0
    return step


def _torch_1f1b(spec: ModelSpec, samples: object) -> Callable[[], float]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from megatron_patch import patch
    from megatron_patch.model import OutputLayer, build_stage_module
    patch.apply(cpu=True)
    patch.seed_model_parallel_rng(1234, 0)
    rank, last = dist.get_rank(), spec.num_pipeline_layers - 1
    first_layer, last_layer = (0, last // 2) if rank == 0 else (last // 2 + 1, last)
    inner = build_stage_module(spec, first_layer, last_layer, device="cpu")

    class Stage(torch.nn.Module):  # plain-torch interface: tensors in, tensors (logits on the last stage) out
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = None
            for layer in self.inner.layers:
                if layer.index == 0:
                    pos = torch.arange(x.shape[1]).unsqueeze(0).expand_as(x)
                    h = layer(x, pos)
                elif isinstance(layer, OutputLayer):
                    return layer.linear(h)[0]
                elif hasattr(layer, "layer"):
                    h = layer(x if h is None else h, self.inner._causal_mask(spec.seq_len), None)
                else:
                    h = layer(x if h is None else h)
            return h

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.t().reshape(-1))

    stage = PipelineStage(Stage(), rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=MICRO, loss_fn=loss_fn)
    opt, clip = _adam(list(inner.parameters()))
    consumed = 0

    def step() -> float:
        nonlocal consumed
        t0 = time.perf_counter()
        data = samples.batch(consumed, MBS * MICRO)
        if rank == 0:
            schedule.step(data[:, :-1].contiguous())
        else:
            schedule.step(target=data[:, 1:].contiguous())
        # plain torch has no cross-stage norm: one scalar all-reduce, as any correct clip needs
        sq = torch.stack([p.grad.pow(2).sum() for p in inner.parameters()]).sum().reshape(1)
        dist.all_reduce(sq)
        coef = min(1.0, clip / (float(sq.sqrt()) + 1e-6))
        for p in inner.parameters():
            p.grad.mul_(coef)
        opt.step()
        opt.zero_grad(set_to_none=True)
        consumed += MBS * MICRO
        return time.perf_counter() - t0
    return step


def rank_main() -> None:
    """Both sides in the same two processes, alternating blocks of steps: equal conditions on a busy host."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from megatron_patch.data import GlobalSamples
    kind, model, steps, rounds, data = (os.environ["BENCH_KIND"], os.environ["BENCH_MODEL"],
                                        int(os.environ["BENCH_STEPS"]), int(os.environ["BENCH_ROUNDS"]),
                                        os.environ["BENCH_DATA"])
    dist.init_process_group("gloo")
    spec = spec_of(model)
    samples = GlobalSamples(data, spec.seq_len)
    sides = {"ours": _ours(kind, spec, samples),
             "torch": _ddp(spec, samples) if kind == "dp" else _torch_1f1b(spec, samples)}
    for fn in sides.values():  # warm-up: first steps pay for connections and allocations
        for _ in range(2):
            fn()
    times: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            times[name] += [fn() for _ in range(steps)]
    print(json.dumps({"rank": dist.get_rank(), "times": times}), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver

def measure(kind: str, model: str, steps: int, rounds: int, data: str) -> tuple[float, float, float]:
    """Median step time (the slower rank's) of ours and torch's, and the median ratio of neighbouring blocks."""
    env = {"BENCH_KIND": kind, "BENCH_MODEL": model, "BENCH_STEPS": str(steps), "BENCH_ROUNDS": str(rounds),
           "BENCH_DATA": data, "BENCH_RANK_MAIN": "1"}
    results = local.run([str(Path(__file__).resolve())], 2, env, timeout=1800)
    per_rank = []
    for r in results:
        if r.returncode != 0:
            raise RuntimeError(f"{kind} rank {r.rank} failed:\n{r.stderr[-3000:]}")
        per_rank.append(json.loads(r.stdout.strip().splitlines()[-1])["times"])
    slower = {side: [max(ts) for ts in zip(*(t[side] for t in per_rank))] for side in ("ours", "torch")}
    blocks = [(sum(slower["ours"][i:i + steps]), sum(slower["torch"][i:i + steps]))
              for i in range(0, len(slower["ours"]), steps)]
    return (statistics.median(slower["ours"]), statistics.median(slower["torch"]),
            statistics.median(o / t for o, t in blocks))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1, help="steps per block")
    ap.add_argument("--rounds", type=int, default=40, help="alternating blocks per side")
    ap.add_argument("--model", default=BENCH.name, help=f"{BENCH.name} (default) or a catalog model")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "data")
        local.build_dataset(data)
        rows = []
        for kind, baseline in (("dp", "torch-ddp"), ("pp", "torch-1f1b")):
            rows.append((kind, baseline, *measure(kind, args.model, args.steps, args.rounds, data)))
    print(f"model {args.model}, 2 gloo ranks, OMP_NUM_THREADS=1, {args.rounds} alternating blocks of {args.steps} "
          f"steps per side, {MICRO} micro-batches of {MBS} per pipeline; median s/step of the slower rank")
    print(f"{'plan':<22}{'baseline':<12}{'ours s/step':>12}{'torch s/step':>13}{'ratio':>7}")
    for kind, baseline, o, t, ratio in rows:
        plan = "2 pipelines x 1 stage" if kind == "dp" else "1 pipeline x 2 stages"
        print(f"{plan:<22}{baseline:<12}{o:>12.4f}{t:>13.4f}{ratio:>7.3f}")
    print("ratio = median over neighbouring blocks of ours/torch (each pair ran back to back)")
    print("goal: ratio <= 1.10 (NCCL/GPU not measured: no GPU in this environment)")
    return 0


if __name__ == "__main__":
    local.self_launching(main, rank_main)
