"""Start N ranks of a command on this machine with torchrun's variables (tests, benchmarks, CPU demos).

torchrun itself would do, but it adds an elastic agent per launch and reads stdin; the tests need
plain processes they can signal or kill one by one.

``fork=True`` forks the ranks from a zygote that has imported torch and megatron-core already
(``megatron_patch.zygote``: the same program, environment and files; 3-4 s of CPU less per rank). One zygote
serves each environment (up to the rendezvous variables), kept for the next start until this process exits.
Commands that a fork cannot start as a fresh process would (interpreter options such as ``-X importtime``) are
refused; a rank that measures its own start-up or memory runs as a new process (the default).
"""
from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from megatron_patch.zygote import Zygote

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world: int, port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("SLURM_PROCID", None)
    env.update(extra or {})
    return env


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str


class RankProcess(Protocol):
    """A rank's process (new, or forked by a zygote), with the files its stdout and stderr go to (:func:`wait`
    reads them)."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    @property
    def outputs(self) -> tuple[IO[str], IO[str]]: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


class NewProcess(subprocess.Popen[str]):
    """A rank started as a new interpreter."""

    outputs: tuple[IO[str], IO[str]]


MAX_ZYGOTES = 2  # idle ones kept at once (each holds torch and megatron-core: ~350 MB)
_zygotes: list[Zygote] = []


def zygote_for(env: dict[str, str]) -> Zygote:
    """A running zygote that serves ``env`` (started, under ``env``, if none does; the oldest idle one goes
    when more than :data:`MAX_ZYGOTES` would be kept)."""
    for z in _zygotes:
        if z.serves(env):
            return z
    idle = [z for z in _zygotes if not z.busy()]
    if len(_zygotes) >= MAX_ZYGOTES and idle:
        _zygotes.remove(idle[0])
        idle[0].close()
    _zygotes.append(Zygote(env, REPO))
    return _zygotes[-1]


@atexit.register
def close_zygotes() -> None:
    while _zygotes:
        _zygotes.pop().close()


def start(argv: list[str], world: int, extra_env: dict[str, str] | None = None,
          logs: Path | None = None, fork: bool = False) -> list[RankProcess]:
    """Start ``python argv...`` as ranks 0..world-1 (returns the processes, not waiting); ``fork``: forked from
    a zygote (module docstring).

    Output goes to files (a full pipe would block a rank inside a collective): ``logs/rank{r}.out``
    and ``.err`` when ``logs`` is given (readable while the ranks run), else temporary files.
    """
    port = free_port()
    procs: list[RankProcess] = []
    for r in range(world):
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            out, err = open(logs / f"rank{r}.out", "w+"), open(logs / f"rank{r}.err", "w+")
        else:
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        env = rank_env(r, world, port, extra_env)
        if fork:
            procs.append(zygote_for(env).start(argv, env, REPO, out, err))
            continue
        p = NewProcess([sys.executable, *argv], env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out,
                       stderr=err, text=True)
        p.outputs = (out, err)
        procs.append(p)
    return procs


def _read(fh: IO[str]) -> str:
    fh.seek(0)
    text = fh.read()
    fh.close()
    return text


class LaunchTimeout(RuntimeError):
    """The ranks did not finish in time; ``results`` holds what they printed before being killed."""

    def __init__(self, timeout: float, results: list[RankResult]) -> None:
        tails = "\n".join(f"--- rank {r.rank} rc={r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}"
                          for r in results)
        super().__init__(f"ranks still running after {timeout:.0f} s; killed\n{tails}")
        self.results = results


def wait(procs: list[RankProcess], timeout: float = 600, grace: float = 20) -> list[RankResult]:
    """Wait for every rank; raise :class:`LaunchTimeout` (after killing them) past ``timeout``.

    As torchrun does, once a rank failed (non-zero exit) the others get ``grace`` seconds to finish
    (they may be blocked in a collective with the dead one) and are then killed.
    """
    deadline = time.monotonic() + timeout
    timed_out = False
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if any(p.returncode not in (None, 0) for p in procs):
            deadline = min(deadline, now + grace)
        if now > deadline:
            timed_out = not any(p.returncode not in (None, 0) for p in procs)
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            break
        time.sleep(0.05)
    results = [RankResult(r, p.wait(), _read(p.outputs[0]), _read(p.outputs[1]))
               for r, p in enumerate(procs)]
    if timed_out:
        raise LaunchTimeout(timeout, results)
    return results


def run(argv: list[str], world: int, extra_env: dict[str, str] | None = None,
        timeout: float = 600, grace: float = 20, fork: bool = False) -> list[RankResult]:
    return wait(start(argv, world, extra_env, fork=fork), timeout, grace)


def build_dataset(prefix: str) -> None:
    """The demo indexed dataset at ``prefix`` (``python -m megatron_patch.data``), in a child process."""
    res = run(["-m", "megatron_patch.data", prefix], 1, timeout=300)[0]
    if res.returncode != 0:
        raise RuntimeError(f"building the dataset failed:\n{res.stderr[-3000:]}")


def self_launching(main: Callable[[], int], rank_main: Callable[[], None], flag: str = "BENCH_RANK_MAIN") -> None:
    """Entry point of a script that starts itself as ranks with :func:`run`: the ranks get ``flag=1``."""
    if os.environ.get(flag) == "1":
        rank_main()
    else:
        raise SystemExit(main())
