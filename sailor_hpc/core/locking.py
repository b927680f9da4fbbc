"""An inter-process lock next to a shared file, that also works on network filesystems.

POSIX record locks (``fcntl.lockf``) are released by the kernel when a writer dies, so a crashed
profiling job never leaves the archive locked. Some network filesystems refuse them (ENOLCK); there
we fall back to an ``O_EXCL`` lock file holding host, PID and a nonce (the holder's token), refreshed
while held and taken over when it has not been refreshed for ``stale_s`` (its holder died).

Taking over is where lock files usually break: two waiters that both see the stale file would both
delete it, and the slower one deletes the fresh lock the faster one just created, so both hold it.
Here a stale lock is never deleted. It is replaced in one rename by a complete file holding the new
token, under a small second lock file (``<lock>.takeover``), and only if the lock path still holds
exactly the stale file the waiter saw (inode, token, mtime); a holder releases only a file that still
carries its own token, under the same guard. Leases still depend on the clocks: a holder stopped for
longer than ``stale_s`` (or a node whose clock runs far from the file server's) can be taken over.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sailor_hpc.core.errors import SailorError

_GUARD_DEPTH = 2  # levels of takeover mutexes (see _guard)
_FILE_POLL_S = 0.05  # between tries at a held lock file: each try is a few metadata calls on the file server


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


@dataclass(frozen=True)
class _Seen:
    """What a waiter saw at a lock path: the holder's token and the file's identity and age. A takeover
    replaces the file only if it is still exactly this (same inode, token and mtime): a lock that was
    released, refreshed or already taken over in the meantime belongs to someone else now."""

    token: str  # "" while its creator is still writing it (or if it died before it wrote it)
    ino: int
    mtime: float

    def stale(self, stale_s: float) -> bool:
        return time.time() - self.mtime > stale_s


def _new_token() -> str:
    """Host and PID first (what a person reading the file wants to know), then a nonce: a PID can be
    reused, the nonce belongs to this one acquisition."""
    return f"{socket.gethostname()} {os.getpid()} {uuid.uuid4().hex}"


def _read(path: Path) -> _Seen | None:
    """The lock file's holder, or None when there is no lock file (stat and content of one inode)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except PermissionError:  # another user's file we may not read: its inode and age still tell staleness
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        return _Seen("<unreadable>", st.st_ino, st.st_mtime)
    try:
        st = os.fstat(fd)
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    return _Seen(data.decode(errors="replace").strip(), st.st_ino, st.st_mtime)


def _create(path: Path, token: str) -> bool:
    """Create ``path`` holding ``token`` unless it exists (O_EXCL: of many creators exactly one wins)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 & ~_umask())
    except FileExistsError:
        return False
    try:
        os.write(fd, f"{token}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _replace(path: Path, token: str) -> None:
    """Put a lock file holding ``token`` at ``path`` in one step: a unique temporary file, complete before
    anyone can see it, renamed over the old one."""
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        _create(tmp, token)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _guard(path: Path, depth: int, timeout_s: float, stale_s: float) -> contextlib.AbstractContextManager[None]:
    """The mutex every change of an *existing* lock file goes through (a takeover, a release), so that two
    waiters that found the same stale lock cannot both replace it, and no one deletes a lock another
    waiter has just taken over. It is a lock file of its own (``<lock>.takeover``), held for a few system
    calls; the takeover of a stale guard is guarded the same way, down to ``_GUARD_DEPTH`` levels (the last
    level unguarded: a race there needs holders that die inside those few calls, level after level)."""
    if depth >= _GUARD_DEPTH:
        return contextlib.nullcontext()
    return _held(path.with_name(f"{path.name}.takeover"), timeout_s, stale_s, depth + 1, heartbeat=False)


def _take_over(path: Path, seen: _Seen, token: str, depth: int, timeout_s: float, stale_s: float) -> bool:
    """Replace the stale lock ``seen`` by ours; False if the lock path no longer holds exactly ``seen``."""
    with _guard(path, depth, timeout_s, stale_s):
        if _read(path) != seen:
            return False
        _replace(path, token)
    now = _read(path)
    return now is not None and now.token == token


def _release(path: Path, token: str, depth: int, timeout_s: float, stale_s: float) -> None:
    """Remove the lock file only while it carries our token: if we were taken over (we stopped refreshing
    it for ``stale_s``, e.g. a stopped process), the file is the new holder's."""
    with _guard(path, depth, timeout_s, stale_s):
        now = _read(path)
        if now is not None and now.token == token:
            os.unlink(path)


def _acquire(path: Path, timeout_s: float, stale_s: float, depth: int) -> str:
    token = _new_token()
    deadline = time.monotonic() + timeout_s
    while True:
        if _create(path, token):
            return token
        seen = _read(path)
        left = max(0.0, deadline - time.monotonic())
        if seen is not None and seen.stale(stale_s) and _take_over(path, seen, token, depth, left, stale_s):
            return token
        if time.monotonic() > deadline:
            raise SailorError(f"timed out after {timeout_s:.0f} s waiting for the lock", file=path,
                              fix="if no writer is running, remove the stale lock file")
        time.sleep(_FILE_POLL_S)


@contextlib.contextmanager
def _held(path: Path, timeout_s: float, stale_s: float, depth: int, heartbeat: bool) -> Iterator[None]:
    token = _acquire(path, timeout_s, stale_s, depth)
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(path, token, stop, max(0.05, stale_s / 4)), daemon=True)
    if heartbeat:  # the guards are held for a few system calls: they need none
        beat.start()
    try:
        yield
    finally:
        stop.set()
        if beat.is_alive():
            beat.join()
        _release(path, token, depth, timeout_s, stale_s)


def _exclusive_file_lock(path: Path, timeout_s: float, stale_s: float) -> contextlib.AbstractContextManager[None]:
    """The O_EXCL lock file (see the module doc): kept fresh while held, taken over once stale."""
    return _held(path, timeout_s, stale_s, 0, heartbeat=True)


def _heartbeat(path: Path, token: str, stop: threading.Event, every_s: float) -> None:
    """Keep a held lock file fresh: only a holder that died (no more beats) ever looks stale, so a
    long-lived holder (a controller drives a run for days) is never taken over while it runs. A file
    that no longer carries our token is not ours to refresh."""
    while not stop.wait(every_s):
        with contextlib.suppress(OSError):
            seen = _read(path)
            if seen is None or seen.token != token:
                return
            os.utime(path)
