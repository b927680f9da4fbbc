"""A parent that has imported torch and megatron-core once, and forks each local rank from there.

Every local rank, reference run and worker script imports torch and megatron-core before it does anything:
3-4 s of CPU apiece, more than a test's few training steps take. A zygote imports them once (:data:`PRELOAD`)
and forks a child per program; the child becomes ``python -m MODULE ...``, ``python -c CODE ...`` or
``python SCRIPT ...`` with the argv, environment, working directory and stdout/stderr files it was given
(stdin is /dev/null), and exits as that program would. Its exit status travels back to the client
(:class:`ForkedProcess`, the ``subprocess.Popen`` subset ``megatron_patch.local`` uses), which signals the
child through a pidfd: never a reused pid.

Where a child is not what a fresh process would be, the zygote refuses (:class:`ZygoteError`) rather than
start it:

- A program cannot change the interpreter's options (``-X``, ``-u``, ...): :func:`program` takes ``-m``,
  ``-c`` or a script only.
- ``fork`` copies only the calling thread: the zygote refuses to start when preloading left a second thread
  (numpy's OpenBLAS starts a pool at import unless ``OMP_NUM_THREADS=1``). Nothing in :data:`PRELOAD` runs a
  torch operation, so neither OpenMP nor gloo has started a thread; each child starts its own.
- Libraries read their environment while they import (libgomp sizes torch's thread pool from
  ``OMP_NUM_THREADS`` when it loads): a zygote serves only an environment equal to the one it imported under,
  apart from :data:`START_ONLY` (the rendezvous variables, read when a rank joins, and pytest's name of the
  running test).

Left shared, as no result may depend on them: the children's ``str`` hash seed and numpy's global random
state are the zygote's. Python's ``random`` reseeds at each fork.

The zygote ends when its client closes the control socket (or exits), and ends its children then.
"""
from __future__ import annotations

import dataclasses
import gc
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NoReturn

#: what every runtime rank, reference run and worker script imports before its first step: torch,
#: megatron-core (through ``mcore_import``, by the runtime's modules), the runtime, and ``torch._dynamo``
#: (``torch.optim`` imports it at the first ``add_param_group``: 0.9 s of CPU)
PRELOAD = (
    "torch", "torch.distributed", "torch._dynamo",
    "megatron_patch.engine", "megatron_patch.checkpoint_io", "megatron_patch.data", "megatron_patch.reference",
    "megatron_patch.training_loop", "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.pipeline_parallel.schedules", "megatron.core.datasets.indexed_dataset",
)
#: variables nothing reads while importing: a zygote serves environments that differ from its own only in these
START_ONLY = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTEST_CURRENT_TEST"})
MAX_MESSAGE = 1 << 20  # argv + environment of one request, bytes (a socket's default buffer holds ~200 KiB)
STATUS_BYTES = 4096  # a child's pid or exit status


class ZygoteError(RuntimeError):
    """The zygote could not start, or cannot start this program as a fresh process would."""


@dataclass(frozen=True)
class Program:
    """What ``python ARGV...`` runs: ``kind`` is ``module``, ``code`` or ``script``; ``target`` the module
    name, the code or the script's path; ``argv`` its ``sys.argv`` (``argv[0]`` as Python sets it)."""

    kind: str
    target: str
    argv: tuple[str, ...]


def program(argv: Sequence[str]) -> Program:
    """The program ``python *argv`` runs, or :class:`ZygoteError` for interpreter options a fork cannot
    take (``-X importtime``, ``-u``, ...)."""
    if not argv:
        raise ZygoteError("no program: an interactive interpreter cannot be forked")
    head, rest = argv[0], tuple(argv[1:])
    if head in ("-m", "-c"):
        if not rest:
            raise ZygoteError(f"{head} needs an argument")
        if head == "-m":
            return Program("module", rest[0], (rest[0], *rest[1:]))  # argv[0] becomes the module's path
        return Program("code", rest[0], ("-c", *rest[1:]))
    if head.startswith("-"):
        raise ZygoteError(f"interpreter option {head!r}: a forked child keeps the zygote's interpreter; "
                          "start this command as a new process")
    return Program("script", head, (head, *rest))


