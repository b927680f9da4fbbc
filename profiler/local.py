"""Profiling on this machine, without Slurm: the ranks of one measurement as local processes.

``sailor-hpc profile --local`` (a laptop, a workstation) measures the same grid as a Slurm sweep, with the
same functions (:func:`profiler.jobs.compute_job`, :mod:`profiler.netbench`), but starts each measurement's
ranks here, one measurement at a time so that none times another's work. Ranks get torchrun's variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a port free now) and no Slurm variables, so a
local sweep started inside an allocation records no job it did not run in.

:func:`run_ranks` starts, waits for and, on failure or the sweep's deadline, ends one measurement's
processes; ``python -m profiler.local TASK OUT`` is a compute rank (the task as JSON; rank 0 writes the
job's summary to OUT). Torch is imported only in the ranks.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from profiler.jobs import ComputeTask, compute_job
from sailor_hpc.core.atomic import atomic_write_text

GRACE_S = 5.0  # how long the other ranks may take to end once one has failed (they may wait in a collective)


@dataclass(frozen=True)
class RanksOutcome:
    """How one measurement's processes ended: ``reason`` is "" when every rank exited 0."""

    reason: str
    pid: int  # rank 0's process id: the "job" of a local measurement


def free_port() -> int:
    """A TCP port free on this machine now (the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """This process's environment for one rank: torchrun's variables, none of Slurm's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


def _last_line(log: Path) -> str:
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:400] if lines else ""


def _end(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # each rank leads a session of its own: its children go too
    for p in procs:
        p.wait()


def run_ranks(command: Sequence[str], world: int, logs: Sequence[Path], deadline: float | None,
              timeout_note: str = "") -> RanksOutcome:
    """Run ``command`` as ranks 0..world-1 and wait for all of them. A rank that fails ends the others
    after :data:`GRACE_S`; the deadline (``time.monotonic()``) ends them all."""
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(world):
            with open(logs[rank], "wb") as log:
                procs.append(subprocess.Popen(list(command), env=rank_env(rank, world, port), stdout=log,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True))
        failed_at: float | None = None
        while [p.poll() for p in procs].count(None):  # every rank polled: each one's exit is seen
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                _end(procs)
                return RanksOutcome(f"still running after the sweep's timeout{timeout_note}: ended", procs[0].pid)
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if failed_at is not None and now - failed_at >= GRACE_S:
                break
            time.sleep(0.05)
    finally:
        _end(procs)
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if not bad:
        return RanksOutcome("", procs[0].pid)
    first = min(bad, key=lambda rc: (rc[1] in (-signal.SIGKILL, None), rc[0]))  # a rank that failed by itself
    rank, code = first
    return RanksOutcome(f"local rank {rank} exited {code}: {_last_line(logs[rank]) or 'no output'} ({logs[rank]})",
                        procs[0].pid)


def task_to_json(task: ComputeTask) -> str:
    return json.dumps(asdict(task))


def task_from_json(text: str) -> ComputeTask:
    doc = json.loads(text)
    return ComputeTask(**{**doc, "mbs": tuple(doc["mbs"])})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m profiler.local", description="one rank of a local compute point")
    ap.add_argument("task", help="ComputeTask as JSON (written by the sweep driver)")
    ap.add_argument("out", help="rank 0 writes the measurement's summary here (JSON)")
    args = ap.parse_args(argv)
    result: dict[str, Any] | None = compute_job(task_from_json(Path(args.task).read_text()))
    if result is not None:  # rank 0
        atomic_write_text(args.out, json.dumps(result, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
