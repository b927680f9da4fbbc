"""Process groups built from the plan (patch P1: no global, homogeneous parallel_state).

Groups are identified by a kind and their sorted rank tuple. torch names a new group by a
per-process counter (and even ``use_local_synchronization`` hashes the ranks *with* the number of
groups the process made before), and NCCL creates a group's communicator by splitting the world's,
a collective of all ranks: so every rank creates every group, members or not, in the same order.
:func:`create_groups` sorts what it is given; the trainer passes everything a plan needs in one
call before anything communicates (``engine.plan_groups``), and with ``init_process_group(device_id=...)``
NCCL communicators are then built eagerly there, not lazily inside the first send (where a plan whose
one-stage pipeline never sends would leave the others waiting for it).

Kinds keep communication that may be in flight at the same time apart: ``P2P`` groups carry the
stage-boundary sends of one pipeline, while the gradient buckets of the same ranks may be all-reducing
(on NCCL, a bucket queued before a send on the same communicator would block the send's receiver).

A process creates a (kind, rank set) once and reuses it for every later plan (the cache, including
"not a member", is identical on all ranks, so they skip the same sets).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

P2P = "p2p"  # a pipeline's stage-boundary sends and receives
_CACHE: dict[tuple[str, tuple[int, ...]], Any] = {}


def create_groups(rank_sets: Iterable[Iterable[int]], kind: str = "") -> None:
    """Collective: create (once) every group of ``rank_sets``; every rank passes the same sets."""
    create_keyed((kind, r) for r in rank_sets)


def create_keyed(keys: Iterable[tuple[str, Iterable[int]]]) -> None:
    """Collective: create (once) the groups of ``(kind, ranks)`` keys, in one sorted order."""
    me, world = dist.get_rank(), dist.get_world_size()
    for key in sorted({(kind, tuple(sorted(r))) for kind, r in keys}):
        if key in _CACHE:
            continue
        kind, ranks = key
        if kind == "" and len(ranks) == world:
            _CACHE[key] = dist.group.WORLD
        else:
            g = dist.new_group(list(ranks))
            _CACHE[key] = g if me in ranks else None


def group(ranks: Iterable[int], kind: str = "") -> Any:
    """The group of exactly these ranks (created before by :func:`create_groups`)."""
    key = (kind, tuple(sorted(ranks)))
    if _CACHE.get(key) is None:
        raise KeyError(f"process group {key} was not created, or rank {dist.get_rank()} is not in it")
    return _CACHE[key]


def singleton_collection(tp_group: Any = None, pp_group: Any = None) -> Any:
    """Collective: a megatron ProcessGroupCollection for one stage, the given TP group and groups of one."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    me = dist.get_rank()
    create_groups([[r] for r in range(dist.get_world_size())])
    alone = group([me])
    pgc = ProcessGroupCollection()
    pgc.tp = tp_group if tp_group is not None else alone
    pgc.cp = alone
    pgc.tp_cp = pgc.tp
    pgc.dp = alone
    pgc.dp_cp = alone
    pgc.pp = pp_group
    pgc.embd = None
    pgc.pos_embd = None
    return pgc
