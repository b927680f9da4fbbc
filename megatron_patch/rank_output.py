"""What a rank writes on stderr where every rank's output lands in one job log (``srun`` merges them).

- Each line a rank writes on stderr through Python (its human log, warnings, errors, tracebacks) starts with
  its label, ``[rank N] `` (:data:`~sailor_hpc.core.runtime_events.RANK_LABEL`), so ``sailor-hpc logs`` shows
  one rank's lines (rank 0's by default) and the controller still reads every rank's errors. Labelled only where
  ``sailor_hpc.jobs.rank_env`` asks for it: ranks started apart (tests, torchrun) each have their own stderr.
- A library's warnings (megatron-core's deprecation notices, torch's) come from code every rank runs alike:
  rank 0 says them, once per job; the other ranks ignore warnings, unless the user chose warning filters
  (``-W``, ``PYTHONWARNINGS``). Errors are never filtered: every rank says its own.
"""
from __future__ import annotations

import io
import sys
import warnings
from typing import TextIO

from sailor_hpc.core.runtime_events import RANK_LABEL


class LabelledLines(io.TextIOBase):
    """A text stream that writes each complete line to ``out`` after ``label`` (a partial line waits for its
    end, or for :meth:`flush`), one write per line: ranks sharing a file never split a line between them."""

    def __init__(self, out: TextIO, label: str) -> None:
        super().__init__()
        self.out, self.label, self._partial = out, label, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            self.out.write(f"{self.label}{line}\n")
        if lines:
            self.out.flush()
        return len(text)

    def flush(self) -> None:
        if self._partial:
            self.out.write(f"{self.label}{self._partial}")
            self._partial = ""
        self.out.flush()

    def fileno(self) -> int:
        return self.out.fileno()


def rank_output(rank: int, label: bool) -> None:
    """Set up this rank's stderr (see the module doc): labelled lines if ``label``, warnings on rank 0 only."""
    if rank != 0 and not sys.warnoptions:
        warnings.simplefilter("ignore")
    if label and not isinstance(sys.stderr, LabelledLines):
        sys.stderr = LabelledLines(sys.stderr, RANK_LABEL.format(rank))
