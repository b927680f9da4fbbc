"""The shared profile archive under stress, with the locks of a filesystem that grants them per node.

Every writer process runs with ``fcntl.lockf`` shimmed to always grant (NFS ``nolock``, Lustre ``localflock``
and BeeGFS give writers on different nodes exactly that), so nothing below rests on locking:

* ``writers``: W processes write E entries each (one entry per write, as a profiling sweep does) while R
  reader processes read the archive in a loop. lost: acknowledged entries (write_entries returned) missing at
  the end; corrupt: reads of the public file with plain h5py that fail (tools that open it directly);
  reader errors: read_archive calls that raised.
* ``SIGKILL`` / ``SIGTERM``: a writer killed at a random moment mid-write, K times each. corrupt: the public
  file unreadable afterwards; lost: acknowledged entries missing; litter: temporary files left after the
  next write (SIGKILL) or right away (SIGTERM: its handler cleans up before the process dies).
* ``takeover``: on a filesystem that refuses POSIX locks, a compaction holder killed while holding the
  lock-file fallback: seconds until the next writer takes the lock over (the waiter watches the file
  unchanged for the stale age on its own clock; no clocks compared).

Run: ``python benchmarks/archive_stress.py [--writers 4] [--entries 8] [--readers 1] [--kills 3]``: about
15 s on a shared 2-core machine (8 writers x 20 entries with 2 readers: about 4 min there, every writer
compacting at once since every one gets the lock). Every column but the time must be zero (exit 1 else).
"""
from __future__ import annotations

import argparse
import errno
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sailor_hpc.core import locking  # noqa: E402
from sailor_hpc.core.archive import (  # noqa: E402
    ComputeEntry,
    archive_files,
    make_provenance,
    read_archive,
    write_entries,
)
from sailor_hpc.core.errors import SailorError  # noqa: E402


@dataclass
class Row:
    trial: str
    runs: int
    acked: int
    lost: int = 0
    corrupt: int = 0
    reader_errors: int = 0
    litter: int = 0
    takeover_s: float | None = None


def _node_local() -> None:
    locking._lockf_with_timeout = lambda *_a: None  # granted to everyone: a node-local lock across nodes


def _entry(gpu: str, i: int) -> ComputeEntry:
    return ComputeEntry("tiny-gpt", gpu, i, 1, np.full((6, 3), float(i)), make_provenance("stress"))


def _writer(path: str, gpu: str, first: int, count: int, acks: str) -> None:
    _node_local()
    with open(acks, "a") as log:
        for i in range(first, first + count):
            write_entries(path, [_entry(gpu, i)])
            log.write(f"{gpu} {i}\n")
            log.flush()
            os.fsync(log.fileno())


def _reader(path: str, stop: mp.synchronize.Event, out: mp.Queue) -> None:
    reads = errors = corrupt = 0
    while not stop.is_set():
        if not os.path.exists(path):
            continue
        try:
            read_archive(path)
            reads += 1
        except SailorError:
            errors += 1
        try:
            with h5py.File(path, "r", locking=False) as h5:
                h5.attrs["format"]
        except (OSError, KeyError):
            corrupt += 1
    out.put((reads, errors, corrupt))


def _acked(acks: Path) -> set[tuple[str, int]]:
    if not acks.exists():
        return set()
    return {(g, int(i)) for g, i in (line.split() for line in acks.read_text().splitlines() if line.strip())}


def _present(path: Path) -> set[tuple[str, int]]:
    archive = read_archive(path)
    return {(g, mbs) for (_, g, _), points in archive.compute.items() for mbs, _ in points}


def _public_ok(path: Path) -> bool:
    try:
        with h5py.File(path, "r", locking=False) as h5:
            return h5.attrs["format"] == "sailor-hpc-profiles"
    except (OSError, KeyError):
        return False


def writers_trial(folder: Path, writers: int, entries: int, readers: int) -> Row:
    path, acks = folder / "w.h5", folder / "w.acks"
    ctx = mp.get_context("fork")
    stop, out = ctx.Event(), ctx.Queue()
    reading = [ctx.Process(target=_reader, args=(str(path), stop, out), daemon=True) for _ in range(readers)]
    writing = [ctx.Process(target=_writer, args=(str(path), f"G{w}", 1, entries, str(acks)), daemon=True)
               for w in range(writers)]
    for p in reading + writing:
        p.start()
    for p in writing:
        p.join(600)
    stop.set()
    results = [out.get(timeout=60) for _ in reading]
    for p in reading:
        p.join(60)
    acked = _acked(acks)
    return Row("writers", writers, len(acked), lost=len(acked - _present(path)),
               corrupt=sum(r[2] for r in results) + (not _public_ok(path)),
               reader_errors=sum(r[1] for r in results) + sum(p.exitcode != 0 for p in writing))


