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

from sailor_hpc.core.archive import (
    EMBEDDED_ARCHIVE,
    ComputeEntry,
    NetworkEntry,
    OverheadEntry,
    PointSpread,
    ProfileArchive,
    make_provenance,
    open_archive,
    read_archive,
    write_entries,
)
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import get_model
from sailor_hpc.core.network import NetworkFit
from sailor_hpc.core.sailor_compat.profiles import import_sailor, sailor_entries
from tests.data import SAILOR_DATA


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("arch") / "sailor.h5"
    import_sailor(SAILOR_DATA, path)
    return path


def test_imported_archive_equals_sailors_numbers(imported: Path) -> None:
    archive = read_archive(imported)
    compute = json.loads((SAILOR_DATA / "profiles" / "compute_profiles.json").read_text())
    memory = json.loads((SAILOR_DATA / "profiles" / "memory_profiles.json").read_text())
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
    raw = json.loads((SAILOR_DATA / "network" / "network_coeffs_all_homo.json").read_text())
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


def _reader(path: str, stop: mp.synchronize.Event, seen: mp.Queue) -> None:
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
    assert archive.failed[("tiny-gpt", "V100-16", "fp32")][(8, 1)].reason == "CUDA out of memory"
    with pytest.raises(SailorError, match="no compute profile"):
        archive.compute_points("tiny-gpt", "V100-16")
    # a later failure of a point another job measured (a lost job, a second partition of the same GPU
    # type) does not erase the measurement; a measurement does replace a failure
    good = ComputeEntry("tiny-gpt", "V100-16", 8, 1, np.ones((6, 3)), make_provenance("test"))
    assert write_entries(path, [good]) == 1
    assert write_entries(path, [bad]) == 0
    kept = read_archive(path).compute_points("tiny-gpt", "V100-16")[(8, 1)]
    assert kept.status == "ok" and kept.times.sum() == 18


def test_spread_and_flag_round_trip_and_archives_without_them_still_read(tmp_path: Path) -> None:
    path = tmp_path / "a.h5"
    layers = np.linspace(0.0, 0.05, 18).reshape(6, 3)
    spread = PointSpread(layers, (0.012, 0.02), 37)
    write_entries(path, [
        ComputeEntry("tiny-gpt", "G", 1, 1, np.ones((6, 3)), make_provenance("test"), spread=spread),
        ComputeEntry("tiny-gpt", "G", 2, 1, np.ones((6, 3)), make_provenance("test"), spread=spread,
                     flag="not monotonic: forward below mbs 1's"),
        ComputeEntry("tiny-gpt", "G", 4, 1, np.ones((6, 3)), make_provenance("test"))])  # as written before spreads
    points = read_archive(path).compute_points("tiny-gpt", "G")
    back = points[(1, 1)].spread
    assert back is not None and np.array_equal(back.layers, layers) and (back.model, back.repetitions) == ((0.012, 0.02), 37)
    assert points[(1, 1)].flag == "" and points[(2, 1)].flag == "not monotonic: forward below mbs 1's"
    assert points[(4, 1)].spread is None and points[(4, 1)].flag == ""
    with h5py.File(path, "r") as h5:  # nothing new in an entry without them: older readers see what they knew
        # (besides the write's stamp that shards are merged by, which older readers ignore)
        assert set(h5["compute/tiny-gpt/G/mbs4_tp1"].attrs) == {"status", "reason", "dtype", "provenance", "written"}
    # the shipped Sailor profiles, written before spreads existed, still read, without any
    shipped = read_archive(EMBEDDED_ARCHIVE)
    assert all(e.spread is None and not e.flag for pts in shipped.compute.values() for e in pts.values())


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


# ---------------------------------------------------------------------- fixed overhead by TP degree

def test_overhead_of_an_unmeasured_tp_degree_follows_the_documented_rule(tmp_path: Path) -> None:
    """TP 4 with rows for TP 1 and 2 only takes TP 2 (the nearest below); a degree below every row takes
    the smallest; a GPU type's table comes whole from the front archive (measured and estimated degrees
    are not mixed); an empty table is an error, never a crash or 0."""
    path = tmp_path / "front.h5"
    write_entries(path, [OverheadEntry("GH-96", {1: 1.0e9}, make_provenance("test")),
                         OverheadEntry("GH-96", {2: 2.0e9}, make_provenance("test")),  # another job, another TP
                         OverheadEntry("X", {4: 5.0e9, 8: 9.0e9}, make_provenance("test"))])
    archive = read_archive(path, EMBEDDED_ARCHIVE)
    assert archive.overhead["GH-96"].by_tp == {1: 1.0e9, 2: 2.0e9}  # merged per TP within the archive
    assert [archive.overhead_tp("GH-96", t) for t in (1, 2, 4, 8)] == [1, 2, 2, 2]
    assert archive.overhead_bytes("GH-96", 4) == 2.0e9  # not the embedded estimate (4.0e9) for TP 4
    assert archive.overhead_bytes("X", 2) == 5.0e9 and archive.overhead_bytes("X", 16) == 9.0e9
    assert read_archive(EMBEDDED_ARCHIVE).overhead_bytes("GH-96", 4) == 4.0e9
    empty = ProfileArchive()
    empty.add(OverheadEntry("Y", {}, {}))
    with pytest.raises(SailorError, match="no fixed memory overhead recorded for Y"):
        empty.overhead_bytes("Y", 1)


