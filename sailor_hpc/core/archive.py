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

Concurrency, on any filesystem a site shares the archive on: no writer ever modifies a file another
process may read, and correctness rests on two operations every shared filesystem gives atomically on
its server (NFS, Lustre's MDS, GPFS, BeeGFS's metadata service), not on its locks: a rename publishes a
complete file under a new name, and a file that was renamed in is seen whole by whoever opens it next
(NFS: close-to-open consistency; the others are coherent). POSIX locks are only as good as the mount
(node-local on NFS ``nolock``, Lustre ``localflock``, BeeGFS by default: two nodes both get them), so
nothing here depends on one.

* The archive is a set of immutable files in the archive's folder: the *public file* (the path users
  name, e.g. ``profiles.h5``), *bases* ``.profiles.h5.base.<id>.h5`` and *shards*
  ``.profiles.h5.shard.<id>.h5``, ``<id>`` = the writer's clock (ns), PID, a nonce and its host. Its
  content is the merge of all of them. Every entry carries a stamp (attribute ``written``: that id and
  the entry's place in its write; per row for overhead tables) and the merge keeps, per entry (per TP row
  of an overhead table), the measured point over a failed one, else the newest stamp, ties broken by
  content: the merge is commutative, associative and idempotent, so reading a file twice, or reading an
  old copy beside a new one, never changes the result.
* A writer (:func:`write_entries`) writes its entries into a shard under a temporary name, fsyncs it and
  renames it in: acknowledged once that rename is done. No lock, so no writer queues behind another.
* Compaction folds: it reads the public file, every base and shard, writes their merge as a new base
  (temporary name, fsync, rename), points the public file at it (a hard link renamed over it: the public
  file always holds a complete, recent merge for tools that open it directly), and only then deletes the
  bases and shards *it read*. A file is therefore deleted only while a superset of it is published, by
  induction over every deletion, so no acknowledged entry is ever dropped, whichever compactions run at
  once: two racing compactions each publish all they read; one that finds a file gone (folded by the
  other) reads the other's new base instead. A writer compacts after its shard if it gets the archive's
  lock (:mod:`sailor_hpc.core.locking`) within a moment; the lock only spares duplicate work, and losing
  it (node-local locks, a stopped holder taken over) costs a redundant compaction, never an entry.
* Readers take every listed file, merge, and list again: a file that vanished meanwhile was folded into a
  base published before its deletion, which the next listing shows, so a read misses nothing that was
  acknowledged before it began. On NFS a new file can take the client's directory cache time
  (``acdirmax``) to appear in listings from other nodes: the write is safe, it is seen a little later.
* Killed writers: SIGTERM (a Slurm time limit) runs the writer's clean-up and then dies of the signal
  (:func:`~sailor_hpc.core.locking.cleanup_on_sigterm`); SIGKILL leaves a temporary file, which the next
  write removes: at once when its writer ran on the same host and is gone (no clocks), else once its
  mtime is an hour older than a file just written (both times from the same server on NFS). Removing a
  live writer's temporary file would only make that write fail loudly, never lose an acknowledged one.
* Permissions: new files take the public file's mode and group, and in a group-shared folder (setgid or
  group-writable) are always readable and writable by the folder's group, whatever the writer's umask.
* One limit: writers of sailor-hpc versions before shards rename their copy over the public file; run
  one version per archive (`sailor-hpc profiles doctor` tells what lies in the folder).