def kill_trial(folder: Path, sig: signal.Signals, kills: int) -> Row:
    path, acks = folder / f"{sig.name}.h5", folder / f"{sig.name}.acks"
    _node_local()
    write_entries(path, [_entry("seed", 1)])
    row = Row(sig.name, kills, 0)
    ctx = mp.get_context("fork")
    for k in range(kills):
        p = ctx.Process(target=_writer, args=(str(path), "K", 1000 * (k + 1), 500, str(acks)), daemon=True)
        p.start()
        deadline = time.monotonic() + 30
        while len([a for a in _acked(acks) if a[1] >= 1000 * (k + 1)]) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(random.uniform(0.0, 0.1))
        os.kill(p.pid, sig)
        p.join(30)
        row.corrupt += not _public_ok(path) or p.exitcode != -sig
        if sig == signal.SIGTERM:  # cleaned up by its own handler, before any next write
            row.litter += len([t for t in archive_files(path).temps if f".{p.pid}." in t.name])
        write_entries(path, [_entry("next", k + 1)])
        if sig == signal.SIGKILL:
            row.litter += len(archive_files(path).temps)
    acked = _acked(acks)
    row.acked, row.lost = len(acked), len(acked - _present(path))
    return row


def _refuse_posix_locks(*_a: object) -> None:
    raise OSError(errno.ENOLCK, "No locks available")


def _die_holding(path: str, held: mp.synchronize.Event) -> None:
    locking._lockf_with_timeout = _refuse_posix_locks
    with locking.file_lock(path, timeout_s=10, stale_s=2.0):
        held.set()
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)  # dies holding it: no release, no more heartbeats


def takeover_trial(folder: Path, runs: int = 2) -> Row:
    """Seconds from a killed holder's death to the next writer holding the lock (stale age 2 s: the
    archive's compaction lock, whose loss costs duplicate work, never an entry)."""
    path = folder / "t.h5"
    ctx = mp.get_context("fork")
    times, corrupt = [], 0
    for _ in range(runs):
        held = ctx.Event()
        p = ctx.Process(target=_die_holding, args=(str(path), held), daemon=True)
        p.start()
        held.wait(30)
        p.join(30)
        t0 = time.monotonic()
        saved = locking._lockf_with_timeout
        locking._lockf_with_timeout = _refuse_posix_locks
        try:
            with locking.file_lock(path, timeout_s=30, stale_s=2.0):
                times.append(time.monotonic() - t0)
        except SailorError:
            corrupt += 1
        finally:
            locking._lockf_with_timeout = saved
    return Row("takeover", runs, 0, corrupt=corrupt, takeover_s=max(times) if times else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--entries", type=int, default=8)
    ap.add_argument("--readers", type=int, default=1)
    ap.add_argument("--kills", type=int, default=3)
    args = ap.parse_args()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="archive-stress-") as tmp:
        folder = Path(tmp)
        rows = [writers_trial(folder, args.writers, args.entries, args.readers),
                kill_trial(folder, signal.SIGKILL, args.kills), kill_trial(folder, signal.SIGTERM, args.kills),
                takeover_trial(folder)]
    head = ("trial", "runs", "acked", "lost", "corrupt", "reader errors", "litter", "takeover s")
    print(f"archive stress, node-local locks (lockf granted to all): {args.writers} writers x {args.entries} "
          f"entries, {args.readers} readers, {args.kills} kills per signal; {time.monotonic() - t0:.0f} s")
    print("  ".join(f"{h:>13}" for h in head))
    for r in rows:
        cells = (r.trial, r.runs, r.acked, r.lost, r.corrupt, r.reader_errors, r.litter,
                 "-" if r.takeover_s is None else f"{r.takeover_s:.2f}")
        print("  ".join(f"{c!s:>13}" for c in cells))
    bad = sum(r.lost + r.corrupt + r.reader_errors + r.litter for r in rows)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