def test_the_simulator_charges_the_overhead_of_the_nearest_measured_tp(tmp_path: Path) -> None:
    from sailor_hpc.core.plan import Pipeline, Plan, Stage
    from sailor_hpc.core.site import load_site
    from simulator import simulate
    from tests.data import SITE_CONFIGS

    front = tmp_path / "front.h5"
    write_entries(front, [OverheadEntry("GH-96", {1: 1.0e9, 2: 2.0e9}, make_provenance("test"))])
    plan = Plan(model="OPT-350M", global_batch_size=4, pipelines=(Pipeline(1, 4, (Stage(0, 25, 4, "GH-96"),)),))
    site = load_site(SITE_CONFIGS / "clariden.toml")
    measured = simulate(plan, site, read_archive(front, EMBEDDED_ARCHIVE)).stage_memory[0]
    estimated = simulate(plan, site, read_archive(EMBEDDED_ARCHIVE)).stage_memory[0]
    assert estimated - measured == pytest.approx(4.0e9 - 2.0e9)


# ---------------------------------------------------------------------- malformed archives

def _broken(tmp_path: Path, name: str, build) -> Path:
    path = tmp_path / f"{name}.h5"
    with h5py.File(path, "w") as h5:
        h5.attrs["format"] = "sailor-hpc-profiles"
        h5.attrs["version"] = 1
        build(h5)
    return path


def _point(h5: h5py.File, data=None, **attrs) -> h5py.Dataset:
    ds = h5.create_dataset("compute/tiny-gpt/G/mbs1_tp1", data=np.ones((6, 3)) if data is None else data)
    ds.attrs.update(attrs)
    return ds


BROKEN = {  # name: (how it is broken, HDF5 path named, words of the message)
    "dataset_for_group": (lambda h5: h5.create_dataset("compute", data=[1, 2]), "compute", "is a dataset"),
    "gpu_is_dataset": (lambda h5: h5.create_dataset("compute/tiny-gpt/G", data=[1.0]), "compute/tiny-gpt/G",
                       "is a dataset"),
    "point_is_group": (lambda h5: h5.create_group("compute/tiny-gpt/G/mbs1_tp1"), "compute/tiny-gpt/G/mbs1_tp1",
                       "is a group"),
    "point_name": (lambda h5: h5.create_dataset("compute/tiny-gpt/G/fast", data=np.ones((6, 3))),
                   "compute/tiny-gpt/G/fast", "mbs<B>_tp<T>"),
    "text_times": (lambda h5: _point(h5, np.array([b"a", b"b"])), "compute/tiny-gpt/G/mbs1_tp1", "not numbers"),
    "flat_times": (lambda h5: _point(h5, np.ones(6)), "compute/tiny-gpt/G/mbs1_tp1", "expected n x 3"),
    "status": (lambda h5: _point(h5, status=3), "compute/tiny-gpt/G/mbs1_tp1", "'status'"),
    "provenance": (lambda h5: _point(h5, provenance="[1]"), "compute/tiny-gpt/G/mbs1_tp1", "JSON object"),
    "spread_shape": (lambda h5: _point(h5, spread=np.ones((5, 3)), model_spread=[0.1, 0.1], repetitions=20),
                     "compute/tiny-gpt/G/mbs1_tp1", "'spread' is not 6 x 3 non-negative numbers"),
    "spread_nan": (lambda h5: _point(h5, spread=np.ones((6, 3)), model_spread=[np.nan, 0.1], repetitions=20),
                   "compute/tiny-gpt/G/mbs1_tp1", "'model_spread' is not 2 non-negative numbers"),
    "spread_reps": (lambda h5: _point(h5, spread=np.ones((6, 3)), model_spread=[0.1, 0.1]),
                    "compute/tiny-gpt/G/mbs1_tp1", "no 'repetitions' attribute"),
    "memory_shape": (lambda h5: h5.create_dataset("memory/tiny-gpt/tp1", data=np.ones((6, 2))),
                     "memory/tiny-gpt/tp1", "expected n x 4"),
    "overhead_empty": (lambda h5: h5.create_dataset("overhead/G", data=np.zeros((0, 2))), "overhead/G",
                       "expected n x 2"),
    "overhead_nan": (lambda h5: h5.create_dataset("overhead/G", data=[[1.0, np.nan]]), "overhead/G",
                     "positive number of bytes"),
    "network_attrs": (lambda h5: h5.create_dataset("network/lab/intra:a:a:2", data=np.ones(3)),
                      "network/lab/intra:a:a:2", "no 'kind' attribute"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_malformed_archive_is_a_sailor_error_naming_file_path_and_fix(tmp_path: Path, name: str) -> None:
    build, hpath, words = BROKEN[name]
    path = _broken(tmp_path, name, build)
    with pytest.raises(SailorError) as info:
        read_archive(path)
    assert info.value.file == str(path) and info.value.field == hpath and words in info.value.message
    assert f"del f[{hpath!r}]" in info.value.fix
    before = path.read_bytes()
    with pytest.raises(SailorError) as info:  # a writer does not copy the broken entry on either
        write_entries(path, [OverheadEntry("A", {1: 1e9}, make_provenance("test"))])
    assert info.value.field == hpath and path.read_bytes() == before


def test_an_entry_readers_would_refuse_is_not_written(tmp_path: Path) -> None:
    path = tmp_path / "a.h5"
    write_entries(path, [OverheadEntry("A", {1: 1e9}, make_provenance("test"))])
    before = path.read_bytes()
    for bad in (OverheadEntry("B", {}, make_provenance("test")), OverheadEntry("B", {1: 0.0}, make_provenance("test")),
                ComputeEntry("tiny-gpt", "B", 1, 1, np.full((6, 3), np.nan), make_provenance("test"))):
        with pytest.raises(SailorError, match="refusing to write") as info:
            write_entries(path, [bad])
        assert info.value.field == bad.path and path.read_bytes() == before