def import_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of ``env`` that modules may read while importing (a zygote's key)."""
    return {k: v for k, v in env.items() if k not in START_ONLY}


def threads() -> int:
    """Threads of this process, native ones included."""
    return len(os.listdir("/proc/self/task"))


# ---------------------------------------------------------------------------------------------- client side


class ForkedProcess:
    """A child of a zygote, as the ``subprocess.Popen`` methods the local launcher uses see it."""

    def __init__(self, channel: socket.socket, pid: int, pidfd: int, outputs: tuple[IO[str], IO[str]]) -> None:
        self.channel, self.pid, self.pidfd, self.outputs = channel, pid, pidfd, outputs
        self.returncode: int | None = None
        self.cpu_s: float | None = None  # user + system seconds, once it has exited

    def _collect(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            self.channel.settimeout(timeout)
            try:
                message = self.channel.recv(STATUS_BYTES)
            except (TimeoutError, BlockingIOError):
                return None
            # an empty message: the zygote died before it could tell the status (it was killed)
            status = json.loads(message) if message else {"exit": -signal.SIGKILL}
            self.returncode, self.cpu_s = int(status["exit"]), status.get("cpu_s")
            self.channel.close()
            os.close(self.pidfd)
        return self.returncode

    def poll(self) -> int | None:
        return self._collect(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._collect(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                signal.pidfd_send_signal(self.pidfd, sig)
            except ProcessLookupError:  # it exited a moment ago; poll() tells the status
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """A zygote process serving ``env``'s :func:`import_env` (client side)."""

    def __init__(self, env: Mapping[str, str], cwd: Path, preload: Sequence[str] | None = None,
                 start_timeout: float = 300,
                 key: Callable[[Mapping[str, str]], dict[str, str]] = import_env) -> None:
        """Start a zygote under ``env`` that imports ``preload`` (default :data:`PRELOAD`) and wait for it;
        it serves the environments whose ``key`` (the variables read while importing) is ``env``'s."""
        preload = PRELOAD if preload is None else preload
        if not hasattr(os, "pidfd_open"):
            raise ZygoteError("forking ranks needs Linux 5.3+ (pidfds); start them as new processes")
        self.key = key
        self.env = key(env)
        self.children: list[ForkedProcess] = []
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.TemporaryFile("w+")  # what preloading printed: shown if the zygote fails to start
        self.process = subprocess.Popen(
            [sys.executable, "-m", "megatron_patch.zygote", str(theirs.fileno()), *preload], env=dict(env),
            cwd=cwd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
            pass_fds=(theirs.fileno(),))
        theirs.close()
        self.control.settimeout(start_timeout)
        try:
            ready = self.control.recv(64)
        except TimeoutError:
            ready = b""
        if ready != b"ready":
            self.log.seek(0)
            said = self.log.read()[-3000:]
            self.close()
            raise ZygoteError(f"the zygote did not start (exit {self.process.returncode}):\n{said}")
        self.control.settimeout(None)

    def serves(self, env: Mapping[str, str]) -> bool:
        return self.process.poll() is None and self.key(env) == self.env

    def busy(self) -> bool:
        """Some child of it still runs (:meth:`close` would end it)."""
        self.children = [c for c in self.children if c.poll() is None]
        return bool(self.children)

    def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, stdout: IO[str],
              stderr: IO[str], cpus: Sequence[int] = ()) -> ForkedProcess:
        """Fork ``python *argv`` with ``env`` in ``cwd``, writing to ``stdout``/``stderr``, on ``cpus`` (all: the
        zygote's)."""
        prog = program(argv)
        if not self.serves(env):
            raise ZygoteError("this zygote imported under another environment (or has exited)")
        request = json.dumps(dataclasses.asdict(Request(prog, dict(env), str(cwd), tuple(cpus)))).encode()
        if len(request) > MAX_MESSAGE // 8:
            raise ZygoteError(f"request of {len(request)} bytes: too large for the zygote's socket")
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            try:
                socket.send_fds(self.control, [request], [stdout.fileno(), stderr.fileno(), theirs.fileno()])
            except OSError as exc:
                mine.close()
                raise ZygoteError(f"the zygote is gone: {exc}") from exc
        message, fds, _, _ = socket.recv_fds(mine, STATUS_BYTES, 1)
        if not message or not fds:
            mine.close()
            raise ZygoteError(f"the zygote did not fork {list(argv)[:3]}: {message.decode() or 'it exited'}")
        self.children.append(ForkedProcess(mine, int(json.loads(message)["pid"]), fds[0], (stdout, stderr)))
        return self.children[-1]

    def close(self) -> None:
        """End the zygote (and any child still running)."""
        self.control.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


# ---------------------------------------------------------------------------------------------- zygote side


@dataclass
class _Child:
    pid: int
    pidfd: int
    channel: socket.socket
    orphaned: bool = False  # its client closed the channel: the child was killed


def _client_gone(selector: selectors.BaseSelector, child: _Child) -> None:
    """The client closed a running child's channel (it exited or was killed: a Slurm step's task that asked
    for this child, ended by its node's loss): the child ends with it, as the task's own process would."""
    selector.unregister(child.channel)
    child.orphaned = True
    try:
        signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclass(frozen=True)
class Request:
    """A program to fork, as the client sends it (JSON)."""

    program: Program
    env: dict[str, str]
    cwd: str
    cpus: tuple[int, ...] = ()  # the CPUs it may run on (a Slurm task's binding); () the zygote's

    @staticmethod
    def from_json(data: bytes) -> Request:
        obj = json.loads(data)
        p = obj["program"]
        return Request(Program(p["kind"], p["target"], tuple(p["argv"])), obj["env"], obj["cwd"],
                       tuple(obj.get("cpus", ())))


@dataclass(frozen=True)
class _Forked:
    """In a freshly forked child: the program to become and its stdout/stderr descriptors."""

    request: Request
    stdout: int
    stderr: int


def _serve(control: socket.socket) -> _Forked:
    """Fork a child per request until the client goes; returns only in a child."""
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    children: dict[int, _Child] = {}  # by pidfd
    while True:
        for key, _ in selector.select():
            if isinstance(key.data, _Child):  # its client's end of the channel: readable only once closed
                _client_gone(selector, key.data)
            elif key.fileobj is control:
                message, fds, flags, _ = socket.recv_fds(control, MAX_MESSAGE, 3)
                if not message:  # the client closed: end the children it left, then the zygote
                    for child in children.values():
                        signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)
                        os.waitpid(child.pid, 0)
                    raise SystemExit(0)
                stdout, stderr, channel_fd = fds
                channel = socket.socket(fileno=channel_fd)
                if flags & socket.MSG_TRUNC:
                    channel.send(b"request truncated")
                    channel.close()
                    continue
                pid = os.fork()
                if pid == 0:  # the child: nothing of the zygote's own stays open
                    selector.close()
                    for child in children.values():
                        os.close(child.pidfd)
                        child.channel.close()
                    control.close()
                    channel.close()
                    return _Forked(Request.from_json(message), stdout, stderr)
                os.close(stdout)
                os.close(stderr)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = _Child(pid, pidfd, channel)
                selector.register(pidfd, selectors.EVENT_READ)
                selector.register(channel, selectors.EVENT_READ, children[pidfd])
                try:
                    socket.send_fds(channel, [json.dumps({"pid": pid}).encode()], [pidfd])
                except OSError:  # the client is gone already; the child is reaped all the same
                    pass
            else:
                child = children.pop(key.fd)
                selector.unregister(key.fd)
                if not child.orphaned:
                    selector.unregister(child.channel)
                _, status, usage = os.wait4(child.pid, 0)
                try:
                    child.channel.send(json.dumps({"exit": os.waitstatus_to_exitcode(status),
                                                   "cpu_s": usage.ru_utime + usage.ru_stime}).encode())
                except OSError:
                    pass
                child.channel.close()
                os.close(child.pidfd)


def _become(forked: _Forked) -> None:
    """Turn this forked child into the requested program and run it; returns or raises as the program does
    (``SystemExit`` included), and the interpreter then exits as ``python ...`` would."""
    req, prog = forked.request, forked.request.program
    os.dup2(forked.stdout, 1)
    os.dup2(forked.stderr, 2)
    os.close(forked.stdout)
    os.close(forked.stderr)
    os.chdir(req.cwd)
    if req.cpus:
        os.sched_setaffinity(0, req.cpus)
    os.environ.clear()
    os.environ.update(req.env)
    kind, target = prog.kind, prog.target
    sys.argv = list(prog.argv)
    if kind == "module":  # as `python -m`: the working directory first on the path, the module not yet imported
        sys.path[0] = os.getcwd()
        sys.modules.pop(target, None)
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif kind == "code":
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(target, "<string>", "exec"), main.__dict__)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> NoReturn | None:
    """``python -m megatron_patch.zygote FD MODULE...``: import the modules, say ``ready`` on the socket FD,
    then serve; in a child, become its program."""
    fd, *preload = sys.argv[1:] if argv is None else argv
    control = socket.socket(fileno=int(fd))
    for name in preload:
        importlib.import_module(name)
    # the imported objects live as long as any child: frozen, a child's garbage collections never walk them
    # (nor write their headers, copying the pages a fork shares): a forked 10-step reference run measured
    # 2.1-2.7 s of CPU without, 1.2-1.9 s with
    gc.collect()
    gc.freeze()
    if threads() != 1:
        raise SystemExit(f"zygote: {threads()} threads after importing {', '.join(preload)}: a fork would copy "
                         "one (set OMP_NUM_THREADS=1)")
    sys.stdout.flush()
    sys.stderr.flush()
    control.send(b"ready")
    forked = _serve(control)
    try:
        _become(forked)
    except Exception as exc:  # reported as the interpreter reports it, from the program's frames on
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        raise SystemExit(1) from None
    return None


if __name__ == "__main__":
    main()
