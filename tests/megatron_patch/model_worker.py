"""Rank program for test_model.py: stage modules against megatron-core's own GPTModel.

Run by megatron_patch.local with 1 or 2 ranks; rank 0 prints one JSON line of measurements. With one
rank: every check at TP 1. With two ranks: the whole model at TP 2 on both ranks against a TP 1
GPTModel (column/row sharding, GQA qkv, SwiGLU fc1 parts, vocab-parallel loss P3), plus a control
that slices SwiGLU's fc1 as one block and must fail.
"""
from __future__ import annotations

import dataclasses
import json
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

from megatron_patch import patch  # noqa: E402
from megatron_patch.groups import collection, groups_of_one  # noqa: E402
from megatron_patch.init_weights import canonical_init  # noqa: E402
from megatron_patch.launch import exit_now  # noqa: E402
from megatron_patch.layout import arch_of, param_layout, shard_of  # noqa: E402
from megatron_patch.model import build_stage_module  # noqa: E402
from megatron_patch.reference import gpt_model  # noqa: E402
from sailor_hpc.core.models import ModelSpec, get_model  # noqa: E402

# a miniature Llama: RMSNorm, SwiGLU, RoPE, GQA, no biases, untied head, final norm as its own layer
TINY_LLAMA = ModelSpec("tiny-llama-test", num_layers=2, hidden_size=64, num_heads=4, ffn_hidden_size=96,
                       vocab_size=200, seq_len=16, family="llama", num_kv_heads=2, tail_layers=2,
                       tied_embeddings=False)
SEED = 7


def batch(spec: ModelSpec, b: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    data = torch.randint(0, spec.vocab_size, (b, spec.seq_len + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def ref_loss(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    s = tokens.shape[1]
    pos = torch.arange(s).unsqueeze(0).expand_as(tokens)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    return model(tokens, pos, mask, labels=labels).mean()


def stage_loss(spec: ModelSpec, pgc: object = None, **kw: object) -> tuple[torch.Tensor, torch.nn.Module]:
    m = build_stage_module(spec, 0, spec.num_pipeline_layers - 1, pg_collection=pgc, device="cpu", seed=SEED, **kw)
    tokens, labels = batch(spec)
    return m(tokens=tokens, labels=labels).mean(), m


def main() -> None:
    dist.init_process_group("gloo")
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)  # for the GPTModel references only (TP 1 everywhere)
    patch.apply(cpu=True)
    patch.seed_model_parallel_rng(SEED, dist.get_rank())
    world, out = dist.get_world_size(), {}
    for spec in (get_model("tiny-gpt"), TINY_LLAMA):
        ref = ref_loss(gpt_model(spec, SEED), *batch(spec))
        if world == 1:
            loss, m = stage_loss(spec)
            out[f"{spec.name}/tp1_vs_gptmodel"] = abs(float(loss) - float(ref))
            out[f"{spec.name}/loss"] = float(ref)
            padded, _ = stage_loss(spec, padded_vocab=spec.vocab_size + 312 if spec.vocab_size == 200 else 512)
            out[f"{spec.name}/padded_vocab_vs_unpadded"] = abs(float(padded) - float(loss))
            loss.backward()
            rec_loss, rec = stage_loss(spec, recompute=True)
            rec_loss.backward()
            diffs = [(a.grad - b.grad).abs().max().item()
                     for a, b in zip(m.canonical_params().values(), rec.canonical_params().values())]
            out[f"{spec.name}/recompute_grad_diff"] = max(diffs)
        else:
            pgc = collection(dist.group.WORLD, groups_of_one())
            loss, m = stage_loss(spec, pgc)
            out[f"{spec.name}/tp{world}_vs_gptmodel"] = abs(float(loss) - float(ref))
            if arch_of(spec).glu:  # control: SwiGLU fc1 sliced as one block instead of [gate_k; up_k]
                infos = {p.name: p for p in param_layout(spec, m.ctx.padded_vocab)}
                with torch.no_grad():
                    for name, p in m.canonical_params().items():
                        if name.endswith("linear_fc1.weight"):
                            naive = dataclasses.replace(infos[name], parts=1)
                            full = canonical_init(infos[name], SEED, spec.vocab_size)
                            p.copy_(shard_of(full, naive, world, dist.get_rank()))
                tokens, labels = batch(spec)
                out[f"{spec.name}/tp{world}_naive_glu_vs_gptmodel"] = abs(float(m(tokens=tokens, labels=labels).mean())
                                                                          - float(ref))
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # as launch does: gloo threads freed at interpreter exit abort a finished rank (SIGABRT)
