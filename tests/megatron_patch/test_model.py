"""Stage modules are megatron-core's GPT: same names, same loss as GPTModel, at TP 1 and TP 2.

Two models: tiny-gpt (LayerNorm, GELU, learned positions, tied embeddings) and a miniature Llama
(RMSNorm, SwiGLU, RoPE, GQA, untied head, final norm as its own pipeline layer).
"""
from __future__ import annotations

import json

import pytest

from megatron_patch import local

pytest.importorskip("megatron.core")


def run_worker(world: int) -> dict[str, float]:
    results = local.run(["tests/megatron_patch/model_worker.py"], world, timeout=300, fork=True)
    for r in results:
        assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(results[0].stdout.strip().splitlines()[-1])


def test_single_process_stage_equals_gptmodel() -> None:
    out = run_worker(1)
    print(out)
    for model in ("tiny-gpt", "tiny-llama-test"):
        assert out[f"{model}/tp1_vs_gptmodel"] <= 1e-6
        assert out[f"{model}/loss"] > 4  # an untrained model: about ln(vocab)
        assert out[f"{model}/padded_vocab_vs_unpadded"] <= 1e-6  # patch P6
        assert out[f"{model}/recompute_grad_diff"] <= 1e-7


def test_tensor_parallel_stage_equals_gptmodel() -> None:
    out = run_worker(2)
    print(out)
    assert out["tiny-gpt/tp2_vs_gptmodel"] <= 1e-5
    assert out["tiny-llama-test/tp2_vs_gptmodel"] <= 1e-5
    assert out["tiny-llama-test/tp2_naive_glu_vs_gptmodel"] > 1e-4  # the control: wrong SwiGLU slicing is seen
