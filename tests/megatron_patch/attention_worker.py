"""Rank program for test_attention.py (one gloo rank): SDPA core attention against megatron's own.

Prints one JSON line of max differences: the core-attention modules alone (forward and input
gradients, causal, MHA and GQA, with and without query-key layer scaling), a non-causal padding mask,
and whole GPTModels (loss and parameter gradients) built with either attention. Controls: dropping
the causal mask, or the GQA expansion, must be visible.
"""
from __future__ import annotations

import json
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

from megatron_patch import patch  # noqa: E402
from megatron_patch.groups import collection  # noqa: E402
from megatron_patch.launch import exit_now  # noqa: E402
from megatron_patch.model import transformer_config  # noqa: E402
from megatron_patch.reference import gpt_model  # noqa: E402
from sailor_hpc.core.models import get_model  # noqa: E402
from tests.megatron_patch.model_worker import SEED, TINY_LLAMA, batch, ref_loss  # noqa: E402


def core_pair(spec: object, layer: int, mask_type: object, scaling: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    import dataclasses

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_patch.attention import SdpaAttention
    cfg = transformer_config(spec, tp=1, dtype=torch.float32, cuda=False)
    if scaling:
        cfg = dataclasses.replace(cfg, apply_query_key_layer_scaling=True)
    kw = dict(config=cfg, layer_number=layer, attn_mask_type=mask_type, attention_type="self",
              pg_collection=collection(dist.group.WORLD, dist.group.WORLD))  # one process
    return DotProductAttention(**kw), SdpaAttention(**kw)


def qkv(spec: object, s: int = 16, b: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    shapes = [(s, b, spec.num_heads, spec.head_dim)] + [(s, b, spec.num_kv_heads or spec.num_heads, spec.head_dim)] * 2
    return [torch.randn(shape, generator=g).requires_grad_(True) for shape in shapes]


def run(module: torch.nn.Module, inputs: list[torch.Tensor], mask: torch.Tensor | None,
        **kw: object) -> tuple[torch.Tensor, list[torch.Tensor]]:
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = module(*xs, mask, **kw)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out.detach(), [x.grad for x in xs]


def diff(a: tuple[torch.Tensor, list[torch.Tensor]], b: tuple[torch.Tensor, list[torch.Tensor]]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip([a[0], *a[1]], [b[0], *b[1]]))


def main() -> None:
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    patch.apply(cpu=True)
    patch.seed_model_parallel_rng(SEED, 0)
    out: dict[str, float] = {}
    s = 16
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    for spec in (get_model("tiny-gpt"), TINY_LLAMA):  # 4 heads MHA; 4 heads over 2 KV groups (GQA)
        inputs = qkv(spec, s)
        for scaling in (False, True):
            ref_mod, sdpa_mod = core_pair(spec, 3, AttnMaskType.causal, scaling)
            ref, got = run(ref_mod, inputs, causal), run(sdpa_mod, inputs, causal)
            out[f"{spec.name}/core_causal{'_qk_scaling' if scaling else ''}"] = diff(ref, got)
        ref_mod, sdpa_mod = core_pair(spec, 1, AttnMaskType.padding, False)
        pad = torch.zeros(3, 1, s, s, dtype=torch.bool)
        pad[..., s - 4:] = True  # the last 4 keys are padding, as a padding mask [b, 1, sq, sk]
        out[f"{spec.name}/core_padding_mask"] = diff(run(ref_mod, inputs, pad), run(sdpa_mod, inputs, pad))
        _, no_mask = core_pair(spec, 1, AttnMaskType.no_mask, False)
        out[f"{spec.name}/control_no_causal_mask"] = diff(ref, run(no_mask, inputs, None))
        tokens, labels = batch(spec)
        losses, grads = {}, {}
        for attention in ("megatron", "sdpa"):
            model = gpt_model(spec, SEED, attention)
            loss = ref_loss(model, tokens, labels)
            loss.backward()
            losses[attention] = float(loss)
            grads[attention] = [p.grad for p in model.parameters()]
        out[f"{spec.name}/gptmodel_loss"] = abs(losses["sdpa"] - losses["megatron"])
        out[f"{spec.name}/gptmodel_grad"] = max(float((a - b).abs().max())
                                                for a, b in zip(grads["sdpa"], grads["megatron"]))
    # control for GQA: the llama's K/V read as if there were one group per head pair in the wrong order
    ref_mod, sdpa_mod = core_pair(TINY_LLAMA, 1, AttnMaskType.causal, False)
    q, k, v = qkv(TINY_LLAMA, s)
    swapped = [q, k.flip(2), v.flip(2)]
    out["control_gqa_groups_swapped"] = diff(run(ref_mod, [q, k, v], causal), run(sdpa_mod, swapped, causal))
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # as launch does: gloo threads freed at interpreter exit abort a finished rank (SIGABRT)
