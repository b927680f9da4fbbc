"""The layout-independent view of the model's parameters: Megatron names, full shapes, TP sharding.

Every parameter has one *canonical* full tensor: the one a single-process (TP=1) megatron-core
GPTModel holds under the same name. A TP rank holds a contiguous slice of it along ``shard_dim``
(per *part*: SwiGLU's fc1 is ``[gate; up]`` and each TP rank holds ``[gate_k; up_k]``, so it has 2
parts). Because every TP degree slices the same canonical tensor, a slice for TP degree ``t`` is a
union of chunks for any multiple of ``t``; gradient sync across pipelines with different TP degrees
and checkpoints that move between plans both work on these chunks.

This module describes the parameters from the ModelSpec alone, so every rank knows where every
parameter of every other stage lives without building it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sailor_hpc.core.models import ModelSpec


@dataclass(frozen=True)
class Arch:
    """The architecture choices a model family implies (what megatron's TransformerConfig is given)."""

    position: str  # "learned_absolute" or "rope"
    norm: str  # "LayerNorm" or "RMSNorm"
    activation: str  # "gelu", "relu" or "swiglu"
    bias: bool
    rotary_base: int = 10000
    norm_eps: float = 1e-5  # LayerNorm / RMSNorm epsilon (Llama 3's rms_norm_eps; Hugging Face checks it)

    @property
    def glu(self) -> bool:
        return self.activation == "swiglu"


def arch_of(spec: ModelSpec) -> Arch:
    if spec.family == "llama":
        return Arch(position="rope", norm="RMSNorm", activation="swiglu", bias=False, rotary_base=500000)
    if spec.family == "opt":
        return Arch(position="learned_absolute", norm="LayerNorm", activation="relu", bias=True)
    return Arch(position="learned_absolute", norm="LayerNorm", activation="gelu", bias=True)


@dataclass(frozen=True)
class ParamInfo:
    """One canonical parameter."""

    name: str  # megatron-core GPTModel name, e.g. "decoder.layers.3.mlp.linear_fc1.weight"
    layer: int  # pipeline layer that owns it (writes it to the checkpoint)
    shape: tuple[int, ...]  # canonical full shape (vocab dimension padded for the plan)
    shard_dim: int | None  # TP partition dim (None: replicated on every TP rank)
    parts: int = 1  # independently sharded parts along shard_dim (2 for SwiGLU fc1)
    vocab_dim: int | None = None  # dimension padded to the plan's vocabulary (stored unpadded)
    holders: tuple[int, ...] = ()  # pipeline layers whose stage needs it (tied embeddings: first and last)
    init_std: float | None = 0.02  # normal(0, std); None: constant (norm weights 1, biases 0)
    init_value: float = 0.0
    decay: bool = True  # weight decay applies (not to biases and norms, as in Megatron)


def embedding_name() -> str:
    return "embedding.word_embeddings.weight"


def head_layer(spec: ModelSpec) -> int:
    return spec.num_pipeline_layers - 1


def final_norm_layer(spec: ModelSpec) -> int:
    return spec.num_layers + 1


def param_layout(spec: ModelSpec, padded_vocab: int) -> list[ParamInfo]:
    """Every canonical parameter in a fixed order (by owning layer, then megatron's order)."""
    a = arch_of(spec)
    h, f, nh = spec.hidden_size, spec.ffn_hidden_size, spec.num_heads
    kv = spec.num_kv_heads or nh
    hd = spec.head_dim
    out_std = 0.02 / (2.0 * spec.num_layers) ** 0.5
    head = head_layer(spec)
    tied = spec.tied_embeddings
    out: list[ParamInfo] = [ParamInfo(embedding_name(), 0, (padded_vocab, h), 0, vocab_dim=0,
                                      holders=(0, head) if tied else (0,))]
    if a.position == "learned_absolute":
        out.append(ParamInfo("embedding.position_embeddings.weight", 0, (spec.seq_len, h), None, holders=(0,)))

    def norm(prefix: str, layer: int) -> list[ParamInfo]:
        ps = [ParamInfo(prefix + ".weight", layer, (h,), None, holders=(layer,), init_std=None, init_value=1.0,
                        decay=False)]
        if a.norm == "LayerNorm":
            ps.append(ParamInfo(prefix + ".bias", layer, (h,), None, holders=(layer,), init_std=None, decay=False))
        return ps

    def linear(prefix: str, layer: int, shape: tuple[int, int], dim: int, parts: int = 1,
               std: float = 0.02) -> list[ParamInfo]:
        ps = [ParamInfo(prefix + ".weight", layer, shape, dim, parts, holders=(layer,), init_std=std)]
        if a.bias:  # column-parallel biases are sharded like the rows, row-parallel biases are replicated
            ps.append(ParamInfo(prefix + ".bias", layer, (shape[0],), 0 if dim == 0 else None, parts if dim == 0 else 1,
                                holders=(layer,), init_std=None, decay=False))
        return ps

    for b in range(1, spec.num_layers + 1):
        p = f"decoder.layers.{b - 1}."
        fc1_rows = 2 * f if a.glu else f
        out += norm(p + "input_layernorm", b)
        out += linear(p + "self_attention.linear_qkv", b, ((nh + 2 * kv) * hd, h), 0)
        out += linear(p + "self_attention.linear_proj", b, (h, nh * hd), 1, std=out_std)
        out += norm(p + "pre_mlp_layernorm", b)
        out += linear(p + "mlp.linear_fc1", b, (fc1_rows, h), 0, parts=2 if a.glu else 1)
        out += linear(p + "mlp.linear_fc2", b, (h, f), 1, std=out_std)
    out += norm("decoder.final_layernorm", final_norm_layer(spec))
    if not tied:
        out.append(ParamInfo("output_layer.weight", head, (padded_vocab, h), 0, vocab_dim=0, holders=(head,)))
    return out


def params_of_layers(layout: list[ParamInfo], first: int, last: int) -> list[ParamInfo]:
    """The parameters a stage holding pipeline layers first..last needs (tied embedding included)."""
    return [p for p in layout if any(first <= h <= last for h in p.holders)]


# ---------------------------------------------------------------- slicing

def chunk_views(t: torch.Tensor, info: ParamInfo, n: int, i: int) -> list[torch.Tensor]:
    """Views of chunk ``i`` of ``n`` equal chunks of ``t`` along the shard dim (one view per part).

    ``t`` is a full tensor or a TP shard; a replicated parameter is its own single chunk.
    """
    if info.shard_dim is None:
        if n != 1:
            raise ValueError(f"{info.name} is replicated; it has one chunk, not {n}")
        return [t]
    d = info.shard_dim
    rows = t.shape[d] // info.parts
    if rows % n:
        raise ValueError(f"{info.name}: {rows} rows per part do not split into {n} chunks")
    m = rows // n
    return [t.narrow(d, p * rows + i * m, m) for p in range(info.parts)]


def shard_of(full: torch.Tensor, info: ParamInfo, tp: int, tp_rank: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s slice of a canonical full tensor (a copy)."""
    if info.shard_dim is None:
        return full.clone()
    return torch.cat(chunk_views(full, info, tp, tp_rank), dim=info.shard_dim)  # cat copies


def full_of(shards: list[torch.Tensor], info: ParamInfo) -> torch.Tensor:
    """The canonical full tensor from all TP ranks' slices, in TP order."""
    if info.shard_dim is None:
        return shards[0].clone()
    per_rank = [chunk_views(s, info, 1, 0) for s in shards]
    parts = [torch.cat([pr[p] for pr in per_rank], dim=info.shard_dim) for p in range(info.parts)]
    return torch.cat(parts, dim=info.shard_dim)


def local_shape(info: ParamInfo, tp: int) -> tuple[int, ...]:
    if info.shard_dim is None:
        return info.shape
    s = list(info.shape)
    s[info.shard_dim] //= tp
    return tuple(s)
