"""Atomic file writes: a reader sees the old file or the new one, never half of either.

Everything sailor-hpc writes (plans, scripts, archives, checkpoints' manifests) goes through
``atomic_write``: write a temporary file in the same directory, fsync, then ``os.replace``.
The temporary file inherits the mode and group of the file it replaces, so shared files keep
their group permissions.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _match_permissions(tmp: Path, target: Path) -> None:
    if target.exists():
        st = target.stat()
        os.chmod(tmp, st.st_mode & 0o7777)
        with contextlib.suppress(PermissionError):
            os.chown(tmp, -1, st.st_gid)
    else:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``target``; on success it replaces ``target`` atomically."""
    target = Path(os.path.realpath(target))  # replace what a symlink points to, and keep the link
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        _match_permissions(tmp, target)
        os.replace(tmp, target)
        with contextlib.suppress(OSError):
            dir_fd = os.open(target.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(target: str | os.PathLike[str], text: str) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(text)


@contextlib.contextmanager
def removed_on_error(path: str | os.PathLike[str]) -> Iterator[None]:
    """A file the block creates is removed again if the block fails (one it found is left alone): a
    command that refuses its input leaves nothing half-done behind."""
    path = Path(path)
    existed = path.exists()
    try:
        yield
    except BaseException:
        if not existed:
            path.unlink(missing_ok=True)
        raise
