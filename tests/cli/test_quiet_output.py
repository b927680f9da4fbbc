"""Quiet by default: a reader that closes the pipe early ends a command without a word."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sailor_hpc.cli.app import EXIT_PIPE_CLOSED
from tests.controller.scenario import REPO
from tests.controller.test_cli import _fake_run
from tests.data.tiny_archive import write_tiny_archive

SAILOR = Path(sys.executable).parent / "sailor-hpc"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("quiet")
    return _fake_run(tmp, write_tiny_archive(tmp / "tiny.h5")).path


def test_head_of_run_status_ends_quietly(run_dir: Path) -> None:
    """``run status DIR | head -1``: the first line, exit 0, nothing on stderr (was: "error: Broken pipe", 2)."""
    shell = f"'{SAILOR}' run status '{run_dir}' | head -1; exit ${{PIPESTATUS[0]}}"
    proc = subprocess.run(["bash", "-c", shell], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout.startswith("run feed01: tiny-gpt to step 60") and proc.stdout.count("\n") == 1, proc.stdout
    assert proc.stderr == "" and proc.returncode in (0, EXIT_PIPE_CLOSED), (proc.returncode, proc.stderr)


def test_a_pipe_closed_before_the_first_line_exits_141_without_a_word(run_dir: Path) -> None:
    """The reader is gone before the command writes anything: every write fails, the command says nothing and
    exits 141, as a Unix tool killed by SIGPIPE does (a script with ``set -o pipefail`` sees it)."""
    proc = subprocess.Popen([str(SAILOR), "run", "status", str(run_dir)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == EXIT_PIPE_CLOSED and err == "", err
