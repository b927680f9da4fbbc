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

Speed: both sides live in the same processes (same world, same data) and alternate step by step
(the order flips every round), after one warm-up step each, as ``runtime_overhead.py`` does, so a
busy host slows both alike. A step's time is the slower rank's; ``speed`` is the median over rounds
of megatron's step time over ours (>1: ours faster), tokens/s the tokens of all ranks over each
side's median step time. Memory: each side once more in fresh processes of its own (1 warm-up + 1
step), peak RSS of the largest rank. Also printed: the peak memory of one forward+backward of one
transformer layer at 2048 with megatron's unfused ``DotProductAttention`` (materialises the [b, heads,
s, s] scores) and with the runtime's ``SdpaAttention`` (``scaled_dot_product_attention``) in its place.

    .venv/bin/python benchmarks/runtime_speed.py [--rounds 6] [--seq 512,2048]
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
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_patch import local, memory  # noqa: E402
from megatron_patch.options import AdamConfig  # noqa: E402
from sailor_hpc.core.models import ModelSpec  # noqa: E402
from sailor_hpc.core.plan import Pipeline, Plan, Stage  # noqa: E402

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
    """megatron-core's own homogeneous data-parallel training step, on the CPU in fp32 with SDPA (as ours)."""
    return megatron_core_step(spec, world, samples, mbs=micro_batch_size(spec.seq_len), micro=MICRO)


def optimizer_param_problems(named: Iterable[tuple[str, Any]], device: str, dtype: Any) -> list[str]:
    """The trainable parameters megatron's optimizer would refuse or train differently from Megatron's own
    training, each as "name: why". Its ``Float16OptimizerWithFloat16Params`` (bf16/fp16) accepts only CUDA
    tensors (``torch.cuda.{Half,BFloat16,Float}Tensor``) and raises a bare TypeError on the first other one;
    Megatron's training gives every parameter the model's device and, through ``Float16Module``, its dtype."""
    out = []
    for name, p in named:
        if not p.requires_grad:
            continue
        why = ([f"on {p.device.type}, not {device}"] if p.device.type != device else []) + \
              ([f"{p.dtype}, not {dtype}"] if p.dtype != dtype else [])
        if why:
            out.append(f"{name}: {', '.join(why)}")
    return out


def check_optimizer_params(model: Any, device: str, dtype: Any) -> None:
    """Raise, naming every offending parameter, before megatron's optimizer fails on the first one."""
    import torch
    if dtype in (torch.bfloat16, torch.float16) and device != "cuda":  # its type check names CUDA tensor types
        raise RuntimeError(f"megatron-core's {dtype} optimizer (Float16OptimizerWithFloat16Params) takes CUDA "
                           f"tensors only: its mixed-precision path cannot run on {device}; use fp32 there")
    bad = optimizer_param_problems(model.named_parameters(), device, dtype)
    if bad:
        raise RuntimeError(f"{len(bad)} parameter(s) not on {device} in {dtype}, as megatron's optimizer needs "
                           f"(build the model as megatron_patch.reference.gpt_model does): " + "; ".join(bad[:12])
                           + (" ..." if len(bad) > 12 else ""))


def megatron_core_step(spec: ModelSpec, world: int, samples: Any, *, mbs: int, micro: int, device: str = "cpu",
                       dtype: str = "fp32", attention: str = "sdpa") -> Callable[[], float]:
    """megatron-core's own homogeneous data-parallel training step (its GPTModel, in ``Float16Module`` for
    bf16/fp16 as its training wraps it; DDP with overlapped grad reduce, fp32 gradient reduction, its
    mixed-precision optimizer); ``attention="megatron"``: its own local spec's attention. The process group
    must be initialised."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_patch import patch
    from megatron_patch.reference import gpt_model
    parallel_state.initialize_model_parallel(1, 1)  # the homogeneous grid: DP = world
    cpu = device == "cpu"
    if cpu:
        patch.apply(cpu=True)
        patch.cpu_torch_in(MEGATRON_CPU_MODULES)
        import megatron.core.optimizer.optimizer as moptimizer
        moptimizer.clip_grad_by_total_norm_fp32 = _cpu_clip
    patch.seed_model_parallel_rng(SEED, 0)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    model = gpt_model(spec, SEED, attention, dtype=torch_dtype, cuda=not cpu)
    check_optimizer_params(model, device, torch_dtype)
    config = model.config
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=True,
                                                                         use_distributed_optimizer=False,
                                                                         grad_reduce_in_fp32=True), model)
    c = AdamConfig()
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=c.lr, weight_decay=c.weight_decay,
                                                 adam_beta1=c.beta1, adam_beta2=c.beta2, adam_eps=c.eps,
                                                 clip_grad=c.clip_grad, bf16=dtype == "bf16", fp16=dtype == "fp16",
                                                 params_dtype=torch_dtype), [ddp])
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()
    seq, rank, dev = spec.seq_len, dist.get_rank(), torch.device(device)
    pos = torch.arange(seq, device=dev).unsqueeze(0).expand(mbs, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=dev), 1)[None, None]
    consumed = 0

    def forward_step(data_iterator: Any, m: Any) -> tuple[torch.Tensor, Callable]:
        chunk = next(data_iterator)
        out = m(chunk[:, :-1].contiguous(), pos, mask, labels=chunk[:, 1:].contiguous())
        return out, lambda per_token: (per_token.float().mean(), {"loss": per_token.detach().float().mean()})

    def step() -> float:
        """One step; returns this rank's mean loss (the global one is the mean over ranks)."""
        nonlocal consumed
        data = samples.batch(consumed + rank * mbs * micro, mbs * micro).to(dev)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        losses = forward_backward(forward_step_func=forward_step, data_iterator=iter(data.split(mbs)), model=[ddp],
                                  num_microbatches=micro, seq_length=seq, micro_batch_size=mbs, forward_only=False)
        opt.step()
        consumed += world * mbs * micro
        return sum(float(x["loss"]) for x in losses) / len(losses)
    return step