A file that is not laid out like this (a dataset where a group belongs, a missing attribute, text where
numbers belong) is reported as a SailorError naming the file, the HDF5 path and the fix, by readers and
by writers alike (a writer never copies a broken archive on).
"""
from __future__ import annotations

import contextlib
import errno
import getpass
import hashlib
import json
import math
import os
import pickle
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")

import h5py  # noqa: E402
import numpy as np  # noqa: E402

from sailor_hpc.core.errors import SailorError  # noqa: E402
from sailor_hpc.core.locking import LockTimeout, Sharing, cleanup_on_sigterm, file_lock  # noqa: E402
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
                                 min_bytes=self.number(ds, "min_bytes"), max_bytes=self.number(ds, "max_bytes"))
                yield ds, NetworkEntry(site, kind, self.text(ds, "a"), self.text(ds, "b"), senders, fit, self.provenance(ds))

    def atoms(self) -> Iterator[_Atom]:
        """Every entry with its stamp (an overhead table: one atom per TP row, each with its own stamp)."""
        self.header()
        for ds, point in self.compute():  # the dataset's own name: an unsuffixed one may hold another dtype
            yield _Atom(point.path, int(point.status == "ok"), self.stamp(ds), point)
        for ds, table in self.memory():
            yield _Atom(table.path, 0, self.stamp(ds), table)
        for ds, link in self.network():
            yield _Atom(link.path, 0, self.stamp(ds), link)
        for ds, rows in self.overhead():
            for (tp, nbytes), stamp in zip(rows.by_tp.items(), self.row_stamps(ds, len(rows.by_tp))):
                yield _Atom(f"{rows.path}#tp{tp}", 0, stamp, OverheadEntry(rows.gpu, {tp: nbytes}, rows.provenance))

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


def _atoms_of(h5: h5py.File, path: Path) -> list[_Atom]:
    """Every entry of an open archive file, checked (see :class:`_Reader`)."""
    reader = _Reader(h5, path)
    try:
        return list(reader.atoms())
    except SailorError:
        raise
    # what the checks did not foresee; h5py raises RuntimeError for damaged group metadata (a bad local heap)
    except (ValueError, KeyError, TypeError, OSError, RuntimeError) as exc:
        raise reader.error(reader.at, f"cannot be read: {exc}") from None


# ---------------------------------------------------------------------- merging: newest wins

@dataclass(frozen=True)
class _Atom:
    """The unit of the merge: one entry (of an overhead table, one TP row) with the stamp of its write."""

    key: str  # the HDF5 path (an overhead row: path#tp<T>)
    rank: int  # 1 for a measured compute point: it beats a failed one whatever their stamps
    stamp: str
    entry: Entry

    def beats(self, other: _Atom) -> bool:
        if (self.rank, self.stamp) != (other.rank, other.stamp):
            return (self.rank, self.stamp) > (other.rank, other.stamp)
        return self._digest() >= other._digest()  # equal stamps: the same write, or two unstamped copies

    @property
    def row(self) -> int:
        """The TP degree of an overhead row (the order of a table's rows)."""
        return min(self.entry.by_tp) if isinstance(self.entry, OverheadEntry) else 0

    def _digest(self) -> str:
        return hashlib.sha256(pickle.dumps(self.entry, protocol=4)).hexdigest()


View = dict[str, _Atom]


def _join(view: View, atoms: Iterable[_Atom]) -> None:
    for atom in atoms:
        held = view.get(atom.key)
        if held is None or atom.beats(held):
            view[atom.key] = atom


def _entries(view: View) -> list[Entry]:
    """The merged entries; an overhead table's rows gathered again (provenance: its newest row's)."""
    out: list[Entry] = []
    tables: dict[str, list[tuple[int, str, OverheadEntry]]] = {}
    for atom in view.values():
        if isinstance(atom.entry, OverheadEntry):
            tables.setdefault(atom.entry.gpu, []).append((atom.row, atom.stamp, atom.entry))
        else:
            out.append(atom.entry)
    for gpu, rows in tables.items():
        newest = max(rows, key=lambda r: r[1])[2]
        by_tp = {tp: e.by_tp[tp] for tp, _, e in sorted(rows, key=lambda r: r[0])}
        out.append(OverheadEntry(gpu, by_tp, newest.provenance))
    return out


# ---------------------------------------------------------------------- the files of one archive

_HOST = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"
_PART_KINDS = ("shard", "base", "copy")  # copy: the public file's next version, a hard link of a base
_READ_ROUNDS = 50  # listings a read may take while compactions keep folding files it listed


@dataclass(frozen=True)
class ArchiveFiles:
    """What belongs to one archive in its folder (names: see the module doc)."""

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


class _Vanished(Exception):
    """A listed base or shard was deleted before it could be read: a compaction folded it."""


_LOADED: dict[tuple[str, int, int, int, int, int], list[_Atom]] = {}  # name and identity -> atoms (see _load)
_LOADED_MAX = 16


def _identity(path: Path, st: os.stat_result) -> tuple[str, int, int, int, int, int]:
    """The name comes first: an inode number is reused as soon as a file is deleted (a new shard of the
    same size, within the same coarse mtime, would pass for the deleted one), a base's or shard's name never."""
    return (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _remember(path: Path, atoms: Iterable[_Atom]) -> None:
    """Bases and shards never change once renamed in, and their names are never reused, so their atoms can
    be kept by name and identity: a writer reads the archive before its write and again to compact it, and
    a sweep writes point after point; this spares re-reading what it has read (or just written)."""
    with contextlib.suppress(OSError):
        _LOADED[_identity(path, os.stat(path))] = list(atoms)
        while len(_LOADED) > _LOADED_MAX:
            del _LOADED[next(iter(_LOADED))]


def _load(path: Path, shown: Path, *, cached: bool = True) -> list[_Atom]:
    """The atoms of one file (``shown``: the name errors give it; ``cached``: for bases and shards only)."""
    try:
        known = _LOADED.get(_identity(path, os.stat(path))) if cached else None
        if known is not None:
            return known
        h5 = h5py.File(path, "r", locking=False)
    except FileNotFoundError:
        raise _Vanished from None
    except OSError as exc:
        if not path.exists():
            raise _Vanished from None
        raise SailorError(f"cannot read the archive: {exc}", file=shown, fix="is it an HDF5 file?") from None
    try:
        with h5:
            atoms = _atoms_of(h5, shown)
    except SailorError:
        if not path.exists():  # deleted while read (NFS: a stale file handle)
            raise _Vanished from None
        raise
    if cached:
        _remember(path, atoms)
    return atoms


@dataclass
class _Read:
    """A merged read of one archive: the view and the bases and shards it took (a compaction may delete
    exactly these, no other)."""

    view: View
    parts: list[Path]


def _read_all(path: Path, shown: Path) -> _Read:
    """Merge the public file, then every base and shard. A file listed but gone when opened was folded into
    a base published before its deletion: list again and read that base too (see the module doc). The
    public file is read first, afresh (people edit it in place) and never skipped: whatever it held before
    a compaction replaced it is in a base that compaction published first, which the listings after show."""
    read = _Read({}, [])
    try:  # held open while reading: its inode cannot be reused, so a part of that inode is this very file
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        fd = -1
    try:
        pinned = None
        if fd >= 0:
            _join(read.view, _load(path, shown, cached=False))
            with contextlib.suppress(OSError):
                if os.path.samestat(os.fstat(fd), os.stat(path)):  # what was read is the inode held open
                    pinned = os.fstat(fd)
        files = archive_files(path)
        for _ in range(_READ_ROUNDS):
            vanished = False
            for f in [p for p in files.parts if p not in read.parts]:
                try:
                    if pinned is None or not os.path.samestat(os.stat(f), pinned):  # else the public file's base
                        _join(read.view, _load(f, f))
                except (_Vanished, FileNotFoundError):
                    vanished = True
                    continue
                read.parts.append(f)
            files = archive_files(path)
            if not vanished and all(b in read.parts for b in files.bases):
                return read
    finally:
        if fd >= 0:
            os.close(fd)
    raise SailorError(f"the archive kept changing while it was read ({_READ_ROUNDS} listings)", file=shown,
                      fix="retry; `sailor-hpc profiles doctor` shows what is in its folder")


def read_archive(*paths: str | os.PathLike[str]) -> ProfileArchive:
    """Read archives in precedence order: an entry of an earlier archive hides the same entry of later ones."""
    archive = ProfileArchive()
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise SailorError("profile archive not found", file=path,
                              fix="check the path, or create it with `sailor-hpc profiles import-sailor` / `profile`")
        for entry in _entries(_read_all(Path(os.path.realpath(path)), path).view):
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


# ---------------------------------------------------------------------- writing

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
    ds.attrs["provenance"] = json.dumps(entry.provenance, sort_keys=True)
    ds.attrs["written"] = np.array(stamp, dtype=h5py.string_dtype()) if isinstance(stamp, list) else stamp


def _write_view(h5: h5py.File, view: View) -> None:
    h5.attrs["format"] = ARCHIVE_FORMAT
    h5.attrs["version"] = ARCHIVE_VERSION
    tables: dict[str, list[_Atom]] = {}
    for atom in view.values():
        if isinstance(atom.entry, OverheadEntry):
            tables.setdefault(atom.entry.path, []).append(atom)
        else:
            _write_entry(h5, atom.entry, atom.stamp)
    for table in _entries({a.key: a for rows in tables.values() for a in rows}):
        rows = sorted(tables[table.path], key=lambda a: a.row)  # the dataset's row order
        _write_entry(h5, table, [a.stamp for a in rows])


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


def _check_public(path: Path) -> None:
    """A writer never adds to a file that is not an archive (a user's notes at the --archive path)."""
    if not path.exists():
        return
    try:
        with h5py.File(path, "r", locking=False) as h5:
            fmt = h5.attrs.get("format")
    except OSError as exc:
        raise SailorError(f"refusing to overwrite a file that is not a sailor-hpc archive ({exc})",
                          file=path, fix="choose another --archive path") from None
    if fmt != ARCHIVE_FORMAT:
        raise SailorError("refusing to overwrite a file that is not a sailor-hpc archive", file=path,
                          fix="choose another --archive path")


_last_ns = 0


def _write_id() -> str:
    """Names a write: the writer's clock first (the merge's order: a later write wins, as it did when
    writers took turns), strictly increasing within a process, then PID, a nonce and the host."""
    global _last_ns
    _last_ns = max(time.time_ns(), _last_ns + 1)
    return f"{_last_ns:020d}.{os.getpid()}.{uuid.uuid4().hex[:12]}.{_HOST}"


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _publish(path: Path, kind: str, view: View, *, check: bool = False) -> Path:
    """Write ``view`` whole under a temporary name, then rename it in as a ``kind`` file (shard or base) of
    the archive at ``path``: readers see it complete or not at all. ``check``: read it back first under the
    readers' rules, so an entry readers would refuse is refused here, before anyone can see it."""
    wid = _write_id()
    final = path.with_name(f".{path.name}.{kind}.{wid}.h5")
    tmp = final.with_suffix(".tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        Sharing.of(path).apply(fd)
        with h5py.File(tmp, "w", locking=False) as h5:
            _write_view(h5, view)
            if check:
                try:
                    _atoms_of(h5, path)
                except SailorError as exc:
                    raise SailorError(f"refusing to write an entry readers would refuse: {exc.message}", file=path,
                                      field=exc.field, fix="nothing was written; correct the entry") from None
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, final)
    finally:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    _remember(final, view.values())
    return final


def _point_public_at(path: Path, base: Path) -> None:
    """Make the public file the base just published: a hard link renamed over it (a copy where the
    filesystem has no hard links). What it held before is in that base, or in another published one."""
    tmp = path.with_name(f".{path.name}.copy.{_write_id()}.tmp")
    try:
        try:
            os.link(base, tmp)
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV, errno.ENOSYS):
                raise
            shutil.copy2(base, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def compact(path: str | os.PathLike[str]) -> int:
    """Fold every base and shard of the archive at ``path`` into one new base and the public file; returns
    how many files it folded (and deleted). Safe to run at any time, by anyone, concurrently (module doc)."""
    real = Path(os.path.realpath(path))
    read = _read_all(real, real)
    if not read.parts:
        return 0  # the public file alone (an archive of a version before shards): nothing to fold
    public = os.stat(real) if real.exists() else None
    if len(read.parts) == 1 and ".base." in read.parts[0].name and public is not None \
            and os.path.samestat(public, os.stat(read.parts[0])):
        return 0  # already one base, and the public file is it
    base = _publish(real, "base", read.view)
    _point_public_at(real, base)
    for part in read.parts:  # only what we read, and only now that a base holding it is published
        if part != base:
            part.unlink(missing_ok=True)
    _fsync_dir(real.parent)
    return len(read.parts)


_COMPACT_WAIT_S = 1.0  # how long a writer waits for another's compaction before leaving its shard to the next
_COMPACT_STALE_S = 2.0  # a compaction takes well under this; a holder silent this long is taken over (harmless)
LITTER_AGE_S = 3600.0  # a temporary file of another host's writer this much older than a new file is litter


def write_entries(path: str | os.PathLike[str], entries: Iterable[Entry], *, lock_timeout_s: float = _COMPACT_WAIT_S
                  ) -> int:
    """Add entries to the archive at ``path`` (created if missing); returns how many were written (a failed
    compute point is not written over a measured one).

    The entries are safe once this returns: they are in a shard of their own (module doc). Then, if the
    archive's lock comes within ``lock_timeout_s``, the shards are folded into the public file; else a later
    writer folds them (readers merge them meanwhile). A SIGTERM meanwhile cleans up before the process dies.
    """
    entries = list(entries)
    real = Path(os.path.realpath(path))  # through a symlink: the shared file itself, not the link
    for entry in entries:
        _check_names(entry)
        if isinstance(entry, OverheadEntry) and not entry.by_tp:  # no row would carry it into the archive
            raise SailorError("refusing to write an entry readers would refuse: an overhead table without rows",
                              file=real, field=entry.path, fix="nothing was written; correct the entry")
    real.parent.mkdir(parents=True, exist_ok=True)
    with cleanup_on_sigterm():
        _check_public(real)
        current = _read_all(real, real).view  # a broken archive is reported, not added to
        shard = View()
        written = 0
        for i, entry in enumerate(entries):
            held = current.get(entry.path)
            if isinstance(entry, ComputeEntry) and entry.status != "ok" and held is not None and held.rank:
                continue  # a failed point never hides a measured one (a lost job, another partition's OOM)
            _join(shard, _atoms(entry, f"{i:06d}"))
            written += 1
        new = _publish(real, "shard", _stamped(shard), check=True) if shard else None
        try:
            with file_lock(real, timeout_s=lock_timeout_s, stale_s=_COMPACT_STALE_S):
                if new is None or new.exists():  # else another writer's compaction has folded it already
                    compact(real)
        except LockTimeout:
            pass  # another writer is compacting; our shard is safe and waits for the next compaction
        if not real.exists():
            _point_public_at(real, _publish(real, "base", View()))  # the empty archive readers can open
        # judged against a file written just now: our shard, else (folded meanwhile) the public file
        remove_litter(real, new if new is not None and new.exists() else real)
    return written


def _atoms(entry: Entry, seq: str) -> list[_Atom]:
    """An entry as merge atoms, stamped with its place in the write (the write's id is added by _stamped)."""
    if isinstance(entry, OverheadEntry):
        return [_Atom(f"{entry.path}#tp{tp}", 0, seq, OverheadEntry(entry.gpu, {int(tp): float(b)}, entry.provenance))
                for tp, b in entry.by_tp.items()]
    return [_Atom(entry.path, int(isinstance(entry, ComputeEntry) and entry.status == "ok"), seq, entry)]


def _stamped(view: View) -> View:
    """The write's id before each atom's place: stamps order writes first, entries within a write second."""
    wid = _write_id()
    return {k: _Atom(a.key, a.rank, f"{wid[:20]}.{a.stamp}.{wid[21:]}", a.entry) for k, a in view.items()}


# ---------------------------------------------------------------------- litter

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
        if m and m[2] == _HOST:
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
