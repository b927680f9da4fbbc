"""An inter-process lock next to a shared file, that also works on network filesystems.

POSIX record locks (``fcntl.lockf``) are released by the kernel when a writer dies, so a crashed
profiling job never leaves a file locked. Some network filesystems refuse them (ENOLCK); there we fall
back to an ``O_EXCL`` lock file holding host, PID and a nonce (the holder's token) and a heartbeat
counter that the holder bumps while it holds the lock.

Staleness never compares clocks: a waiter watches the lock file on its own monotonic clock and takes it
over once it has seen the same file (inode, token, counter) for ``stale_s``: a live holder bumps the
counter every ``stale_s / 4``, so only a dead (or stopped) one looks unchanged that long. ``timeout_s``
defaults to several stale ages, so a waiter always outlives a dead holder's lock. Each look opens the file,
which on NFS revalidates it (close-to-open), so a cached copy cannot hide a live holder's beats.

Taking over is where lock files usually break: two waiters that both see the stale file would both
delete it, and the slower one deletes the fresh lock the faster one just created, so both hold it.
Here a stale lock is never deleted. It is replaced in one rename by a complete file holding the new
token, under a small second lock file (``<lock>.takeover``), and only if the lock path still holds
exactly the stale file the waiter saw; a holder releases only a file that still carries its own token,
under the same guard. A holder stopped for longer than ``stale_s`` can still be taken over: callers whose
correctness must not depend on the lock (the profile archive) use it only to avoid duplicate work.

Which locks a mount really gives (node-local on NFS ``nolock``, Lustre ``localflock``, BeeGFS by default)
is told by :func:`mount_locks`; new lock and data files are made group-usable by :class:`Sharing`.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import socket
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from sailor_hpc.core.errors import SailorError

_GUARD_DEPTH = 2  # levels of takeover mutexes (see _guard)
_FILE_POLL_S = 0.05  # between tries at a held lock file: each try is a few metadata calls on the file server


class LockTimeout(SailorError):
    """The lock stayed held (by a live holder) for the whole timeout."""


@contextlib.contextmanager
def file_lock(target: str | os.PathLike[str], timeout_s: float = 300.0, stale_s: float = 30.0) -> Iterator[None]:
    """Hold ``<target>.lock`` (a POSIX record lock, else the lock-file fallback) for the block; raises
    :class:`LockTimeout` after ``timeout_s``."""
    target = os.path.realpath(target)  # writers through a symlink lock the file itself
    lock_path = Path(f"{target}.lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666 & ~umask())
    except PermissionError:
        raise SailorError("cannot open the lock file for writing", file=lock_path,
                          fix="its owner must make it group-writable (chmod g+w), or remove it while no one writes"
                          ) from None
    Sharing.of(Path(target)).apply(fd)
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


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------------- group-shared files

def group_shared(directory: Path) -> bool:
    """A folder meant for a group: setgid (new files get its group) or writable by the group."""
    try:
        mode = directory.stat().st_mode
    except OSError:
        return False
    return bool(mode & (stat.S_ISGID | stat.S_IWGRP))


@dataclass(frozen=True)
class Sharing:
    """The mode and group a new file next to a shared one gets: the shared file's own where it exists (the
    site chose them), else the writer's umask; in a group-shared folder always readable and writable by the
    folder's group, whatever the writer's umask (a first writer with umask 077 would otherwise lock the rest
    of the group out of the archive and its lock)."""

    mode: int
    gid: int  # -1: the creator's (or what a setgid folder gives)

    @classmethod
    def of(cls, target: Path) -> Sharing:
        mode, gid = 0o666 & ~umask(), -1
        with contextlib.suppress(OSError):  # no such file yet: the folder and umask decide
            st = target.stat()
            mode, gid = st.st_mode & 0o666, st.st_gid
        if group_shared(target.parent):
            mode |= 0o660
            if gid < 0:
                gid = target.parent.stat().st_gid
        return cls(mode, gid)

    def apply(self, fd: int) -> None:
        """Give an open file these permissions (a file of another user's stays as it is: not ours to change)."""
        with contextlib.suppress(OSError):
            os.fchmod(fd, self.mode)
        if self.gid >= 0:
            with contextlib.suppress(OSError):  # a group we are not in: the folder's setgid bit still applies
                os.fchown(fd, -1, self.gid)


# ---------------------------------------------------------------------- what the mount's locks are worth

@dataclass(frozen=True)
class MountLocks:
    """What POSIX locks on a mount protect against: ``cluster`` (every node sees them), ``node`` (granted
    per node: two nodes may both hold one), ``none`` (refused: the lock-file fallback) or ``unknown``."""

    mount: str
    fstype: str
    scope: str
    why: str


def mount_locks(path: Path, mounts_file: Path = Path("/proc/mounts")) -> MountLocks:
    """The lock semantics of the mount holding ``path``, from its type and options in ``/proc/mounts``."""
    real = os.path.realpath(path)
    best: tuple[str, str, list[str]] = ("/", "unknown", [])
    with contextlib.suppress(OSError):
        for line in mounts_file.read_text().splitlines():
            fields = line.split()
            if len(fields) < 4:
                continue
            point = fields[1].replace("\\040", " ")
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best[0]):
                best = (point, fields[2], fields[3].split(","))
    point, fstype, options = best
    scope, why = _lock_scope(fstype, options)
    return MountLocks(point, fstype, scope, why)


