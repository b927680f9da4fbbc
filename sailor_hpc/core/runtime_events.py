"""The runtime's account of a job, as typed events: what a rank (or a job's batch script) prints as one JSON
line per event, and what the controller reads back from the job's log.

Both runtimes (``megatron_patch.training_loop``) and the in-place step (``sailor_hpc.controller.inplace``) print
every event as ``{"event": NAME, ...fields}`` through :func:`encode_event`; :func:`decode_event` turns a line
back into the frozen dataclass of its name, so a reader dispatches on the type and a field renamed on one side
is a :class:`~sailor_hpc.core.errors.SailorError` naming the event and the field, not a ``None`` read silently.
A field a line lacks takes its default (a runtime that does not measure it, or an older one). Events meant
only for people (``ready``, ``eval``, ``go``) are typed for the writer but decode to None, as lines of unknown
events do.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.typed_json import Mismatch, from_json


@dataclass(frozen=True)
class RuntimeEvent:
    """One line of a job's log."""

    name: ClassVar[str]


@dataclass(frozen=True, kw_only=True)
class RankEvent(RuntimeEvent):
    """An event of one training rank, with its place in the plan."""

    rank: int = 0
    pipeline: int | None = None
    stage: int | None = None
    tp_rank: int | None = None


@dataclass(frozen=True, kw_only=True)
class Started(RankEvent):
    """A rank started (and joined its process group): its role, host and device; the DeepSpeed runtime also
    names itself, its version and ZeRO stage."""

    name: ClassVar[str] = "start"
    tp: int | None = None
    layers: list[int] = field(default_factory=list)
    gpu_type: str | None = None
    partition: str | None = None
    host: str | None = None
    node: int | None = None
    local_gpu: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    device: str | None = None
    plan_gpus: int | None = None
    runtime: str | None = None
    deepspeed: str | None = None
    zero_stage: int | None = None
    pid: int | None = None  # a resident rank starts once per plan in one process
    epoch: int | None = None  # its plan's number (0: the job's own)


@dataclass(frozen=True, kw_only=True)
class Ready(RankEvent):
    """A rank built its model and optimizer (for people; megatron_patch also says what it patched and how it
    syncs gradients)."""

    name: ClassVar[str] = "ready"
    params: int
    megatron_core: str | None = None
    patches: list[str] | None = None
    sync_groups: int | None = None
    sync_buckets: int | None = None
    tf32: bool | None = None
    valid_samples: bool | None = None


@dataclass(frozen=True, kw_only=True)
class Waiting(RankEvent):
    """A rank of a job taking over from another waits for its gate file (``path``) before loading."""

    name: ClassVar[str] = "waiting"
    path: str | None = None


@dataclass(frozen=True, kw_only=True)
class Go(RankEvent):
    """The gate file exists: the rank loads now (for people)."""

    name: ClassVar[str] = "go"
    waited_s: float


@dataclass(frozen=True, kw_only=True)
class CheckpointSkipped(RankEvent):
    """Rank 0 passed over a checkpoint that does not verify (``step``: the step its directory names;
    ``using``: the one it loads, None: none does). The controller journals it: a run's status names every
    checkpoint it could not use."""

    name: ClassVar[str] = "checkpoint_skipped"
    path: str
    reason: str
    step: int | None = None
    using: str | None = None


@dataclass(frozen=True, kw_only=True)
class Loaded(RankEvent):
    """A rank loaded the newest complete checkpoint: the step and data position it resumes from."""

    name: ClassVar[str] = "loaded"
    step: int
    consumed_samples: int | None = None
    path: str | None = None
    seconds: float | None = None
    from_memory: int = 0  # parameters a resident rank restored from its own memory, not from the files


@dataclass(frozen=True, kw_only=True)
class Stepped(RankEvent):
    """A rank finished an optimizer step (``t``: wall time, the runtime's clock). ``grad_norm`` is None on a step
    skipped for an fp16 overflow; the memory fields are ``megatron_patch.training_loop.memory_record``'s (the
    CUDA ones None on the CPU)."""

    name: ClassVar[str] = "step"
    step: int
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    skipped: bool | None = None
    loss_scale: float | None = None
    iter_s: float | None = None
    sync_s: float | None = None
    mem_bytes: int | None = None
    mem_allocated_bytes: int | None = None
    mem_reserved_bytes: int | None = None
    mem_device_bytes: int | None = None
    mem_device_peak_bytes: int | None = None
    consumed_samples: int | None = None
    t: float | None = None


@dataclass(frozen=True, kw_only=True)
class Evaluated(RankEvent):
    """A rank's validation loss over ``iters`` batches (for people)."""

    name: ClassVar[str] = "eval"
    step: int
    loss: float
    iters: int


@dataclass(frozen=True, kw_only=True)
class Saved(RankEvent):
    """A rank's part of a complete checkpoint is written (``seconds``: how long the save took)."""

    name: ClassVar[str] = "saved"
    step: int
    seconds: float | None = None
    path: str | None = None


@dataclass(frozen=True, kw_only=True)
class Signalled(RankEvent):
    """A rank stopped on SIGUSR1/SIGTERM (``signals``: the numbers received) after this step, and saves it."""

    name: ClassVar[str] = "signal"
    step: int
    signals: list[int] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class Done(RankEvent):
    """A rank trained to the requested step."""

    name: ClassVar[str] = "done"
    step: int


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
    resident: bool = False  # the surviving ranks went on in their own processes (no new step)


@dataclass(frozen=True)
class InPlaceRefused(RuntimeEvent):
    """The job lost nodes but no plan fits the survivors (or Slurm did not answer): it ends."""

    name: ClassVar[str] = "in_place_refused"
    job_id: str
    step_index: int
    rc: int
    reason: str
    t: float | None = None


#: set (by ``sailor_hpc.jobs.rank_env``) where srun merges every rank's output into one job log: each rank then
#: starts its stderr lines with :data:`RANK_LABEL` (its JSON events carry their rank already)
LABEL_ENV = "SAILOR_LABEL_RANKS"
RANK_LABEL = "[rank {}] "
_LABELLED = re.compile(r"^\[rank (\d+)\] ")


def unlabelled(line: str) -> tuple[int | None, str]:
    """The rank a job log's line is labelled with (None: no rank's label) and its text without the label."""
    m = _LABELLED.match(line)
    return (int(m.group(1)), line[m.end():]) if m else (None, line)


#: the events a reader decodes (the others are for people: decoded to None)
EVENTS: dict[str, type[RuntimeEvent]] = {c.name: c for c in (Started, CheckpointSkipped, Loaded, Stepped, Saved,
                                                                  Signalled, Done, Waiting, InPlace, InPlaceRefused)}


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
