"""Which archives a command reads, in precedence order, and reading them into one ProfileArchive: the
user's or site's archive first, the embedded Sailor profiles underneath, so planning works before anyone
profiles."""
from __future__ import annotations

import os
from pathlib import Path

from sailor_hpc.core.archive.merge import merged_entries
from sailor_hpc.core.archive.query import ProfileArchive
from sailor_hpc.core.archive.shards import read_merged
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.site import Site

EMBEDDED_ARCHIVE = Path(__file__).parent.parent / "data" / "sailor_profiles.h5"


def read_archive(*paths: str | os.PathLike[str]) -> ProfileArchive:
    """Read archives in precedence order: an entry of an earlier archive hides the same entry of later ones."""
    archive = ProfileArchive()
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise SailorError("profile archive not found", file=path,
                              fix="check the path, or create it with `sailor-hpc profiles import-sailor` / `profile`")
        for entry in merged_entries(read_merged(Path(os.path.realpath(path)), path).view):
            archive.add(entry, override=False)
    archive.sources = tuple(str(p) for p in paths)
    return archive


def resolve_archive_paths(explicit: str | os.PathLike[str] | None = None, site: Site | None = None) -> list[Path]:
    """Where to read profiles from: --archive, else $SAILOR_PROFILES, else the site's shared archive;
    the embedded Sailor profiles always come last, so planning works before anyone profiles."""
    chosen = explicit or os.environ.get("SAILOR_PROFILES") or (site.archive if site is not None else "")
    paths = [Path(chosen)] if chosen else []
    if EMBEDDED_ARCHIVE.exists() and EMBEDDED_ARCHIVE not in paths:
        paths.append(EMBEDDED_ARCHIVE)
    return paths


def open_archive(explicit: str | os.PathLike[str] | None = None, site: Site | None = None) -> ProfileArchive:
    paths = resolve_archive_paths(explicit, site)
    if not paths:
        raise SailorError("no profile archive", field="--archive",
                          fix="pass --archive, set SAILOR_PROFILES, or reinstall to get the embedded default")
    return read_archive(*paths)
