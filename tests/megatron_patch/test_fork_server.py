"""The fork server against a new interpreter: the same program, output, exit status and signals, through a
stand-in process as a Slurm task would run it (``rank_env``); a stand-in's death ends its rank; what the server
cannot run as a new interpreter would, it refuses, and nothing starts."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_patch.fork_server import forked_dir, step_key
from tests.conftest import fork_server

# the stand-in: what rank_env does after setting the rank's variables
STAND_IN = ("import sys; from megatron_patch.fork_server import run_forked, exit_as; "
            "code = run_forked(sys.argv[2:], sys.argv[1]); print('not served' if code is None else '', end='', "
            "file=sys.stderr); sys.exit(3 if code is None else exit_as(code))")
# prints what a program sees of its start: argv, one variable, working directory, parent's stand-in, CPUs
PROBE = ("import json, os, sys; print(json.dumps({'argv': sys.argv, 'var': os.environ.get('PROBE_VAR'), "
         "'slurm': os.environ.get('SLURM_JOB_ID'), 'cwd': os.getcwd(), 'path0': sys.path[0]})); "
         "print('to stderr', file=sys.stderr); sys.exit(int(sys.argv[1]))")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with fork_server(tmp_path_factory, env) as path:
        yield path


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _stand_in(server: Path, command: list[str], env: dict[str, str], cwd: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", STAND_IN, str(server), *command], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_a_forked_program_runs_as_a_new_interpreter_would(server: Path, tmp_path: Path):
    command = [sys.executable, "-c", PROBE, "5", "x y"]
    env = _env(PROBE_VAR="here", SLURM_JOB_ID="77")
    fresh = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    forked = _stand_in(server, command, env, tmp_path)
    out, err = forked.communicate(timeout=120)
    assert fresh.returncode == forked.returncode == 5, err
    assert json.loads(out) == json.loads(fresh.stdout)
    assert err == fresh.stderr == "to stderr\n"


def test_the_task_environment_differs_only_in_step_variables_from_the_zygote_key():
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": "/x"}
    task = {**base, "SLURM_JOB_ID": "5", "SLURM_PROCID": "3", "RANK": "3", "LOCAL_WORLD_SIZE": "4",
            "SAILOR_LABEL_RANKS": "1", "CUDA_VISIBLE_DEVICES": "2", "PWD": "/run"}
    assert step_key(task) == step_key(base) == base
    assert step_key({**base, "OMP_NUM_THREADS": "4"}) != step_key(base)  # libgomp reads it as torch loads


def test_signals_reach_the_rank_and_its_death_is_the_task_s(server: Path, tmp_path: Path):
    # short sleeps, as a rank's steps are: Python runs a handler between bytecodes, so a signal that lands between
    # the print and a long sleep's system call would wait for the sleep's end (1 in ~100 tries under load)
    handler = ("import signal, sys, time\n"
               "signal.signal(signal.SIGUSR1, lambda s, f: (print('USR1', flush=True), sys.exit(7)))\n"
               "print('ready', flush=True)\n"
               "for _ in range(600): time.sleep(0.1)")
    proc = _stand_in(server, [sys.executable, "-c", handler], _env(), tmp_path)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=30) == 7 and proc.stdout.read() == "USR1\n"
    # killed by a signal: the task dies of the same one (Slurm reads the step's status from it)
    proc = _stand_in(server, [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                     _env(), tmp_path)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM


def test_a_killed_task_takes_its_rank_with_it(server: Path, tmp_path: Path):
    sleeper = "import os, time; print(os.getpid(), flush=True); time.sleep(120)"
    proc = _stand_in(server, [sys.executable, "-c", sleeper], _env(), tmp_path)
    assert proc.stdout is not None
    rank = int(proc.stdout.readline())
    assert rank != proc.pid and (forked_dir(server) / f"{rank}.json").exists()  # noted while it runs
    proc.kill()  # what Slurm does to a lost node's step
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{rank}").exists() or (forked_dir(server) / f"{rank}.json").exists():
        assert time.monotonic() < deadline, f"rank {rank} outlived its task"
        time.sleep(0.05)


@pytest.mark.parametrize("case", ["interpreter option", "another interpreter", "no server"])
def test_what_a_fork_cannot_start_is_refused_and_nothing_runs(server: Path, tmp_path: Path, bare_python: Path,
                                                               case: str):
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').close()"
    command = {"interpreter option": [sys.executable, "-X", "importtime", "-c", code],
               "another interpreter": [str(bare_python), "-c", code],
               "no server": [sys.executable, "-c", code]}[case]
    where = tmp_path / "nowhere.sock" if case == "no server" else server
    proc = _stand_in(where, command, _env(), tmp_path)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3 and "not served" in err
    assert not marker.exists()

