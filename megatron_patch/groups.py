"""Process groups built from the plan (patch P1: no global, homogeneous parallel_state).

torch names a new group by a per-process counter (and even ``use_local_synchronization`` hashes the
ranks *with* the number of groups the process made before), and NCCL creates a group's communicator by
splitting the world's, a collective of all ranks: so every rank creates every group, members or not,
in the same order. :func:`create` sorts what it is given, and :func:`plan_groups` passes everything a
plan needs in one call, before anything communicates; with ``init_process_group(device_id=...)`` NCCL
communicators are then built eagerly there, not lazily inside the first send (where a plan whose
one-stage pipeline never sends would leave the others waiting for it).

The result is a :class:`PlanGroups` that the trainer hands to what communicates (its stage's
megatron ``ProcessGroupCollection``, its p2p communicator, its gradient buckets), as megatron-core
passes explicit process groups: nothing is looked up in a process-wide registry.

Kinds keep communication that may be in flight at the same time apart: ``P2P`` groups carry the
stage-boundary sends of one pipeline, while the gradient buckets of the same ranks may be all-reducing
(on NCCL, a bucket queued before a send on the same communicator would block the send's receiver).
Within a kind, equal rank sets are one group (a gradient rank set equal to a stage's TP group shares it).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron_patch.grad_sync import RankSet
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.roles import Role, stage_rank_table

P2P = "p2p"  # a pipeline's stage-boundary sends and receives
Key = tuple[str, tuple[int, ...]]  # (kind, sorted ranks)


def create(keys: Iterable[tuple[str, Iterable[int]]]) -> dict[Key, Any]:
    """Collective: create every group of ``(kind, ranks)`` keys, in one sorted order; every rank passes
    the same keys. Returns the groups this rank is a member of (the world's own group for all ranks)."""
    me, world = dist.get_rank(), dist.get_world_size()
    mine: dict[Key, Any] = {}
    for key in sorted({(kind, tuple(sorted(r))) for kind, r in keys}):
        kind, ranks = key
        if kind == "" and len(ranks) == world:
            mine[key] = dist.group.WORLD
            continue
        g = dist.new_group(list(ranks))
        if me in ranks:
            mine[key] = g
    return mine


def groups_of_one() -> Any:
    """Collective: every rank's group of one (every rank creates all of them); this rank's."""
    return create(("", (r,)) for r in range(dist.get_world_size()))[("", (dist.get_rank(),))]


def collection(tp: Any, alone: Any, pp: Any = None) -> Any:
    """A megatron ProcessGroupCollection for one stage: its TP group, ``alone`` (this rank's group of one)
    for context and data parallelism, which a stage never has, and ``pp`` for the schedule."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    pgc = ProcessGroupCollection()
    pgc.tp = tp
    pgc.cp = alone
    pgc.tp_cp = tp
    pgc.dp = alone
    pgc.dp_cp = alone
    pgc.pp = pp
    pgc.embd = None
    pgc.pos_embd = None
    return pgc


@dataclass(frozen=True)
class PlanGroups:
    """One rank's process groups under one plan (made by :func:`plan_groups` on every rank at once)."""

    alone: Any  # this rank's group of one
    tp: Any  # its stage's TP group
    p2p: Any  # its pipeline's stage-boundary group; None for a pipeline of one stage (it never sends)
    sync: Mapping[tuple[int, ...], Any]  # the gradient rank sets (of several ranks) it sums in, by sorted ranks

    def collection(self, pp: Any) -> Any:
        """The stage's megatron ProcessGroupCollection, ``pp`` being what the schedule sees as its pp group."""
        return collection(self.tp, self.alone, pp)


def plan_groups(plan: Plan, role: Role, sets: list[RankSet]) -> PlanGroups:
    """Collective: every group ``plan`` trains with (TP groups, groups of one, gradient rank sets of
    several ranks, one P2P group per pipeline of several stages), created by every rank in one order;
    ``role``'s groups among them."""
    table = stage_rank_table(plan)
    pipes = [tuple(r for ranks in row for r in ranks) for row in table]
    keys: list[tuple[str, Iterable[int]]] = [("", ranks) for row in table for ranks in row]
    keys += [("", (r,)) for r in range(plan.num_gpus)]
    keys += [("", s.ranks) for s in sets if len(s.ranks) > 1]
    keys += [(P2P, pipe) for row, pipe in zip(table, pipes) if len(row) > 1]
    mine = create(keys)
    return PlanGroups(alone=mine[("", (role.rank,))], tp=mine[("", tuple(sorted(role.stage_ranks)))],
                      p2p=mine.get((P2P, tuple(sorted(pipes[role.pipeline])))),
                      sync={s.ranks: mine[("", s.ranks)] for s in sets if len(s.ranks) > 1 and role.rank in s.ranks})
