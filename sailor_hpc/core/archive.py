"""The HDF5 profile archive, shared by every user of a site.

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
                                          it, else above it (:meth:`ProfileArchive.overhead_tp`)
    /network/<site>/<link>                float64 (3,): quadratic fit coefficients (GB/s vs log2 MB)
                                          [kind, a, b, senders, max_gbps, min_bytes, max_bytes, provenance]

Every entry carries ``provenance``: a JSON object with user, host, time, source and the GPU, driver,
CUDA and torch versions where known.

Concurrency: readers open the file without HDF5 locking (which fails on many network filesystems) and
always see a complete file, because writers never modify it in place: a writer takes the archive's
lock (see :mod:`sailor_hpc.core.locking`), copies the current file and its new entries into a temporary
file, and renames it over the archive. Concurrent writers therefore serialise and lose nothing.

A file that is not laid out like this (a dataset where a group belongs, a missing attribute, text where
numbers belong) is reported as a SailorError naming the file, the HDF5 path and the fix, by readers and
by writers alike (a writer never copies a broken archive on).
"""
from __future__ import annotations

import getpass
import json
import math
import os
import re
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")

import h5py  # noqa: E402
import numpy as np  # noqa: E402

from sailor_hpc.core.atomic import atomic_path  # noqa: E402
from sailor_hpc.core.errors import SailorError  # noqa: E402
from sailor_hpc.core.locking import file_lock  # noqa: E402
from sailor_hpc.core.network import NetworkFit  # noqa: E402
from sailor_hpc.core.precision import DTYPES  # noqa: E402
from sailor_hpc.core.site import Site  # noqa: E402

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


@dataclass
class ProfileArchive:
    """An archive's content in memory (archives are small: a few MB for every model and GPU)."""

    # a profile per (model, GPU type, dtype): the simulator never takes one dtype's times for another's
    compute: dict[ComputeKey, dict[tuple[int, int], ComputeEntry]] = field(default_factory=dict)
    failed: dict[ComputeKey, dict[tuple[int, int], ComputeEntry]] = field(default_factory=dict)
    memory: dict[str, dict[int, MemoryEntry]] = field(default_factory=dict)
    overhead: dict[str, OverheadEntry] = field(default_factory=dict)
    network: dict[str, list[NetworkEntry]] = field(default_factory=dict)
    sources: tuple[str, ...] = ()

    # ------------------------------------------------------------------ queries
    def models(self) -> list[str]:
        return sorted({m for m, _, _ in self.compute} | set(self.memory))

    def gpus(self, model: str, dtype: str | None = None) -> list[str]:
        """GPU types with a compute profile of ``model`` (in ``dtype``, or in any)."""
        return sorted({g for m, g, d in self.compute if m == model and dtype in (None, d)})

    def dtypes(self, model: str, gpu: str) -> list[str]:
        """The dtypes ``model`` was profiled in on ``gpu``."""
        return sorted(d for m, g, d in self.compute if (m, g) == (model, gpu))

    def has_compute(self, model: str, gpu: str, dtype: str = "fp32") -> bool:
        return (model, gpu, dtype) in self.compute

    def compute_points(self, model: str, gpu: str, dtype: str = "fp32") -> dict[tuple[int, int], ComputeEntry]:
        """(mbs, tp) -> entry of every measured point; raises if the triple was never profiled."""
        try:
            return self.compute[(model, gpu, dtype)]
        except KeyError:
            other = self.dtypes(model, gpu)
            if other:
                raise SailorError(f"{model} on {gpu} is profiled in {', '.join(other)}, not {dtype}", file=self.where,
                                  field=f"compute/{model}/{gpu}",
                                  fix=f"profile {dtype} (`sailor-hpc profile --model {model} --dtype {dtype}`) "
                                      f"or plan in {' or '.join(other)} (--dtype)") from None
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

    def overhead_tp(self, gpu: str, tp: int) -> int:
        """The measured TP degree whose fixed overhead stands for ``tp`` on ``gpu``.

        The rule: ``tp`` itself if it was measured, else the largest measured degree below it, else (``tp``
        below every measured degree) the smallest measured one. Why: the fixed memory grows with TP (a TP
        group adds its communicator's buffers, a larger group more channels), so the nearest degree below
        is the closest measurement of the same kind of set-up, and where there is none below, the next one
        above errs on the safe side (a plan is refused, never sent out of memory). A GPU type without any
        recorded overhead is an error (never 0): its plans would look smaller than they are.

        The table of one GPU type comes whole from one archive: every profiling job adds its TP degree to
        the GPU's table in its archive (:func:`write_entries`), and a front archive's table hides the embedded
        estimates of that GPU type entirely, so measured and estimated degrees are never mixed (Sailor's
        estimates include other ranks' CUDA contexts that a runtime binding its devices first does not pay).
        """
        entry = self.overhead.get(gpu)
        if entry is None or not entry.by_tp:
            raise SailorError(f"no fixed memory overhead recorded for {gpu}", file=self.where,
                              field=f"overhead/{gpu}", fix=f"run `sailor-hpc profile` on a {gpu} partition")
        below = [t for t in entry.by_tp if t <= tp]
        return max(below) if below else min(entry.by_tp)

    def overhead_bytes(self, gpu: str, tp: int) -> float:
        """Fixed per-GPU memory (bytes) of one GPU of a TP-``tp`` group, by the rule of :meth:`overhead_tp`."""
        measured = self.overhead_tp(gpu, tp)
        return self.overhead[gpu].by_tp[measured]

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
            key = entry.key
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

