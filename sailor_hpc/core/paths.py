"""Directories something will be written into, checked before anything is written (torch-free).

A checkpoint directory under ``/proc``, a path through a broken symbolic link or below a file fails only
when the first file is written: minutes into a job, after a wait in the queue, as an OSError on one rank.
Every writer of the project (the runtime's ``--save``, a job's work and log directories) asks here first.
"""
from __future__ import annotations

import os
from pathlib import Path

from sailor_hpc.core.errors import SailorError


def writable_dir(path: str | os.PathLike[str], field: str) -> Path:
    """``path`` (absolute) if it is a directory that exists or can be created, and that this user can
    write; else a SailorError naming it, the reason and ``field``, the option that gave it."""
    target = Path(path).expanduser().absolute()
    broken = next((d for d in (target, *target.parents) if d.is_symlink() and not d.exists()), None)
    if broken is not None:
        raise SailorError(f"{broken} is a broken symbolic link", file=target, field=field,
                          fix="point the link at a directory, or choose another path")
    existing = next(d for d in (target, *target.parents) if d.exists())
    if not existing.is_dir():
        raise SailorError(f"{existing} is not a directory", file=target, field=field,
                          fix="choose a directory path")
    # os.access says yes to root everywhere and to anyone on a read-only mount: try for real where it matters
    if not os.access(existing, os.W_OK | os.X_OK) or not _can_create_in(existing):
        what = "is not writable" if existing == target else f"cannot be created: {existing} is not writable"
        raise SailorError(f"the directory {what}", file=target, field=field,
                          fix=f"choose a directory you can write, with {field}")
    return target


def _can_create_in(directory: Path) -> bool:
    """Whether a file can be made in ``directory`` (and removed again): /proc, sysfs and read-only mounts
    refuse even root, which ``os.access`` does not tell."""
    probe = directory / f".sailor-write-test-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError:
        return False
    os.close(fd)
    try:
        probe.unlink()
    except OSError:
        pass
    return True


def writable_file(path: str | os.PathLike[str], field: str) -> Path:
    """``path`` (absolute) if a file can be written there: not a directory, its folder writable or creatable
    (:func:`writable_dir`), and an existing file open for writing (opened to append: nothing changes);
    else a SailorError naming it and ``field``."""
    target = Path(path).expanduser().absolute()
    if target.is_dir():
        raise SailorError("is a directory, not a file", file=target, field=field,
                          fix=f"give {field} the path of a file, in this directory or elsewhere")
    writable_dir(target.parent, field)
    if target.exists():
        try:
            os.close(os.open(target, os.O_WRONLY | os.O_APPEND))
        except OSError as exc:
            raise SailorError(f"the file cannot be written ({exc.strerror})", file=target, field=field,
                              fix=f"choose a file you can write, with {field}") from None
    return target
