"""What the training says: the runtime's JSON lines in the job's log, read as they are written.

``megatron_patch.launch`` prints one JSON object per line and rank (``start``, ``loaded``, ``step``,
``saved``, ``signal``, ``done``); ``srun`` merges the ranks' lines into the job's log, among Slurm's own
messages and Python warnings, which are skipped. :class:`LogTail` reads only what was appended since
the last call and keeps a partial last line for the next one, so polling a long log stays cheap.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Progress:
    """The training's own account of one job (all ranks merged)."""

    started: bool = False
    loaded_step: int | None = None
    loaded_consumed: int | None = None
    first_step: int | None = None
    last_step: int | None = None
    consumed_samples: int | None = None
    saved_steps: list[int] = field(default_factory=list)
    signal_step: int | None = None  # the job stopped on SIGUSR1/SIGTERM (and saved)
    done_step: int | None = None
    losses: dict[int, float] = field(default_factory=dict)  # step -> loss (rank-independent in this runtime)
    errors: list[str] = field(default_factory=list)
    slowest_step_s: float = 0.0  # of any rank: what finishing the current step may take
    slowest_save_s: float = 0.0  # ... and writing a checkpoint
    first_step_t: float | None = None  # wall time its first step ended (the runtime's own clock)
    last_step_t: float | None = None  # ... and its last step
    before_t: float | None = None  # the last step's wall time of the account before this one (same job)

    @property
    def stop_needs_s(self) -> float:
        """Measured time to finish a step and save it: what a job asked to checkpoint and stop needs."""
        return self.slowest_step_s + self.slowest_save_s

    def add(self, rec: dict[str, Any]) -> None:
        kind = rec.get("event")
        step = rec.get("step")
        if kind == "in_place":  # the next step of the same job, re-planned on the survivors: a new account
            self.__dict__.update(Progress(before_t=self.last_step_t).__dict__)
        elif kind == "start":
            if self.first_step is not None or self.signal_step is not None:
                self.__dict__.update(Progress().__dict__)  # the job runs again (requeued): a new account
            self.started = True
        elif kind == "loaded":
            self.loaded_step, self.loaded_consumed = step, rec.get("consumed_samples")
        elif kind == "step" and isinstance(step, int):
            self.first_step = step if self.first_step is None else self.first_step
            if isinstance(rec.get("t"), (int, float)):
                self.first_step_t = self.first_step_t or float(rec["t"])
                self.last_step_t = max(float(rec["t"]), self.last_step_t or 0.0)
            self.last_step = max(step, self.last_step or 0)
            self.consumed_samples = rec.get("consumed_samples", self.consumed_samples)
            if isinstance(rec.get("loss"), (int, float)):
                self.losses[step] = float(rec["loss"])
            self.slowest_step_s = max(self.slowest_step_s, _seconds(rec.get("iter_s")))
        elif kind == "saved" and isinstance(step, int):
            if step not in self.saved_steps:
                self.saved_steps.append(step)
            self.slowest_save_s = max(self.slowest_save_s, _seconds(rec.get("seconds")))
        elif kind == "signal":
            self.signal_step = step
        elif kind == "done":
            self.done_step = step


def _seconds(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else 0.0


class LogTail:
    """Incremental reader of a log file's JSON lines (the file may not exist yet)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.offset = 0
        self._partial = b""
        self.progress = Progress()
        self.waiting = 0  # ranks that said they wait for a gate file before loading (a job taking over)

    def poll(self) -> list[dict[str, Any]]:
        """New records since the last call; they are also added to :attr:`progress`."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        out = []
        for raw in lines:
            line = raw.decode("utf-8", errors="replace").strip()
            if line.startswith("error:") or ": error:" in line:  # SailorError / argparse refusals
                self.progress.errors.append(line)
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "event" in rec:
                self.waiting += rec["event"] == "waiting"
                self.progress.add(rec)
                out.append(rec)
        return out
