"""Canonical initial weights, generated shard by shard: the same full tensor under every TP degree.

Why not ``normal_`` on the full tensor and then slice (what this module replaces): every TP rank then
materialises every full tensor of its stage (an OPT-30B block is 1.2 G fp32 values), so init memory
did not shrink with TP. Here a tensor is defined slice by slice along its TP shard dimension (dim 0
for replicated tensors): slice ``k`` is ``std * standard_normal`` drawn from its own counter-based
Philox stream keyed by ``(init_seed(seed, name), k)``. A TP shard is a union of whole slices, so a
rank draws exactly the values it holds, and the values do not depend on the TP degree, the plan or
the construction order (what the exactness tests and layout-independent checkpoints rely on).
Philox's 128-bit key makes the streams of different slices and tensors distinct (torch's CPU
generator keeps only 32 bits of a seed).
"""
from __future__ import annotations

import zlib

import numpy as np
import torch

from megatron_patch.layout import ParamInfo, local_shape


def init_seed(seed: int, name: str) -> int:
    """Per-parameter seed: the same canonical tensor whatever the layout or construction order."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _gen_dim(info: ParamInfo) -> int:
    return 0 if info.shard_dim is None else info.shard_dim


def _slice_values(key: int, index: int, numel: int, std: float) -> torch.Tensor:
    """Slice ``index`` of the tensor keyed ``key``: ``numel`` normal(0, std) fp32 values."""
    rng = np.random.Generator(np.random.Philox(key=(key << 64) | index))
    return torch.from_numpy(rng.standard_normal(numel, dtype=np.float32)).mul_(std)


def local_slices(info: ParamInfo, tp: int, tp_rank: int) -> list[int]:
    """Indices (along the generation dim of the full tensor) of the slices TP rank ``tp_rank`` holds, in order."""
    if info.shard_dim is None:
        return list(range(info.shape[0]))
    rows = info.shape[info.shard_dim] // info.parts
    m = rows // tp
    return [p * rows + tp_rank * m + i for p in range(info.parts) for i in range(m)]


def init_shard(info: ParamInfo, seed: int, vocab_size: int, tp: int = 1, tp_rank: int = 0) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard of the canonical fp32 initial tensor, drawn without the full tensor.

    Megatron's init: normal(0, init_std) (scaled for output layers), constants for norms and biases;
    vocabulary rows past ``vocab_size`` (the plan's padding) stay zero: they are never used (P6).
    """
    shape = local_shape(info, tp)
    if info.init_std is None:
        return torch.full(shape, info.init_value, dtype=torch.float32)
    dim = _gen_dim(info)
    if info.vocab_dim not in (None, dim):
        raise ValueError(f"{info.name}: vocabulary dim {info.vocab_dim} is not the generation dim {dim}")
    out = torch.zeros(shape, dtype=torch.float32)
    key = init_seed(seed, info.name)
    for local, k in enumerate(local_slices(info, tp, tp_rank)):
        if info.vocab_dim is not None and k >= vocab_size:
            continue
        view = out.select(dim, local)
        view.copy_(_slice_values(key, k, view.numel(), info.init_std).view(view.shape))
    return out


def canonical_init(info: ParamInfo, seed: int, vocab_size: int) -> torch.Tensor:
    """The canonical full fp32 initial tensor (what a single process, TP 1, holds)."""
    return init_shard(info, seed, vocab_size, 1, 0)
