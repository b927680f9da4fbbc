"""The HDF5 profile archive, shared by every user of a site.

Layout (version 1; attributes in brackets)::

    / [format="sailor-hpc-profiles", version=1]
    /compute/<model>/<gpu>/mbs<B>_tp<T>   float64 (L, 3): fwd, bwd, optimizer-update seconds per pipeline
                                          layer for one micro-batch of B on one GPU of a TP-T group
                                          [status="ok"|"failed", reason, dtype, provenance]
    /memory/<model>/tp<T>                 float64 (L, 4): params, act_output, act_input (elements per TP
                                          rank) and act_mem_bytes (retained activation bytes at mbs 1)
                                          [dtype, provenance]
    /overhead/<gpu>                       float64 (n, 2): rows (tp, bytes) of per-GPU fixed memory
                                          (CUDA context, communicator buffers, allocator) [provenance]
    /network/<site>/<link>                float64 (3,): quadratic fit coefficients (GB/s vs log2 MB)
                                          [kind, a, b, senders, max_gbps, min_bytes, max_bytes, provenance]

Every entry carries ``provenance``: a JSON object with user, host, time, source and the GPU, driver,
CUDA and torch versions where known.

Concurrency: readers open the file without HDF5 locking (which fails on many network filesystems) and
always see a complete file, because writers never modify it in place: a writer takes the archive's
lock (see :mod:`sailor_hpc.locking`), copies the current file and its new entries into a temporary
file, and renames it over the archive. Concurrent writers therefore serialise and lose nothing.
"""
from __future__ import annotations

import getpass
import json
import os
import re
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")

import h5py  # noqa: E402
import numpy as np  # noqa: E402

from sailor_hpc.atomic import atomic_path  # noqa: E402
from sailor_hpc.errors import SailorError  # noqa: E402
from sailor_hpc.locking import file_lock  # noqa: E402
from sailor_hpc.network import NetworkFit  # noqa: E402

ARCHIVE_FORMAT = "sailor-hpc-profiles"
ARCHIVE_VERSION = 1
EMBEDDED_ARCHIVE = Path(__file__).parent / "data" / "sailor_profiles.h5"
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

    @property
    def path(self) -> str:
        return f"compute/{self.model}/{self.gpu}/mbs{self.mbs}_tp{self.tp}"


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


@dataclass
class ProfileArchive:
    """An archive's content in memory (archives are small: a few MB for every model and GPU)."""

    compute: dict[tuple[str, str], dict[tuple[int, int], ComputeEntry]] = field(default_factory=dict)
    failed: dict[tuple[str, str], dict[tuple[int, int], ComputeEntry]] = field(default_factory=dict)
    memory: dict[str, dict[int, MemoryEntry]] = field(default_factory=dict)
    overhead: dict[str, OverheadEntry] = field(default_factory=dict)
    network: dict[str, list[NetworkEntry]] = field(default_factory=dict)
    sources: tuple[str, ...] = ()

    # ------------------------------------------------------------------ queries
    def models(self) -> list[str]:
        return sorted({m for m, _ in self.compute} | set(self.memory))

    def gpus(self, model: str) -> list[str]:
        return sorted(g for m, g in self.compute if m == model)

    def compute_points(self, model: str, gpu: str) -> dict[tuple[int, int], ComputeEntry]:
        """(mbs, tp) -> entry of every measured point; raises if the pair was never profiled."""
        try:
            return self.compute[(model, gpu)]
        except KeyError:
            have = ", ".join(self.gpus(model)) or "none"
            raise SailorError(f"no compute profile for model {model} on {gpu} (profiled GPUs: {have})",
                              file=self.where, field=f"compute/{model}/{gpu}",
                              fix=f"run `sailor-hpc profile --model {model}` on a {gpu} partition") from None

    def memory_table(self, model: str, tp: int) -> MemoryEntry:
        tables = self.memory.get(model)
        if not tables:
            raise SailorError(f"no memory profile for model {model}", file=self.where, field=f"memory/{model}",
                              fix=f"run `sailor-hpc profile --model {model}`")
        if tp not in tables:
            raise SailorError(f"no memory profile for {model} at TP {tp} (have TP {sorted(tables)})",
                              file=self.where, field=f"memory/{model}/tp{tp}",
                              fix=f"profile TP {tp} (`sailor-hpc profile --tp {tp}`) or use a profiled TP")
        return tables[tp]

    def overhead_bytes(self, gpu: str, tp: int) -> float:
        entry = self.overhead.get(gpu)
        if entry is None:
            raise SailorError(f"no fixed memory overhead recorded for {gpu}", file=self.where,
                              field=f"overhead/{gpu}", fix=f"run `sailor-hpc profile` on a {gpu} partition")
        lower = [t for t in entry.by_tp if t <= tp]
        return entry.by_tp[max(lower) if lower else min(entry.by_tp)]

    @property
    def where(self) -> str:
        return " + ".join(self.sources) or "<empty archive>"

    def entries(self) -> Iterable[Entry]:
        for table in (self.compute, self.failed):
            for points in table.values():
                yield from points.values()
        for tables in self.memory.values():
            yield from tables.values()
        yield from self.overhead.values()
        for links in self.network.values():
            yield from links

    # ------------------------------------------------------------------ building
    def add(self, entry: Entry, *, override: bool = True) -> None:
        if isinstance(entry, ComputeEntry):
            key = (entry.model, entry.gpu)
            good, bad = self.compute.setdefault(key, {}), self.failed.setdefault(key, {})
            point = (entry.mbs, entry.tp)
            if not override and (point in good or point in bad):
                return
            good.pop(point, None)
            bad.pop(point, None)
            (good if entry.status == "ok" else bad)[point] = entry
            if not bad:
                del self.failed[key]
            if not good:
                del self.compute[key]
        elif isinstance(entry, MemoryEntry):
            tables = self.memory.setdefault(entry.model, {})
            if override or entry.tp not in tables:
                tables[entry.tp] = entry
        elif isinstance(entry, OverheadEntry):
            if override or entry.gpu not in self.overhead:
                self.overhead[entry.gpu] = entry
        else:
            links = self.network.setdefault(entry.site, [])
            same = [e for e in links if e.path == entry.path]
            if same and not override:
                return
            links[:] = [e for e in links if e.path != entry.path] + [entry]


