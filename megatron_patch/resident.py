"""A resident rank's side of an allocation change: leave the broken communicators, keep its state, rejoin.

The protocol (held markers, the agent's directives) is :mod:`sailor_hpc.core.resident`'s; this module holds what
needs torch:

* :func:`abort_communication`: a rank whose peer is gone must also free the ranks blocked on *it*. NCCL has an
  abort (``ncclCommAbort``, through torch's ``_abort_process_group``); gloo has none that wakes a peer (torch's
  ``abort()`` on a gloo group leaves the other side blocked in its receive until the process exits, measured on
  torch 2.13), so the rank shuts its TCP connections down: every peer blocked on it gets "connection closed"
  at once and does the same, and the failure reaches every rank in milliseconds (a rank waits on a peer, that
  one on another, down to the rank that is gone).
* :class:`Kept`: the rank's own shards of the layers it trained, at a step it saved: after the change, the layers
  the new plan leaves on this rank (same TP shard) are restored from memory, the others from the checkpoint's
  files (which the save just wrote: from the page cache).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class Kept:
    """A rank's optimizer state (fp32 master weight and Adam moments, its TP shard) of ``step``."""

    step: int
    tp: int
    tp_rank: int
    tensors: dict[str, dict[str, torch.Tensor]]
    used: list[str] = field(default_factory=list)  # names restored from it by the last load

    def shard(self, name: str, tp: int, tp_rank: int, like: torch.Tensor, step: int) -> dict[str, torch.Tensor] | None:
        """``name``'s kept state where it is what a checkpoint of ``step`` would give this TP shard, else None."""
        kept = self.tensors.get(name)
        if kept is None or step != self.step or (tp, tp_rank) != (self.tp, self.tp_rank):
            return None
        if kept["param"].shape != like.shape:  # another plan's TP degrees pad the vocabulary differently
            return None
        self.used.append(name)
        return kept


def kept_state(trainer: Any) -> Kept:
    """References to the trainer's optimizer state (no copy): the trainer is dropped right after."""
    return Kept(step=trainer.step, tp=trainer.role.tp, tp_rank=trainer.role.tp_rank,
                tensors={name: trainer.optimizer.state_of(name) for name in trainer.params})


def _shutdown_tcp_sockets() -> int:
    """Shut down (not close: their owners still hold the descriptors) every TCP socket of this process."""
    n = 0
    for fd in _fds():
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # not a socket
        try:
            # a listening socket stays: gloo's listener thread aborts the process when its accept fails
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM \
                    and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    n += 1
                except OSError:
                    pass  # not connected, or shut down already
        finally:
            s.close()  # the duplicate only
    return n


def _fds() -> list[int]:
    try:
        return [int(f) for f in os.listdir("/proc/self/fd")]
    except OSError:
        return []


def abort_communication() -> None:
    """Leave every process group at once, waking the peers blocked on this rank, then forget them all."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        c10d._abort_process_group()
        return
    _shutdown_tcp_sockets()
    try:
        dist.destroy_process_group()
    except (RuntimeError, ValueError, AssertionError):
        c10d._world.pg_map.clear()  # the groups are broken already: forget them, so a new world can start
        c10d._update_default_pg(None)
