"""What the gradient sync sums: per layer and per TP chunk across every holder, weighted by samples.

Each pipeline's loss is the mean over its own samples (megatron's schedule divides by its micro-batch
count). The global loss is the mean over all samples, so pipeline ``p``'s gradient enters with weight
``w_p = samples_p / global_batch``.

For a parameter held by several stages (one per pipeline, or two in one pipeline for a tied
embedding split over its first and last stage), with TP degrees ``t_h``:

- sharded: cut the canonical tensor into ``L = lcm(t_h)`` chunks; chunk ``c`` lives on TP rank
  ``c // (L / t_h)`` of holder ``h``. Those ranks (one per holder) sum ``w_p * chunk``.
- replicated (norms, row-parallel biases, position embeddings): every TP rank of every holder has
  the same gradient; all of them sum ``w_p / t_h * grad``, so every replica ends bit-identical.

Pieces that go to the same set of ranks form a :class:`RankSet` (one process group). A rank set is
cut into size-capped :class:`Bucket` s, filled in reverse layout order (the order the backward
produces gradients), so a bucket's all-reduce can start while earlier layers still run backward.
Every rank derives the same buckets from the plan alone and launches its own in one global order
(:func:`plan_buckets`), a subsequence of one total order on all buckets: members of a group
issue its collectives in the same order whatever their backward order, and no two groups can wait
on each other in a cycle (NCCL's rule for several communicators). After the sync every holder of a
chunk has the same values, so the global gradient norm counts each chunk once, on its *owner*
(first member).

This module is plan arithmetic only; ``grad_buckets`` runs it on a rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_patch.layout import ParamInfo
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.roles import stage_rank_table

WEIGHTINGS = ("samples", "uniform")  # "uniform" (1/num_pipelines) exists as the tests' negative control
DEFAULT_BUCKET_MB = 40.0  # as Megatron's DDP (40 MB of fp32 gradients per bucket)


@dataclass(frozen=True)
class Holder:
    pipeline: int
    ranks: tuple[int, ...]
    weight: float


@dataclass(frozen=True)
class Piece:
    """Chunk ``chunk`` of parameter ``name`` as held by ``rank``: local chunk ``local`` of ``n_local``."""

    name: str
    chunk: int
    rank: int
    local: int
    n_local: int
    scale: float  # weight this rank applies before the sum
    numel: int  # elements of the chunk (equal on every holder)

    @property
    def whole(self) -> bool:
        """The piece is the rank's whole local tensor (its gradient can live in the bucket)."""
        return self.n_local == 1


@dataclass
class RankSet:
    """Every piece summed over exactly ``ranks`` (one process group)."""

    ranks: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)


@dataclass(frozen=True)
class Bucket:
    """Bucket ``index`` of rank set ``ranks``: one flat all-reduce of ``numel`` fp32 elements.

    ``pieces`` holds every member's pieces, slot by slot: a slot (parameter, chunk) has one piece per
    member and occupies the same ``numel`` elements at the same offset in every member's buffer.
    ``ready`` is the backward position (reverse layout order) of its last slot: the launch-order key.
    """

    ranks: tuple[int, ...]
    index: int
    pieces: tuple[Piece, ...]
    numel: int
    ready: int

    def own(self, rank: int) -> list[Piece]:
        return [p for p in self.pieces if p.rank == rank]


def holders(plan: Plan, info: ParamInfo, weighting: str = "samples") -> list[Holder]:
    """Every stage (one entry per stage, pipelines in order) that holds ``info``."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}")
    table = stage_rank_table(plan)
    out = []
    for p, pipe in enumerate(plan.pipelines):
        w = pipe.samples / plan.global_batch_size if weighting == "samples" else 1.0 / len(plan.pipelines)
        for s, st in enumerate(pipe.stages):
            if any(st.first_layer <= layer <= st.last_layer for layer in info.holders):
                out.append(Holder(p, table[p][s], w))
    return out


def rank_sets(plan: Plan, layout: list[ParamInfo], weighting: str = "samples") -> list[RankSet]:
    """The whole sync by rank set (identical on every rank), sorted by rank tuple."""
    by_ranks: dict[tuple[int, ...], RankSet] = {}
    for info in layout:
        hs = holders(plan, info, weighting)
        numel = math.prod(info.shape)
        if info.shard_dim is None:
            _add(by_ranks, [Piece(info.name, 0, r, 0, 1, h.weight / len(h.ranks), numel) for h in hs for r in h.ranks])
            continue
        n = math.lcm(*(len(h.ranks) for h in hs))
        for c in range(n):
            members = []
            for h in hs:
                per = n // len(h.ranks)
                members.append(Piece(info.name, c, h.ranks[c // per], c % per, per, h.weight, numel // n))
            _add(by_ranks, members)
    return [by_ranks[k] for k in sorted(by_ranks)]


def _add(by_ranks: dict[tuple[int, ...], RankSet], members: list[Piece]) -> None:
    key = tuple(sorted(p.rank for p in members))
    by_ranks.setdefault(key, RankSet(key)).pieces.extend(members)


def split(rank_set: RankSet, backward_pos: dict[str, int], cap: int) -> list[Bucket]:
    """Cut a rank set into buckets of at least ``cap`` elements (the last one smaller; ``cap <= 0``: one).

    Slots go in backward order (``backward_pos``: 0 = the parameter whose gradient comes first), as
    Megatron's DDP fills its buckets; a slot is never split.
    """
    slots: dict[tuple[str, int], list[Piece]] = {}
    for p in rank_set.pieces:
        slots.setdefault((p.name, p.chunk), []).append(p)
    order = sorted(slots, key=lambda k: (backward_pos[k[0]], k[1]))
    out: list[Bucket] = []
    current: list[tuple[str, int]] = []
    numel = 0

    def close() -> None:
        pieces = tuple(p for k in current for p in slots[k])
        out.append(Bucket(rank_set.ranks, len(out), pieces, numel, backward_pos[current[-1][0]]))

    for k in order:
        current.append(k)
        numel += slots[k][0].numel
        if 0 < cap <= numel:
            close()
            current, numel = [], 0
    if current:
        close()
    return out


def plan_buckets(sets: list[RankSet], layout: list[ParamInfo], bucket_mb: float = DEFAULT_BUCKET_MB) -> list[Bucket]:
    """Every bucket of the plan in the one global launch order (each rank launches its own in it)."""
    backward_pos = {info.name: len(layout) - 1 - i for i, info in enumerate(layout)}
    cap = int(bucket_mb * 1e6) // 4  # fp32 elements
    buckets = [b for s in sets for b in split(s, backward_pos, cap)]
    return sorted(buckets, key=lambda b: (b.ready, b.ranks, b.index))
