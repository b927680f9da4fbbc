"""The HDF5 profile archive: Sailor import fidelity, concurrency, permissions, precedence, errors."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import stat
from pathlib import Path

import h5py
import numpy as np
import pytest

from sailor_hpc.archive import (EMBEDDED_ARCHIVE, ComputeEntry, NetworkEntry, OverheadEntry, make_provenance,
                                open_archive, read_archive, write_entries)
from sailor_hpc.errors import SailorError
from sailor_hpc.models import get_model
from sailor_hpc.network import NetworkFit
from sailor_hpc.sailor_import import import_sailor, sailor_entries
from tests.spine.conftest import sailor_data


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("arch") / "sailor.h5"
    import_sailor(sailor_data(), path)
    return path


def test_imported_archive_equals_sailors_numbers(imported: Path) -> None:
    archive = read_archive(imported)
    compute = json.loads((sailor_data() / "profiles" / "compute_profiles.json").read_text())
    memory = json.loads((sailor_data() / "profiles" / "memory_profiles.json").read_text())
    checked = 0
    # Sailor's LLAMA-3-8 is another network than the catalog's Llama-3-8B (independent numbers: its block
    # has 268,496,896 parameters, Llama-3-8B's 4096 hidden, 8 KV heads of 128, 14336 FFN give 218,112,000)
    assert memory["LLAMA-3-8"]["1"]["1"]["params_floats"] == 268_496_896
    assert get_model("Llama-3-8B").block_params() == 4096 * (4096 + 2 * 8 * 128) + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    assert "Llama-3-8B" not in archive.models()
    for sailor_model, gpus in compute.items():
        if sailor_model == "LLAMA-3-8":
            continue
        model = get_model(sailor_model).name
        for gpu, by_mbs in gpus.items():
            points = archive.compute_points(model, gpu)
            assert {(int(b), int(t)) for b in by_mbs for t in by_mbs[b]} == set(points)
            for b, by_tp in by_mbs.items():
                for t, layers in by_tp.items():
                    times = points[(int(b), int(t))].times
                    assert times.shape == (len(layers), 3)
                    for layer, values in layers.items():
                        assert list(times[int(layer)]) == values  # bit-exact
                        checked += 3
    for sailor_model, by_tp in memory.items():
        if sailor_model == "LLAMA-3-8":
            continue
        model = get_model(sailor_model).name
        for t, layers in by_tp.items():
            table = archive.memory_table(model, int(t)).table
            for layer, v in layers.items():
                row = table[int(layer)]
                assert list(row) == [v["params_floats"], v["act_output_floats"], v["act_input_floats"], v["act_mem_bytes"]]
                checked += 4
    assert checked > 19_000
    prov = archive.compute_points("OPT-350M", "GH-96")[(1, 4)].provenance
    assert {"user", "host", "time", "source"} <= set(prov) and "Sailor" in prov["source"]


def test_network_entries_match_sailors_fits(imported: Path) -> None:
    archive = read_archive(imported)
    raw = json.loads((sailor_data() / "network" / "network_coeffs_all_homo.json").read_text())
    entries = {(e.kind, e.a, e.senders): e.fit for e in archive.network["sailor"]}
    for kind, by_gpu in raw.items():
        for gpu, by_k in by_gpu.items():
            for k, ((a, b, c), max_bps) in by_k.items():
                fit = entries[(kind, gpu, int(k))]
                assert fit.coeffs == (a, b, c) and fit.max_gbps == pytest.approx(max_bps / 1e9, rel=1e-12)


def test_shipped_embedded_archive_is_a_fresh_import(imported: Path) -> None:
    shipped, fresh = read_archive(EMBEDDED_ARCHIVE), read_archive(imported)
    assert set(shipped.compute) == set(fresh.compute) and set(shipped.memory) == set(fresh.memory)
    for key, points in fresh.compute.items():
        for point, entry in points.items():
            np.testing.assert_array_equal(shipped.compute[key][point].times, entry.times)
    for model, tables in fresh.memory.items():
        for tp, entry in tables.items():
            np.testing.assert_array_equal(shipped.memory[model][tp].table, entry.table)
    assert {g: e.by_tp for g, e in shipped.overhead.items()} == {g: e.by_tp for g, e in fresh.overhead.items()}


def _writer(path: str, worker: int, n: int) -> None:
    for i in range(n):
        times = np.full((6, 3), worker * 1000 + i, dtype=np.float64)
        write_entries(path, [ComputeEntry("tiny-gpt", f"GPU{worker}", i + 1, 1, times,
                                          make_provenance("test", worker=worker))])


def _reader(path: str, stop: "mp.synchronize.Event", seen: "mp.Queue") -> None:
    reads = 0
    while not stop.is_set():
        if os.path.exists(path):
            archive = read_archive(path)  # must never fail on a half-written file
            reads += 1 if archive.models() else 0
    seen.put(reads)


def test_eight_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "shared.h5")
    ctx = mp.get_context("spawn")
    stop, seen = ctx.Event(), ctx.Queue()
    reader = ctx.Process(target=_reader, args=(path, stop, seen))
    reader.start()
    writers = [ctx.Process(target=_writer, args=(path, w, 4)) for w in range(8)]
    for p in writers:
        p.start()
    for p in writers:
        p.join(120)
        assert p.exitcode == 0
    stop.set()
    reader.join(60)
    assert reader.exitcode == 0 and seen.get(timeout=10) > 0
    archive = read_archive(path)
    for w in range(8):
        points = archive.compute_points("tiny-gpt", f"GPU{w}")
        assert sorted(points) == [(i + 1, 1) for i in range(4)]
        for i in range(4):
            assert points[(i + 1, 1)].times[0, 0] == w * 1000 + i
            assert points[(i + 1, 1)].provenance["worker"] == w
    with h5py.File(path, "r", locking=False) as h5:  # a valid HDF5 file, nothing left over
        assert h5.attrs["format"] == "sailor-hpc-profiles"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_group_permissions_survive_rewrites(tmp_path: Path) -> None:
    path = tmp_path / "shared.h5"
    write_entries(path, [OverheadEntry("X", {1: 1e9}, make_provenance("test"))])
    os.chmod(path, 0o664)
    write_entries(path, [OverheadEntry("Y", {1: 2e9}, make_provenance("test"))])
    assert stat.S_IMODE(path.stat().st_mode) == 0o664
    assert set(read_archive(path).overhead) == {"X", "Y"}


def test_failed_points_are_recorded_not_dropped(tmp_path: Path) -> None:
    path = tmp_path / "a.h5"
    bad = ComputeEntry("tiny-gpt", "V100-16", 8, 1, np.full((6, 3), np.nan), make_provenance("test"),
                       status="failed", reason="CUDA out of memory")
    write_entries(path, [bad])
    archive = read_archive(path)
    assert archive.failed[("tiny-gpt", "V100-16")][(8, 1)].reason == "CUDA out of memory"
    with pytest.raises(SailorError, match="no compute profile"):
        archive.compute_points("tiny-gpt", "V100-16")
    # a later failure of a point another job measured (a lost job, a second partition of the same GPU
    # type) does not erase the measurement; a measurement does replace a failure
    good = ComputeEntry("tiny-gpt", "V100-16", 8, 1, np.ones((6, 3)), make_provenance("test"))
    assert write_entries(path, [good]) == 1
    assert write_entries(path, [bad]) == 0
    kept = read_archive(path).compute_points("tiny-gpt", "V100-16")[(8, 1)]
    assert kept.status == "ok" and kept.times.sum() == 18


def test_earlier_archive_hides_later_one(tmp_path: Path) -> None:
    shared = tmp_path / "site.h5"
    mine = np.ones((26, 3))
    write_entries(shared, [ComputeEntry("OPT-350M", "GH-96", 1, 4, mine, make_provenance("measured"))])
    archive = read_archive(shared, EMBEDDED_ARCHIVE)
    assert archive.compute_points("OPT-350M", "GH-96")[(1, 4)].provenance["source"] == "measured"
    assert (2, 4) in archive.compute_points("OPT-350M", "GH-96")  # the rest still comes from the embedded one
    os.environ["SAILOR_PROFILES"] = str(shared)
    try:
        assert open_archive().sources == (str(shared), str(EMBEDDED_ARCHIVE))
    finally:
        del os.environ["SAILOR_PROFILES"]


def test_network_and_constant_fits_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "n.h5"
    fits = [NetworkEntry("lab", "inter", "a100", "v100", 2, NetworkFit(coeffs=(0.1, 0.2, 3.0), max_gbps=4.0),
                         make_provenance("test")),
            NetworkEntry("lab", "intra", "a100", "a100", 4, NetworkFit(constant_gbps=100.0), make_provenance("test"))]
    write_entries(path, fits)
    back = {e.kind: e.fit for e in read_archive(path).network["lab"]}
    assert back["inter"].coeffs == (0.1, 0.2, 3.0)
    assert back["intra"].bandwidth(1e6) == pytest.approx(100e9)


def test_archive_errors(tmp_path: Path) -> None:
    with pytest.raises(SailorError, match="profile archive not found"):
        read_archive(tmp_path / "missing.h5")
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as h5:
        h5.attrs["format"] = "something-else"
    with pytest.raises(SailorError, match="not a sailor-hpc profile archive"):
        read_archive(other)
    with pytest.raises(SailorError, match="refusing to overwrite"):
        write_entries(other, [OverheadEntry("X", {1: 1.0}, {})])
    junk = tmp_path / "junk.h5"
    junk.write_text("not hdf5")
    with pytest.raises(SailorError, match="cannot read the archive"):
        read_archive(junk)
    archive = read_archive(EMBEDDED_ARCHIVE)
    with pytest.raises(SailorError) as info:
        archive.memory_table("OPT-350M", 16)
    assert "memory/OPT-350M/tp16" == info.value.field and "profile" in info.value.fix
    with pytest.raises(SailorError, match="no fixed memory overhead"):
        archive.overhead_bytes("MI300X", 1)


def test_import_reports_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(SailorError, match="file not found"):
        sailor_entries(tmp_path)


def test_a_name_with_a_slash_is_refused_and_the_archive_stays_readable(tmp_path: Path) -> None:
    path = tmp_path / "shared.h5"
    write_entries(path, [OverheadEntry("RTX", {1: 1e9}, make_provenance("test"))])
    with pytest.raises(SailorError, match="cannot name an archive entry"):
        write_entries(path, [OverheadEntry("A100/40", {1: 1e9}, make_provenance("test"))])
    assert set(read_archive(path).overhead) == {"RTX"}


def test_writing_through_a_symlink_updates_the_shared_file(tmp_path: Path) -> None:
    real = tmp_path / "real" / "arch.h5"
    write_entries(real, [OverheadEntry("A", {1: 1e9}, make_provenance("test"))])
    link = tmp_path / "link.h5"
    link.symlink_to(real)
    write_entries(link, [OverheadEntry("B", {1: 1e9}, make_provenance("test"))])
    assert link.is_symlink() and set(read_archive(real).overhead) == {"A", "B"}
    assert not (tmp_path / "link.h5.lock").exists() and (tmp_path / "real" / "arch.h5.lock").exists()


def test_the_lock_file_is_shared_like_the_archive(tmp_path: Path) -> None:
    path = tmp_path / "shared.h5"
    write_entries(path, [OverheadEntry("A", {1: 1e9}, make_provenance("test"))])
    os.chmod(path, 0o664)
    old = os.umask(0o022)  # the writer's umask would give 0644: other group members could not lock
    try:
        (tmp_path / "shared.h5.lock").unlink()
        write_entries(path, [OverheadEntry("B", {1: 1e9}, make_provenance("test"))])
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "shared.h5.lock").stat().st_mode) == 0o664


def test_a_file_that_is_not_hdf5_is_not_overwritten(tmp_path: Path) -> None:
    notes = tmp_path / "notes.h5"
    notes.write_text("my notes")
    with pytest.raises(SailorError, match="refusing to overwrite"):
        write_entries(notes, [OverheadEntry("A", {1: 1e9}, make_provenance("test"))])
    assert notes.read_text() == "my notes"


def test_overhead_entries_add_their_tp_degrees(tmp_path: Path) -> None:
    """Each profiling job measures one TP degree and writes it itself (a resumed sweep then loses none)."""
    path = tmp_path / "a.h5"
    write_entries(path, [OverheadEntry("X", {1: 1e9}, make_provenance("test"))])
    write_entries(path, [OverheadEntry("X", {2: 2e9}, make_provenance("test"))])
    assert read_archive(path).overhead["X"].by_tp == {1: 1e9, 2: 2e9}
    write_entries(path, [OverheadEntry("X", {1: 3e9}, make_provenance("test"))])  # a new measurement replaces
    assert read_archive(path).overhead["X"].by_tp == {1: 3e9, 2: 2e9}
