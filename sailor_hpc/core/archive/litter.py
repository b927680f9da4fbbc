"""Temporary files that killed writers left in an archive's folder, and when each may go."""
from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from sailor_hpc.core.archive.files import HOST, archive_files

LITTER_AGE_S = 3600.0  # a temporary file of another host's writer this much older than a new file is litter


@dataclass(frozen=True)
class Litter:
    """A writer's temporary file and whether it may go (its writer is gone, or it is old enough)."""

    path: Path
    removable: bool
    why: str


def litter(path: str | os.PathLike[str], reference: Path | None = None, min_age_s: float = LITTER_AGE_S
           ) -> list[Litter]:
    """The archive's temporary files, judged without comparing hosts' clocks where it can: one of this host
    whose writer process is gone may go at once; any other once its mtime is ``min_age_s`` older than that
    of ``reference``, a file just written in the same folder (on NFS both times are the server's)."""
    files = archive_files(path)
    ref_ns = None
    with contextlib.suppress(OSError):
        ref_ns = os.stat(reference).st_mtime_ns if reference is not None else None
    owner = re.compile(r"\.(?:shard|base|copy)\.\d+\.(\d+)\.[0-9a-f]+\.(.+)\.tmp$")
    out = []
    for tmp in files.temps:
        m = owner.search(tmp.name)
        if m and m[2] == HOST:
            gone = not _alive(int(m[1]))
            out.append(Litter(tmp, gone, f"its writer (PID {m[1]} on this host) is {'gone' if gone else 'running'}"))
            continue
        try:
            age = None if ref_ns is None else (ref_ns - os.stat(tmp).st_mtime_ns) / 1e9
        except FileNotFoundError:
            continue
        old = age is not None and age > min_age_s
        out.append(Litter(tmp, old, "age unknown" if age is None else f"{age:.0f} s old"))
    return out


def remove_litter(path: str | os.PathLike[str], reference: Path | None = None,
                  min_age_s: float = LITTER_AGE_S) -> list[Path]:
    """Remove what :func:`litter` finds removable; returns the removed files. Removing a live writer's file
    (a host's clock far off) only makes that write fail loudly: no acknowledged entry is in a temporary file."""
    removed = []
    for item in litter(path, reference, min_age_s):
        if item.removable:
            with contextlib.suppress(FileNotFoundError):
                item.path.unlink()
                removed.append(item.path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
