"""The safetensors file format, read and written here so the runtime extra needs no extra package.

A file is an 8-byte little-endian header length, a JSON header (``name -> {dtype, shape,
data_offsets}`` plus ``__metadata__``, padded with spaces to 8 bytes) and the raw little-endian
tensor bytes. Hugging Face's ``safetensors`` package reads what :func:`write` writes (the tests
check it against that package, which comes with ``transformers`` in the test extra).

Both directions go one tensor at a time: a writer streams tensors it is handed in header order, a
reader seeks to one tensor, so neither holds a whole model.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from sailor_hpc.core.checkpoint import CheckpointError

DTYPES: dict[str, torch.dtype] = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                                  "BF16": torch.bfloat16}
_CODES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 << 20  # the safetensors package's own limit


@dataclass(frozen=True)
class Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets in the data section
    end: int


def _header(entries: dict[str, Entry], metadata: dict[str, str]) -> bytes:
    body = {"__metadata__": metadata, **{n: {"dtype": _CODES[e.dtype], "shape": list(e.shape),
                                             "data_offsets": [e.begin, e.end]} for n, e in entries.items()}}
    raw = json.dumps(body, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def layout(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> dict[str, Entry]:
    """Offsets of ``shapes`` (in this order) stored back to back in ``dtype``."""
    out, pos = {}, 0
    size = torch.empty((), dtype=dtype).element_size()
    for name, shape in shapes.items():
        n = size * int(torch.Size(shape).numel())
        out[name] = Entry(dtype, tuple(shape), pos, pos + n)
        pos += n
    return out


def write(path: str | Path, shapes: dict[str, tuple[int, ...]], tensors: Iterable[tuple[str, torch.Tensor]],
          dtype: torch.dtype = torch.float32, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (given in the order of ``shapes``, converted to ``dtype``) to ``path`` (fsynced).

    The caller makes it atomic (the exporter writes a whole folder under a temporary name)."""
    entries = layout(shapes, dtype)
    names = iter(entries)
    with open(path, "wb") as fh:
        fh.write(_header(entries, {"format": "pt", **(metadata or {})}))
        for name, t in tensors:
            expected = next(names, None)
            if name != expected or tuple(t.shape) != entries[name].shape:
                raise ValueError(f"{path}: got {name} {tuple(t.shape)}, expected {expected} in header order")
            fh.write(t.detach().to("cpu", dtype).contiguous().view(torch.uint8).numpy().tobytes())
        if next(names, None) is not None:
            raise ValueError(f"{path}: fewer tensors than the header lists")
        fh.flush()
        os.fsync(fh.fileno())


class Reader:
    """One safetensors file: its header at once, its tensors one at a time (as fp32 or their own dtype)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.entries, self.metadata, self._data_start = self._read_header()

    def _bad(self, what: str) -> CheckpointError:
        return CheckpointError(f"not a valid safetensors file: {what}", file=self.path,
                               fix="re-save the model with save_pretrained(..., safe_serialization=True)")

    def _read_header(self) -> tuple[dict[str, Entry], dict[str, str], int]:
        size = self.path.stat().st_size
        with open(self.path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise self._bad("shorter than its header length")
            (n,) = struct.unpack("<Q", raw)
            if n > min(_MAX_HEADER, size - 8):
                raise self._bad(f"header length {n} exceeds the file")
            try:
                header = json.loads(fh.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise self._bad(f"header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        entries = {}
        for name, e in header.items():
            try:
                begin, end = map(int, e["data_offsets"])
                entry = Entry(DTYPES[e["dtype"]], tuple(int(d) for d in e["shape"]), begin, end)
            except KeyError as exc:
                raise self._bad(f"tensor {name}: unsupported dtype or missing {exc}") from None
            except (TypeError, ValueError):
                raise self._bad(f"tensor {name}: malformed entry {e}") from None
            nbytes = entry.end - entry.begin
            if not 0 <= entry.begin <= entry.end <= size - 8 - n or \
                    nbytes != torch.Size(entry.shape).numel() * torch.empty((), dtype=entry.dtype).element_size():
                raise self._bad(f"tensor {name}: data offsets {[begin, end]} do not fit its shape or the file")
            entries[name] = entry
        return entries, metadata, 8 + n

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name`` in its stored dtype (a fresh CPU tensor: only its bytes are read)."""
        e = self.entries[name]
        with open(self.path, "rb") as fh:
            fh.seek(self._data_start + e.begin)
            data = bytearray(fh.read(e.end - e.begin))
        if not data:  # torch.frombuffer refuses an empty buffer
            return torch.empty(e.shape, dtype=e.dtype)
        return torch.frombuffer(data, dtype=e.dtype).reshape(e.shape)
