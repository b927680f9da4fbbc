"""Training data: a Megatron indexed token dataset (.bin/.idx) addressed by global sample index.

Every plan must see the same global batches in the same order, so a sample is a pure function of
its global index ``g`` (and the seed), never of the rank that reads it:

- the token stream is the dataset's documents concatenated, each followed by an end-of-document
  token; sample ``i`` is the ``seq_len + 1`` tokens starting at ``i * seq_len`` (inputs and
  shifted labels);
- epoch ``e = g // num_samples`` visits the samples in a permutation seeded by ``(seed, e)``
  (:class:`SampleOrder`, evaluated per index);
- global batch ``k`` of a run is samples ``consumed .. consumed + global_batch - 1``, where
  ``consumed`` is what the checkpoint stores; pipeline ``p`` takes the slice starting at the
  samples of the pipelines before it, micro-batch by micro-batch.

Memory: nothing per rank grows with the dataset. Document starts come from the index's memory-mapped
``sequence_pointers`` (megatron's .bin is the sequences back to back, so a pointer is the start in
bytes), and the permutation is a function of the index rather than an int64 array of every sample
(146 M samples of a 300 G-token corpus at 2048 tokens were 1.2 GB per rank, per cached epoch).

The tokenizer is bytes (token = byte value, end-of-document = 0), so every catalog model's vocabulary
(>= 256) can train on it. ``python -m megatron_patch.data PREFIX [FILES...]`` builds a dataset from
the given text files, or from the text the project ships (Sailor's published data, which never changes).
"""
from __future__ import annotations

import argparse
import bisect
import functools
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.sailor_compat import SAILOR_DATA

EOD = 0
ORDER = "feistel-v1"  # the sample permutation's name, stored in checkpoints (another order would skip samples)
_MASK64 = (1 << 64) - 1


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


def build_dataset(prefix: str | Path, texts: Iterable[str]) -> Path:
    """Write ``prefix.bin`` / ``prefix.idx`` with megatron-core's IndexedDatasetBuilder (one document per text)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(get_bin_path(str(prefix)), dtype=np.uint16)
    n = 0
    for text in texts:
        doc = np.concatenate([encode(text), np.array([EOD], dtype=np.uint16)])
        builder.add_item(torch.from_numpy(doc.astype(np.int32)))
        builder.end_document()
        n += 1
    builder.finalize(get_idx_path(str(prefix)))
    if n == 0:
        raise SailorError("no text to build a dataset from", field="texts")
    return prefix


def shipped_texts() -> list[str]:
    """Sailor's published data shipped with the package (JSON, CSV, README, LICENSE; 1.5 MB), in a fixed
    order: a corpus that never changes with the code (the project's own sources did, and every edit
    changed what the tests and demos trained on)."""
    files = sorted(p for p in SAILOR_DATA.rglob("*") if p.is_file())
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijective, well-mixing map of 64-bit integers."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class SampleOrder:
    """A pseudo-random permutation of ``range(n)`` for ``(seed, epoch)``, evaluated index by index.

    Why not ``rng.permutation(n)``: that is an int64 array of every sample on every rank. This is a
    balanced Feistel network on the smallest even bit width covering ``n`` (a bijection of
    ``[0, 2**bits)``, ``2**bits < 4n``) with cycle walking (images >= n are mapped again), so it is a
    bijection of ``[0, n)`` at O(1) memory and a few microseconds per index.
    """

    ROUNDS = 6

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        if n < 1:
            raise ValueError("a permutation of no samples")
        bits = max(2, (n - 1).bit_length())
        self.n, self.half = n, (bits + bits % 2) // 2
        self.mask = (1 << self.half) - 1
        base = _mix64(_mix64(seed) + 0x9E3779B97F4A7C15 * (epoch + 1))
        self.keys = [_mix64(base + r) for r in range(self.ROUNDS)]

    def _feistel(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix64(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"sample {i} of {self.n}")
        x = self._feistel(i)
        while x >= self.n:
            x = self._feistel(x)
        return x


class GlobalSamples:
    """Samples of ``seq_len + 1`` tokens by global index, from an indexed dataset."""

    def __init__(self, prefix: str | Path, seq_len: int, seed: int = 1234) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path
        prefix = str(prefix)
        for path in (get_bin_path(prefix), get_idx_path(prefix)):
            if not Path(path).is_file():
                raise SailorError("indexed dataset file not found", file=path,
                                  fix="build one: python -m megatron_patch.data PREFIX")
        self.ds = IndexedDataset(prefix)
        self.seq_len = seq_len
        self.seed = seed
        index = self.ds.index
        self._pointers = index.sequence_pointers  # memory-mapped int64, bytes into .bin
        self._itemsize = int(index.dtype_size)
        count = len(self._pointers)
        total = 0 if count == 0 else int(self._pointers[-1]) // self._itemsize + int(index.sequence_lengths[-1])
        if Path(get_bin_path(prefix)).stat().st_size != total * self._itemsize:
            raise SailorError("the .bin file is not the index's sequences back to back", file=get_bin_path(prefix),
                              fix="rebuild it with megatron's IndexedDatasetBuilder (python -m megatron_patch.data)")
        self.total_tokens = total
        self.num_samples = (total - 1) // seq_len
        if self.num_samples < 1:
            raise SailorError(f"dataset has {total} tokens, fewer than one sample of {seq_len + 1}",
                              file=prefix, fix="use more text or a shorter sequence")

    def _start(self, seq: int) -> int:
        """First token of sequence ``seq`` in the stream (``len`` sequences: the stream's end)."""
        return self.total_tokens if seq == len(self._pointers) else int(self._pointers[seq]) // self._itemsize

    def _tokens(self, start: int, length: int) -> np.ndarray:
        out = []
        # bisect, not np.searchsorted: the mapped pointers are unaligned (after int32 lengths), and numpy
        # would copy all of them to an aligned buffer on every call
        doc = bisect.bisect_right(self._pointers, start * self._itemsize) - 1
        while length > 0:
            offset = start - self._start(doc)
            take = min(length, self._start(doc + 1) - start)
            out.append(self.ds.get(doc, offset=offset, length=take))
            start, length, doc = start + take, length - take, doc + 1
        return np.concatenate(out).astype(np.int64)

    @functools.lru_cache(maxsize=4)  # noqa: B019  (a dataset lives as long as the run)
    def _order(self, epoch: int) -> SampleOrder:
        return SampleOrder(self.num_samples, self.seed, epoch)

    def sample(self, g: int) -> np.ndarray:
        epoch, i = divmod(g, self.num_samples)
        j = self._order(epoch)(i)
        return self._tokens(j * self.seq_len, self.seq_len + 1)

    def batch(self, start: int, count: int) -> torch.Tensor:
        """Samples ``start .. start + count - 1`` as a [count, seq_len + 1] int64 tensor."""
        return torch.from_numpy(np.stack([self.sample(g) for g in range(start, start + count)]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_patch.data", description=__doc__.split("\n")[0])
    ap.add_argument("prefix", help="output prefix (writes PREFIX.bin and PREFIX.idx)")
    ap.add_argument("files", nargs="*", help="text files (default: the Sailor data the package ships)")
    args = ap.parse_args(argv)
    texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in args.files] or shipped_texts()
    build_dataset(args.prefix, texts)
    ds = GlobalSamples(args.prefix, seq_len=32)
    print(f"wrote {args.prefix}.bin/.idx: {len(texts)} documents, {ds.total_tokens} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
