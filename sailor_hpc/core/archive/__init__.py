"""The HDF5 profile archive, shared by every user of a site: what the profiler writes and the simulator,
planner and controller read.

One job per module:

* :mod:`~sailor_hpc.core.archive.entries`: the entries (compute points, memory and overhead tables,
  network fits) and their provenance;
* :mod:`~sailor_hpc.core.archive.query`: :class:`ProfileArchive`, an archive in memory and its queries;
* :mod:`~sailor_hpc.core.archive.hdf5_format`: one file's HDF5 layout, its checked reader and writer;
* :mod:`~sailor_hpc.core.archive.merge`: the merge of several files (measured over failed, newest wins);
* :mod:`~sailor_hpc.core.archive.shards`: the shard store, concurrent writers and readers on any shared
  filesystem, and compaction;
* :mod:`~sailor_hpc.core.archive.files`, :mod:`~sailor_hpc.core.archive.litter`: an archive's files in its
  folder, and the temporary ones killed writers left;
* :mod:`~sailor_hpc.core.archive.sources`: which archives a command reads, merged into one ProfileArchive.
"""
from __future__ import annotations

import os

# HDF5's own file locks are off: the shard store never needs them, and they hang on NFS mounts without locks
os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")

from sailor_hpc.core.archive.entries import (  # noqa: E402
    ComputeEntry,
    ComputeKey,
    Entry,
    MemoryEntry,
    NetworkEntry,
    OverheadEntry,
    PointSpread,
    make_provenance,
)
from sailor_hpc.core.archive.files import ArchiveFiles, archive_files  # noqa: E402
from sailor_hpc.core.archive.litter import LITTER_AGE_S, Litter, litter, remove_litter  # noqa: E402
from sailor_hpc.core.archive.query import ProfileArchive  # noqa: E402
from sailor_hpc.core.archive.shards import compact, write_entries  # noqa: E402
from sailor_hpc.core.archive.sources import (  # noqa: E402
    EMBEDDED_ARCHIVE,
    open_archive,
    read_archive,
    resolve_archive_paths,
)

__all__ = [
    "EMBEDDED_ARCHIVE",
    "LITTER_AGE_S",
    "ArchiveFiles",
    "ComputeEntry",
    "ComputeKey",
    "Entry",
    "Litter",
    "MemoryEntry",
    "NetworkEntry",
    "OverheadEntry",
    "PointSpread",
    "ProfileArchive",
    "archive_files",
    "compact",
    "litter",
    "make_provenance",
    "open_archive",
    "read_archive",
    "remove_litter",
    "resolve_archive_paths",
    "write_entries",
]
