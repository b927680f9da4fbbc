"""The shard store: how concurrent writers and readers share one archive.

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
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import h5py

from sailor_hpc.core.archive.entries import ComputeEntry, Entry, MemoryEntry, NetworkEntry, OverheadEntry
from sailor_hpc.core.archive.files import HOST, archive_files
from sailor_hpc.core.archive.hdf5_format import ARCHIVE_FORMAT, read_atoms, write_view
from sailor_hpc.core.archive.litter import remove_litter
from sailor_hpc.core.archive.merge import Atom, View, entry_atoms, join
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.locking import LockTimeout, Sharing, cleanup_on_sigterm, file_lock

_READ_ROUNDS = 50  # listings a read may take while compactions keep folding files it listed


class _Vanished(Exception):
    """A listed base or shard was deleted before it could be read: a compaction folded it."""


_LOADED: dict[tuple[str, int, int, int, int, int], list[Atom]] = {}  # name and identity -> atoms (see _load)
_LOADED_MAX = 16


def _identity(path: Path, st: os.stat_result) -> tuple[str, int, int, int, int, int]:
    """The name comes first: an inode number is reused as soon as a file is deleted (a new shard of the
    same size, within the same coarse mtime, would pass for the deleted one), a base's or shard's name never."""
    return (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _remember(path: Path, atoms: Iterable[Atom]) -> None:
    """Bases and shards never change once renamed in, and their names are never reused, so their atoms can
    be kept by name and identity: a writer reads the archive before its write and again to compact it, and
    a sweep writes point after point; this spares re-reading what it has read (or just written)."""
    with contextlib.suppress(OSError):
        _LOADED[_identity(path, os.stat(path))] = list(atoms)
        while len(_LOADED) > _LOADED_MAX:
            del _LOADED[next(iter(_LOADED))]


def _load(path: Path, shown: Path, *, cached: bool = True) -> list[Atom]:
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
            atoms = read_atoms(h5, shown)
    except SailorError:
        if not path.exists():  # deleted while read (NFS: a stale file handle)
            raise _Vanished from None
        raise
    if cached:
        _remember(path, atoms)
    return atoms


@dataclass
class MergedRead:
    """A merged read of one archive: the view and the bases and shards it took (a compaction may delete
    exactly these, no other)."""

    view: View
    parts: list[Path]


def read_merged(path: Path, shown: Path) -> MergedRead:
    """Merge the public file, then every base and shard. A file listed but gone when opened was folded into
    a base published before its deletion: list again and read that base too (see the module doc). The
    public file is read first, afresh (people edit it in place) and never skipped: whatever it held before
    a compaction replaced it is in a base that compaction published first, which the listings after show."""
    read = MergedRead({}, [])
    try:  # held open while reading: its inode cannot be reused, so a part of that inode is this very file
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        fd = -1
    try:
        pinned = None
        if fd >= 0:
            join(read.view, _load(path, shown, cached=False))
            with contextlib.suppress(OSError):
                if os.path.samestat(os.fstat(fd), os.stat(path)):  # what was read is the inode held open
                    pinned = os.fstat(fd)
        files = archive_files(path)
        for _ in range(_READ_ROUNDS):
            vanished = False
            for f in [p for p in files.parts if p not in read.parts]:
                try:
                    if pinned is None or not os.path.samestat(os.stat(f), pinned):  # else the public file's base
                        join(read.view, _load(f, f))
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
    return f"{_last_ns:020d}.{os.getpid()}.{uuid.uuid4().hex[:12]}.{HOST}"


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish(path: Path, kind: str, view: View, *, check: bool = False) -> Path:
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
            write_view(h5, view)
            if check:
                try:
                    read_atoms(h5, path)
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
    read = read_merged(real, real)
    if not read.parts:
        return 0  # the public file alone (an archive of a version before shards): nothing to fold
    public = os.stat(real) if real.exists() else None
    if len(read.parts) == 1 and ".base." in read.parts[0].name and public is not None \
            and os.path.samestat(public, os.stat(read.parts[0])):
        return 0  # already one base, and the public file is it
    base = publish(real, "base", read.view)
    _point_public_at(real, base)
    for part in read.parts:  # only what we read, and only now that a base holding it is published
        if part != base:
            part.unlink(missing_ok=True)
    _fsync_dir(real.parent)
    return len(read.parts)


_COMPACT_WAIT_S = 1.0  # how long a writer waits for another's compaction before leaving its shard to the next
_COMPACT_STALE_S = 2.0  # a compaction takes well under this; a holder silent this long is taken over (harmless)


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
        current = read_merged(real, real).view  # a broken archive is reported, not added to
        shard = View()
        written = 0
        for i, entry in enumerate(entries):
            held = current.get(entry.path)
            if isinstance(entry, ComputeEntry) and entry.status != "ok" and held is not None and held.rank:
                continue  # a failed point never hides a measured one (a lost job, another partition's OOM)
            join(shard, entry_atoms(entry, f"{i:06d}"))
            written += 1
        new = publish(real, "shard", _stamped(shard), check=True) if shard else None
        try:
            with file_lock(real, timeout_s=lock_timeout_s, stale_s=_COMPACT_STALE_S):
                if new is None or new.exists():  # else another writer's compaction has folded it already
                    compact(real)
        except LockTimeout:
            pass  # another writer is compacting; our shard is safe and waits for the next compaction
        if not real.exists():
            _point_public_at(real, publish(real, "base", View()))  # the empty archive readers can open
        # judged against a file written just now: our shard, else (folded meanwhile) the public file
        remove_litter(real, new if new is not None and new.exists() else real)
    return written


def _stamped(view: View) -> View:
    """The write's id before each atom's place: stamps order writes first, entries within a write second."""
    wid = _write_id()
    return {k: Atom(a.key, a.rank, f"{wid[:20]}.{a.stamp}.{wid[21:]}", a.entry) for k, a in view.items()}
