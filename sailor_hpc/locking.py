"""An inter-process lock next to a shared file, that also works on network filesystems.

POSIX record locks (``fcntl.lockf``) are released by the kernel when a writer dies, so a crashed
profiling job never leaves the archive locked. Some network filesystems refuse them (ENOLCK); there
we fall back to an ``O_EXCL`` lock file holding host and PID, refreshed while held and taken over when
it has not been refreshed for ``stale_s`` (its holder died).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from sailor_hpc.errors import SailorError


@contextlib.contextmanager
def file_lock(target: str | os.PathLike[str], timeout_s: float = 300.0, stale_s: float = 600.0) -> Iterator[None]:
    target = os.path.realpath(target)  # writers through a symlink lock the file itself
    lock_path = Path(f"{target}.lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666 & ~_umask())
    except PermissionError:
        raise SailorError("cannot open the lock file for writing", file=lock_path,
                          fix="its owner must make it group-writable (chmod g+w), or remove it while no one writes"
                          ) from None
    _share_like(fd, Path(target))
    try:
        try:
            _lockf_with_timeout(fd, timeout_s, lock_path)
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            os.close(fd)
            fd = -1
            with _exclusive_file_lock(Path(f"{target}.xlock"), timeout_s, stale_s):
                yield
            return
        try:
            yield
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN)
    finally:
        if fd >= 0:
            os.close(fd)


def _share_like(fd: int, target: Path) -> None:
    """Give the lock file the shared file's permissions and group, so every user who may write the
    file may take its lock (the first writer's umask would otherwise lock the others out)."""
    with contextlib.suppress(OSError):  # not our lock file, or no such file yet: nothing to align
        st = target.stat()
        os.fchmod(fd, st.st_mode & 0o666)
        os.fchown(fd, -1, st.st_gid)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _lockf_with_timeout(fd: int, timeout_s: float, path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() > deadline:
            raise SailorError(f"timed out after {timeout_s:.0f} s waiting for the lock", file=path,
                              fix="another writer holds it; retry later")
        time.sleep(0.02)


@contextlib.contextmanager
def _exclusive_file_lock(path: Path, timeout_s: float, stale_s: float) -> Iterator[None]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 & ~_umask())
            os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
            os.close(fd)
            break
        except FileExistsError:
            with contextlib.suppress(FileNotFoundError):
                if time.time() - path.stat().st_mtime > stale_s:
                    path.unlink()
                    continue
        if time.monotonic() > deadline:
            raise SailorError(f"timed out after {timeout_s:.0f} s waiting for the lock", file=path,
                              fix="if no writer is running, remove the stale lock file")
        time.sleep(0.05)
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(path, stop, max(0.05, stale_s / 4)), daemon=True)
    beat.start()
    try:
        yield
    finally:
        stop.set()
        beat.join()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _heartbeat(path: Path, stop: threading.Event, every_s: float) -> None:
    """Keep a held lock file fresh: only a holder that died (no more beats) ever looks stale, so a
    long-lived holder (a controller drives a run for days) is never taken over while it runs."""
    while not stop.wait(every_s):
        with contextlib.suppress(OSError):
            os.utime(path)
