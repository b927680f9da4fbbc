"""A progress bar for a running sweep, on stderr: redrawn in place on a terminal, one line per change
otherwise (logs, CI), so a long sweep shows what it is waiting for."""
from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import TextIO

ORDER = ("ok", "failed", "running", "queued", "skipped")


class Progress:
    def __init__(self, total: int, stream: TextIO | None = None, width: int = 28, tty: bool | None = None) -> None:
        self.total = max(total, 0)
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = self.stream.isatty() if tty is None else tty
        self.t0 = time.monotonic()
        self._last = ""

    def line(self, counts: Mapping[str, int]) -> str:
        done = counts.get("ok", 0) + counts.get("failed", 0) + counts.get("skipped", 0)
        filled = int(self.width * done / self.total) if self.total else self.width
        bar = "#" * filled + "-" * (self.width - filled)
        parts = ", ".join(f"{counts[k]} {k}" for k in ORDER if counts.get(k))
        return f"[{bar}] {done}/{self.total} ({parts}) {time.monotonic() - self.t0:.0f} s"

    def update(self, counts: Mapping[str, int]) -> None:
        text = self.line(counts)
        key = text.rsplit(")", 1)[0]
        if self.tty:
            self.stream.write("\r" + text.ljust(len(self._last)))
            self.stream.flush()
            self._last = text
        elif key != self._last:
            self.stream.write(text + "\n")
            self.stream.flush()
            self._last = key

    def message(self, text: str) -> None:
        if self.tty and self._last:
            self.stream.write("\r" + " " * len(self._last) + "\r")
        self.stream.write(text + "\n")
        if self.tty and self._last:
            self.stream.write(self._last)
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._last:
            self.stream.write("\n")
            self.stream.flush()
