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

A run reads a blend of datasets (:class:`BlendedSamples`: which dataset a global index goes to is
itself a function of the index) cut into train/valid/test by documents (:func:`split_samples`,
Megatron's split rule); before training, :func:`check_vocab` refuses a token id the model has no
embedding row for.

The tokenizer is bytes (token = byte value, end-of-document = 0), so every catalog model's vocabulary
(>= 256) can train on it. ``python -m megatron_patch.data PREFIX [FILES...]`` builds a dataset from
the given text or .jsonl files, or from the text the project ships (Sailor's published data, which
never changes).
"""
from __future__ import annotations

import argparse
import bisect
import functools
import json
import os
import sys
from collections.abc import Iterable
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from megatron_patch.dataset_files import check_dataset_files
from megatron_patch.mcore_import import import_megatron
from megatron_patch.options import OptionParser
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.fields import Fields
from sailor_hpc.core.paths import writable_dir
from sailor_hpc.core.sailor_compat import SAILOR_DATA
from sailor_hpc.core.training import SPLITS, DataBlend, check_dataset_prefix, split_bounds

EOD = 0
ORDER = "feistel-v1"  # the sample permutation's name, stored in checkpoints (another order would skip samples)
_MASK64 = (1 << 64) - 1


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


def build_dataset(prefix: str | Path, texts: Iterable[str]) -> Path:
    """Write ``prefix.bin`` / ``prefix.idx`` with megatron-core's IndexedDatasetBuilder (one document per
    text). Written under temporary names and renamed at the end: a bad document leaves nothing behind."""
    import_megatron()
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path
    prefix = Path(prefix)
    made = [d for d in (prefix.parent, *prefix.parent.parents) if not d.exists()]  # deepest first
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(prefix.with_name(f".{prefix.name}.tmp{os.getpid()}"))
    done = {get_bin_path(tmp): get_bin_path(str(prefix)), get_idx_path(tmp): get_idx_path(str(prefix))}
    ok = False
    try:
        builder = IndexedDatasetBuilder(get_bin_path(tmp), dtype=np.uint16)
        n = 0
        for text in texts:
            doc = np.concatenate([encode(text), np.array([EOD], dtype=np.uint16)])
            builder.add_item(torch.from_numpy(doc.astype(np.int32)))
            builder.end_document()
            n += 1
        builder.finalize(get_idx_path(tmp))
        if n == 0:
            raise SailorError("no text to build a dataset from", field="texts")
        for src, dst in done.items():
            os.replace(src, dst)
        ok = True
    finally:
        for src in done:
            Path(src).unlink(missing_ok=True)
        for folder in made if not ok else ():  # the folders made for a dataset that was never written
            folder.rmdir()
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
    """Samples of ``seq_len + 1`` tokens by global index, from an indexed dataset, or from its documents
    ``docs = (first, end)`` only (a train/valid/test split: :func:`split_samples`)."""

    def __init__(self, prefix: str | Path, seq_len: int, seed: int = 1234, docs: tuple[int, int] | None = None,
                 name: str = "") -> None:
        import_megatron()
        from megatron.core.datasets.indexed_dataset import IndexedDataset
        prefix = str(prefix)
        check_dataset_prefix(prefix)
        check_dataset_files(prefix)  # megatron's reader trusts the index: a truncated file fails deep inside it
        self.ds = IndexedDataset(prefix)
        self.seq_len = seq_len
        self.seed = seed
        index = self.ds.index
        self._pointers = index.sequence_pointers  # memory-mapped int64, bytes into .bin
        self._itemsize = int(index.dtype_size)
        count = len(self._pointers)
        self._stream = 0 if count == 0 else int(self._pointers[-1]) // self._itemsize + int(index.sequence_lengths[-1])
        self.prefix, self.num_documents = prefix, count
        first, end = docs if docs is not None else (0, count)
        self._base = self._start(first) if count else 0  # the split's first token in the stream
        self.total_tokens = self._start(end) - self._base if count else 0
        self.num_samples = (self.total_tokens - 1) // seq_len
        if self.num_samples < 1:
            what = f"the {name} split (documents {first}..{end - 1}) of the dataset" if name else "dataset"
            raise SailorError(f"{what} has {self.total_tokens} tokens, fewer than one sample of {seq_len + 1}",
                              file=prefix, fix="use more text, a shorter sequence or another --split")

    def _start(self, seq: int) -> int:
        """First token of sequence ``seq`` in the stream (``len`` sequences: the stream's end)."""
        return self._stream if seq == len(self._pointers) else int(self._pointers[seq]) // self._itemsize

    def _tokens(self, start: int, length: int) -> np.ndarray:
        out = []
        start += self._base
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
        return stack_samples(self, start, count)


def check_vocab(prefix: str | Path, vocab_size: int, model: str = "the model") -> int:
    """Refuse a dataset holding a token id >= ``vocab_size``, naming the file, the first offending id and
    its position; returns the largest id. At TP 1 such an id is a device-side assert on a GPU, at TP > 1
    a silently zero embedding row and a wrong loss, so the runtime checks before training: one pass of
    ``max`` over the memory-mapped tokens, a chunk at a time (memory bounded, any corpus size)."""
    check_dataset_prefix(prefix)
    check_dataset_files(prefix)
    import_megatron()
    from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path
    ds = IndexedDataset(str(prefix))
    path = get_bin_path(str(prefix))
    tokens = np.memmap(path, dtype=ds.index.dtype, mode="r")
    chunk, top = 1 << 24, -1
    for lo in range(0, len(tokens), chunk):
        part = tokens[lo:lo + chunk]
        top = max(top, int(part.max()))
        if top >= vocab_size:
            pos = lo + int(np.argmax(part >= vocab_size))
            doc = bisect.bisect_right(ds.index.sequence_pointers, pos * int(ds.index.dtype_size)) - 1
            raise SailorError(f"token id {int(tokens[pos])} at token {pos} (document {doc}) is outside {model}'s "
                              f"vocabulary of {vocab_size} ids", file=path, field="--data",
                              fix="tokenize the text with the model's tokenizer (python -m megatron_patch.data "
                                  "writes byte ids < 256), or train a model whose vocabulary covers it")
    return top


def split_samples(prefix: str | Path, seq_len: int, seed: int,
                  split: tuple[float, float, float]) -> dict[str, GlobalSamples | None]:
    """train/valid/test samples of one dataset: its documents cut by Megatron's split rule (None: empty)."""
    whole = GlobalSamples(prefix, seq_len, seed)
    if split[0] == 1.0:  # the whole dataset trains: exactly the samples of a run without --split
        return {"train": whole, "valid": None, "test": None}
    bounds = split_bounds(split, whole.num_documents)
    return {name: GlobalSamples(prefix, seq_len, seed, docs=b, name=name) if b[1] > b[0] else None
            for name, b in zip(SPLITS, bounds)}


class BlendedSamples:
    """Samples of several datasets interleaved by weight, by global index (Megatron's blend, made a
    function of the index so every plan reads the same samples and no rank holds a per-sample array).

    The datasets are split off one by one: dataset ``d`` takes share ``p = w_d / (w_d + ... + w_last)``
    of the indices left, index ``n`` going to it when ``floor((n + 1) p) > floor(n p)`` (Bresenham:
    after any ``n`` indices it has had ``floor(n p)``, never a sample off its share), as its sample
    ``floor(n p)``; the others continue with ``n - floor(n p)``. Weights are exact fractions of the
    decimal text given, so the interleaving does not depend on float rounding.
    """

    def __init__(self, parts: list[GlobalSamples], fractions: list[Fraction]) -> None:
        if not parts or len(parts) != len(fractions):
            raise ValueError("a blend needs one weight per dataset")
        self.parts = parts
        self.seq_len = parts[0].seq_len
        left = sum(fractions)
        self._shares: list[tuple[int, int]] = []
        for f in fractions:
            share = f / left if left else Fraction(1)
            self._shares.append((share.numerator, share.denominator))
            left -= f

    def locate(self, g: int) -> tuple[int, int]:
        """(dataset, its sample index) of blended sample ``g``."""
        n = g
        for d, (num, den) in enumerate(self._shares):
            taken = n * num // den
            if (n + 1) * num // den > taken:
                return d, taken
            n -= taken
        raise AssertionError("the last share is 1")

    def sample(self, g: int) -> np.ndarray:
        d, i = self.locate(g)
        return self.parts[d].sample(i)

    def batch(self, start: int, count: int) -> torch.Tensor:
        return stack_samples(self, start, count)


def stack_samples(source: GlobalSamples | BlendedSamples, start: int, count: int) -> torch.Tensor:
    """Samples ``start .. start + count - 1`` of ``source`` as a [count, seq_len + 1] int64 tensor."""
    return torch.from_numpy(np.stack([source.sample(g) for g in range(start, start + count)]))


Samples = GlobalSamples | BlendedSamples


def build_samples(blend: DataBlend, seq_len: int, seed: int,
                  split: tuple[float, float, float]) -> dict[str, Samples | None]:
    """train/valid/test samples of a blend (each dataset split on its own, as Megatron does; a split
    none of the datasets has is None). One dataset with weight 1 gives the :class:`GlobalSamples`
    themselves (the same samples as before blends existed, so older checkpoints resume on the same data)."""
    for prefix in blend.prefixes:
        GlobalSamples(prefix, seq_len, seed)  # missing or inconsistent files first, with their own error
    per = [split_samples(p, seq_len, seed, split) for p in blend.prefixes]
    out: dict[str, Samples | None] = {}
    for name in SPLITS:
        have = [(s, f) for parts, f in zip(per, blend.fractions()) if (s := parts[name]) is not None and f > 0]
        if not have:
            out[name] = None
        elif len(have) == 1 and len(blend.prefixes) == 1:
            out[name] = have[0][0]
        else:
            out[name] = BlendedSamples([s for s, _ in have], [f for _, f in have])
    return out



def train_split(data: dict[str, Samples | None], split: str) -> Samples:
    """The train samples of :func:`build_samples`' result; an error naming ``--split`` when it has none."""
    train = data["train"]
    if train is None:
        raise SailorError(f"--split {split} leaves no document of the data for training", field="--split",
                          fix="give the train split (the first weight) a share large enough for one document")
    return train

def read_documents(files: Iterable[str | Path], json_key: str = "text") -> Iterable[str]:
    """Documents of raw text files: a ``.jsonl`` file holds one per line (its ``json_key`` field, as
    Megatron's preprocess_data.py reads), any other file is one document."""
    for f in files:
        path = Path(f)
        if path.suffix != ".jsonl":
            yield path.read_text(encoding="utf-8", errors="replace")
            continue
        with path.open(encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path}, line {n}"
                try:
                    record = json.loads(line)
                except ValueError:
                    raise SailorError("is not JSON", file=where, field=json_key, fix="one JSON object per line") from None
                try:
                    yield Fields(record, file=where, path="").req(json_key, str)
                except SailorError as exc:
                    if exc.field == json_key:
                        exc.fix = f"{exc.fix + '; or ' if exc.fix else ''}name the field of the text with --json-key"
                    raise


def check_build_paths(prefix: str | Path, files: Iterable[str | Path]) -> None:
    """Every input is a readable file and the output's folder can be written (a file made and removed there),
    before anything is read or written: a typo ends in one message naming the path, not a traceback halfway
    through."""
    for f in files:
        path = Path(f)
        if not path.exists():
            raise SailorError("no such file", file=path, field="files", fix="check the path of the raw text file")
        if not path.is_file():
            raise SailorError("is not a file", file=path, field="files", fix="name the text files, not a folder")
        if not os.access(path, os.R_OK):
            raise SailorError("cannot be read (permissions)", file=path, field="files", fix="check its permissions")
    out = Path(prefix)
    if out.suffix in (".bin", ".idx") or out.is_dir() or str(prefix).endswith(os.sep):
        raise SailorError("is not a dataset prefix: the tool writes PREFIX.bin and PREFIX.idx", file=out,
                          field="prefix", fix=f"name the files without their suffix, e.g. {out.with_suffix('')}"
                          if out.suffix in (".bin", ".idx") else f"e.g. {out / 'corpus'} for files in that folder")
    for written in (Path(f"{prefix}.bin"), Path(f"{prefix}.idx")):
        if written.is_dir():
            raise SailorError("is a folder, where the dataset's file goes", file=written, field="prefix",
                              fix="choose another output prefix")
    try:
        writable_dir(out.parent, "prefix")
    except SailorError as exc:
        raise SailorError(f"cannot write the dataset here: {exc.message}", file=out, field="prefix",
                          fix="choose an output prefix in a folder you can write") from None


def parser() -> argparse.ArgumentParser:
    ap = OptionParser(prog="python -m megatron_patch.data", description=__doc__.split("\n")[0])
    ap.add_argument("prefix", help="output prefix (writes PREFIX.bin and PREFIX.idx)")
    ap.add_argument("files", nargs="*", help="raw text files, one document each, or .jsonl files, one document "
                                             "per line (default: the Sailor data the package ships)")
    ap.add_argument("--json-key", default=None, help="the field of a .jsonl line that holds the text (default: text)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.json_key is not None and not any(Path(f).suffix == ".jsonl" for f in args.files):
            raise SailorError("only .jsonl files have fields, and none is given", field="--json-key",
                              fix="drop --json-key, or name the .jsonl files to read")
        check_build_paths(args.prefix, args.files)
        json_key = "text" if args.json_key is None else args.json_key
        texts = read_documents(args.files, json_key) if args.files else shipped_texts()
        build_dataset(args.prefix, texts)
        written = check_dataset_files(args.prefix, field="prefix")
    except OSError as exc:  # a file that vanished or a disk that filled after the checks
        print(f"error: {SailorError(exc.strerror or str(exc), file=exc.filename, fix='check the path')}",
              file=sys.stderr)
        return 2
    except SailorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.prefix}.bin/.idx: {written.documents} documents, {written.tokens} tokens "
          f"(byte ids, end of document {EOD})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
