"""A socket at which a Slurm step's tasks have their rank forked from a zygote instead of importing anew.

Every rank of a Slurm job starts as a new interpreter (``srun`` → ``rank_env`` → ``python -m
megatron_patch.launch``) and imports torch and megatron-core: 3-4 s of CPU before its first step, the larger
part of a test job's rank. Where one machine runs many steps' tasks (the local test cluster, whose fake nodes
all run here), a fork server started on it keeps zygotes (:mod:`megatron_patch.zygote`) and forks each rank:
``rank_env`` sees ``SAILOR_FORK_SERVER=PATH`` in the task's environment and, instead of ``exec``, asks the
server for the same program (:func:`run_forked`). The task's process stays as the rank's stand-in inside the
step, as Slurm sees it:

- the rank writes to the task's own stdout and stderr (passed over the socket) and runs on its CPUs;
- every signal the task gets (Slurm's SIGTERM of a cancel or time limit, ``--signal``, SIGCONT, SIGUSR1 of a
  checkpoint request) goes to the rank, through a pidfd: never to a reused pid;
- the task exits with the rank's status, by the same signal where the rank was killed;
- when the task dies (Slurm's SIGKILL of a lost node's step), its connection closes and the server kills the
  rank: nothing outlives its step.

A server refuses (and ``rank_env`` then ``exec``\\ s as always) a command of another interpreter or with
interpreter options, and an environment whose zygote cannot start. A zygote serves the tasks whose
environment, less the variables Slurm and the job set per step and task (:func:`step_key`), equals the one it
imported under. The server notes each forked rank in ``PATH.forked/<pid>.json`` (its argv) while it runs, so a
tool that looks ranks up by their command line (the tests' ``ranks.py``) finds them.

``python -m megatron_patch.fork_server PATH`` serves until its stdin closes (the process that started it
exited) or it is terminated; the test suite starts one per lab (``tests/conftest.py``).
"""
from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from megatron_patch.zygote import MAX_MESSAGE, STATUS_BYTES, ForkedProcess, Zygote, ZygoteError, import_env, program

FORK_SERVER_ENV = "SAILOR_FORK_SERVER"
#: set by Slurm, the job's script and rank_env per job, step or task; read by a rank when it runs, never while
#: torch, megatron-core or the runtime import (the shell's own bookkeeping too)
STEP_ONLY_PREFIXES = ("SLURM_", "SLURMD_", "SRUN_", "PMI_", "PMIX_", "SAILOR_", "ENVIRONMENT")
STEP_ONLY = frozenset({"LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL",
                       "ROCR_VISIBLE_DEVICES", "ZE_AFFINITY_MASK", "PWD", "OLDPWD", "SHLVL", "_", "TMPDIR", "HOSTNAME"})
#: what a task passes on to its rank (SIGKILL and SIGSTOP cannot be caught: the first ends the rank through the
#: closed connection; Slurm does not stop a step's tasks but to suspend a job)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT, signal.SIGALRM)
MAX_ZYGOTES = 3  # environments served at once (each zygote holds torch and megatron-core: ~350 MB)
REPO = Path(__file__).resolve().parents[1]


