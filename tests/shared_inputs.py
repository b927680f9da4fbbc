"""Inputs that several test files build alike, built once per test session and shared by its xdist workers.

The shipped dataset (``python -m megatron_patch.data``) and the runtime tests' single-process reference run
are the same bytes wherever they are built, and each imports torch and megatron-core (3-6 s of CPU on this
2-core host, where the suite is CPU-bound; the reference in a process of its own). The first worker that needs one builds it
under a file lock while the others wait, then every test reads it; none writes into them (the runtime only
reads its data and the reference's snapshots).
"""
from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def _session_dir(factory: pytest.TempPathFactory) -> Path:
    """A folder of this session that every worker sees: under xdist each worker's base temp is
    ``<session>/popen-gwN``; a serial run has the session's own."""
    base = factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-inputs"


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder ``build(folder)`` fills, built by the first worker that asks (the others wait for it)."""
    root = _session_dir(factory)
    root.mkdir(parents=True, exist_ok=True)
    done = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_dir():  # renamed into place whole: a build that failed leaves no half folder behind
            partial = root / f"{name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            build(partial)
            partial.rename(done)
    return done


def build_data(prefix: Path, *files: str) -> str:
    """``python -m megatron_patch.data PREFIX [FILES...]`` run in process (no torch.distributed, no
    megatron globals): the shipped Sailor data by default. Returns the prefix."""
    from megatron_patch import data
    assert data.main([str(prefix), *files]) == 0
    return str(prefix)


def shipped_dataset(factory: pytest.TempPathFactory) -> str:
    """The prefix of the dataset ``python -m megatron_patch.data PREFIX`` makes of the shipped Sailor data."""
    return str(built_once(factory, "shipped-data", lambda folder: build_data(folder / "shipped")) / "shipped")
