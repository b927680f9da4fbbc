"""The run's journal: one JSON object per line, appended, never rewritten; the controller's only memory.

Every observation (a node of the job lost, the job requeued, more idle GPUs, the first step of a job,
a new checkpoint), every decision (the plan chosen and why, resize or keep and the gain) and every
action (the intent to submit, the job id Slurm gave, a signal, a cancel) is a record
``{"seq": n, "t": unix seconds, "kind": ..., ...}``. The controller's state is a fold over these
records (:mod:`sailor_hpc.controller.state`), so a restarted controller knows what the killed one
knew, and ``sailor-hpc run status`` tells the run's story from the same file. Each record is a frozen
dataclass of :mod:`sailor_hpc.controller.records`, written and read by its codec: a line whose kind or fields
do not fit is refused naming the file, the line and the field.

Appends are atomic for readers: a record is one ``write`` of a whole line on an ``O_APPEND``
descriptor, then ``fsync``. A controller killed in the middle of a write can leave a torn last line
(no newline); readers ignore it and the next writer (one at a time: the run's lock) cuts it off.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sailor_hpc.controller.records import Kind, Record, decode, encode
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.typed_json import fits_float

R = TypeVar("R", bound=Record)  # append returns the record it was given, stamped

__all__ = ["Journal", "Kind", "Record", "read_journal", "read_journal_lines"]


_EDITED = "the journal was edited or corrupted; restore it or start a new run"


def _check_envelope(rec: dict[str, Any], number: int, path: Path) -> None:
    """The fields every reader uses (the writer's next ``seq``, the status' times, the fold's ``kind``) have
    the types the writer gives them, so a damaged line is named here, not met as a TypeError later."""
    seq, t, kind = rec["seq"], rec.get("t"), rec["kind"]
    for field, ok, what in (("seq", isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0,
                             "a non-negative integer"),
                            ("t", fits_float(t, finite=True),
                             "a finite number of seconds"),
                            ("kind", isinstance(kind, str), "text")):
        if not ok:
            raise SailorError(f"line {number}: {field} must be {what}, got {rec.get(field)!r}", file=path,
                              field=field, fix=_EDITED)


def _parse(data: bytes, path: Path) -> tuple[list[Record], list[int], int]:
    """Records of a journal's bytes, the line of each, and the byte length of its complete lines (a torn
    tail is left out, whatever its bytes: a write cut short may end inside a character)."""
    records: list[Record] = []
    lines: list[int] = []
    complete = data.rfind(b"\n") + 1
    try:
        text = data[:complete].decode()
    except UnicodeDecodeError as exc:
        bad = data[:exc.start].count(b"\n") + 1
        raise SailorError(f"line {bad} is not UTF-8 text ({exc.reason})", file=path, fix=_EDITED) from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SailorError(f"line {number} is not JSON ({exc})", file=path, fix=_EDITED) from None
        if not isinstance(rec, dict) or "kind" not in rec or "seq" not in rec:
            raise SailorError(f"line {number} is not a journal record", file=path, fix=_EDITED)
        _check_envelope(rec, number, path)
        records.append(decode(rec, file=path, line=number))
        lines.append(number)
    return records, lines, complete


def read_journal(path: str | os.PathLike[str]) -> list[Record]:
    """Every complete record of the journal at ``path`` (none if it does not exist yet)."""
    return read_journal_lines(path)[0]


def read_journal_lines(path: str | os.PathLike[str]) -> tuple[list[Record], list[int]]:
    """Every complete record of the journal at ``path`` and the line it is on (for messages that name it)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], []
    records, lines, _ = _parse(data, path)
    return records, lines


class Journal:
    """The writer. Only one per run at a time (the controller holds the run's lock while it writes)."""

    def __init__(self, path: str | os.PathLike[str], clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.clock = clock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        records, lines, good = self._load()
        self.records: list[Record] = records
        self.lines: list[int] = lines  # the line of each record in the file
        self._next = (records[-1].seq + 1) if records else 0
        self.repaired = self._cut_torn_tail(good)

    def _load(self) -> tuple[list[Record], list[int], int]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return [], [], 0
        return _parse(data, self.path)

    def _cut_torn_tail(self, good: int) -> bool:
        if self.path.exists() and self.path.stat().st_size > good:
            with open(self.path, "r+b") as fh:
                fh.truncate(good)
                os.fsync(fh.fileno())
            return True
        return False

    def append(self, record: R) -> R:
        """Write one record (durably), stamped with its ``seq`` and time, and return the stamped record."""
        rec = dataclasses.replace(record, seq=self._next, t=round(self.clock(), 3))
        line = (json.dumps(encode(rec), sort_keys=True) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, line)
            if written != len(line):
                raise OSError(f"short write to the journal ({written} of {len(line)} bytes)")
            os.fsync(fd)
        finally:
            os.close(fd)
        self._next += 1
        self.lines.append(self.path.read_bytes().count(b"\n") if not self.lines else self.lines[-1] + 1)
        self.records.append(rec)
        return rec
