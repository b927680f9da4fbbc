"""Training data: a Megatron indexed token dataset (.bin/.idx) addressed by global sample index.

Every plan must see the same global batches in the same order, so a sample is a pure function of
its global index ``g`` (and the seed), never of the rank that reads it:

- the token stream is the dataset's documents concatenated, each followed by an end-of-document
  token; sample ``i`` is the ``seq_len + 1`` tokens starting at ``i * seq_len`` (inputs and
  shifted labels);
- epoch ``e = g // num_samples`` visits the samples in a permutation seeded by ``(seed, e)``;
- global batch ``k`` of a run is samples ``consumed .. consumed + global_batch - 1``, where
  ``consumed`` is what the checkpoint stores; pipeline ``p`` takes the slice starting at the
  samples of the pipelines before it, micro-batch by micro-batch.

The tokenizer is bytes (token = byte value, end-of-document = 0), so every catalog model's vocabulary
(>= 256) can train on it. ``python -m megatron_patch.data PREFIX [FILES...]`` builds a dataset from
the given text files, or from the text the project ships (its Python and Markdown sources).
"""
from __future__ import annotations

import argparse
import functools
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

import megatron_patch
import sailor_hpc
from sailor_hpc.core.errors import SailorError

EOD = 0


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
    """The project's own Python and Markdown sources, in a fixed order (deterministic)."""
    files: list[Path] = []
    for pkg in (sailor_hpc, megatron_patch):
        root = Path(pkg.__file__).parent
        files += sorted(p for p in root.rglob("*") if p.suffix in (".py", ".md"))
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


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
        lengths = np.asarray(self.ds.sequence_lengths, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lengths)])
        total = int(self.starts[-1])
        self.num_samples = (total - 1) // seq_len
        if self.num_samples < 1:
            raise SailorError(f"dataset has {total} tokens, fewer than one sample of {seq_len + 1}",
                              file=prefix, fix="use more text or a shorter sequence")

    def _tokens(self, start: int, length: int) -> np.ndarray:
        out = []
        doc = int(np.searchsorted(self.starts, start, side="right")) - 1
        while length > 0:
            offset = start - int(self.starts[doc])
            take = min(length, int(self.starts[doc + 1]) - start)
            out.append(self.ds.get(doc, offset=offset, length=take))
            start, length, doc = start + take, length - take, doc + 1
        return np.concatenate(out).astype(np.int64)

    @functools.lru_cache(maxsize=4)  # noqa: B019  (a dataset lives as long as the run)
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def sample(self, g: int) -> np.ndarray:
        epoch, i = divmod(g, self.num_samples)
        j = int(self._order(epoch)[i])
        return self._tokens(j * self.seq_len, self.seq_len + 1)

    def batch(self, start: int, count: int) -> torch.Tensor:
        """Samples ``start .. start + count - 1`` as a [count, seq_len + 1] int64 tensor."""
        return torch.from_numpy(np.stack([self.sample(g) for g in range(start, start + count)]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_patch.data", description=__doc__.split("\n")[0])
    ap.add_argument("prefix", help="output prefix (writes PREFIX.bin and PREFIX.idx)")
    ap.add_argument("files", nargs="*", help="text files (default: the project's shipped sources)")
    args = ap.parse_args(argv)
    texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in args.files] or shipped_texts()
    build_dataset(args.prefix, texts)
    ds = GlobalSamples(args.prefix, seq_len=32)
    print(f"wrote {args.prefix}.bin/.idx: {len(texts)} documents, {int(ds.starts[-1])} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
