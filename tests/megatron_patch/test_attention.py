"""SDPA core attention (megatron_patch.attention) equals megatron-core's DotProductAttention in fp32.

The reference GPTModel and the runtime both use SDPA, so the exactness tests compare like with like;
this test is what ties SDPA back to megatron's own attention: causal masking, GQA (the miniature
Llama: 4 query heads over 2 KV groups), query-key layer scaling, a padding mask, and whole GPTModels
(loss and every parameter gradient), each within 1e-6 on the CPU.
"""
from __future__ import annotations

import json

import pytest

from megatron_patch import local

pytest.importorskip("megatron.core")

TOL = 1e-6


@pytest.fixture(scope="module")
def measured() -> dict[str, float]:
    results = local.run(["tests/megatron_patch/attention_worker.py"], 1, timeout=300, fork=True)
    assert results[0].returncode == 0, results[0].stderr[-4000:]
    out = json.loads(results[0].stdout.strip().splitlines()[-1])
    print(out)
    return out


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-llama-test"])
def test_sdpa_equals_dot_product_attention(measured: dict[str, float], model: str) -> None:
    for check in ("core_causal", "core_causal_qk_scaling", "core_padding_mask", "gptmodel_loss", "gptmodel_grad"):
        assert measured[f"{model}/{check}"] <= TOL, check


def test_controls_are_seen(measured: dict[str, float]) -> None:
    """Without the causal mask, or with the KV groups mismatched, the outputs differ by far more."""
    assert measured["tiny-gpt/control_no_causal_mask"] > 1e-2
    assert measured["tiny-llama-test/control_no_causal_mask"] > 1e-2
    assert measured["control_gqa_groups_swapped"] > 1e-2