def _lock_scope(fstype: str, options: list[str]) -> tuple[str, str]:
    opts = set(options)
    if fstype.startswith("nfs"):
        if "nolock" in opts or any(o in opts for o in ("local_lock=all", "local_lock=posix")):
            return "node", "NFS mounted nolock/local_lock: locks are granted per node"
        return "cluster", "NFS with the lock manager (v3 NLM, v4 built in)"
    if fstype == "lustre":
        if "localflock" in opts:
            return "node", "Lustre localflock: locks are granted per node"
        if "flock" in opts:
            return "cluster", "Lustre flock: cluster-wide locks"
        return "none", "Lustre without flock refuses POSIX locks (the lock-file fallback is used)"
    if fstype == "beegfs":
        return "node", "BeeGFS grants locks per node unless tuneUseGlobalFileLocks is set on every client"
    if fstype == "gpfs":
        return "cluster", "GPFS: cluster-wide locks"
    if fstype in ("ext4", "xfs", "btrfs", "tmpfs", "zfs", "overlay"):
        return "cluster", f"{fstype} is local to this node: its locks cover every process that can see it"
    return "unknown", f"{fstype}: lock semantics unknown"


# ---------------------------------------------------------------------- SIGTERM

@contextlib.contextmanager
def cleanup_on_sigterm() -> Iterator[None]:
    """Turn a SIGTERM inside the block into an exception, so that its ``finally`` clauses (temporary files,
    locks) run before the process dies; then die of the signal as before. A Slurm job killed at its time
    limit gets SIGTERM, and its default action would leave the lock file and a temporary copy behind.
    Only where Python can install a handler (the main thread) and none was installed (a program with its
    own SIGTERM handling keeps it)."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    class _Terminated(BaseException):
        pass

    caught: list[int] = []

    def handler(signum: int, _frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
        caught.append(signum)
        raise _Terminated

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except _Terminated:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if caught:  # even where a library swallowed the exception: the process was told to end
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the signal is delivered before this returns; never reached
            raise SystemExit(128 + signal.SIGTERM)


# ---------------------------------------------------------------------- the POSIX record lock

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
            raise LockTimeout(f"timed out after {timeout_s:.0f} s waiting for the lock", file=path,
                              fix="another writer holds it; retry later")
        time.sleep(0.02)


# ---------------------------------------------------------------------- the lock-file fallback

@dataclass(frozen=True)
class _Seen:
    """What a waiter saw at a lock path: the holder's token, its heartbeat and the file's identity. A
    takeover replaces the file only if it is still exactly this: a lock that was released, refreshed or
    already taken over in the meantime belongs to someone else now."""

    token: str  # "" while its creator is still writing it (or if it died before it wrote it)
    ino: int
    beat: str  # the holder's heartbeat counter ("" before its first beat)


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
    except PermissionError:  # another user's file we may not read: its inode and times still tell changes
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        return _Seen("<unreadable>", st.st_ino, str(st.st_mtime_ns))
    try:
        st = os.fstat(fd)
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    token, _, beat = data.decode(errors="replace").partition("\n")
    return _Seen(token.strip(), st.st_ino, beat.strip())


def _create(path: Path, token: str) -> bool:
    """Create ``path`` holding ``token`` unless it exists (O_EXCL: of many creators exactly one wins)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 & ~umask())
    except FileExistsError:
        return False
    try:
        Sharing.of(path).apply(fd)
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
    """Remove the lock file only while it carries our token: if we were taken over (we stopped beating for
    ``stale_s``, e.g. a stopped process), the file is the new holder's."""
    with _guard(path, depth, timeout_s, stale_s):
        now = _read(path)
        if now is not None and now.token == token:
            os.unlink(path)


def _acquire(path: Path, timeout_s: float, stale_s: float, depth: int) -> str:
    token = _new_token()
    deadline = time.monotonic() + timeout_s
    watched: _Seen | None = None
    since = time.monotonic()
    while True:
        if _create(path, token):
            return token
        seen = _read(path)
        now = time.monotonic()
        if seen != watched:  # a new holder or a beat: it is alive, start watching afresh
            watched, since = seen, now
        elif seen is not None and now - since >= stale_s \
                and _take_over(path, seen, token, depth, max(0.0, deadline - now), stale_s):
            return token
        if now > deadline:
            raise LockTimeout(f"timed out after {timeout_s:.0f} s waiting for the lock", file=path,
                              fix="another writer holds it and is alive (its heartbeat moves); retry later")
        time.sleep(_FILE_POLL_S)


@contextlib.contextmanager
def _held(path: Path, timeout_s: float, stale_s: float, depth: int, heartbeat: bool) -> Iterator[None]:
    token = _acquire(path, timeout_s, stale_s, depth)
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(path, token, stop, max(0.02, stale_s / 4)), daemon=True)
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
    """The O_EXCL lock file (see the module doc): its counter moves while held, taken over once it stops."""
    return _held(path, timeout_s, stale_s, 0, heartbeat=True)


def _heartbeat(path: Path, token: str, stop: threading.Event, every_s: float) -> None:
    """Keep a held lock file visibly alive: only a holder that died (no more beats) ever looks stale, so a
    long-lived holder (a controller drives a run for days) is never taken over while it runs. The counter is
    written in place and the file closed (on NFS the close sends it to the server, where waiters see it). A
    file that no longer carries our token is not ours to write."""
    count = 0
    while not stop.wait(every_s):
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDWR)  # the token is checked on the very inode written (not a successor's)
            try:
                if os.pread(fd, 4096, 0).decode(errors="replace").partition("\n")[0].strip() != token:
                    return
                count += 1
                os.pwrite(fd, f"{token}\n{count}\n".encode(), 0)
            finally:
                os.close(fd)
