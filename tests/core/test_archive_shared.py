"""The archive on shared filesystems: node-local locks, killed writers, litter, group permissions.

The node-local-lock test is the one that failed before the shard protocol: with ``lockf`` granted to every
writer (as NFS ``nolock``, Lustre ``localflock`` and BeeGFS grant it to processes on different nodes), the
copy-and-rename writers overwrote each other's copies and lost entries without any error.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import stat
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from sailor_hpc.core.archive import (
    LITTER_AGE_S,
    ComputeEntry,
    OverheadEntry,
    archive_files,
    make_provenance,
    read_archive,
    write_entries,
)

WRITERS, ENTRIES = 6, 8


def _grant_always(*_args: object) -> None:
    """A lock that every process gets at once: what a node-local lock is to processes on different nodes."""


def _shimmed_writer(path: str, worker: int, start: mp.synchronize.Barrier) -> None:
    import sailor_hpc.core.locking as locking

    locking._lockf_with_timeout = _grant_always
    start.wait(60)
    for i in range(ENTRIES):
        times = np.full((6, 3), worker * 1000 + i, dtype=np.float64)
        write_entries(path, [ComputeEntry("tiny-gpt", f"GPU{worker}", i + 1, 1, times,
                                          make_provenance("test", worker=worker))])


def test_node_local_locks_lose_no_entry(tmp_path: Path) -> None:
    """Six writer processes whose lock is always granted, eight entries each, all acknowledged: every one is
    in the archive afterwards. The copy-and-rename protocol this replaced lost 39 of the 48 here (three runs, 39 each time)."""
    path = tmp_path / "shared.h5"
    ctx = mp.get_context("fork")  # each its own process, as on its own node; forked: quicker to start
    start = ctx.Barrier(WRITERS)
    procs = [ctx.Process(target=_shimmed_writer, args=(str(path), w, start)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * WRITERS
    archive = read_archive(path)
    found = {(g, point) for (_, g, _), points in archive.compute.items() for point in points}
    want = {(f"GPU{w}", (i + 1, 1)) for w in range(WRITERS) for i in range(ENTRIES)}
    assert not want - found, f"{len(want - found)} of {len(want)} acknowledged entries lost"


# ---------------------------------------------------------------------- killed writers

def _looping_writer(path: str, acks: str, first: int) -> None:
    """Writes one entry after another, noting each acknowledged one (write_entries returned) durably."""
    with open(acks, "a") as log:
        for i in range(first, first + 500):
            write_entries(path, [ComputeEntry("tiny-gpt", "KILLED", i, 1, np.full((6, 3), float(i)),
                                              make_provenance("test"))])
            log.write(f"{i}\n")
            log.flush()
            os.fsync(log.fileno())


def _kill_mid_write(path: Path, acks: Path, first: int, sig: int) -> int:
    """Start a looping writer, let it acknowledge a few writes, kill it with ``sig`` at a random moment."""
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_looping_writer, args=(str(path), str(acks), first), daemon=True)
    p.start()
    deadline = time.monotonic() + 30
    while (not acks.exists() or len(acks.read_text().split()) < 2 * first // 1000) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(random.uniform(0.0, 0.15))
    os.kill(p.pid, sig)
    p.join(30)
    assert p.exitcode == -sig  # it died of the signal, as before (Slurm sees the same end)
    return p.pid


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_writer_killed_mid_write_loses_nothing_acknowledged(tmp_path: Path, sig: int) -> None:
    """Three trials per signal: after each, the public file is a complete archive (old or new, nothing
    between), every acknowledged entry reads back, and the next write leaves no litter. SIGTERM cleans up
    itself (its handler runs the clean-up, then the process dies of the signal)."""
    path, acks = tmp_path / "shared.h5", tmp_path / "acks"
    write_entries(path, [OverheadEntry("X", {1: 1e9}, make_provenance("test"))])
    for trial in range(3):
        pid = _kill_mid_write(path, acks, 1000 * (trial + 1), sig)
        with h5py.File(path, "r", locking=False) as h5:  # what tools opening the public file see: whole
            assert h5.attrs["format"] == "sailor-hpc-profiles"
        acked = {int(i) for i in acks.read_text().split()}
        points = read_archive(path).compute_points("tiny-gpt", "KILLED")
        assert acked and not acked - {mbs for mbs, _ in points}
        if sig == signal.SIGTERM:
            assert not [t for t in archive_files(path).temps if f".{pid}." in t.name]
            assert not archive_files(path).locks or all(lk.name.endswith(".lock") for lk in archive_files(path).locks)
        write_entries(path, [OverheadEntry("X", {trial + 2: 1e9}, make_provenance("test"))])
        assert archive_files(path).temps == ()
        assert not archive_files(path).shards  # the uncontended write folded everything
    assert read_archive(path).overhead["X"].by_tp == {1: 1e9, 2: 1e9, 3: 1e9, 4: 1e9}


def test_litter_of_other_hosts_goes_only_when_old(tmp_path: Path) -> None:
    """A temporary file of a writer on another host is judged by its age against a file just written in
    the same folder (one server's clock on NFS), never by this host's clock; an old one goes."""
    path = tmp_path / "shared.h5"
    write_entries(path, [OverheadEntry("X", {1: 1e9}, make_provenance("test"))])
    fresh = tmp_path / ".shared.h5.shard.01700000000000000000.4242.abcdef012345.elsewhere.tmp"
    old = tmp_path / ".shared.h5.abcd1234.tmp"  # a copy left by the versions before shards
    for f in (fresh, old):
        f.write_bytes(b"partial")
    ancient = time.time() - 2 * LITTER_AGE_S
    os.utime(old, (ancient, ancient))
    write_entries(path, [OverheadEntry("X", {2: 1e9}, make_provenance("test"))])
    assert fresh.exists() and not old.exists()


# ---------------------------------------------------------------------- group permissions

def test_a_group_shared_folder_keeps_every_file_group_usable_whatever_the_umask(tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o2775)  # setgid, group-writable: a site's shared profile folder
    old = os.umask(0o077)
    try:
        write_entries(folder / "p.h5", [OverheadEntry("X", {1: 1e9}, make_provenance("test"))])
    finally:
        os.umask(old)
    files = archive_files(folder / "p.h5")
    for f in (files.path, *files.bases, *files.locks):
        st = f.stat()
        assert stat.S_IMODE(st.st_mode) & 0o660 == 0o660, f.name
        assert st.st_gid == folder.stat().st_gid


# ---------------------------------------------------------------------- profiles doctor

def test_doctor_finds_and_fixes_what_is_safe(tmp_path: Path) -> None:
    """Unfolded shards, a killed writer's temporary file and a file the group cannot write: exit 1, then
    --fix folds, removes and chmods, and the archive is healthy (exit 0); not an archive: exit 2."""
    from click.testing import CliRunner

    from sailor_hpc.cli.app import main
    from sailor_hpc.core.archive.files import HOST
    from sailor_hpc.core.archive.shards import publish

    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o2775)
    path = folder / "p.h5"
    write_entries(path, [OverheadEntry("X", {1: 1e9}, make_provenance("test"))])
    publish(path, "shard", {}, check=False)  # a shard no compaction has folded yet
    dead = folder / f".p.h5.shard.01700000000000000000.999999.abcdef012345.{HOST}.tmp"
    dead.write_bytes(b"partial")  # PID 999999 is not running
    os.chmod(path, 0o600)
    run = CliRunner().invoke
    found = run(main, ["profiles", "doctor", str(path)])
    assert found.exit_code == 1, found.output
    assert "1 shards" in found.output and dead.name in found.output and "0o600" in found.output
    fixed = run(main, ["profiles", "doctor", str(path), "--fix"])
    assert fixed.exit_code == 0, fixed.output
    assert not dead.exists() and not archive_files(path).shards and stat.S_IMODE(path.stat().st_mode) & 0o660 == 0o660
    assert run(main, ["profiles", "doctor", str(path)]).exit_code == 0
    assert read_archive(path).overhead["X"].by_tp == {1: 1e9}
    notes = folder / "notes.h5"
    notes.write_text("not hdf5")
    assert run(main, ["profiles", "doctor", str(notes)]).exit_code == 2
    assert run(main, ["profiles", "doctor", str(folder / "none.h5")]).exit_code == 2


def test_mount_lock_semantics_are_read_from_the_mount_options(tmp_path: Path) -> None:
    from sailor_hpc.core.locking import mount_locks

    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\n"
                      "srv:/home /shared nfs rw,vers=3,nolock,proto=tcp 0 0\n"
                      "srv:/proj /shared/proj nfs4 rw,vers=4.2 0 0\n"
                      "mgs@tcp:/fs /lus lustre rw,localflock 0 0\n"
                      "beegfs_nodev /bee beegfs rw 0 0\n")
    scopes = {p: mount_locks(Path(p) / "a.h5", mounts).scope for p in ("/shared", "/shared/proj", "/lus", "/bee", "/tmp")}
    assert scopes == {"/shared": "node", "/shared/proj": "cluster", "/lus": "node", "/bee": "node", "/tmp": "cluster"}
