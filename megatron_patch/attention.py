"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` for megatron's local spec.

Why: megatron-core 0.16.1's local ``DotProductAttention`` materialises the [b, np, s, s] score matrix
(baddbmm, masked softmax, bmm); only its TransformerEngine spec reaches flash attention, and TE is not
used here. SDPA picks flash / memory-efficient / cuDNN kernels on GPU and its fused CPU kernel on the
CPU, from the same call. :class:`SdpaAttention` is a drop-in ``core_attention`` (same constructor,
same forward arguments, same [sq, b, hp] output) and inherits ``DotProductAttention`` so its
configuration checks, softmax scale and head bookkeeping are megatron's own.

The reference (``megatron_patch.reference``) builds GPTModel with this module too, so exactness tests
compare like with like; ``tests/megatron_patch/test_attention.py`` checks it against megatron's
``DotProductAttention`` (fp32, causal, GQA) within 1e-6.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_patch.mcore_import import import_megatron

import_megatron()  # before megatron's first module (why: mcore_import)

from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402


class SdpaAttention(DotProductAttention):
    """megatron's DotProductAttention with the score/softmax/context part done by SDPA."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.config
        if cfg.softmax_type != "vanilla" or self.scale_mask_softmax.window_size is not None:
            raise NotImplementedError("SdpaAttention supports vanilla softmax without a sliding window")
        # megatron divides the scale by the layer number and multiplies it back inside the softmax
        self.sdpa_scale = self.softmax_scale * (self.layer_number if cfg.apply_query_key_layer_scaling else 1)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        """[sq, b, np, hn] queries, [sk, b, ng, hn] keys/values -> context [sq, b, np * hn].

        ``attention_mask`` follows megatron (True = masked out). A causal mask type ignores the mask
        and uses SDPA's ``is_causal``, as megatron's fused causal softmax kernel does.
        """
        assert packed_seq_params is None and attention_bias is None, "not supported by the local spec"
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type == AttnMaskType.causal and query.size(0) > 1
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        # flash kernels take grouped K/V natively; elsewhere expand them as megatron does
        gqa = groups > 1 and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
        if groups > 1 and not gqa:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        mask = None if causal or attention_mask is None else ~attention_mask
        p = self.attention_dropout.p if self.training else 0.0
        kwargs = dict(attn_mask=mask, dropout_p=p, is_causal=causal, scale=self.sdpa_scale, enable_gqa=gqa)
        if p > 0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                ctx = F.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            ctx = F.scaled_dot_product_attention(q, k, v, **kwargs)
        return ctx.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), self.hidden_size_per_partition)
