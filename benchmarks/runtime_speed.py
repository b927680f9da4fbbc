"""Training speed and memory of megatron_patch against megatron-core's own homogeneous path, on CPU (gloo).

Same GPT (4 blocks, hidden 256, 4 heads, ffn 1024, byte vocabulary 256), same data, same batches
(2 micro-batches per rank per step, 4096 tokens per rank), fp32, at sequence length 512 and 2048:

- ``ours``: ``megatron_patch.engine.Trainer`` on a homogeneous plan: 2 pipelines x 1 stage (DP 2,
  two ranks) and 1 pipeline (one rank);
- ``megatron``: megatron-core's own path on the same world: ``initialize_model_parallel``, its
  ``GPTModel``, its ``DistributedDataParallel`` (``overlap_grad_reduce``: bucketed all-reduce during
  backward), its optimizer (``get_megatron_optimizer``: Adam without the distributed optimizer; torch's
  AdamW underneath, as megatron falls back to without TE/apex), its no-pipelining schedule and
  ``finalize_model_grads``. Its CUDA calls see the runtime's CPU proxy (patch P7).

Each configuration runs in fresh processes (so peak RSS is its own): 1 warm-up step, then timed steps;
tokens/s counts all ranks' tokens over the median step time of the slower rank; peak RSS is the
largest rank's high-water mark. Also printed: the peak memory of one forward+backward of one
transformer layer at 2048 with megatron's unfused ``DotProductAttention`` (materialises the [b, heads,
s, s] scores) and with ``torch.nn.functional.scaled_dot_product_attention`` in its place.

    .venv/bin/python benchmarks/runtime_speed.py [--steps 3] [--seq 512,2048]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_patch import local  # noqa: E402
from sailor_hpc.models import ModelSpec  # noqa: E402
from sailor_hpc.plan import Pipeline, Plan, Stage  # noqa: E402

MICRO = 2  # micro-batches per rank per step
TOKENS_PER_MICRO = 2048  # micro-batch size = TOKENS_PER_MICRO // seq
SEED = 1234
# megatron modules that call torch.cuda on the DDP/optimizer path the runtime does not use
MEGATRON_CPU_MODULES = ("megatron.core.distributed.param_and_grad_buffer",
                        "megatron.core.distributed.distributed_data_parallel",
                        "megatron.core.distributed.finalize_model_grads",
                        "megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads")


def spec_for(seq: int) -> ModelSpec:
    return ModelSpec("speed-gpt", num_layers=4, hidden_size=256, num_heads=4, ffn_hidden_size=1024, vocab_size=256,
                     seq_len=seq, family="gpt")


def micro_batch_size(seq: int) -> int:
    return max(1, TOKENS_PER_MICRO // seq)


# ---------------------------------------------------------------- rank side: one training step function per side

def _ours(spec: ModelSpec, world: int, samples: Any) -> Callable[[], float]:
    from megatron_patch.engine import Trainer
    mbs, last = micro_batch_size(spec.seq_len), spec.num_pipeline_layers - 1
    pipe = Pipeline(mbs, MICRO, (Stage(0, last, 1, "CPU"),))
    trainer = Trainer(Plan("tiny-gpt", world * mbs * MICRO, (pipe,) * world), samples, spec=spec)
    return lambda: trainer.train_step().loss


def _cpu_clip(parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False) -> None:
    """megatron's ``clip_grad_by_total_norm_fp32`` without its CUDA-tensor assertion (same scaling)."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for p in parameters:
            grad = p.decoupled_grad if use_decoupled_grad else p.grad
            if grad is not None:
                grad.detach().mul_(coeff)


