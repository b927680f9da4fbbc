"""Cost of the training data's new parts: the vocabulary check, the blend's index arithmetic, a batch.

- ``check_vocab``: one chunked ``max`` over the memory-mapped ``.bin`` that rank 0 runs before the first
  step; its speed in tokens/s says what it costs on a real corpus (a cold page cache reads from disk);
- ``BlendedSamples.locate``: where blended sample ``g`` comes from (exact fractions, per index);
- a global batch of ``--gbs`` samples of ``--seq-len`` tokens from a 3-way blend, as a first or last
  stage reads it each step.

    .venv/bin/python benchmarks/data_pipeline.py [--tokens 100_000_000] [--gbs 256] [--seq-len 2048]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from fractions import Fraction
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_corpus(prefix: Path, tokens: int, doc_len: int = 4096) -> None:
    """A random uint16 corpus of ``tokens`` ids < 50000 in documents of ``doc_len`` (megatron's builder)."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(get_bin_path(str(prefix)), dtype=np.uint16)
    for start in range(0, tokens, doc_len):
        builder.add_item(torch.from_numpy(rng.integers(0, 50000, min(doc_len, tokens - start), dtype=np.int32)))
        builder.end_document()
    builder.finalize(get_idx_path(str(prefix)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=100_000_000)
    ap.add_argument("--gbs", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=2048)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    from megatron_patch.data import BlendedSamples, GlobalSamples, check_vocab

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "corpus"
        write_corpus(prefix, args.tokens)
        check_vocab(prefix, 50304)  # warm the page cache: the figure is the scan, not the disk
        t0 = time.perf_counter()
        check_vocab(prefix, 50304)
        dt = time.perf_counter() - t0
        rows.append(("check_vocab (page cache warm)", f"{args.tokens / 1e6:.0f} M tokens", f"{dt:.3f} s",
                     f"{args.tokens / dt / 1e9:.2f} G tokens/s"))
        parts = [GlobalSamples(prefix, args.seq_len, seed=s) for s in (1, 2, 3)]
        blend = BlendedSamples(parts, [Fraction(5, 10), Fraction(3, 10), Fraction(2, 10)])
        n = 100_000
        start = 10**12  # deep into a long run: big integers cost the same
        t0 = time.perf_counter()
        for g in range(start, start + n):
            blend.locate(g)
        dt = time.perf_counter() - t0
        rows.append(("BlendedSamples.locate (3 datasets)", f"{n} indices", f"{dt:.3f} s", f"{dt / n * 1e6:.2f} us/index"))
        blend.batch(0, args.gbs)
        t0 = time.perf_counter()
        blend.batch(args.gbs, args.gbs)
        dt = time.perf_counter() - t0
        rows.append((f"global batch {args.gbs} x {args.seq_len + 1} tokens (blend)", f"{args.gbs} samples",
                     f"{dt:.3f} s", f"{args.gbs * (args.seq_len + 1) / dt / 1e6:.1f} M tokens/s"))
    width = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, width)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
