"""A tiny-gpt profile archive made from measured OPT-350M layers (the embedded archive has none).

Shared by the planner tests and the resize controller tests: tiny-gpt's 6 pipeline layers borrow
OPT-350M's embedding, first four blocks and head, on the two GPU types of the local test cluster.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from sailor_hpc.core.archive import (
    EMBEDDED_ARCHIVE,
    ComputeEntry,
    MemoryEntry,
    make_provenance,
    read_archive,
    write_entries,
)

# tiny-gpt's 6 pipeline layers borrow OPT-350M's embedding, first four blocks and head
OPT_ROWS = [0, 1, 2, 3, 4, 25]
GPU_TYPES = ("A100-40", "V100-16")


def write_tiny_archive(path: str | Path) -> Path:
    """Write the tiny-gpt entries (mbs <= 4, TP <= 2, both GPU types) to the HDF5 archive ``path``."""
    opt = read_archive(EMBEDDED_ARCHIVE)
    prov = make_provenance("test: OPT-350M layers 0-4 and 25 of the Sailor profiles")
    entries = []
    for gpu in GPU_TYPES:
        for (mbs, tp), e in opt.compute_points("OPT-350M", gpu).items():
            if mbs <= 4 and tp <= 2:
                entries.append(ComputeEntry("tiny-gpt", gpu, mbs, tp, np.asarray(e.times)[OPT_ROWS], prov))
    for tp in (1, 2):
        entries.append(MemoryEntry("tiny-gpt", tp, np.asarray(opt.memory_table("OPT-350M", tp).table)[OPT_ROWS], prov))
    write_entries(path, entries)
    return Path(path)