# ---------------------------------------------------------------------- reading

def _prov(obj: Any) -> dict[str, Any]:
    raw = obj.attrs.get("provenance", "{}")
    return json.loads(raw if isinstance(raw, str) else raw.decode())


def _read_into(archive: ProfileArchive, path: Path, *, override: bool) -> None:
    with h5py.File(path, "r", locking=False) as h5:
        if h5.attrs.get("format") != ARCHIVE_FORMAT:
            raise SailorError("not a sailor-hpc profile archive", file=path, field="format",
                              fix="pass an archive written by sailor-hpc (profiles import-sailor / profile)")
        version = int(h5.attrs.get("version", 0))
        if version != ARCHIVE_VERSION:
            raise SailorError(f"archive version {version} is not supported", file=path, field="version",
                              fix=f"this sailor-hpc reads version {ARCHIVE_VERSION}")
        for model, gpus in h5.get("compute", {}).items():
            for gpu, points in gpus.items():
                for name, ds in points.items():
                    mbs, tp = (int(x[3:] if x.startswith("mbs") else x[2:]) for x in name.split("_"))
                    archive.add(ComputeEntry(model, gpu, mbs, tp, ds[()], _prov(ds), str(ds.attrs.get("status", "ok")),
                                             str(ds.attrs.get("reason", "")), str(ds.attrs.get("dtype", "fp32"))),
                                override=override)
        for model, tables in h5.get("memory", {}).items():
            for name, ds in tables.items():
                archive.add(MemoryEntry(model, int(name[2:]), ds[()], _prov(ds), str(ds.attrs.get("dtype", "fp32"))),
                            override=override)
        for gpu, ds in h5.get("overhead", {}).items():
            archive.add(OverheadEntry(gpu, {int(t): float(b) for t, b in ds[()]}, _prov(ds)), override=override)
        for site, links in h5.get("network", {}).items():
            for ds in links.values():
                at = ds.attrs
                fit = NetworkFit(coeffs=tuple(float(c) for c in ds[()]), max_gbps=float(at["max_gbps"]) or None,
                                 min_bytes=float(at["min_bytes"]), max_bytes=float(at["max_bytes"]))
                archive.add(NetworkEntry(site, str(at["kind"]), str(at["a"]), str(at["b"]), int(at["senders"]), fit,
                                         _prov(ds)), override=override)


def read_archive(*paths: str | os.PathLike[str]) -> ProfileArchive:
    """Read archives in precedence order: an entry of an earlier archive hides the same entry of later ones."""
    archive = ProfileArchive()
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise SailorError("profile archive not found", file=path,
                              fix="check the path, or create it with `sailor-hpc profiles import-sailor` / `profile`")
        try:
            _read_into(archive, path, override=False)
        except OSError as exc:
            raise SailorError(f"cannot read the archive: {exc}", file=path, fix="is it an HDF5 file?") from None
        except (ValueError, KeyError, TypeError) as exc:  # a group or attribute not as sailor-hpc writes them
            raise SailorError(f"malformed archive entry: {exc!r}", file=path,
                              fix="re-create the archive with `sailor-hpc profiles import-sailor` / `profile`") from None
    archive.sources = tuple(str(p) for p in paths)
    return archive


def resolve_archive_paths(explicit: str | os.PathLike[str] | None = None, site: Any | None = None) -> list[Path]:
    """Where to read profiles from: --archive, else $SAILOR_PROFILES, else the site's shared archive;
    the embedded Sailor profiles always come last, so planning works before anyone profiles."""
    chosen = explicit or os.environ.get("SAILOR_PROFILES") or (site.archive if site is not None else "")
    paths = [Path(chosen)] if chosen else []
    if EMBEDDED_ARCHIVE.exists() and EMBEDDED_ARCHIVE not in paths:
        paths.append(EMBEDDED_ARCHIVE)
    return paths


