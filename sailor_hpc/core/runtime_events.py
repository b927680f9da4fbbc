"""The runtime's account of a job, as typed events: what a rank (or a job's batch script) prints as one JSON
line per event, and what the controller reads back from the job's log.

The runtime (``megatron_patch.launch``) and the in-place step (``sailor_hpc.controller.inplace``) print
``{"event": NAME, ...}`` lines; :func:`decode_event` turns one into the frozen dataclass of its name, so a
reader dispatches on the type and a field renamed on one side is a :class:`~sailor_hpc.core.errors.SailorError`
naming the event and the field, not a ``None`` read silently. Fields a reader does not need stay in the JSON
(the runtime prints role, memory and timing details for people) and are not decoded. Lines of unknown events
decode to None: the log also carries events meant only for people (``ready``, ``eval``, ``go``).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.typed_json import Mismatch, from_json


@dataclass(frozen=True)
class RuntimeEvent:
    """One line of a job's log that the controller reads."""

    name: ClassVar[str]


@dataclass(frozen=True)
class Started(RuntimeEvent):
    """A rank started (and joined its process group)."""

    name: ClassVar[str] = "start"
    rank: int = 0


@dataclass(frozen=True)
class Loaded(RuntimeEvent):
    """A rank loaded the newest complete checkpoint: the step and data position it resumes from."""

    name: ClassVar[str] = "loaded"
    step: int
    consumed_samples: int | None = None


@dataclass(frozen=True)
class Stepped(RuntimeEvent):
    """A rank finished an optimizer step (``t``: wall time, the runtime's clock)."""

    name: ClassVar[str] = "step"
    step: int
    loss: float | None = None
    iter_s: float | None = None
    consumed_samples: int | None = None
    t: float | None = None


@dataclass(frozen=True)
class Saved(RuntimeEvent):
    """A rank's part of a complete checkpoint is written (``seconds``: how long the save took)."""

    name: ClassVar[str] = "saved"
    step: int
    seconds: float | None = None


@dataclass(frozen=True)
class Signalled(RuntimeEvent):
    """A rank stopped on SIGUSR1/SIGTERM after this step, and saves it."""

    name: ClassVar[str] = "signal"
    step: int


@dataclass(frozen=True)
class Done(RuntimeEvent):
    """A rank trained to the requested step."""

    name: ClassVar[str] = "done"
    step: int


@dataclass(frozen=True)
class Waiting(RuntimeEvent):
    """A rank of a job taking over from another waits for its gate file before loading."""

    name: ClassVar[str] = "waiting"


@dataclass(frozen=True)
class InPlace(RuntimeEvent):
    """The job's batch script re-planned its next step on the surviving nodes (same job, no queue)."""

    name: ClassVar[str] = "in_place"
    job_id: str
    step_index: int
    rc: int
    t_step_end: float
    t_ready: float
    lost: dict[str, str]
    released: list[str]
    refused: list[str]
    plan_file: str
    nodes: list[str]
    gpus: dict[str, int]
    throughput: float
    cost_per_hour: float
    was_gpus: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class InPlaceRefused(RuntimeEvent):
    """The job lost nodes but no plan fits the survivors (or Slurm did not answer): it ends."""

    name: ClassVar[str] = "in_place_refused"
    job_id: str
    step_index: int
    rc: int
    reason: str
    t: float | None = None


EVENTS: dict[str, type[RuntimeEvent]] = {c.name: c for c in (Started, Loaded, Stepped, Saved, Signalled, Done,
                                                                  Waiting, InPlace, InPlaceRefused)}


def encode_event(event: RuntimeEvent) -> str:
    """The event as the one JSON line a job prints."""
    return json.dumps({"event": event.name, **dataclasses.asdict(event)}, sort_keys=True)


def event_fields(event: RuntimeEvent) -> dict[str, Any]:
    """The event's fields (without its name), as a journal record copies them."""
    return dataclasses.asdict(event)


def decode_event(obj: dict[str, Any], source: str | None = None) -> RuntimeEvent | None:
    """The typed event of one parsed log line; None for events no reader needs. Raises SailorError (naming
    ``source``, the event and the field) when a field it needs is missing or of the wrong type; fields it does
    not need are left undecoded."""
    cls = EVENTS.get(str(obj.get("event")))
    if cls is None:
        return None
    try:
        return from_json(cls, obj, ignore_unknown=True)
    except Mismatch as exc:
        raise SailorError(f"the runtime's {obj.get('event')!r} event: {exc.message}", file=source, field=exc.field,
                          fix="the job ran a different sailor-hpc version than the controller: run both "
                              "from the same installation") from None
