"""Canonical layout, TP slicing and the gradient-sync plan, checked by hand on small cases."""
from __future__ import annotations

import itertools
import math

import pytest

torch = pytest.importorskip("torch")

from megatron_patch.grad_sync import holders, plan_buckets, rank_sets  # noqa: E402
from megatron_patch.layout import ParamInfo, chunk_views, full_of, param_layout, shard_of  # noqa: E402
from sailor_hpc.core.models import get_model  # noqa: E402
from sailor_hpc.core.plan import Pipeline, Plan, Stage  # noqa: E402
from tests.megatron_patch.conftest import PLANS  # noqa: E402
from tests.megatron_patch.test_no_deadlock import SHAPES  # noqa: E402


def test_swiglu_fc1_shards_are_gate_and_up_slices() -> None:
    info = ParamInfo("fc1", 1, (8, 3), 0, parts=2)
    full = torch.arange(24.0).view(8, 3)  # rows 0-3 gate, 4-7 up
    s1 = shard_of(full, info, 2, 1)
    assert s1[:, 0].tolist() == [6.0, 9.0, 18.0, 21.0]  # gate rows 2,3 then up rows 6,7
    assert torch.equal(full_of([shard_of(full, info, 2, r) for r in range(2)], info), full)


@pytest.mark.parametrize("name", ["tiny-gpt", "Llama-3-8B"])
def test_every_parameter_round_trips_through_every_tp_degree(name: str) -> None:
    spec = get_model(name)
    small = [p for p in param_layout(spec, 512) if p.layer in (0, 1, spec.num_pipeline_layers - 1)]
    for info, tp in itertools.product(small, (1, 2, 4)):
        shape = tuple(min(d, 1024) if i != info.shard_dim else d for i, d in enumerate(info.shape))
        if info.shard_dim is not None and shape[info.shard_dim] % (tp * info.parts):
            continue
        full = torch.randn(shape)
        shards = [shard_of(full, info, tp, r) for r in range(tp)]
        assert torch.equal(full_of(shards, info), full), info.name
        # chunk c of lcm(2, 4) = 4 chunks lives in local chunk c % (4 / tp) of TP rank c // (4 / tp)
        if info.shard_dim is not None:
            per = 4 // tp if 4 % tp == 0 else None
            for c in range(4 if per else 0):
                a = chunk_views(full, info, 4, c)
                b = chunk_views(shards[c // per], info, per, c % per)
                assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_sync_plan_by_hand_for_a_tp_mismatch_and_a_tied_embedding() -> None:
    st = lambda a, b, tp: Stage(a, b, tp, "A100-40")  # noqa: E731
    # pipeline 0: ranks 0,1 (TP2, layers 0-3) | rank 2 (TP1, 4-5); pipeline 1: rank 3 (everything)
    plan = Plan("tiny-gpt", 8, (Pipeline(2, 3, (st(0, 3, 2), st(4, 5, 1))), Pipeline(2, 1, (st(0, 5, 1),))))
    layout = param_layout(get_model("tiny-gpt"), 256)
    info = {p.name: p for p in layout}
    emb = info["embedding.word_embeddings.weight"]
    hs = holders(plan, emb)
    assert [(h.pipeline, h.ranks, h.weight) for h in hs] == [(0, (0, 1), 0.75), (0, (2,), 0.75), (1, (3,), 0.25)]
    buckets = {b.ranks: b for b in rank_sets(plan, layout)}
    # tied embedding, lcm(2, 1, 1) = 2 chunks: chunk 0 on ranks {0, 2, 3}, chunk 1 on {1, 2, 3}
    for c, ranks in ((0, (0, 2, 3)), (1, (1, 2, 3))):
        pieces = [p for p in buckets[ranks].pieces if p.name == emb.name and p.chunk == c]
        assert sorted((p.rank, p.local, p.n_local, p.scale) for p in pieces) == \
            [(ranks[0], 0, 1, 0.75), (2, c, 2, 0.75), (3, c, 2, 0.25)]
    # a replicated norm of block 1: every TP rank of every holder, weights w_p / t_p summing to 1
    norm = [p for p in buckets[(0, 1, 3)].pieces if p.name == "decoder.layers.0.input_layernorm.weight"]
    assert sorted((p.rank, p.scale) for p in norm) == [(0, 0.375), (1, 0.375), (3, 0.25)]
    # every (parameter, chunk) appears once per holder stage
    seen = {}
    for b in buckets.values():
        for p in b.pieces:
            seen.setdefault((p.name, p.chunk), []).append(p.rank)
    for p in layout:
        n = 1 if p.shard_dim is None else math.lcm(*(len(h.ranks) for h in holders(plan, p)))
        for c in range(n):
            expect = len(holders(plan, p)) if p.shard_dim is not None else sum(len(h.ranks) for h in holders(plan, p))
            assert len(seen[(p.name, c)]) == expect


def _plans() -> list[Plan]:
    return [*PLANS.values(), *SHAPES.values()]


@pytest.mark.parametrize("mb", [0.0, 0.002, 40.0])
def test_buckets_cover_each_rank_set_once_in_backward_order(mb: float) -> None:
    """Buckets partition every rank set; each member sees the same slots at the same offsets."""
    layout = param_layout(get_model("tiny-gpt"), 256)
    for plan in _plans():
        sets = rank_sets(plan, layout)
        buckets = plan_buckets(sets, layout, mb)
        for s in sets:
            mine = sorted((b for b in buckets if b.ranks == s.ranks), key=lambda b: b.index)
            assert sorted(mine, key=lambda b: (b.ready, b.index)) == mine  # launch order keeps index order
            assert sorted((p.name, p.chunk, p.rank) for b in mine for p in b.pieces) == \
                sorted((p.name, p.chunk, p.rank) for p in s.pieces)
            for b in mine:
                sizes = {r: sum(p.numel for p in b.own(r)) for r in b.ranks}
                assert set(sizes.values()) == {b.numel}
                slots = {r: [(p.name, p.chunk) for p in b.own(r)] for r in b.ranks}
                assert len({tuple(v) for v in slots.values()}) == 1
            if mb == 0.0:
                assert len(mine) == 1
        if mb == 0.002:
            assert len(buckets) > 3 * len(sets)  # the tests' small cap does make many buckets
        cap = int(mb * 1e6) // 4
        for b in buckets:  # only a rank set's last bucket may be under the cap
            last = max(x.index for x in buckets if x.ranks == b.ranks)
            assert cap <= 0 or b.index == last or b.numel >= cap