_POINT_NAME = re.compile(r"^mbs([1-9][0-9]*)_tp([1-9][0-9]*)(?:_([a-z0-9]+))?$")
_TP_NAME = re.compile(r"^tp([1-9][0-9]*)$")
_REPAIR = ("delete the entry (h5py: `del f[{path!r}]`) and profile it again, or re-create the archive with "
           "`sailor-hpc profiles import-sailor` / `sailor-hpc profile`")


class _Reader:
    """Reads one archive file. Anything that is not as :func:`write_entries` writes it (a dataset where a
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
        for key, child in parent.items() if parent is not None else ():
            if not isinstance(child, h5py.Group):
                raise self.error(child.name, "is a dataset where the archive has a group")
            yield key, child

    def datasets(self, group: h5py.Group | None) -> Iterator[tuple[str, h5py.Dataset]]:
        for key, child in group.items() if group is not None else ():
            if not isinstance(child, h5py.Dataset):
                raise self.error(child.name, "is a group where the archive has a dataset")
            self.at = child.name
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

    def compute(self) -> Iterator[ComputeEntry]:
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
                    yield ComputeEntry(model, gpu, int(match[1]), int(match[2]), times, self.provenance(ds), status,
                                       self.text(ds, "reason", ""), dtype, self.spread(ds, times.shape),
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

    def memory(self) -> Iterator[MemoryEntry]:
        for model, tables in self.groups(self.group(self.h5, "memory")):
            for name, ds in self.datasets(tables):
                match = _TP_NAME.match(name)
                if match is None:
                    raise self.error(ds.name, "is not named tp<T>")
                table = self.numbers(ds, (None, len(MEMORY_COLUMNS)), ", ".join(MEMORY_COLUMNS) + " per layer")
                self.require(bool(np.isfinite(table).all() and (table >= 0).all()), ds,
                             "has negative or missing (NaN) values")
                yield MemoryEntry(model, int(match[1]), table, self.provenance(ds), self.text(ds, "dtype", "fp32"))

    def overhead(self) -> Iterator[OverheadEntry]:
        for gpu, ds in self.datasets(self.group(self.h5, "overhead")):
            rows = self.numbers(ds, (None, 2), "rows of (TP degree, bytes)")
            tps, nbytes = rows[:, 0], rows[:, 1]
            self.require(bool((tps >= 1).all() and (tps == np.round(tps)).all()), ds,
                         f"TP degrees {tps.tolist()} are not positive integers")
            self.require(len(set(tps.tolist())) == len(tps), ds, f"TP degrees {tps.tolist()} repeat")
            self.require(bool(np.isfinite(nbytes).all() and (nbytes > 0).all()), ds,
                         f"fixed memory {nbytes.tolist()} is not a positive number of bytes per TP degree")
            yield OverheadEntry(gpu, {int(t): float(b) for t, b in rows}, self.provenance(ds))

    def network(self) -> Iterator[NetworkEntry]:
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
                                 min_bytes=self.number(ds, "min_bytes"), max_bytes=self.number(ds, "max_bytes"))
                yield NetworkEntry(site, kind, self.text(ds, "a"), self.text(ds, "b"), senders, fit, self.provenance(ds))

    def entries(self) -> Iterator[Entry]:
        self.header()
        yield from self.compute()
        yield from self.memory()
        yield from self.overhead()
        yield from self.network()


def _entries_of(h5: h5py.File, path: Path) -> list[Entry]:
    """Every entry of an open archive, checked (see :class:`_Reader`)."""
    reader = _Reader(h5, path)
    try:
        return list(reader.entries())
    except SailorError:
        raise
    except (ValueError, KeyError, TypeError, OSError) as exc:  # what the checks did not foresee
        raise reader.error(reader.at, f"cannot be read: {exc}") from None


def _read_into(archive: ProfileArchive, path: Path, *, override: bool) -> None:
    with h5py.File(path, "r", locking=False) as h5:
        for entry in _entries_of(h5, path):
            archive.add(entry, override=override)


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
                        _entries_of(old, path)  # a broken archive is reported, not copied on with new entries
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
                _readable(out, path)
    return written


def _readable(h5: h5py.File, path: Path) -> None:
    """The new archive, before it replaces the old one, reads back under the readers' rules: an entry the
    readers would refuse (an empty overhead table, NaN seconds in a measured point) is refused here, and
    the shared file stays as it was."""
    try:
        _entries_of(h5, path)
    except SailorError as exc:
        raise SailorError(f"refusing to write an entry readers would refuse: {exc.message}", file=path,
                          field=exc.field, fix="nothing was written; correct the entry") from None


def _hides_a_measurement(h5: h5py.File, entry: Entry) -> bool:
    """A failed point never replaces a measured one: a lost job, or a second partition of the same GPU
    type that ran out of memory, must not erase what another job measured (delete it to re-measure)."""
    if not isinstance(entry, ComputeEntry) or entry.status == "ok" or entry.path not in h5:
        return False
    return str(h5[entry.path].attrs.get("status", "ok")) == "ok"
