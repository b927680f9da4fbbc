"""Samples are a pure function of their global index: the token stream, epochs, batches by hand."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("megatron.core")

from megatron_patch.data import EOD, GlobalSamples, build_dataset  # noqa: E402

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
    order = np.random.default_rng([3, 0]).permutation(6)
    for g in range(6):
        i = order[g]
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
