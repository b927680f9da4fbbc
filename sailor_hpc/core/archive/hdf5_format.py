"""One archive file in HDF5: its layout, the checked reader and the writer.

Layout (version 1; attributes in brackets)::

    / [format="sailor-hpc-profiles", version=1]
    /compute/<model>/<gpu>/mbs<B>_tp<T>[_<dtype>]
                                          float64 (L, 3): fwd, bwd, optimizer-update seconds per pipeline
                                          layer for one micro-batch of B on one GPU of a TP-T group, in
                                          ``dtype`` (the name has no suffix for fp32: archives written
                                          before other dtypes were profiled read unchanged)
                                          [status="ok"|"failed", reason, dtype, provenance; measured by
                                          sailor-hpc profile since the chain timing also: spread (L, 3)
                                          interquartile range / median per layer and column,
                                          model_spread (2,) the same of the whole model's fwd and bwd,
                                          repetitions; flag when the point breaks monotonicity in the
                                          micro-batch size after a re-measure. Absent: not recorded
                                          (Sailor's profiles, older archives)]
    /memory/<model>/tp<T>                 float64 (L, 4): params, act_output, act_input (elements per TP
                                          rank) and act_mem_bytes (retained activation bytes at mbs 1)
                                          [dtype, provenance]
    /overhead/<gpu>                       float64 (n, 2): rows (tp, bytes) of per-GPU fixed memory
                                          (CUDA context, communicator buffers, allocator) [provenance];
                                          a TP degree without a row takes the nearest measured one below
                                          it, else above it (:meth:`~sailor_hpc.core.archive.query.ProfileArchive.overhead_tp`)
    /network/<site>/<link>                float64 (3,): quadratic fit coefficients (GB/s vs log2 MB)
                                          [kind, a, b, senders, max_gbps, min_bytes, max_bytes, provenance;
                                          collective_latency_s, gather_latency_s: the link's latency per ring
                                          step of a small all-reduce and all-gather back to back, and
                                          issued_latency_s, issued_gather_latency_s: the same issued one at a
                                          time after computing; replica_jitter: how far the link's replicas
                                          drift apart doing the same work; each where measured]

Every entry carries ``provenance``: a JSON object with user, host, time, source and the GPU, driver,
CUDA and torch versions where known.

A file that is not laid out like this (a dataset where a group belongs, a missing attribute, text where
numbers belong) is reported as a SailorError naming the file, the HDF5 path and the fix, by readers and
by writers alike (a writer never copies a broken archive on).
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from sailor_hpc.core.archive.entries import (
    MEMORY_COLUMNS,
    ComputeEntry,
    Entry,
    MemoryEntry,
    NetworkEntry,
    OverheadEntry,
    PointSpread,
)
from sailor_hpc.core.archive.merge import Atom, View, merged_entries
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.network import MAX_JITTER, NetworkFit
from sailor_hpc.core.precision import DTYPES

ARCHIVE_FORMAT = "sailor-hpc-profiles"
ARCHIVE_VERSION = 1
# a network entry's measured latencies (NetworkFit's fields of the same names): optional attributes, so archives
# written before one was measured read as they were (0: not measured)
LATENCY_ATTRS = ("collective_latency_s", "gather_latency_s", "issued_latency_s", "issued_gather_latency_s",
                 "replica_jitter")

_POINT_NAME = re.compile(r"^mbs([1-9][0-9]*)_tp([1-9][0-9]*)(?:_([a-z0-9]+))?$")
_TP_NAME = re.compile(r"^tp([1-9][0-9]*)$")
_REPAIR = ("delete the entry (h5py: `del f[{path!r}]`) and profile it again, or re-create the archive with "
           "`sailor-hpc profiles import-sailor` / `sailor-hpc profile`")


class _Reader:
    """Reads one archive file. Anything that is not as :func:`write_view` writes it (a dataset where a
    group belongs, a missing attribute, text where numbers belong, a wrong shape) becomes a SailorError
    naming the file, the HDF5 path and the fix, never an AttributeError from deep inside h5py: archives
    are shared, and the person who meets a broken one is rarely the one who broke it."""

    def __init__(self, h5: h5py.File, path: Path) -> None:
        self.h5, self.path = h5, path
        self.at = "/"  # the HDF5 path being read, for errors raised from below (h5py, numpy)

    def error(self, hpath: str, message: str) -> SailorError:
        hpath = hpath.lstrip("/") or "/"
        return SailorError(message, file=self.path, field=hpath, fix=_REPAIR.format(path=hpath))

    def group(self, parent: h5py.Group, name: str) -> h5py.Group | None:
        """``parent[name]`` as a group, None when absent."""
        node = parent.get(name)
        if node is not None and not isinstance(node, h5py.Group):
            raise self.error(node.name, "is a dataset where the archive has a group")
        return node

    def groups(self, parent: h5py.Group | None) -> Iterator[tuple[str, h5py.Group]]:
        for key, child in self._children(parent):
            if not isinstance(child, h5py.Group):
                raise self.error(child.name, "is a dataset where the archive has a group")
            yield key, child

    def datasets(self, group: h5py.Group | None) -> Iterator[tuple[str, h5py.Dataset]]:
        for key, child in self._children(group):
            if not isinstance(child, h5py.Dataset):
                raise self.error(child.name, "is a group where the archive has a dataset")
            self.at = child.name
            yield key, child

    def _children(self, parent: h5py.Group | None) -> Iterator[tuple[str, h5py.HLObject]]:
        """A group's members; h5py gives None for a link it cannot follow (dangling, or damaged on disk)."""
        if parent is None:
            return
        for key, child in parent.items():
            if child is None:
                raise self.error(f"{parent.name}/{key}", "is a link to nothing (dangling or damaged)")
            yield key, child

    def numbers(self, ds: h5py.Dataset, shape: tuple[int | None, ...], what: str) -> np.ndarray:
        """The dataset as float64 of ``shape`` (None: any length >= 1)."""
        if ds.dtype.kind not in "fiu":
            raise self.error(ds.name, f"holds {ds.dtype} values, not numbers ({what})")
        data = np.asarray(ds[()], dtype=np.float64)
        if data.ndim != len(shape) or any(n is not None and n != d for n, d in zip(shape, data.shape)) \
                or 0 in data.shape:
            want = " x ".join("n" if n is None else str(n) for n in shape)
            raise self.error(ds.name, f"has shape {data.shape}, expected {want} ({what})")
        return data

    def require(self, ok: bool, ds: h5py.HLObject, message: str) -> None:
        if not ok:
            raise self.error(ds.name, message)

    def text(self, obj: h5py.HLObject, name: str, default: str | None = None) -> str:
        raw = obj.attrs.get(name, default)
        if raw is None:
            raise self.error(obj.name, f"has no {name!r} attribute")
        if isinstance(raw, bytes | np.bytes_):
            raw = raw.decode(errors="replace")
        if not isinstance(raw, str):
            raise self.error(obj.name, f"attribute {name!r} is {raw!r}, not text")
        return raw

    def number(self, obj: h5py.HLObject, name: str, kind: type = float) -> float:
        raw = obj.attrs.get(name)
        if raw is None:
            raise self.error(obj.name, f"has no {name!r} attribute")
        ok = isinstance(raw, int | float | np.integer | np.floating) and not isinstance(raw, bool | np.bool_)
        if not ok or not math.isfinite(float(raw)) or (kind is int and float(raw) != int(raw)):
            raise self.error(obj.name, f"attribute {name!r} is {raw!r}, not {'an integer' if kind is int else 'a number'}")
        return kind(raw)

    def provenance(self, obj: h5py.HLObject) -> dict[str, Any]:
        text = self.text(obj, "provenance", "{}")
        try:
            prov = json.loads(text)
        except json.JSONDecodeError as exc:
            raise self.error(obj.name, f"attribute 'provenance' is not JSON ({exc})") from None
        if not isinstance(prov, dict):
            raise self.error(obj.name, "attribute 'provenance' is not a JSON object")
        return prov

    def header(self) -> None:
        if self.text(self.h5, "format", "") != ARCHIVE_FORMAT:
            raise SailorError("not a sailor-hpc profile archive", file=self.path, field="format",
                              fix="pass an archive written by sailor-hpc (profiles import-sailor / profile)")
        version = self.h5.attrs.get("version", 0)
        if not isinstance(version, int | np.integer) or int(version) != ARCHIVE_VERSION:
            raise SailorError(f"archive version {version!r} is not supported", file=self.path, field="version",
                              fix=f"this sailor-hpc reads version {ARCHIVE_VERSION}")

    def compute(self) -> Iterator[tuple[h5py.Dataset, ComputeEntry]]:
        for model, gpus in self.groups(self.group(self.h5, "compute")):
            for gpu, points in self.groups(gpus):
                for name, ds in self.datasets(points):
                    match = _POINT_NAME.match(name)
                    if match is None:
                        raise self.error(ds.name, "is not named mbs<B>_tp<T> or mbs<B>_tp<T>_<dtype>")
                    dtype = self.text(ds, "dtype", "fp32")
                    self.require(dtype in DTYPES, ds, f"dtype {dtype!r} is none of {', '.join(DTYPES)}")
                    # an unsuffixed name holds fp32, or a point written before the suffix existed
                    self.require(match[3] in (None, dtype), ds, f"is named for {match[3]} but holds {dtype} times")
                    status = self.text(ds, "status", "ok")
                    self.require(status in ("ok", "failed"), ds, f"status {status!r} is neither 'ok' nor 'failed'")
                    times = self.numbers(ds, (None, 3), "fwd, bwd, update seconds per layer")
                    self.require(status == "failed" or bool(np.isfinite(times).all() and (times >= 0).all()), ds,
                                 "a measured point has negative or missing (NaN) seconds")
                    yield ds, ComputeEntry(model, gpu, int(match[1]), int(match[2]), times, self.provenance(ds),
                                           status, self.text(ds, "reason", ""), dtype, self.spread(ds, times.shape),
                                           self.text(ds, "flag", ""))

    def spread(self, ds: h5py.Dataset, shape: tuple[int, ...]) -> PointSpread | None:
        """A point's spread attributes, None where it has none (every archive written before them)."""
        if "spread" not in ds.attrs:
            return None
        model = self.rates(ds, "model_spread", (2,))
        reps = int(self.number(ds, "repetitions", int))
        self.require(reps >= 1, ds, f"repetitions {reps} is not positive")
        return PointSpread(self.rates(ds, "spread", shape), (float(model[0]), float(model[1])), reps)

    def rates(self, obj: h5py.HLObject, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """An attribute holding non-negative finite numbers of ``shape``, as float64."""
        raw = np.asarray(obj.attrs.get(name, []))
        values = raw.astype(np.float64) if raw.dtype.kind in "fiu" and raw.shape == shape else None
        self.require(values is not None and bool(np.isfinite(values).all() and (values >= 0).all()), obj,
                     f"attribute {name!r} is not {' x '.join(map(str, shape))} non-negative numbers")
        assert values is not None
        return values

    def memory(self) -> Iterator[tuple[h5py.Dataset, MemoryEntry]]:
        for model, tables in self.groups(self.group(self.h5, "memory")):
            for name, ds in self.datasets(tables):
                match = _TP_NAME.match(name)
                if match is None:
                    raise self.error(ds.name, "is not named tp<T>")
                table = self.numbers(ds, (None, len(MEMORY_COLUMNS)), ", ".join(MEMORY_COLUMNS) + " per layer")
                self.require(bool(np.isfinite(table).all() and (table >= 0).all()), ds,
                             "has negative or missing (NaN) values")
                yield ds, MemoryEntry(model, int(match[1]), table, self.provenance(ds), self.text(ds, "dtype", "fp32"))

    def overhead(self) -> Iterator[tuple[h5py.Dataset, OverheadEntry]]:
        for gpu, ds in self.datasets(self.group(self.h5, "overhead")):
            rows = self.numbers(ds, (None, 2), "rows of (TP degree, bytes)")
            tps, nbytes = rows[:, 0], rows[:, 1]
            self.require(bool((tps >= 1).all() and (tps == np.round(tps)).all()), ds,
                         f"TP degrees {tps.tolist()} are not positive integers")
            self.require(len(set(tps.tolist())) == len(tps), ds, f"TP degrees {tps.tolist()} repeat")
            self.require(bool(np.isfinite(nbytes).all() and (nbytes > 0).all()), ds,
                         f"fixed memory {nbytes.tolist()} is not a positive number of bytes per TP degree")
            yield ds, OverheadEntry(gpu, {int(t): float(b) for t, b in rows}, self.provenance(ds))

    def network(self) -> Iterator[tuple[h5py.Dataset, NetworkEntry]]:
        for site, links in self.groups(self.group(self.h5, "network")):
            for _, ds in self.datasets(links):
                coeffs = self.numbers(ds, (3,), "quadratic fit coefficients")
                self.require(bool(np.isfinite(coeffs).all()), ds, "has missing (NaN) fit coefficients")
                kind = self.text(ds, "kind")
                self.require(kind in ("intra", "inter"), ds, f"kind {kind!r} is neither 'intra' nor 'inter'")
                senders = int(self.number(ds, "senders", int))
                self.require(senders >= 1, ds, f"senders {senders} is not positive")
                a, b, c = (float(x) for x in coeffs)
                fit = NetworkFit(coeffs=(a, b, c), max_gbps=self.number(ds, "max_gbps") or None,
                                 min_bytes=self.number(ds, "min_bytes"), max_bytes=self.number(ds, "max_bytes"),
                                 **{k: self.number(ds, k) for k in LATENCY_ATTRS if k in ds.attrs})
                self.require(min(getattr(fit, k) for k in LATENCY_ATTRS) >= 0, ds, "has a negative latency")
                self.require(fit.replica_jitter < MAX_JITTER, ds, f"has a replica_jitter of {MAX_JITTER} or more")
                yield ds, NetworkEntry(site, kind, self.text(ds, "a"), self.text(ds, "b"), senders, fit, self.provenance(ds))

    def atoms(self) -> Iterator[Atom]:
        """Every entry with its stamp (an overhead table: one atom per TP row, each with its own stamp)."""
        self.header()
        for ds, point in self.compute():  # the dataset's own name: an unsuffixed one may hold another dtype
            yield Atom(point.path, int(point.status == "ok"), self.stamp(ds), point)
        for ds, table in self.memory():
            yield Atom(table.path, 0, self.stamp(ds), table)
        for ds, link in self.network():
            yield Atom(link.path, 0, self.stamp(ds), link)
        for ds, rows in self.overhead():
            for (tp, nbytes), stamp in zip(rows.by_tp.items(), self.row_stamps(ds, len(rows.by_tp))):
                yield Atom(f"{rows.path}#tp{tp}", 0, stamp, OverheadEntry(rows.gpu, {tp: nbytes}, rows.provenance))

    def stamp(self, ds: h5py.Dataset) -> str:
        """The ``written`` stamp of an entry ("" before stamps existed: older than every stamped write)."""
        return self.text(ds, "written", "")

    def row_stamps(self, ds: h5py.Dataset, rows: int) -> list[str]:
        raw = ds.attrs.get("written")
        if raw is None:
            return [""] * rows
        values = np.asarray(raw)
        ok = values.shape == (rows,) and values.dtype.kind in "OSU"
        self.require(ok, ds, f"attribute 'written' is not {rows} stamps (one per TP row)")
        return [v.decode(errors="replace") if isinstance(v, bytes) else str(v) for v in values.tolist()]


def read_atoms(h5: h5py.File, path: Path) -> list[Atom]:
    """Every entry of an open archive file, checked (see :class:`_Reader`)."""
    reader = _Reader(h5, path)
    try:
        return list(reader.atoms())
    except SailorError:
        raise
    # what the checks did not foresee; h5py raises RuntimeError for damaged group metadata (a bad local heap)
    except (ValueError, KeyError, TypeError, OSError, RuntimeError) as exc:
        raise reader.error(reader.at, f"cannot be read: {exc}") from None


def _write_entry(h5: h5py.File, entry: Entry, stamp: str | list[str]) -> None:
    """One entry into a new file (bases and shards are written whole, never edited)."""
    if isinstance(entry, ComputeEntry):
        ds = h5.create_dataset(entry.path, data=np.asarray(entry.times, dtype=np.float64))
        ds.attrs.update({"status": entry.status, "reason": entry.reason, "dtype": entry.dtype})
        if entry.spread is not None:
            ds.attrs.update({"spread": np.asarray(entry.spread.layers, dtype=np.float64),
                             "model_spread": np.asarray(entry.spread.model, dtype=np.float64),
                             "repetitions": int(entry.spread.repetitions)})
        if entry.flag:
            ds.attrs["flag"] = entry.flag
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
        for key in LATENCY_ATTRS:  # measured by the profiler; older entries have none (0)
            if getattr(entry.fit, key):
                ds.attrs[key] = getattr(entry.fit, key)
    ds.attrs["provenance"] = json.dumps(entry.provenance, sort_keys=True)
    ds.attrs["written"] = np.array(stamp, dtype=h5py.string_dtype()) if isinstance(stamp, list) else stamp


def write_view(h5: h5py.File, view: View) -> None:
    """A view as one new archive file: an overhead table's rows, merged apart, are one dataset again."""
    h5.attrs["format"] = ARCHIVE_FORMAT
    h5.attrs["version"] = ARCHIVE_VERSION
    tables: dict[str, list[Atom]] = {}
    for atom in view.values():
        if isinstance(atom.entry, OverheadEntry):
            tables.setdefault(atom.entry.path, []).append(atom)
        else:
            _write_entry(h5, atom.entry, atom.stamp)
    for table in merged_entries({a.key: a for rows in tables.values() for a in rows}):
        rows = sorted(tables[table.path], key=lambda a: a.row)  # the dataset's row order
        _write_entry(h5, table, [a.stamp for a in rows])