def train_main() -> None:
    """``SPEED_SIDE=both``: the two sides alternate in these processes; else one side alone (for its memory)."""
    import torch.distributed as dist

    from megatron_patch.data import GlobalSamples
    side, seq, steps, data = (os.environ["SPEED_SIDE"], int(os.environ["SPEED_SEQ"]), int(os.environ["SPEED_STEPS"]),
                              os.environ["SPEED_DATA"])
    dist.init_process_group("gloo")
    spec, world = spec_for(seq), dist.get_world_size()
    names = ("ours", "megatron") if side == "both" else (side,)
    makers = {"ours": _ours, "megatron": _megatron}
    # megatron's first: initialize_model_parallel must come before the runtime's patch sets megatron's globals
    run = {n: makers[n](spec, world, GlobalSamples(data, seq, SEED)) for n in sorted(names, key=lambda n: n != "megatron")}
    losses: dict[str, list[float]] = {n: [run[n]()] for n in names}  # warm-up: connections, buffers, Adam state
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(steps):
        for n in names if r % 2 == 0 else names[::-1]:
            dist.barrier()  # both ranks start the step together: its time is the slower rank's
            t0 = time.perf_counter()
            losses[n].append(run[n]())
            times[n].append(time.perf_counter() - t0)
    print(json.dumps({"times": times, "losses": losses, "peak_rss": memory.peak_rss()}), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------- rank side: attention memory of one layer

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
    unfused, sdpa = layer_spec(spec, "megatron"), layer_spec(spec, "sdpa")
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


def _step_s(ranks: list[dict[str, Any]], side: str) -> list[float]:
    """Per step, the slower rank's time."""
    return [max(ts) for ts in zip(*(r["times"][side] for r in ranks))]


def measure(world: int, seq: int, rounds: int, data: str) -> dict[str, Any]:
    """Both sides alternating in the same processes, then each alone (fresh processes) for its peak RSS."""
    env = {"SPEED_SEQ": str(seq), "SPEED_DATA": data}
    ranks = _launch(world, {**env, "SPEED_SIDE": "both", "SPEED_STEPS": str(rounds)})
    ours, theirs = _step_s(ranks, "ours"), _step_s(ranks, "megatron")
    tokens = world * MICRO * micro_batch_size(seq) * seq
    out: dict[str, Any] = {
        "speed": statistics.median(m / o for o, m in zip(ours, theirs)),
        "tok_s": {n: tokens / statistics.median(ts) for n, ts in (("ours", ours), ("megatron", theirs))},
        "loss_diff": max(abs(statistics.mean(a) - statistics.mean(b)) for a, b in
                         zip(zip(*(r["losses"]["ours"] for r in ranks)), zip(*(r["losses"]["megatron"] for r in ranks)))),
        "rss": {}}
    for side in ("ours", "megatron"):
        alone = _launch(world, {**env, "SPEED_SIDE": side, "SPEED_STEPS": "1"})
        out["rss"][side] = max(r["peak_rss"] for r in alone)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds (one step of each side) after warm-up")
    ap.add_argument("--seq", default="512,2048", help="sequence lengths")
    args = ap.parse_args()
    seqs = [int(s) for s in args.seq.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "data")
        local.build_dataset(data)
        for seq in seqs:
            for world in (2, 1):
                rows.append((seq, world, measure(world, seq, args.rounds, data)))
                print(f"  measured seq {seq}, {world} rank(s)", file=sys.stderr, flush=True)
    # a fixed mmap threshold: glibc returns every freed block >= 64 KiB at once, so RSS follows what is live
    # (its default adaptive threshold keeps freed blocks in the heap and hides the second variant's peak)
    attn = _launch(1, {"SPEED_SIDE": "attention", "MALLOC_MMAP_THRESHOLD_": "65536"})[0]
    mib = 2.0 ** 20
    print(f"GPT 4 x hidden 256 (ffn 1024, 4 heads, vocab 256), fp32, gloo on CPU, OMP_NUM_THREADS=1, "
          f"{MICRO} micro-batches of {TOKENS_PER_MICRO} tokens per rank per step, {args.rounds} alternating rounds")
    print(f"{'seq':>5}{'ranks':>6}{'ours tok/s':>12}{'mcore tok/s':>13}{'speed':>7}"
          f"{'ours MiB':>10}{'mcore MiB':>11}{'memory':>8}{'loss diff':>11}")
    for seq, world, m in rows:
        om, mm = m["rss"]["ours"], m["rss"]["megatron"]
        print(f"{seq:>5}{world:>6}{m['tok_s']['ours']:>12.0f}{m['tok_s']['megatron']:>13.0f}{m['speed']:>7.2f}"
              f"{om / mib:>10.0f}{mm / mib:>11.0f}{om / mm:>8.2f}{m['loss_diff']:>11.1e}")
    print("speed = median over rounds of megatron/ours step time (>1: ours faster); "
          "memory = ours/megatron peak RSS of the largest rank (each side alone);")
    print("loss diff = max |ours - megatron| global loss over the steps (same init, data and Adam: a sanity check)")
    print(f"attention at 2048 (1 layer, batch 1, forward+backward peak RSS growth): unfused DotProductAttention "
          f"{attn['unfused'] / mib:.0f} MiB, SdpaAttention {attn['sdpa'] / mib:.0f} MiB "
          f"(ratio {attn['sdpa'] / attn['unfused']:.2f})")
    return 0


if __name__ == "__main__":
    local.self_launching(main, rank_main)