def step_key(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that may matter while importing: a zygote's key."""
    return {k: v for k, v in import_env(env).items()
            if k not in STEP_ONLY and not k.startswith(STEP_ONLY_PREFIXES)}


def forked_dir(server: str | Path) -> Path:
    """Where a server notes the ranks it forked and that still run."""
    return Path(f"{server}.forked")


# ---------------------------------------------------------------------------------------------- task side


def run_forked(command: Sequence[str], server: str) -> int | None:
    """Run ``command`` (``python ...``) as a child of the fork server at ``server`` and stand in for it here;
    its exit status (negative: the signal that killed it), or None when the server cannot run it (nothing was
    started: run it as a new process)."""
    python = shutil.which(command[0]) if command else None
    if python is None:
        return None
    try:
        program(command[1:])
    except ZygoteError:
        return None
    request = {"python": os.path.abspath(python), "argv": list(command[1:]), "env": dict(os.environ),
               "cwd": os.getcwd(), "cpus": sorted(os.sched_getaffinity(0))}
    # the rank may run (and be signalled: Slurm's USR1, a test's) before this task has its pidfd: until the
    # forwarding is in place, a signal waits blocked instead of ending the task with the rank left on
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(server)
        socket.send_fds(conn, [json.dumps(request).encode()], [sys.stdout.fileno(), sys.stderr.fileno()])
        reply, fds, _, _ = socket.recv_fds(conn, STATUS_BYTES, 1)
    except OSError:
        fds = []
    if not fds:  # no server, or refused (its log says why): nothing started; exec keeps a mask, so restore it
        conn.close()
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return None
    try:
        return _stand_in(conn, fds[0], mask)
    finally:
        conn.close()


def _stand_in(conn: socket.socket, pidfd: int, mask: set[int | signal.Signals]) -> int:
    """Forward every signal to the rank at ``pidfd`` until the server tells its exit status. The signals come
    through a wakeup descriptor, not Python handlers: a handler runs only between bytecodes, so a signal caught
    just before ``recv`` blocks would wait for the rank's exit (the same race in a sleeping rank: 1 in ~100 tries)."""
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    for sig in FORWARDED:
        signal.signal(sig, lambda *_: None)  # caught (not its default action); its number goes to wake_w
    signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # what came meanwhile is forwarded now
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(conn, selectors.EVENT_READ)
            selector.register(wake_r, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj is conn:  # the server's end closes without a word only if it was killed
                        status = conn.recv(STATUS_BYTES)
                        return int(json.loads(status)["exit"]) if status else -signal.SIGKILL
                    for signum in wake_r.recv(256):
                        with contextlib.suppress(ProcessLookupError):  # it has exited: its status is on the way
                            signal.pidfd_send_signal(pidfd, signum)
    finally:
        signal.set_wakeup_fd(-1)
        wake_r.close()
        wake_w.close()


def exit_as(code: int) -> int:
    """Leave this process as a child that exited with ``code`` would have (by its signal, if negative)."""
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code  # a signal this process may not die of (none of FORWARDED's)
    return code


# -------------------------------------------------------------------------------------------- server side


@dataclass
class Zygotes:
    """The server's zygotes, one per :func:`step_key`, and how many ranks each runs."""

    limit: int = MAX_ZYGOTES
    _zygotes: list[Zygote] = field(default_factory=list)
    _running: dict[int, int] = field(default_factory=dict)  # id(zygote) -> ranks running
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, outputs: Sequence[IO[str]],
              cpus: Sequence[int]) -> tuple[Zygote, ForkedProcess]:
        with self._lock:
            zygote = next((z for z in self._zygotes if z.serves(env)), None) or self._new(env)
            child = zygote.start(argv, env, cwd, outputs[0], outputs[1], cpus)
            self._running[id(zygote)] = self._running.get(id(zygote), 0) + 1
        return zygote, child

    def ended(self, zygote: Zygote) -> None:
        with self._lock:
            self._running[id(zygote)] -= 1

    def _new(self, env: Mapping[str, str]) -> Zygote:
        idle = [z for z in self._zygotes if not self._running.get(id(z))]
        if len(self._zygotes) >= self.limit:
            if not idle:
                raise ZygoteError(f"all {self.limit} zygotes run ranks of other environments")
            self._zygotes.remove(idle[0])
            idle[0].close()
        key = step_key(env)
        differ = sorted({k for z in self._zygotes for k in set(z.env) | set(key) if z.env.get(k) != key.get(k)})
        zygote = Zygote(key, REPO, key=step_key)
        self._zygotes.append(zygote)
        _log(f"zygote {len(self._zygotes)} started" + (f" (other zygotes differ in {', '.join(differ)})" if differ else ""))
        return zygote

    def close(self) -> None:
        with self._lock:
            while self._zygotes:
                self._zygotes.pop().close()


def _log(line: str) -> None:
    print(f"fork server: {line}", file=sys.stderr, flush=True)


def _answer(conn: socket.socket, zygotes: Zygotes, notes: Path) -> None:
    """One task: fork its program, hand it the rank's pidfd, relay the status; kill the rank if the task goes."""
    with conn, contextlib.ExitStack() as outputs:
        try:
            message, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 2)
            files = [outputs.enter_context(open(fd, "w", closefd=True)) for fd in fds]  # the child gets its own
            req: dict[str, Any] = json.loads(message)
            if len(files) != 2:
                raise ZygoteError(f"{len(files)} descriptors passed, not stdout and stderr")
            if req["python"] != os.path.abspath(sys.executable):
                raise ZygoteError(f"{req['python']} is not this server's interpreter {sys.executable}")
            zygote, child = zygotes.start(req["argv"], req["env"], Path(req["cwd"]), files, req["cpus"])
        except (ZygoteError, OSError, ValueError, KeyError) as exc:
            _log(f"refused: {exc}")
            with contextlib.suppress(OSError):
                conn.send(json.dumps({"refused": str(exc)}).encode())
            return
        outputs.close()
        note = notes / f"{child.pid}.json"
        note.write_text(json.dumps({"argv": [req["python"], *req["argv"]]}))
        try:
            socket.send_fds(conn, [json.dumps({"pid": child.pid}).encode()], [child.pidfd])
            _relay(conn, child)
        finally:
            note.unlink(missing_ok=True)
            zygotes.ended(zygote)


def _relay(conn: socket.socket, child: ForkedProcess) -> None:
    """Wait for the child's exit and tell the task; the task's connection closing first kills the child."""
    with selectors.DefaultSelector() as selector:
        selector.register(conn, selectors.EVENT_READ)
        selector.register(child.channel, selectors.EVENT_READ)
        task_gone = False
        while True:
            for key, _ in selector.select():
                if key.fileobj is conn:  # the task sends nothing: readable means closed
                    selector.unregister(conn)
                    task_gone = True
                    child.kill()
                    continue
                code = child.wait()
                if not task_gone:
                    with contextlib.suppress(OSError):
                        conn.send(json.dumps({"exit": code}).encode())
                return


def serve(path: Path) -> None:
    """Answer tasks at ``path`` until stdin closes."""
    path.unlink(missing_ok=True)
    notes = forked_dir(path)
    notes.mkdir(parents=True, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(64)
    zygotes = Zygotes()

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=_answer, args=(conn, zygotes, notes), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        sys.stdin.buffer.read()  # until the starter closes its end (or exits)
    finally:
        zygotes.close()
        listener.close()
        path.unlink(missing_ok=True)
        shutil.rmtree(notes, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m megatron_patch.fork_server SOCKET_PATH")
    serve(Path(sys.argv[1]))
