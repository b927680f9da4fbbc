"""Single-process reference trainer: megatron-core's own GPTModel, the whole global batch at once.

The heterogeneous runtime is checked against this. It shares only the starting point (the canonical
initialisation) and the data (global sample indices) with the runtime: no pipeline, no micro-batches,
no TP, no gradient sync, no vocabulary padding; megatron's ``GPTModel`` with its own loss
(``compute_language_model_loss`` -> ``vocab_parallel_cross_entropy`` at TP 1), ``torch.optim.AdamW``
and ``torch.nn.utils.clip_grad_norm_``. It uses the runtime's core attention (SDPA: its equality with
megatron's DotProductAttention is tested on its own) and the runtime's AdamW flavour (foreach). It
needs ``torch.distributed`` initialised with one process (megatron's layers call collectives on their
size-1 groups) and runs on the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_patch import patch
from megatron_patch.data import Samples, build_samples, train_split
from megatron_patch.init_weights import canonical_init
from megatron_patch.layout import arch_of, param_layout
from megatron_patch.mcore_import import quiet_fallback_notices
from megatron_patch.model import layer_spec, transformer_config
from megatron_patch.optimizer import adamw, set_lr
from megatron_patch.options import (
    TrainOptions,
    adam_from_args,
    add_adam_args,
    add_flags,
    check_train_args,
    schedule_from_args,
)
from sailor_hpc.core.models import ModelSpec, get_model
from sailor_hpc.core.training import DATA_FLAGS, DataBlend, eval_due, parse_split


def gpt_model(spec: ModelSpec, seed: int, attention: str = "sdpa", *, dtype: torch.dtype = torch.float32,
              cuda: bool = False) -> torch.nn.Module:
    """megatron-core's GPTModel at TP 1 (local layer spec, unpadded vocabulary), canonically initialised.

    Its core attention is the runtime's (SDPA) unless ``attention="megatron"`` (DotProductAttention).
    ``dtype``/``cuda``: megatron's own mixed-precision GPU model (the GPU check's baseline), made as Megatron's
    training (``get_model``) makes it: moved with ``.cuda()`` (torch's LayerNorm, which the local spec uses
    without apex, and the learned position embedding are built on the host in fp32 whatever the config says),
    then wrapped in ``Float16Module`` for bf16/fp16 (every parameter in that dtype, fp32 losses out), whose
    parameter names carry a ``module.`` prefix."""
    from megatron.core.models.gpt import GPTModel
    a = arch_of(spec)
    model = GPTModel(transformer_config(spec, tp=1, dtype=dtype, cuda=cuda), layer_spec(spec, attention),
                     vocab_size=spec.vocab_size, max_sequence_length=spec.seq_len,
                     share_embeddings_and_output_weights=spec.tied_embeddings, position_embedding_type=a.position,
                     rotary_base=a.rotary_base)
    infos = {p.name: p for p in param_layout(spec, spec.vocab_size)}
    names = {n for n, _ in model.named_parameters()}
    if names != set(infos):
        raise RuntimeError(f"GPTModel names differ from the layout: {sorted(names ^ set(infos))}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(canonical_init(infos[name], seed, spec.vocab_size))
    if cuda:
        model.cuda(torch.cuda.current_device())
    if dtype in (torch.bfloat16, torch.float16):
        from megatron.core.transformer.module import Float16Module
        return Float16Module(model.config, model)
    return model


class ReferenceTrainer:
    def __init__(self, spec: ModelSpec, samples: Samples, global_batch: int,
                 opts: TrainOptions = TrainOptions()) -> None:
        from megatron.core import parallel_state
        if dist.get_world_size() != 1:
            raise RuntimeError("the reference runs in a single process")
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)  # a homogeneous world of one: megatron's own setup
        patch.apply(cpu=True)
        patch.seed_model_parallel_rng(opts.seed, 0)
        self.spec, self.samples, self.global_batch, self.opts = spec, samples, global_batch, opts
        self.model = gpt_model(spec, opts.seed)
        self.infos = {p.name: p for p in param_layout(spec, spec.vocab_size)}
        self.params: OrderedDict[str, torch.nn.Parameter] = OrderedDict(self.model.named_parameters())
        c = opts.adam
        decay = [p for n, p in self.params.items() if self.infos[n].decay]
        no_decay = [p for n, p in self.params.items() if not self.infos[n].decay]
        self.optimizer = adamw([{"params": decay, "weight_decay": c.weight_decay},
                                {"params": no_decay, "weight_decay": 0.0}], c, torch.device("cpu"))
        self.step = 0
        self.consumed_samples = 0

    def load(self, path: str) -> None:
        """Continue from a checkpoint written under any plan (full tensors, Adam moments, step, data position)."""
        from megatron_patch.checkpoint_io import CheckpointReader
        reader = CheckpointReader(path)
        steps = int(reader.manifest["adam_steps"])
        with torch.no_grad():
            for name, p in self.params.items():
                t = reader.tensors(name)
                p.copy_(t["param"])
                self.optimizer.state[p] = {"step": torch.tensor(float(steps)), "exp_avg": t["exp_avg"].clone(),
                                           "exp_avg_sq": t["exp_avg_sq"].clone()}
        self.step = int(reader.manifest["step"])
        self.consumed_samples = int(reader.manifest["consumed_samples"])

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        s = tokens.shape[1]
        pos = torch.arange(s).unsqueeze(0).expand_as(tokens)
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
        return self.model(tokens, pos, mask, labels=labels).mean()

    def train_step(self) -> float:
        self.model.train()
        loss = self.loss(self.samples.batch(self.consumed_samples, self.global_batch))
        loss.backward()
        if self.opts.adam.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.opts.adam.clip_grad)
        set_lr(self.optimizer, self.opts.lr_at(self.consumed_samples))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.consumed_samples += self.global_batch
        return float(loss)

    def evaluate(self, valid: Samples, iters: int) -> float:
        """Mean loss of the first ``iters`` global batches of ``valid`` (the runtime's evaluation)."""
        self.model.eval()
        with torch.no_grad():
            return sum(float(self.loss(valid.batch(k * self.global_batch, self.global_batch)))
                       for k in range(iters)) / iters

    def state(self) -> dict[str, dict[str, torch.Tensor]]:
        """name -> {param, exp_avg, exp_avg_sq} (full tensors), as a checkpoint stores them."""
        out = {}
        for name, p in self.params.items():
            st = self.optimizer.state.get(p, {})
            out[name] = {"param": p.detach().clone(),
                         "exp_avg": st.get("exp_avg", torch.zeros_like(p)).detach().clone(),
                         "exp_avg_sq": st.get("exp_avg_sq", torch.zeros_like(p)).detach().clone()}
        return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m megatron_patch.reference", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True, nargs="+", help="PREFIX, or a blend W1 PREFIX1 W2 PREFIX2 ...")
    ap.add_argument("--global-batch", type=int, required=True)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--snapshots", default="", help="comma-separated steps to save (default: the last)")
    ap.add_argument("--out", required=True, help="directory for ref_step_N.pt files and losses.json")
    ap.add_argument("--load", help="continue from this checkpoint (any plan's)")
    ap.add_argument("--seed", type=int, default=1234)
    add_adam_args(ap)
    add_flags(ap, DATA_FLAGS)
    args = ap.parse_args(argv)
    check_train_args(args)
    return args


def main(argv: list[str] | None = None) -> int:
    """Train the reference and save ``{name: {param, exp_avg, exp_avg_sq}}`` at the requested steps."""
    args = parse_args(argv)
    quiet_fallback_notices()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # one rank: its store binds a port the kernel picks (0), with no window for another process to take it
    os.environ.setdefault("MASTER_PORT", "0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    train(args)
    dist.destroy_process_group()
    return 0


def train(args: argparse.Namespace) -> None:
    """:func:`main` in a process whose torch.distributed already holds one rank (a test's worker that
    also runs other single-process models): trains and writes ``--out``."""
    spec = get_model(args.model)
    opts = TrainOptions(adam=adam_from_args(args), seed=args.seed,
                        schedule=schedule_from_args(args, args.global_batch, args.steps))
    data = build_samples(DataBlend.parse(args.data), args.seq_len or spec.seq_len, args.seed, parse_split(args.split))
    ref = ReferenceTrainer(spec, train_split(data, args.split), args.global_batch, opts)
    if args.load:
        ref.load(args.load)
    snaps = {int(s) for s in args.snapshots.split(",") if s} or {args.steps}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    losses, evals = [], {}
    while ref.step < args.steps:
        losses.append(ref.train_step())
        if ref.step in snaps:
            torch.save(ref.state(), out / f"ref_step_{ref.step}.pt")
        if eval_due(ref.step, args.eval_interval, args.steps) and data["valid"] is not None:
            evals[ref.step] = ref.evaluate(data["valid"], args.eval_iters)
    (out / "losses.json").write_text(json.dumps(losses))
    (out / "eval_losses.json").write_text(json.dumps(evals))


if __name__ == "__main__":
    raise SystemExit(main())