def _megatron(spec: ModelSpec, world: int, samples: Any) -> Callable[[], float]:
    """megatron-core's own homogeneous data-parallel training step (DDP with overlapped grad reduce)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_patch import patch
    from megatron_patch.options import AdamConfig
    from megatron_patch.reference import gpt_model
    parallel_state.initialize_model_parallel(1, 1)  # the homogeneous grid: DP = world
    patch.apply(cpu=True)
    patch.cpu_torch_in(MEGATRON_CPU_MODULES)
    import megatron.core.optimizer.optimizer as moptimizer
    moptimizer.clip_grad_by_total_norm_fp32 = _cpu_clip
    patch.seed_model_parallel_rng(SEED, 0)
    model = gpt_model(spec, SEED)
    config = model.config
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=True,
                                                                         use_distributed_optimizer=False), model)
    c = AdamConfig()
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=c.lr, weight_decay=c.weight_decay,
                                                 adam_beta1=c.beta1, adam_beta2=c.beta2, adam_eps=c.eps,
                                                 clip_grad=c.clip_grad), [ddp])
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()
    seq, mbs, rank = spec.seq_len, micro_batch_size(spec.seq_len), dist.get_rank()
    pos = torch.arange(seq).unsqueeze(0).expand(mbs, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]
    consumed = 0

    def forward_step(data_iterator: Any, m: Any) -> tuple[torch.Tensor, Callable]:
        chunk = next(data_iterator)
        out = m(chunk[:, :-1].contiguous(), pos, mask, labels=chunk[:, 1:].contiguous())
        return out, lambda per_token: (per_token.float().mean(), {"loss": per_token.detach().float().mean()})

    def step() -> float:
        """One step; returns this rank's mean loss (the global one is the mean over ranks)."""
        nonlocal consumed
        data = samples.batch(consumed + rank * mbs * MICRO, mbs * MICRO)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        losses = forward_backward(forward_step_func=forward_step, data_iterator=iter(data.split(mbs)), model=[ddp],
                                  num_microbatches=MICRO, seq_length=seq, micro_batch_size=mbs, forward_only=False)
        opt.step()
        consumed += world * mbs * MICRO
        return sum(float(x["loss"]) for x in losses) / len(losses)
    return step


def train_main() -> None:
    import torch.distributed as dist

    from megatron_patch import memory
    from megatron_patch.data import GlobalSamples
    side, seq, steps, data = (os.environ["SPEED_SIDE"], int(os.environ["SPEED_SEQ"]), int(os.environ["SPEED_STEPS"]),
                              os.environ["SPEED_DATA"])
    dist.init_process_group("gloo")
    spec = spec_for(seq)
    step = {"ours": _ours, "megatron": _megatron}[side](spec, dist.get_world_size(), GlobalSamples(data, seq, SEED))
    losses = [step()]  # warm-up: connections, buffers, Adam state
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    print(json.dumps({"times": times, "losses": losses, "peak_rss": memory.peak_rss()}), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------- rank side: attention memory of one layer

def _sdpa_class() -> type:
    """The SDPA core attention module (a function: torch is imported in the ranks only)."""
    import torch
    import torch.nn.functional as F

    class Sdpa(torch.nn.Module):
        """megatron's core-attention interface over torch's fused causal scaled_dot_product_attention."""

        def __init__(self, config: Any, **_kw: Any) -> None:
            super().__init__()
            self.config = config

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    **_kw: Any) -> torch.Tensor:
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]
            if k.shape[1] != q.shape[1]:
                k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return out.permute(2, 0, 1, 3).reshape(q.shape[2], q.shape[0], -1)
    return Sdpa


