"""What the training says: the runtime's JSON lines in the job's log, read as they are written.

``megatron_patch.launch`` prints one JSON object per line and rank (``start``, ``checkpoint_skipped``,
``loaded``, ``step``, ``saved``, ``signal``, ``done``: :mod:`sailor_hpc.core.runtime_events`, read here by
type); ``srun`` merges the ranks' lines into the job's log, among Slurm's own messages and Python warnings, which are skipped.
:class:`LogTail` reads only what was appended since the last call and keeps a partial last line for the
next one, so polling a long log stays cheap.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.runtime_events import (
    CheckpointSkipped,
    Done,
    InPlace,
    Loaded,
    RuntimeEvent,
    Saved,
    Signalled,
    Started,
    Stepped,
    Waiting,
    decode_event,
    unlabelled,
)


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

    def add(self, event: RuntimeEvent) -> None:
        match event:
            case InPlace():  # the next step of the same job, re-planned on the survivors: a new account
                self.__dict__.update(Progress(before_t=self.last_step_t).__dict__)
            case Started():
                if self.first_step is not None or self.signal_step is not None:
                    self.__dict__.update(Progress().__dict__)  # the job runs again (requeued): a new account
                self.started = True
            case Loaded(step=step, consumed_samples=consumed):
                self.loaded_step, self.loaded_consumed = step, consumed
            case Stepped(step=step):
                self.first_step = step if self.first_step is None else self.first_step
                if event.t is not None:
                    self.first_step_t = self.first_step_t or event.t
                    self.last_step_t = max(event.t, self.last_step_t or 0.0)
                self.last_step = max(step, self.last_step or 0)
                if event.consumed_samples is not None:
                    self.consumed_samples = event.consumed_samples
                if event.loss is not None:
                    self.losses[step] = event.loss
                self.slowest_step_s = max(self.slowest_step_s, _seconds(event.iter_s))
            case Saved(step=step):
                if step not in self.saved_steps:
                    self.saved_steps.append(step)
                self.slowest_save_s = max(self.slowest_save_s, _seconds(event.seconds))
            case Signalled(step=step):
                self.signal_step = step
            case Done(step=step):
                self.done_step = step


def _seconds(value: float | None) -> float:
    return value if value is not None and value >= 0 else 0.0


class LogTail:
    """Incremental reader of a log file's JSON lines (the file may not exist yet)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.offset = 0
        self._partial = b""
        self.progress = Progress()
        self.waiting = 0  # ranks that said they wait for a gate file before loading (a job taking over)
        self.malformed: list[str] = []  # lines naming an event whose fields do not fit it
        self.skipped: list[CheckpointSkipped] = []  # checkpoints the job passed over as it resumed

    def poll(self) -> list[RuntimeEvent]:
        """New events since the last call; they are also added to :attr:`progress`. A line that names an event
        but lacks a field of it is kept in :attr:`malformed` (the message names the field), not guessed at."""
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
            _, line = unlabelled(raw.decode("utf-8", errors="replace").strip())  # a rank's label: whose, not what
            if line.startswith("error:") or ": error:" in line:  # SailorError / argparse refusals
                self.progress.errors.append(line)
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # two ranks' lines interleaved, or not the runtime's
            if not isinstance(rec, dict):
                continue
            try:
                event = decode_event(rec, source=str(self.path))
            except SailorError as exc:
                self.malformed.append(str(exc))
                continue
            if event is None:
                continue
            self.waiting += isinstance(event, Waiting)
            if isinstance(event, CheckpointSkipped):
                self.skipped.append(event)
            self.progress.add(event)
            out.append(event)
        return out


def saved_on_signal(tail: LogTail | None, checkpoint_step: int) -> bool:
    """The job stopped on the signal and the checkpoint of that step is complete (published: the run's
    newest complete checkpoint is ``checkpoint_step``)."""
    if tail is None or tail.progress.signal_step is None:
        return False
    return checkpoint_step >= tail.progress.signal_step