def open_archive(explicit: str | os.PathLike[str] | None = None, site: Any | None = None) -> ProfileArchive:
    paths = resolve_archive_paths(explicit, site)
    if not paths:
        raise SailorError("no profile archive", field="--archive",
                          fix="pass --archive, set SAILOR_PROFILES, or reinstall to get the embedded default")
    return read_archive(*paths)


# ---------------------------------------------------------------------- writing

def _write_entry(h5: h5py.File, entry: Entry) -> None:
    if isinstance(entry, OverheadEntry) and entry.path in h5:
        # each profiling job measures its own TP degree: it adds to the GPU's table, never drops the others
        entry = OverheadEntry(entry.gpu, {**{int(t): float(b) for t, b in h5[entry.path][()]}, **entry.by_tp},
                              entry.provenance)
    if entry.path in h5:
        del h5[entry.path]
    if isinstance(entry, ComputeEntry):
        ds = h5.create_dataset(entry.path, data=np.asarray(entry.times, dtype=np.float64))
        ds.attrs.update({"status": entry.status, "reason": entry.reason, "dtype": entry.dtype})
    elif isinstance(entry, MemoryEntry):
        ds = h5.create_dataset(entry.path, data=np.asarray(entry.table, dtype=np.float64))
        ds.attrs.update({"dtype": entry.dtype, "columns": ",".join(MEMORY_COLUMNS)})
    elif isinstance(entry, OverheadEntry):
        ds = h5.create_dataset(entry.path, data=np.array(sorted(entry.by_tp.items()), dtype=np.float64))
    else:
        # a constant bandwidth is stored as the flat quadratic (0, 0, c)
        coeffs = entry.fit.coeffs or (0.0, 0.0, float(entry.fit.constant_gbps or 0.0))
        ds = h5.create_dataset(entry.path, data=np.asarray(coeffs, dtype=np.float64))
        ds.attrs.update({"kind": entry.kind, "a": entry.a, "b": entry.b, "senders": entry.senders,
                         "max_gbps": entry.fit.max_gbps or 0.0, "min_bytes": entry.fit.min_bytes,
                         "max_bytes": entry.fit.max_bytes})
    ds.attrs["provenance"] = json.dumps(entry.provenance, sort_keys=True)


_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


def _check_names(entry: Entry) -> None:
    """Names become HDF5 group names (and ':'-joined keys): a '/' would nest groups every reader then
    misparses, so such an entry is refused before anything is written."""
    names = {ComputeEntry: ("model", "gpu"), MemoryEntry: ("model",), OverheadEntry: ("gpu",),
             NetworkEntry: ("site", "a", "b")}[type(entry)]
    for attr in names:
        value = getattr(entry, attr)
        if not _SAFE_NAME.match(str(value)):
            raise SailorError(f"{attr} {value!r} cannot name an archive entry", field=attr,
                              fix="use letters, digits, '_', '-', '.', '+' (rename the GPU type, model or site)")


def _open_existing(path: Path) -> h5py.File:
    try:
        return h5py.File(path, "r", locking=False)
    except OSError as exc:
        raise SailorError(f"refusing to overwrite a file that is not a sailor-hpc archive ({exc})",
                          file=path, fix="choose another --archive path") from None


def write_entries(path: str | os.PathLike[str], entries: Iterable[Entry], *, lock_timeout_s: float = 300.0) -> int:
    """Merge entries into the archive at ``path`` (created if missing); returns how many were written
    (a failed compute point is not written over a measured one).

    Safe against concurrent writers (lock + copy + atomic rename) and readers (they never see a partial file).
    """
    entries = list(entries)
    path = Path(os.path.realpath(path))  # through a symlink: the shared file itself, not the link
    for entry in entries:
        _check_names(entry)
    with file_lock(path, timeout_s=lock_timeout_s):
        with atomic_path(path) as tmp:
            with h5py.File(tmp, "w", locking=False) as out:
                if path.exists():
                    with _open_existing(path) as old:
                        if old.attrs.get("format") != ARCHIVE_FORMAT:
                            raise SailorError("refusing to overwrite a file that is not a sailor-hpc archive",
                                              file=path, fix="choose another --archive path")
                        for name in old:
                            old.copy(old[name], out, name=name)
                out.attrs["format"] = ARCHIVE_FORMAT
                out.attrs["version"] = ARCHIVE_VERSION
                written = 0
                for entry in entries:
                    if _hides_a_measurement(out, entry):
                        continue
                    _write_entry(out, entry)
                    written += 1
    return written


def _hides_a_measurement(h5: h5py.File, entry: Entry) -> bool:
    """A failed point never replaces a measured one: a lost job, or a second partition of the same GPU
    type that ran out of memory, must not erase what another job measured (delete it to re-measure)."""
    if not isinstance(entry, ComputeEntry) or entry.status == "ok" or entry.path not in h5:
        return False
    return str(h5[entry.path].attrs.get("status", "ok")) == "ok"
