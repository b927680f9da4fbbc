"""Samples are a pure function of their global index: the token stream, epochs, batches by hand."""
from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("megatron.core")

from megatron_patch.data import EOD, GlobalSamples, SampleOrder, build_dataset  # noqa: E402

TEXTS = ["abcdefghij", "KLMNOPQ", "xyz" * 5]


@pytest.fixture(scope="module")
def prefix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_dataset(tmp_path_factory.mktemp("data") / "d", TEXTS)


def stream() -> np.ndarray:
    return np.concatenate([np.frombuffer(t.encode(), dtype=np.uint8).astype(np.int64).tolist() + [EOD]
                           for t in TEXTS])


def test_samples_are_seq_plus_one_tokens_of_the_stream_across_documents(prefix: Path) -> None:
    s = GlobalSamples(prefix, seq_len=5, seed=3)
    full = stream()
    assert s.num_samples == (len(full) - 1) // 5 == 6
    order = SampleOrder(6, 3, 0)
    for g in range(6):
        i = order(g)
        assert s.sample(g).tolist() == full[i * 5:i * 5 + 6].tolist()


def test_epochs_visit_every_sample_in_a_new_order_and_batches_are_slices(prefix: Path) -> None:
    s = GlobalSamples(prefix, seq_len=5, seed=3)
    epoch0 = [tuple(s.sample(g)) for g in range(6)]
    epoch1 = [tuple(s.sample(g)) for g in range(6, 12)]
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1
    batch = s.batch(4, 5)
    assert batch.shape == (5, 6)
    assert [tuple(r) for r in batch.tolist()] == epoch0[4:] + epoch1[:3]
    again = GlobalSamples(prefix, seq_len=5, seed=3)  # another process, another plan: the same samples
    assert again.batch(4, 5).equal(batch)


@pytest.mark.parametrize("n", [*range(1, 70), 1000, 4097, 65536])
def test_sample_order_is_a_permutation_that_depends_on_seed_and_epoch(n: int) -> None:
    orders = {(seed, epoch): [SampleOrder(n, seed, epoch)(i) for i in range(n)] for seed in (1, 2) for epoch in (0, 1)}
    for order in orders.values():
        assert sorted(order) == list(range(n))
    if n >= 8:  # 8! orders: distinct keys give distinct permutations (a chance collision is ~1e-5)
        assert len({tuple(o) for o in orders.values()}) == 4
    if n >= 1000:  # shuffled: neighbours are not neighbours
        assert sum(abs(a - b) == 1 for a, b in zip(orders[1, 0], orders[1, 0][1:])) < n // 100


def test_no_array_per_document_or_sample(tmp_path: Path) -> None:
    """100k documents, ~200k samples: reading samples allocates nothing that grows with either.

    tracemalloc sees numpy's allocations; the index's arrays are memory-mapped views (not counted)."""
    docs = [chr(97 + i % 26) * (1 + i % 13) for i in range(100_000)]
    prefix = build_dataset(tmp_path / "many", docs)
    tracemalloc.start()
    s = GlobalSamples(prefix, seq_len=4, seed=5)
    rows = [s.batch(g, 8) for g in (0, s.num_samples - 4, 3 * s.num_samples + 17)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert s.num_samples > 190_000 and len(docs) == 100_000
    assert all(r.shape == (8, 5) for r in rows)
    print(f"peak traced memory of a GlobalSamples over 100k documents / {s.num_samples} samples: {peak} bytes")
    assert peak < 200_000  # an int64 per document alone would be 800 kB, per sample 1.6 MB


@pytest.mark.parametrize("case", ["missing_file", "folder_as_file", "prefix_under_a_file"])
def test_data_tool_refuses_bad_paths_with_exit_2_and_writes_nothing(tmp_path: Path, case: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_patch.data import main
    good = tmp_path / "good.txt"
    good.write_text("some text")
    prefix, files, named = tmp_path / "out" / "web", [str(good)], ""
    if case == "missing_file":
        files.append(str(tmp_path / "missing.txt"))
        named = str(tmp_path / "missing.txt")
    elif case == "folder_as_file":
        (tmp_path / "folder").mkdir()
        files.append(str(tmp_path / "folder"))
        named = str(tmp_path / "folder")
    else:
        (tmp_path / "blocker").write_text("a file where a folder should be")
        prefix = tmp_path / "blocker" / "web"
        named = str(prefix)
    assert main([str(prefix), *files]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err and "fix:" in err and "Traceback" not in err
    assert not list(tmp_path.rglob("*.bin")) and not list(tmp_path.rglob("*.idx")) and not (tmp_path / "out").exists()
