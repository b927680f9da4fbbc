"""The archive's entries: one measured (or failed) compute point, memory table, fixed-overhead table or
network fit each, with the provenance every entry carries. Plain data: the HDF5 layout is
:mod:`sailor_hpc.core.archive.hdf5_format`'s, the queries :class:`~sailor_hpc.core.archive.query.ProfileArchive`'s.
"""
from __future__ import annotations

import getpass
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from sailor_hpc.core.network import NetworkFit

MEMORY_COLUMNS = ("params", "act_output", "act_input", "act_mem_bytes")


def make_provenance(source: str, **extra: Any) -> dict[str, Any]:
    """Who measured an entry, where, when and with what."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    prov = {"user": user, "host": socket.gethostname(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "source": source}
    prov.update({k: v for k, v in extra.items() if v is not None})
    return prov


@dataclass(frozen=True)
class PointSpread:
    """How much a compute point's repetitions varied, kept beside its medians so that a reader can tell a
    real difference between two points from noise (and the profiler, a non-monotonic point from a flat
    one). Relative interquartile ranges (q75 - q25) / median: robust to the odd slow repetition that a
    shared node produces, and comparable across layers of very different sizes."""

    layers: np.ndarray  # (L, 3): fwd, bwd, update of every pipeline layer
    model: tuple[float, float]  # the whole model's forward and backward seconds per repetition
    repetitions: int  # timed repetitions behind every median


@dataclass
class ComputeEntry:
    model: str
    gpu: str
    mbs: int
    tp: int
    times: np.ndarray  # (L, 3)
    provenance: dict[str, Any]
    status: str = "ok"
    reason: str = ""
    dtype: str = "fp32"
    spread: PointSpread | None = None  # None: not recorded (Sailor's profiles, archives before it existed)
    flag: str = ""  # why the point is suspect (not monotonic in the micro-batch size after a re-measure)

    @property
    def path(self) -> str:
        suffix = "" if self.dtype == "fp32" else f"_{self.dtype}"
        return f"compute/{self.model}/{self.gpu}/mbs{self.mbs}_tp{self.tp}{suffix}"

    @property
    def key(self) -> ComputeKey:
        return (self.model, self.gpu, self.dtype)


@dataclass
class MemoryEntry:
    model: str
    tp: int
    table: np.ndarray  # (L, 4) MEMORY_COLUMNS
    provenance: dict[str, Any]
    dtype: str = "fp32"

    @property
    def path(self) -> str:
        return f"memory/{self.model}/tp{self.tp}"


@dataclass
class OverheadEntry:
    gpu: str
    by_tp: dict[int, float]  # tp -> bytes
    provenance: dict[str, Any]

    @property
    def path(self) -> str:
        return f"overhead/{self.gpu}"


@dataclass
class NetworkEntry:
    site: str
    kind: str  # "intra" (inside a node of partition a) or "inter" (between nodes of partitions a and b)
    a: str
    b: str
    senders: int
    fit: NetworkFit
    provenance: dict[str, Any]

    @property
    def path(self) -> str:
        return f"network/{self.site}/{self.kind}:{self.a}:{self.b}:{self.senders}"


Entry = ComputeEntry | MemoryEntry | OverheadEntry | NetworkEntry
ComputeKey = tuple[str, str, str]  # (model, GPU type, dtype): one profile; its points are keyed (mbs, tp)
