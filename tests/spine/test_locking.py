"""The lock-file fallback for filesystems without POSIX locks: a live holder keeps its lock, a dead one's is
taken over."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from sailor_hpc.errors import SailorError
from sailor_hpc.locking import _exclusive_file_lock


def test_a_live_holder_is_never_taken_over_even_past_the_stale_age(tmp_path: Path) -> None:
    path = tmp_path / "run.xlock"
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with _exclusive_file_lock(path, timeout_s=5, stale_s=0.4):
            held.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(5)
    try:
        with pytest.raises(SailorError, match="waiting for the lock"):
            with _exclusive_file_lock(path, timeout_s=1.5, stale_s=0.4):  # > 3 stale ages of waiting
                pass
    finally:
        release.set()
        t.join(10)
    with _exclusive_file_lock(path, timeout_s=1, stale_s=0.4):  # released: free again
        assert path.exists()
    assert not path.exists()


def test_a_dead_holders_lock_is_taken_over(tmp_path: Path) -> None:
    path = tmp_path / "run.xlock"
    path.write_text("elsewhere 12345\n")  # its holder died without removing it: no more heartbeats
    old = time.time() - 10
    os.utime(path, (old, old))
    with _exclusive_file_lock(path, timeout_s=2, stale_s=1):
        assert path.read_text().split()[1] == str(os.getpid())
