"""Watch, pause and resume the training ranks of a Slurm step from a test (every fake node runs on this machine).

A tiny model trains ~12 steps/s on CPU while Slurm and the controller take seconds to act on a change, so
a test that changes the allocation under a running job pauses the job's ranks (SIGSTOP) while the change
is acted on: what happens is then the same on a slow machine as on a fast one.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

from megatron_patch.fork_server import FORK_SERVER_ENV, forked_dir


def rank_pids(plan_file: str | Path) -> list[int]:
    """The training processes of the step started with ``--plan plan_file`` (every fake node runs on this
    machine); srun and rank_env carry the same arguments, so only ``python -m`` a runtime's launch module counts.
    A rank forked by the session's fork server has the zygote's command line: the server's notes give its own."""
    pids = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, PermissionError):
            argv = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
            if _runs_plan([a.decode(errors="replace") for a in argv], plan_file):
                pids.append(int(proc.name))
    server = os.environ.get(FORK_SERVER_ENV)
    for note in forked_dir(server).glob("*.json") if server else ():
        with contextlib.suppress(FileNotFoundError, ValueError):
            if _runs_plan(json.loads(note.read_text())["argv"], plan_file) and Path(f"/proc/{note.stem}").exists():
                pids.append(int(note.stem))
    return pids


def _runs_plan(argv: list[str], plan_file: str | Path) -> bool:
    return argv[1:2] == ["-m"] and argv[2:3] in (["megatron_patch.launch"], ["megatron_patch.ds_runtime.launch"]) \
        and str(plan_file) in argv


def agent_pids(plan_file: str | Path, part: int) -> list[int]:
    """The job agent (``sailor_hpc.controller.job_agent``) of part ``part`` of the bundle submitted with
    ``--plan plan_file`` (0: the lead, which answers the bundle's changes)."""
    pids = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, PermissionError):
            argv = [a.decode(errors="replace") for a in (proc / "cmdline").read_bytes().split(b"\0")] \
                if proc.name.isdigit() else []
            parts = [a.removeprefix("--bundle-part=") for a in argv if a.startswith("--bundle-part=")]
            if argv[1:3] == ["-m", "sailor_hpc.controller.job_agent"] and str(plan_file) in argv \
                    and [p.rpartition(":")[2].partition("/")[0] for p in parts] == [str(part)]:  # PARTITION:I/N
                pids.append(int(proc.name))
    return pids


def pause(plan_file: str | Path, sig: signal.Signals = signal.SIGSTOP) -> list[int]:
    """Send ``sig`` to every rank of the step started with ``--plan plan_file``. SIGSTOP makes a step as
    slow as a test needs, so a change the test makes next never races with the run's last step."""
    pids = rank_pids(plan_file)
    assert pids, f"no rank process runs plan {plan_file}"
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return pids


def resume(plan_file: str | Path, once_pending: signal.Signals | None = None, timeout: float = 60.0) -> list[int]:
    """SIGCONT the paused ranks; with ``once_pending``, only once that signal (a controller's or a test's
    ``scancel --signal``, which takes seconds through slurmctld and slurmd) waits on every one of them."""
    if once_pending is not None:
        bit = 1 << (once_pending - 1)
        deadline = time.monotonic() + timeout
        for pid in rank_pids(plan_file):
            while not _pending(pid) & bit:
                assert time.monotonic() < deadline, f"no {once_pending.name} reached rank {pid} in {timeout} s"
                time.sleep(0.05)
    return pause(plan_file, signal.SIGCONT)


def _pending(pid: int) -> int:
    """The signals waiting on a process (its own and its threads' shared set), as a bit mask."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return sum(int(line.split()[1], 16) for line in status if line.startswith(("SigPnd:", "ShdPnd:")))


def wait_in_log(log: Path, text: str, timeout: float = 120.0) -> None:
    """Wait until a job's log holds ``text`` (read directly: the controller may be down or lagging)."""
    deadline = time.monotonic() + timeout
    while not (log.exists() and text in log.read_text(errors="replace")):
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log yet)"
            raise AssertionError(f"no {text} in {log} after {timeout} s; its end:\n{tail}")
        time.sleep(0.1)
