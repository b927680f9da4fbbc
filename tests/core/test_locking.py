"""The lock-file fallback for filesystems without POSIX locks: a live holder keeps its lock, a dead one's is
taken over once a waiter has watched it unchanged for the stale age (on its own clock, never the file's mtime)."""
from __future__ import annotations

import errno
import multiprocessing as mp
import os
import threading
import time
from pathlib import Path

import pytest

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.locking import _exclusive_file_lock


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


# ------------------------------------------------------------------ concurrent processes on the fallback

def _fallback_only(*_args: object) -> None:
    """Stands in for the POSIX record lock on a filesystem that refuses it."""
    raise OSError(errno.ENOLCK, "No locks available")


def _plant_dead_holder(lock: Path) -> None:
    """A lock file left by a holder that died long ago (no heartbeat since)."""
    fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, b"elsewhere 99999 deadbeef\n")
    os.close(fd)
    old = time.time() - 3600
    os.utime(lock, (old, old))


def _slow_metadata() -> None:
    """Removing and renaming files take milliseconds, as on a network filesystem (a local disk makes the
    gap between seeing a stale lock and acting on it too short to hit in a test)."""
    for name in ("unlink", "replace", "rename"):
        fast = getattr(os, name)

        def slow(*args: object, _fast=fast, **kw: object) -> object:
            time.sleep(0.005)
            return _fast(*args, **kw)

        setattr(os, name, slow)


def _contender(target: str, me: int, rounds: int, barrier: mp.synchronize.Barrier, stale_s: float) -> None:
    """One process of the race: every round a stale lock waits, all contenders start at once, and inside the
    lock a counter is incremented read-modify-write (a second holder at the same time loses an update) while
    an O_EXCL marker shows any overlap directly."""
    import sailor_hpc.core.locking as locking

    locking._lockf_with_timeout = _fallback_only
    # waiters retry every 5 ms, not 50: the rounds (each six holders in turn) go faster, and the stale
    # lock each round starts with is still found by all six at once
    locking._FILE_POLL_S = 0.005
    _slow_metadata()
    base = Path(target)
    counter, inside, overlaps = (Path(f"{target}.{n}") for n in ("counter", "inside", f"overlaps{me}"))
    for _ in range(rounds):
        if me == 0:
            _plant_dead_holder(Path(f"{target}.xlock"))
        barrier.wait(60)
        with locking.file_lock(base, timeout_s=60, stale_s=stale_s):
            try:
                os.close(os.open(inside, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                with open(overlaps, "a") as fh:
                    fh.write("x")
            value = int(counter.read_text())
            time.sleep(0.002)
            counter.write_text(str(value + 1))
            inside.unlink(missing_ok=True)
        barrier.wait(60)


def test_racing_takeovers_of_a_stale_lock_leave_one_holder(tmp_path: Path) -> None:
    """Every round: a dead holder's lock, six processes released at once, all of them watching it unchanged
    for the stale age and so finding it stale together.
    Deleting a stale lock (and so, for the slower waiters, the fresh lock of the faster one) let several
    hold it at once; the takeover must leave exactly one holder each time, and the stale lock is still
    taken over (nobody waits for the timeout)."""
    target = tmp_path / "archive.h5"
    Path(f"{target}.counter").write_text("0")
    ctx = mp.get_context("spawn")
    workers, rounds = 6, 8
    barrier = ctx.Barrier(workers)
    procs = [ctx.Process(target=_contender, args=(str(target), w, rounds, barrier, 0.3)) for w in range(workers)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    assert [p.exitcode for p in procs] == [0] * workers
    overlaps = sum(len(p.read_text()) for p in tmp_path.glob("archive.h5.overlaps*"))
    assert overlaps == 0, f"{overlaps} times two processes held the lock at once"
    assert int(Path(f"{target}.counter").read_text()) == workers * rounds
    assert time.monotonic() - t0 < 90
    assert not Path(f"{target}.xlock").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["archive.h5.lock", "archive.h5.counter"]), "no takeover or temporary files left behind"


def _die_holding(target: str, held: mp.synchronize.Event) -> None:
    import sailor_hpc.core.locking as locking

    locking._lockf_with_timeout = _fallback_only
    with locking.file_lock(target, timeout_s=10, stale_s=0.5):
        held.set()
        time.sleep(0.3)
        os._exit(0)  # dies holding it: no release, no more heartbeats


def test_a_crashed_holder_process_is_taken_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sailor_hpc.core.locking as locking

    target = tmp_path / "archive.h5"
    ctx = mp.get_context("spawn")
    held = ctx.Event()
    p = ctx.Process(target=_die_holding, args=(str(target), held))
    p.start()
    assert held.wait(60)
    p.join(30)
    lock = Path(f"{target}.xlock")
    assert lock.exists() and lock.read_text().split()[1] == str(p.pid)
    monkeypatch.setattr(locking, "_lockf_with_timeout", _fallback_only)
    t0 = time.monotonic()
    with locking.file_lock(target, timeout_s=10, stale_s=0.5):
        assert lock.read_text().split()[1] == str(os.getpid())
    assert time.monotonic() - t0 < 5 and not lock.exists()


def test_an_outdated_view_of_a_stale_lock_replaces_nothing(tmp_path: Path) -> None:
    """The race itself, step by step: a waiter saw the stale lock, another took it over meanwhile; the
    first must neither replace the new holder's lock nor, on release, remove it."""
    from sailor_hpc.core.locking import _read, _release, _take_over

    lock = tmp_path / "a.xlock"
    _plant_dead_holder(lock)
    seen = _read(lock)
    assert seen is not None and seen.token.startswith("elsewhere")
    with _exclusive_file_lock(lock, timeout_s=2, stale_s=1.0):  # the faster waiter takes it over
        mine = _read(lock)
        assert mine is not None and mine.token.split()[1] == str(os.getpid())
        assert not _take_over(lock, seen, "slow 1 waiter", 0, 2, 1.0)
        _release(lock, "slow 1 waiter", 0, 2, 1.0)
        assert _read(lock) == mine
    assert not lock.exists()