def attention_main() -> None:
    """Peak RSS growth of one layer's forward+backward at 2048 (batch 1): unfused vs SDPA core attention."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.spec_utils import build_module

    from megatron_patch import memory, patch
    from megatron_patch.model import layer_spec, transformer_config
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    patch.apply(cpu=True)
    patch.seed_model_parallel_rng(SEED, 0)
    spec, seq = spec_for(2048), 2048
    config = transformer_config(spec, tp=1, dtype=torch.float32, cuda=False)
    unfused = layer_spec(spec, te=False)
    sdpa = copy.deepcopy(unfused)
    sdpa.submodules.self_attention.submodules.core_attention = _sdpa_class()
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]
    out: dict[str, float] = {}
    for name, ls in (("unfused", unfused), ("sdpa", sdpa)):
        layer = build_module(ls, config=config, layer_number=1)
        for p in layer.parameters():
            torch.nn.init.normal_(p, 0.0, 0.02)
        growth = []
        for _ in range(2):  # the second run has a warm allocator
            h = torch.randn(seq, 1, spec.hidden_size, requires_grad=True)
            memory.reset_peak()
            before = memory.rss()
            layer(hidden_states=h, attention_mask=mask)[0].sum().backward()
            growth.append(memory.peak_rss() - before)
        out[name] = min(growth)
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def rank_main() -> None:
    warnings.filterwarnings("ignore")
    attention_main() if os.environ.get("SPEED_SIDE") == "attention" else train_main()


# ---------------------------------------------------------------- driver

def _launch(world: int, env: dict[str, str]) -> list[dict[str, Any]]:
    results = local.run([str(Path(__file__).resolve())], world, {**env, "BENCH_RANK_MAIN": "1"}, timeout=1800)
    for r in results:
        if r.returncode != 0:
            raise RuntimeError(f"{env} rank {r.rank} failed:\n{r.stderr[-4000:]}")
    return [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]


def measure(side: str, world: int, seq: int, steps: int, data: str) -> tuple[float, float, list[float]]:
    """(tokens/s over all ranks, peak RSS of the largest rank in bytes, global loss per step)."""
    ranks = _launch(world, {"SPEED_SIDE": side, "SPEED_SEQ": str(seq), "SPEED_STEPS": str(steps), "SPEED_DATA": data})
    step_s = statistics.median(max(ts) for ts in zip(*(r["times"] for r in ranks)))
    losses = [statistics.mean(ls) for ls in zip(*(r["losses"] for r in ranks))]
    return world * MICRO * micro_batch_size(seq) * seq / step_s, max(r["peak_rss"] for r in ranks), losses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per configuration (after 1 warm-up)")
    ap.add_argument("--seq", default="512,2048", help="sequence lengths")
    args = ap.parse_args()
    seqs = [int(s) for s in args.seq.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "data")
        local.build_dataset(data)
        for seq in seqs:
            for world in (2, 1):
                ours = measure("ours", world, seq, args.steps, data)
                theirs = measure("megatron", world, seq, args.steps, data)
                rows.append((seq, world, ours, theirs))
                print(f"  measured seq {seq}, {world} rank(s)", file=sys.stderr, flush=True)
    # a fixed mmap threshold: glibc returns every freed block >= 64 KiB at once, so RSS follows what is live
    # (its default adaptive threshold keeps freed blocks in the heap and hides the second variant's peak)
    attn = _launch(1, {"SPEED_SIDE": "attention", "MALLOC_MMAP_THRESHOLD_": "65536"})[0]
    mib = 2.0 ** 20
    print(f"GPT 4 x hidden 256 (ffn 1024, 4 heads, vocab 256), fp32, gloo on CPU, OMP_NUM_THREADS=1, "
          f"{MICRO} micro-batches of {TOKENS_PER_MICRO} tokens per rank per step, median of {args.steps} steps")
    print(f"{'seq':>5}{'ranks':>6}{'ours tok/s':>12}{'mcore tok/s':>13}{'speed':>7}"
          f"{'ours MiB':>10}{'mcore MiB':>11}{'memory':>8}{'loss diff':>11}")
    for seq, world, (ot, om, ol), (mt, mm, ml) in rows:
        loss = max(abs(a - b) for a, b in zip(ol, ml))
        print(f"{seq:>5}{world:>6}{ot:>12.0f}{mt:>13.0f}{ot / mt:>7.2f}"
              f"{om / mib:>10.0f}{mm / mib:>11.0f}{om / mm:>8.2f}{loss:>11.1e}")
    print("speed = ours/megatron tokens/s (>1: ours faster); memory = ours/megatron peak RSS of the largest rank;")
    print("loss diff = max |ours - megatron| global loss over the steps (same init, data and Adam: a sanity check)")
    print(f"attention at 2048 (1 layer, batch 1, forward+backward peak RSS growth): unfused DotProductAttention "
          f"{attn['unfused'] / mib:.0f} MiB, scaled_dot_product_attention {attn['sdpa'] / mib:.0f} MiB "
          f"(ratio {attn['sdpa'] / attn['unfused']:.2f})")
    return 0


if __name__ == "__main__":
    local.self_launching(main, rank_main)
