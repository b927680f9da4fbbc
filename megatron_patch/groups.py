"""Process groups built from the plan (patch P1: no global, homogeneous parallel_state).

Groups are identified by their sorted rank tuple. torch names a new group by a per-process counter
(and even ``use_local_synchronization`` hashes the ranks *with* the number of groups the process made
before), so every rank must create every group, members or not, in the same order: callers pass the
same global list on every rank and groups are created in sorted order. Only members build a gloo/NCCL
communicator; the others just advance the counter.

A process creates a rank set once and reuses it for every later plan (the cache, including "not a
member", is identical on all ranks, so they skip the same sets).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

_CACHE: dict[tuple[int, ...], Any] = {}


def create_groups(rank_sets: Iterable[Iterable[int]]) -> None:
    """Collective: create (once) every group of ``rank_sets``; every rank passes the same sets."""
    me = dist.get_rank()
    for ranks in sorted({tuple(sorted(r)) for r in rank_sets}):
        if ranks in _CACHE:
            continue
        if len(ranks) == dist.get_world_size():
            _CACHE[ranks] = dist.group.WORLD
        else:
            g = dist.new_group(list(ranks))
            _CACHE[ranks] = g if me in ranks else None


def group(ranks: Iterable[int]) -> Any:
    """The group of exactly these ranks (created before by :func:`create_groups`)."""
    key = tuple(sorted(ranks))
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
