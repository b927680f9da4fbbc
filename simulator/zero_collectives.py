"""How many collectives one step of the ``deepspeed`` runtime issues, for the link's per-collective latency.

The link model charges a collective its bytes and, per ring step, the link's measured latency
(:mod:`simulator.network`). DeepSpeed's traffic per step is a few all-reduces' worth of the gradients'
bytes (:func:`simulator.api.zero_traffic`), but it moves them in many collectives, some of a few bytes,
and each pays the latency whatever it moves. Counted on DeepSpeed 0.19.8 (``stage_1_and_2.py``,
``stage3.py``) and on a run (tiny-gpt, DP 2, 4 micro-batches, every ``torch.distributed`` collective timed:
``benchmarks/simulator_vs_runtime.py --deepspeed-only``: 2 / 6 / 9 / 59 a step for ZeRO 0-3):

* every step: the runtime's all-reduce of the loss and the stop flag (``megatron_patch.ds_runtime``);
* the gradients' reduction, one collective per bucket: at the accumulation boundary (ZeRO 0, 1) or in every
  micro-batch's backward (ZeRO 2 all-reduces, ZeRO 3 reduce-scatters);
* ZeRO 1-3: two scalar all-reduces in the step (the overflow check and the gradient norm);
* ZeRO 1 and 2: one all-gather of the updated partition per parameter group;
* ZeRO 3: one all-gather per parameter tensor (the updated weights), and per micro-batch two more (forward
  and backward) for every tensor above DeepSpeed's persistence threshold.

Each collective pays the link's latency of its kind (:func:`simulator.network.collective_latency_seconds`):
the all-gathers an all-gather's, the rest (all-reduces, reduce-scatters) an all-reduce's; and as issued
alone after computing, since DeepSpeed issues them one at a time between its compute, never back to back.
The two kinds differ by backend: gloo on this repository's host, back to back, 0.26 ms an all-reduce and
0.9 ms an all-gather of a few bytes.
"""
from __future__ import annotations

import math

from sailor_hpc.core.models import ModelSpec

# DeepSpeed keeps a parameter smaller than this whole on every rank under ZeRO 3
# (stage3_param_persistence_threshold, which sailor_hpc.core.ds_config leaves at its default)
PARAM_PERSISTENCE_THRESHOLD = 100_000
PARAM_GROUPS = 2  # the runtime's optimizer groups: weights with decay, biases and norms without


def layer_tensors(model: ModelSpec, first: int, last: int) -> list[int]:
    """Element counts of the parameter tensors pipeline layers ``first..last`` hold, as megatron_patch lays
    them out (``megatron_patch.layout.param_layout``; the vocabulary unpadded)."""
    h, f, nh = model.hidden_size, model.ffn_hidden_size, model.num_heads
    kv = model.num_kv_heads or nh
    hd = model.head_dim
    llama = model.family == "llama"
    norm = [h] if llama else [h, h]  # RMSNorm: a weight; LayerNorm: weight and bias

    def linear(rows: int, cols: int) -> list[int]:
        return [rows * cols] if llama else [rows * cols, rows]

    L = model.num_pipeline_layers
    out: list[int] = []
    for layer in range(first, last + 1):
        if layer == 0:
            out.append(model.vocab_size * h)
            if not llama:  # learned absolute positions
                out.append(model.seq_len * h)
        if 1 <= layer <= model.num_layers:
            fc1 = 2 * f if llama else f
            out += norm + linear((nh + 2 * kv) * hd, h) + linear(h, nh * hd) + norm + linear(fc1, h) + linear(h, f)
        if layer == model.num_layers + 1:
            out += norm
        if layer == L - 1 and not model.tied_embeddings:
            out.append(model.vocab_size * h)
    return out


def zero_collectives(stage: int, micro_batches: int, buckets: int, tensors: list[int]) -> tuple[int, int]:
    """(all-reduces and reduce-scatters, all-gathers) one step of ZeRO ``stage`` issues for a segment whose
    gradients fill ``buckets`` reduce buckets and whose parameters are ``tensors`` (element counts; see the
    module doc)."""
    m = micro_batches
    runtime = 1  # the runtime's loss and stop-flag all-reduce
    if stage == 0:
        return runtime + buckets, 0
    scalars = 2  # the overflow check and the gradient norm
    if stage == 1:
        return runtime + buckets + scalars, PARAM_GROUPS
    if stage == 2:
        return runtime + m * buckets + scalars, PARAM_GROUPS
    gathered = sum(1 for n in tensors if n >= PARAM_PERSISTENCE_THRESHOLD)
    return runtime + m * buckets + scalars, len(tensors) + 2 * m * gathered


def buckets_of(nbytes: float, bucket_bytes: float) -> int:
    """Reduce buckets a segment's gradients fill (at least one)."""
    return max(1, math.ceil(nbytes / bucket_bytes))


__all__ = ["PARAM_GROUPS", "PARAM_PERSISTENCE_THRESHOLD", "buckets_of", "layer_tensors", "zero_collectives"]
