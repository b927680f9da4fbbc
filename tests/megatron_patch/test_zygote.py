"""A program forked by the zygote is what ``python ...`` would have started: the same argv, working directory,
environment, path, stdin, stdout/stderr, signal dispositions, exit status and error report, checked against
a real new interpreter running the same program. Nothing of the zygote's own stays open in it; it refuses
what a fork cannot reproduce; it ends the children it leaves.

A light preload (``json``) keeps these fast; the runtime tests run the real one (``megatron_patch.zygote
.PRELOAD``) through ``megatron_patch.local.start(fork=True)`` and compare their results with the
single-process reference as before.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from megatron_patch import local
from megatron_patch.zygote import START_ONLY, Zygote, ZygoteError, import_env, program

# everything a program sees of how it was started
PROBE = r"""
import json, os, signal, stat, sys
fds = {}
for fd in os.listdir("/proc/self/fd"):
    try:
        fds[fd] = os.readlink(f"/proc/self/fd/{fd}").split(":")[0]
    except OSError:
        pass  # the listing's own descriptor, closed already
print(json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "env": dict(os.environ), "name": __name__,
    "stdin": sys.stdin.read(), "stdout_is_file": stat.S_ISREG(os.fstat(1).st_mode),
    "handlers": {s.name: str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1,
                                                           signal.SIGPIPE, signal.SIGCHLD)},
    "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "sockets": sorted(v for v in fds.values() if v in ("socket", "anon_inode")),
}))
print("to stderr", file=sys.stderr)
"""


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    z = Zygote(local.rank_env(0, 1, 0), local.REPO, preload=("json",))
    yield z
    z.close()


def _read(fh: IO[str]) -> str:
    fh.seek(0)
    return fh.read()


def _forked(z: Zygote, argv: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str, str]:
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    return z.start(argv, env, cwd, out, err).wait(60), _read(out), _read(err)


def _fresh(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str, str]:
    """The reference: the same program in a new interpreter (files for stdout/stderr, as the ranks have)."""
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    code = subprocess.run([sys.executable, *argv], env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                          stderr=err, timeout=60).returncode
    return code, _read(out), _read(err)


@pytest.mark.parametrize("form", ["code", "module", "script"])
def test_a_forked_program_starts_as_a_new_interpreter_would(zygote: Zygote, tmp_path: Path, form: str) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    argv = {"code": ["-c", PROBE, "x", "--y"], "module": ["-m", "probe", "x", "--y"],
            "script": [str(tmp_path / "probe.py"), "x", "--y"]}[form]
    # another rank of the same run: only the rendezvous variables differ from the zygote's environment
    env = local.rank_env(1, 2, 29999, {"PYTHONPATH": str(tmp_path)}) if form == "module" else local.rank_env(1, 2, 29999)
    if form == "module":
        zygote = Zygote(env, local.REPO, preload=("json",))  # PYTHONPATH is read at start: a zygote of its own
    try:
        got, want = _forked(zygote, argv, env, tmp_path), _fresh(argv, env, tmp_path)
    finally:
        if form == "module":
            zygote.close()
    assert got[0] == want[0] == 0, (got[2], want[2])
    assert got[2] == want[2] == "to stderr\n"
    forked, fresh = json.loads(got[1]), json.loads(want[1])
    assert forked == fresh
    assert forked["env"]["RANK"] == "1" and forked["cwd"] == str(tmp_path) and forked["argv"][1:] == ["x", "--y"]
    assert forked["sockets"] == []  # neither the zygote's control socket nor another child's channel


@pytest.mark.parametrize("code", ["import sys; sys.exit(3)", "raise ValueError('bad value')",
                                  "import sys; sys.exit('a message')", "import os; os._exit(75)",
                                  "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
def test_exit_status_and_error_report_are_a_new_interpreters(zygote: Zygote, tmp_path: Path, code: str) -> None:
    env = local.rank_env(0, 1, 0)
    assert _forked(zygote, ["-c", code], env, tmp_path) == _fresh(["-c", code], env, tmp_path)


def test_signals_reach_the_child_and_a_handler_decides_its_exit(zygote: Zygote, tmp_path: Path) -> None:
    env = local.rank_env(0, 1, 0)
    code = ("import signal, sys, time\nsignal.signal(signal.SIGUSR1, lambda *_: sys.exit(75))\n"
            "print('ready', flush=True)\ntime.sleep(60)")
    for sig, want in ((signal.SIGUSR1, 75), (signal.SIGTERM, -signal.SIGTERM), (signal.SIGKILL, -signal.SIGKILL)):
        out = tempfile.TemporaryFile("w+")
        child = zygote.start(["-c", code], env, tmp_path, out, out)
        deadline = time.monotonic() + 30
        while "ready" not in _read(out) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert child.poll() is None
        child.send_signal(sig)
        assert child.wait(30) == want and child.returncode == want
        child.kill()  # after the exit: nothing to signal, no error (as Popen)


def test_what_a_fork_cannot_reproduce_is_refused(zygote: Zygote, tmp_path: Path) -> None:
    env = local.rank_env(0, 1, 0)
    out = tempfile.TemporaryFile("w+")
    with pytest.raises(ZygoteError, match="interpreter option '-X'"):
        zygote.start(["-X", "importtime", "-c", "pass"], env, tmp_path, out, out)
    with pytest.raises(ZygoteError, match="another environment"):  # read while importing, e.g. OMP_NUM_THREADS
        zygote.start(["-c", "pass"], {**env, "OMP_NUM_THREADS": "2"}, tmp_path, out, out)
    assert zygote.serves({**env, "RANK": "3", "MASTER_PORT": "1"})  # the rendezvous is read at start only
    assert {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"} <= START_ONLY
    assert "OMP_NUM_THREADS" in import_env(env)
    assert program(["-m", "megatron_patch.launch", "--x"]).argv == ("megatron_patch.launch", "--x")
    with pytest.raises(ZygoteError, match="interactive"):
        program([])


def test_a_zygote_with_a_second_thread_refuses_to_start(tmp_path: Path) -> None:
    """fork copies only the calling thread: a preload that started one makes every fork suspect."""
    (tmp_path / "starts_a_thread.py").write_text("import threading, time\n"
                                                 "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    env = local.rank_env(0, 1, 0, {"PYTHONPATH": str(tmp_path)})
    with pytest.raises(ZygoteError, match="2 threads after importing starts_a_thread"):
        Zygote(env, local.REPO, preload=("starts_a_thread",))


def test_closing_the_zygote_ends_the_children_it_left(tmp_path: Path) -> None:
    env = local.rank_env(0, 1, 0)
    z = Zygote(env, local.REPO, preload=("json",))
    out = tempfile.TemporaryFile("w+")
    child = z.start(["-c", "import time; time.sleep(120)"], env, tmp_path, out, out)
    z.close()
    assert child.wait(30) == -signal.SIGKILL
    assert z.process.returncode == 0
    with pytest.raises(ZygoteError):
        z.start(["-c", "pass"], env, tmp_path, out, out)


def test_local_keeps_a_zygote_per_environment_and_ends_only_idle_ones(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``megatron_patch.local.start(fork=True)``: ranks of one environment share a zygote; a third environment
    ends the oldest idle one, never one whose ranks still run."""
    monkeypatch.setattr(local, "_zygotes", [])
    monkeypatch.setattr("megatron_patch.zygote.PRELOAD", ("json",))  # Zygote's default, read at each start
    sleeper = ["-c", "import time; time.sleep(60)"]
    try:
        running = local.start(sleeper, 2, {"WHICH": "a"}, fork=True)
        assert len(local._zygotes) == 1 and local._zygotes[0].busy()
        done = local.run(["-c", "import os; print(os.environ['WHICH'], os.environ['RANK'])"], 2, {"WHICH": "b"},
                         fork=True)
        assert [r.stdout for r in done] == ["b 0\n", "b 1\n"]
        local.run(["-c", "pass"], 1, {"WHICH": "c"}, fork=True)  # b was idle: it goes, a stays
        assert [z.env["WHICH"] for z in local._zygotes] == ["a", "c"]
        assert all(p.poll() is None for p in running)
        for p in running:
            p.kill()
        assert [r.returncode for r in local.wait(running)] == [-signal.SIGKILL] * 2
    finally:
        local.close_zygotes()
