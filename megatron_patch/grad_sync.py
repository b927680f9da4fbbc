"""Gradient synchronisation per layer and per TP chunk across every holder, weighted by samples.

Each pipeline's loss is the mean over its own samples (megatron's schedule divides by its micro-batch
count). The global loss is the mean over all samples, so pipeline ``p``'s gradient enters with weight
``w_p = samples_p / global_batch``.

For a parameter held by several stages (one per pipeline, or two in one pipeline for a tied
embedding split over its first and last stage), with TP degrees ``t_h``:

- sharded: cut the canonical tensor into ``L = lcm(t_h)`` chunks; chunk ``c`` lives on TP rank
  ``c // (L / t_h)`` of holder ``h``. Those ranks (one per holder) sum ``w_p * chunk``.
- replicated (norms, row-parallel biases, position embeddings): every TP rank of every holder has
  the same gradient; all of them sum ``w_p / t_h * grad``, so every replica ends bit-identical.

Pieces that go to the same set of ranks share one flat buffer and one all-reduce ("bucket"). Every
rank derives the same bucket list from the plan and runs its buckets in one global order (sorted
rank tuples), which cannot deadlock. After the sync every holder of a chunk has the same values, so
the global gradient norm counts each chunk once, on its *owner* (first member).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_patch.groups import create_groups, group
from megatron_patch.layout import ParamInfo, chunk_views
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.roles import stage_rank_table

WEIGHTINGS = ("samples", "uniform")  # "uniform" (1/num_pipelines) exists as the tests' negative control


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


@dataclass
class Bucket:
    ranks: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)


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


def build_buckets(plan: Plan, layout: list[ParamInfo], weighting: str = "samples") -> list[Bucket]:
    """The whole sync as buckets (identical on every rank), in execution order."""
    by_ranks: dict[tuple[int, ...], Bucket] = {}
    for info in layout:
        hs = holders(plan, info, weighting)
        if info.shard_dim is None:
            members = [Piece(info.name, 0, r, 0, 1, h.weight / len(h.ranks)) for h in hs for r in h.ranks]
            _add(by_ranks, members)
            continue
        n = math.lcm(*(len(h.ranks) for h in hs))
        for c in range(n):
            members = []
            for h in hs:
                per = n // len(h.ranks)
                members.append(Piece(info.name, c, h.ranks[c // per], c % per, per, h.weight))
            _add(by_ranks, members)
    return [by_ranks[k] for k in sorted(by_ranks)]


def _add(by_ranks: dict[tuple[int, ...], Bucket], members: list[Piece]) -> None:
    key = tuple(sorted(p.rank for p in members))
    by_ranks.setdefault(key, Bucket(key)).pieces.extend(members)


class GradSync:
    """This rank's share of the sync: run it on the local (main) gradients after the backward passes."""

    def __init__(self, plan: Plan, layout: list[ParamInfo], weighting: str = "samples") -> None:
        self.rank = dist.get_rank()
        self.infos = {p.name: p for p in layout}
        buckets = build_buckets(plan, layout, weighting)
        create_groups(b.ranks for b in buckets if len(b.ranks) > 1)
        self.mine: list[tuple[tuple[int, ...], list[Piece]]] = []
        self.owned: list[Piece] = []  # pieces this rank counts in the global norm
        for b in buckets:
            own = [p for p in b.pieces if p.rank == self.rank]
            if own:
                self.mine.append((b.ranks, own))
            first_of: dict[tuple[str, int], int] = {}
            for p in b.pieces:
                first_of.setdefault((p.name, p.chunk), p.rank)
            self.owned += [p for p in own if first_of[(p.name, p.chunk)] == self.rank]
        self.num_groups = sum(1 for ranks, _ in self.mine if len(ranks) > 1)

    def _views(self, grads: dict[str, torch.Tensor], p: Piece) -> list[torch.Tensor]:
        return chunk_views(grads[p.name], self.infos[p.name], p.n_local, p.local)

    def run(self, grads: dict[str, torch.Tensor]) -> None:
        """Replace every local gradient by the weighted sum over its holders (in place)."""
        pending = []
        for ranks, pieces in self.mine:
            views = [v for p in pieces for v in self._views(grads, p)]
            scales = [p.scale for p in pieces for _ in self._views(grads, p)]
            if len(ranks) == 1:
                for v, s in zip(views, scales):
                    if s != 1.0:
                        v.mul_(s)
                continue
            flat = torch.cat([v.reshape(-1) * s for v, s in zip(views, scales)])
            pending.append((dist.all_reduce(flat, group=group(ranks), async_op=True), flat, views))
        for work, flat, views in pending:
            work.wait()
            offset = 0
            for v in views:
                v.copy_(flat[offset:offset + v.numel()].view_as(v))
                offset += v.numel()

    def owned_sq_norm(self, grads: dict[str, torch.Tensor]) -> float:
        """Sum of squares of the gradient chunks this rank owns (after :meth:`run`)."""
        views = [v for p in self.owned for v in self._views(grads, p)]
        if not views:
            return 0.0
        norms = torch.stack(torch._foreach_norm(views)).double()  # fp32 per piece, as clip_grad_norm_
        return float(norms.pow(2).sum())
