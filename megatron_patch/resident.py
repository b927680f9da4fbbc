"""A resident rank's side of an allocation change: leave the broken communicators, keep its state, rejoin.

The protocol (held markers, the agent's directives) is :mod:`sailor_hpc.core.resident`'s; this module holds what
needs torch:

* :func:`abort_communication`: a rank whose peer is gone must also free the ranks blocked on *it*. NCCL has an
  abort (``ncclCommAbort``, through torch's ``_abort_process_group``); gloo has none that wakes a peer (torch's
  ``abort()`` on a gloo group leaves the other side blocked in its receive until the process exits, measured on
  torch 2.13), so the rank shuts its TCP connections down: every peer blocked on it gets "connection closed"
  at once and does the same, and the failure reaches every rank in milliseconds (a rank waits on a peer, that
  one on another, down to the rank that is gone).
* :class:`Waker`: a lost node whose processes live on (a network cut, a hung node) closes no connection, and
  its peers would wait in their collective until the timeout. The job agent, which sees the node's step end,
  writes a wake marker; a thread of each rank watches for it and shuts the rank's connections down (the main
  thread's collective fails at once, as above).
* :class:`Kept`: the rank's own shards of the layers it trained, at a step it saved: after the change, the layers
  the new plan leaves on this rank (same TP shard) are restored from memory, the others from the checkpoint's
  files (which the save just wrote: from the page cache).
"""
from __future__ import annotations

import faulthandler
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sailor_hpc.core.resident import wake_file

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


#: while a resident rank trains on gloo (:class:`Waker`), the event its wake sets: :func:`wait` returns early on it
_WAKE: threading.Event | None = None
WAIT_POLL_S = (0.00005, 0.001)  # first and longest pause between looks: a short wait adds ~50 us, a long one ~1 ms


def wait(work: Any) -> None:
    """``work.wait()``, which a wake interrupts on gloo: a gloo op whose peer was lost may never complete even
    with every connection shut down (seen on the local cluster: a survivor blocked in its gradient bucket's
    wait, woken, never holding), so a resident rank polls the work and raises on the wake instead. NCCL's
    waits do not block the host (and its abort ends them): they stay as they are."""
    wake = _WAKE
    if wake is None:
        work.wait()
        return
    pause = WAIT_POLL_S[0]
    while not work.is_completed():
        if wake.is_set():
            raise RuntimeError("woken by the job agent while waiting on a collective")
        time.sleep(pause)
        pause = min(2 * pause, WAIT_POLL_S[1])
    work.wait()  # the op's own error, if it failed


class Waker:
    """Watches ``wake-<epoch>`` while this rank trains ``epoch``; when the agent writes it, shuts the rank's
    connections down from this thread, so the main thread's collective fails. :meth:`stop` (under the lock,
    before the rank joins another epoch's groups) ends the watch: a late wake never touches the next groups.
    ``gloo``: the rank's groups block the host in their waits, which :func:`wait` then polls."""

    POLL_S = 0.05
    STACKS_AFTER_S = 10.0  # still training this long after a wake: print every thread's stack (where it hangs)

    def __init__(self, root: Path, epoch: int, gloo: bool) -> None:
        self._path = wake_file(root, epoch)
        self._gloo = gloo
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"sailor-wake-{epoch}", daemon=True)

    def __enter__(self) -> Waker:
        global _WAKE
        self._woken = threading.Event()
        _WAKE = self._woken if self._gloo else None
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        global _WAKE
        with self._lock:
            self._stopped.set()
            _WAKE = None

    def _watch(self) -> None:
        while not self._stopped.wait(self.POLL_S):
            if not self._path.exists():
                continue
            with self._lock:
                if self._stopped.is_set():
                    return
                self._woken.set()
                n = interrupt_communication()
            sys.stderr.write(f"woken by the job agent ({self._path.name}): {n} connections shut down\n")
            sys.stderr.flush()
            if not self._stopped.wait(self.STACKS_AFTER_S):
                sys.stderr.write(f"still training {self.STACKS_AFTER_S:.0f} s after the wake; every thread:\n")
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            return


def interrupt_communication() -> int:
    """Make every collective of this process fail now, from any thread (NCCL: abort; gloo: shut down its TCP
    connections); how many connections were shut down (0 for NCCL)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if dist.is_initialized() and dist.get_backend() == "nccl":
        c10d._abort_process_group()
        return 0
    return _shutdown_tcp_sockets()


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


#: the broken gloo groups of every change, referenced for the process's life: never destructed. A gloo group's
#: destructor waits until its worker threads drained their queue, and a worker blocked in a collective with a
#: lost peer may never return; the destructor then hangs the rank where the trainer that held the group is
#: freed (seen on the local cluster: a survivor of a node loss stuck there, never holding). The cost: each
#: change leaves its groups' idle threads and buffers behind.
_ABANDONED: list[Any] = []


def abort_communication() -> None:
    """Leave every process group at once, waking the peers blocked on this rank, then forget them all."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    interrupt_communication()
    if not dist.is_initialized():
        return  # NCCL's abort forgot every group
    _ABANDONED.extend(c10d._world.pg_map)
    try:
        dist.destroy_process_group()
    except (RuntimeError, ValueError, AssertionError):
        c10d._world.pg_map.clear()  # the groups are broken already: forget them, so a new world can start
        c10d._update_default_pg(None)
