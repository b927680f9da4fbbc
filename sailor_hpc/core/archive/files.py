"""The files of one archive in its folder: the public file, bases, shards, writers' temporary files and
lock files (names: :mod:`sailor_hpc.core.archive.shards`)."""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

HOST = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"


@dataclass(frozen=True)
class ArchiveFiles:
    """What belongs to one archive in its folder (names: see :mod:`sailor_hpc.core.archive.shards`)."""

    path: Path  # the public file (the real path; it may not exist yet)
    bases: tuple[Path, ...]
    shards: tuple[Path, ...]
    temps: tuple[Path, ...]  # writers' temporary files: live ones, and those of writers that were killed
    locks: tuple[Path, ...]

    @property
    def parts(self) -> tuple[Path, ...]:
        return self.bases + self.shards


def archive_files(path: str | os.PathLike[str]) -> ArchiveFiles:
    real = Path(os.path.realpath(path))
    name = re.escape(real.name)
    part = re.compile(rf"^\.{name}\.(shard|base|copy)\.\d+\.\d+\.[0-9a-f]+\..+\.(h5|tmp)$")
    # also the temporary copies of the versions before shards (mkstemp) and of the lock-file fallback
    temp = re.compile(rf"^(\.{name}\.[a-z0-9_]{{8}}\.tmp|{name}\.xlock(\.takeover)*\.[0-9a-f]{{32}}\.tmp)$")
    lock = re.compile(rf"^{name}\.(lock|xlock(\.takeover)*)$")
    try:
        names = sorted(os.listdir(real.parent))
    except OSError:  # a folder we may not list (or none): only the public file can be read
        names = []
    found: dict[str, list[Path]] = {"base": [], "shard": [], "temp": [], "lock": []}
    for n in names:
        m = part.match(n)
        if m:
            found["temp" if m[2] == "tmp" or m[1] == "copy" else m[1]].append(real.parent / n)
        elif temp.match(n):
            found["temp"].append(real.parent / n)
        elif lock.match(n):
            found["lock"].append(real.parent / n)
    return ArchiveFiles(real, *(tuple(found[k]) for k in ("base", "shard", "temp", "lock")))
