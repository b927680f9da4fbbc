"""A Megatron indexed dataset's two files checked against each other before anything reads them (torch-free).

megatron-core's reader trusts the ``.idx`` header: a truncated ``.idx`` (an interrupted copy) fails deep
inside numpy or as a bare assert, a truncated ``.bin`` only when a sample past its end is read, minutes into a
run. The sizes say it at once: the ``.idx`` is its header plus the arrays the header counts, and the ``.bin``
ends where the last sequence does. Every rank checks them (a few reads, whatever the corpus size) before it
joins the others, so all of them stop alike with one line naming the file.

The layout (megatron-core 0.16 ``_IndexWriter``): ``MMIDIDX\\x00\\x00``, version (u64 = 1), dtype code (u8),
sequence count ``n`` (u64), document count ``d`` (u64), then ``n`` int32 lengths, ``n`` int64 byte pointers
into the ``.bin``, ``d`` int64 document boundaries (sequence indices, the first 0, the last ``n``) and, in a
multimodal index, ``n`` int8 modes.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from sailor_hpc.core.errors import SailorError

HEADER = b"MMIDIDX\x00\x00"
_PREAMBLE = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
#: megatron-core's ``DType`` codes -> bytes per token
DTYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}
_REBUILD = "rebuild the dataset (python -m megatron_patch.data PREFIX FILES...), or copy both files again whole"


@dataclass(frozen=True)
class DatasetFiles:
    """What the index says of a dataset whose files agree."""

    sequences: int
    documents: int  # documents (the index's boundaries less one)
    tokens: int
    token_bytes: int


def check_dataset_files(prefix: str | os.PathLike[str], field: str = "--data") -> DatasetFiles:
    """``PREFIX.idx`` and ``PREFIX.bin`` agree (sizes, counts and the ends of the pointer and document arrays);
    else a SailorError naming the file at fault and ``field``. The prefix's files must exist
    (:func:`sailor_hpc.core.training.check_dataset_prefix` says when they do not)."""
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")

    def bad(path: Path, message: str) -> SailorError:
        return SailorError(message, file=path, field=field, fix=_REBUILD)

    idx_size, bin_size = idx.stat().st_size, bin_.stat().st_size
    with idx.open("rb") as f:
        head = f.read(_PREAMBLE.size)
        if len(head) < _PREAMBLE.size:
            raise bad(idx, f"truncated: {idx_size} bytes, shorter than the {_PREAMBLE.size}-byte header")
        magic, version, code, n, d = _PREAMBLE.unpack(head)
        if magic != HEADER or version != 1:
            raise bad(idx, "not a Megatron indexed dataset index (MMIDIDX version 1)")
        if code not in DTYPE_SIZES:
            raise bad(idx, f"unknown token dtype code {code}")
        size = DTYPE_SIZES[code]
        arrays = _PREAMBLE.size + 12 * n + 8 * d  # lengths (int32), pointers (int64), document boundaries (int64)
        if idx_size < arrays:
            raise bad(idx, f"truncated: {idx_size} bytes, but its header counts {n} sequences and {d} document "
                           f"boundaries ({arrays} bytes)")
        if idx_size not in (arrays, arrays + n):  # + n: a multimodal index's modes
            raise bad(idx, f"{idx_size - arrays} bytes more than its header counts ({arrays} bytes)")
        if d < 1 or _int64(f, _PREAMBLE.size + 12 * n) != 0 or _int64(f, arrays - 8) != n:
            raise bad(idx, f"its document boundaries do not run from sequence 0 to {n}")
        if n == 0:
            tokens = 0
        else:
            f.seek(_PREAMBLE.size + 4 * (n - 1))
            last_length = struct.unpack("<i", f.read(4))[0]
            first, last = _int64(f, _PREAMBLE.size + 4 * n), _int64(f, _PREAMBLE.size + 4 * n + 8 * (n - 1))
            if first != 0 or last_length < 0 or last < 0 or last % size:
                raise bad(idx, "its sequence pointers or lengths are not those of sequences back to back")
            tokens = last // size + last_length
    if bin_size != tokens * size:
        what = "truncated" if bin_size < tokens * size else "longer than its index says"
        raise bad(bin_, f"{what}: {bin_size} bytes, but {idx.name} indexes {tokens} tokens of {size} bytes "
                        f"({tokens * size} bytes)")
    return DatasetFiles(sequences=n, documents=d - 1, tokens=tokens, token_bytes=size)


def _int64(f: BinaryIO, offset: int) -> int:
    f.seek(offset)
    value: int = struct.unpack("<q", f.read(8))[0]
    return value
