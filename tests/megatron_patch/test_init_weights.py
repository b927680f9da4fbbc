"""Initial weights: every TP rank draws only its shard, and the shards form one canonical tensor.

The canonical tensor must not depend on the TP degree (exactness across plans and the single-process
reference rely on it), and a rank at TP t must not build the full tensor (init memory ~1/t).
"""
from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from megatron_patch.init_weights import canonical_init, init_shard  # noqa: E402
from megatron_patch.layout import ParamInfo, full_of, param_layout  # noqa: E402
from sailor_hpc.core.models import ModelSpec, get_model  # noqa: E402
from tests.megatron_patch.conftest import memory_growth  # noqa: E402

LLAMA = ModelSpec("tiny-llama-test", num_layers=2, hidden_size=64, num_heads=4, ffn_hidden_size=96, vocab_size=200,
                  seq_len=16, family="llama", num_kv_heads=2, tail_layers=2, tied_embeddings=False)


@pytest.mark.parametrize("spec", [get_model("tiny-gpt"), LLAMA], ids=lambda s: s.name)
def test_shards_of_every_tp_degree_form_the_same_canonical_tensor(spec: ModelSpec) -> None:
    seed = 7
    for info, tp in itertools.product(param_layout(spec, spec.padded_vocab_size((4,))), (1, 2, 4)):
        if info.shard_dim is not None and info.shape[info.shard_dim] % (tp * info.parts):
            continue
        shards = [init_shard(info, seed, spec.vocab_size, tp, r) for r in range(tp)]
        if info.shard_dim is None:
            assert all(torch.equal(s, shards[0]) for s in shards), info.name
        assert torch.equal(full_of(shards, info), canonical_init(info, seed, spec.vocab_size)), (info.name, tp)
    emb = param_layout(spec, 512)[0]  # another plan's vocabulary padding: the same real rows, zero padding
    small = canonical_init(param_layout(spec, spec.padded_vocab_size((1,)))[0], seed, spec.vocab_size)
    big = canonical_init(emb, seed, spec.vocab_size)
    assert torch.equal(big[:spec.vocab_size], small[:spec.vocab_size]) and not big[spec.vocab_size:].any()
    std = float(big[:spec.vocab_size].std())
    assert 0.019 < std < 0.021  # megatron's normal(0, 0.02)


def test_seeds_and_names_give_different_tensors() -> None:
    info = ParamInfo("w", 1, (64, 32), 1)
    a, b = canonical_init(info, 1, 0), canonical_init(info, 2, 0)
    c = canonical_init(ParamInfo("v", 1, (64, 32), 1), 1, 0)
    assert not torch.equal(a, b) and not torch.equal(a, c)
    assert len({tuple(col.tolist()) for col in a.t()}) == 32  # every slice its own stream


@pytest.mark.parametrize("dim", [0, 1])
def test_a_tp4_shard_is_drawn_without_the_full_tensor(dim: int) -> None:
    """Peak RSS while drawing a TP-4 shard of a 128 MiB tensor: ~32 MiB, not 128 (the control: TP 1)."""
    setup = ("from megatron_patch.init_weights import init_shard\nfrom megatron_patch.layout import ParamInfo\n"
             f"info = ParamInfo('w', 1, (8192, 4096), {dim})\n"
             "init_shard(ParamInfo('s', 1, (8, 8), 0), 1, 0)  # warm-up (imports)\n")
    full = 8192 * 4096 * 4
    tp4 = memory_growth(setup, "x = init_shard(info, 1, 0, 4, 3)")["peak"]
    tp1 = memory_growth(setup, "x = init_shard(info, 1, 0, 1, 0)")["peak"]
    print(f"init peak RSS growth, dim {dim}: TP4 shard {tp4 / 2**20:.1f} MiB, full {tp1 / 2**20:.1f} MiB")
    assert tp4 < 0.3 * full
    assert tp1 > 0.9 * full
