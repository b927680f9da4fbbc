"""The journal's records: one frozen dataclass per kind, defined once, written and read by one codec.

A record's fields are its meaning: the controller builds one (``SubmitIntent(attempt=..., ...)``), the journal
stamps its ``seq`` and time and writes ``{"seq", "t", "kind", ...fields}`` as one JSON line (:func:`encode`),
and every reader gets the same dataclass back (:func:`decode`); :mod:`.state`, :mod:`.story` and the
controller dispatch on the type. A renamed or missing field is refused where the journal is read, naming the
file, the line and the field, instead of becoming ``None`` in a resumed controller's state.

Fields a writer does not always give have a default (``None``, ``False``, empty), which is also what a line
without the field decodes to: a journal written before a field existed still replays.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar, get_type_hints

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.runtime_events import InPlace
from sailor_hpc.core.typed_json import Mismatch, from_json


class Kind(StrEnum):
    """Every kind of journal record, as stored in its ``kind`` (plain JSON text)."""

    ADOPTED = "adopted"
    BACKOFF = "backoff"
    BASELINE = "baseline"
    CANCEL = "cancel"
    CHECKPOINT = "checkpoint"
    CHECKPOINT_PASSED_OVER = "checkpoint_passed_over"
    CONTROLLER_STARTED = "controller_started"
    CONTROLLER_STOPPED = "controller_stopped"
    DECISION = "decision"
    ERROR = "error"
    FAILURE = "failure"
    FINISHED = "finished"
    FIRST_STEP = "first_step"
    GATE_OPENED = "gate_opened"
    GAVE_UP = "gave_up"
    GROW_CANCELLED = "grow_cancelled"
    GROW_RUNNING = "grow_running"
    GROW_SUBMITTED = "grow_submitted"
    # a run across clusters: one group of jobs (one per cluster) per attempt, numbered by ``group``
    GROUP_INTENT = "group_intent"
    GROUP_SUBMITTED = "group_submitted"
    GROUP_ADOPTED = "group_adopted"
    GROUP_RUNNING = "group_running"
    GROUP_RECOVERED = "group_recovered"
    GROUP_FAILED = "group_failed"
    GROUP_STOPPED = "group_stopped"
    CLUSTER_DROPPED = "cluster_dropped"
    CLUSTER_LOST = "cluster_lost"
    REGROW_DECISION = "regrow_decision"
    REGROWN = "regrown"
    IDLE_GPUS = "idle_gpus"
    IN_PLACE = "in_place"
    IN_PLACE_REFUSED = "in_place_refused"
    JOB_GONE = "job_gone"
    JOB_RUNNING = "job_running"
    JOB_STOPPED = "job_stopped"
    NO_PLAN = "no_plan"
    NODE_LOST = "node_lost"
    PLAN = "plan"
    RECOVERY = "recovery"
    RUN_STARTED = "run_started"
    STOP_REQUESTED = "stop_requested"
    RUN_STOPPED = "run_stopped"
    RUN_RESUMED = "run_resumed"
    SIGNAL_SENT = "signal_sent"
    SUBMIT_INTENT = "submit_intent"
    SUBMITTED = "submitted"


Gpus = dict[str, int]  # partition -> GPUs


@dataclass(frozen=True, kw_only=True)
class Record:
    """What every record carries: its place in the journal and when it was written (set by the journal)."""

    kind: ClassVar[Kind]
    seq: int = -1
    t: float = 0.0


# ------------------------------------------------------------------------------------------ the controller

@dataclass(frozen=True, kw_only=True)
class RunStarted(Record):
    kind: ClassVar[Kind] = Kind.RUN_STARTED
    run_id: str
    spec: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class ControllerStarted(Record):
    kind: ClassVar[Kind] = Kind.CONTROLLER_STARTED
    pid: int | None = None
    host: str | None = None
    resumed: bool = False
    repaired_torn_line: bool = False


@dataclass(frozen=True, kw_only=True)
class ControllerStopped(Record):
    kind: ClassVar[Kind] = Kind.CONTROLLER_STOPPED
    reason: str


@dataclass(frozen=True, kw_only=True)
class PlanChosen(Record):
    """The plan for the next job and what it was planned on (``available``: GPUs free for the run)."""

    kind: ClassVar[Kind] = Kind.PLAN
    reason: str
    available: Gpus
    gpus: Gpus
    throughput: float
    cost_per_hour: float = 0.0
    planner_available: Gpus | None = None
    plan_file: str | None = None
    iteration_s: float | None = None
    pipelines: int | None = None
    # objective time, planned on the queue: seconds from queue_read_t to the expected start (and its source:
    # idle now, squeue timeline, sbatch --test-only, sacct history) and to the expected finish
    expected_start_s: float | None = None
    start_source: str | None = None
    expected_finish_s: float | None = None
    queue_read_t: float | None = None
    runtime: str | None = None  # who trains the plan (None: a journal without it, megatron_patch)
    runtime_reason: str | None = None  # run --runtime auto: why this runtime's plan was taken


@dataclass(frozen=True, kw_only=True)
class NoPlan(Record):
    kind: ClassVar[Kind] = Kind.NO_PLAN
    message: str
    available: Gpus


@dataclass(frozen=True, kw_only=True)
class Baseline(Record):
    """The GPUs free for the run when it last judged them: only more than these is a change."""

    kind: ClassVar[Kind] = Kind.BASELINE
    available: Gpus
    note: str | None = None


@dataclass(frozen=True, kw_only=True)
class SubmitIntent(Record):
    """Journaled before ``sbatch``: the attempt exists from here on, and its job is found by ``job_name``."""

    kind: ClassVar[Kind] = Kind.SUBMIT_INTENT
    attempt: int
    job_name: str
    plan_file: str
    script: str
    reason: str
    gpus: Gpus
    throughput: float
    cost_per_hour: float
    trigger: str | None = None
    trigger_t: float | None = None
    handover_from: int | None = None  # the attempt whose job this one took over from (grown beside it)


@dataclass(frozen=True, kw_only=True)
class Submitted(Record):
    kind: ClassVar[Kind] = Kind.SUBMITTED
    attempt: int
    job_id: str
    log: str
    submitted_t: float | None = None  # a job submitted before it became the run's attempt (grown beside)


@dataclass(frozen=True, kw_only=True)
class Adopted(Record):
    """The attempt's job, found in Slurm by its name after a restart."""

    kind: ClassVar[Kind] = Kind.ADOPTED
    attempt: int
    job_id: str
    log: str


@dataclass(frozen=True, kw_only=True)
class JobRunning(Record):
    kind: ClassVar[Kind] = Kind.JOB_RUNNING
    attempt: int
    job_id: str | None = None
    nodes: list[str] = field(default_factory=list)
    since: float | None = None  # when it started running, if before this record (grown beside)


@dataclass(frozen=True, kw_only=True)
class FirstStep(Record):
    kind: ClassVar[Kind] = Kind.FIRST_STEP
    attempt: int
    step: int
    loaded_step: int = 0
    job_id: str | None = None
    consumed_samples: int | None = None


@dataclass(frozen=True, kw_only=True)
class RecoveryMeasured(Record):
    """An allocation change and the first step after it: what the change cost (in a new job or in place)."""

    kind: ClassVar[Kind] = Kind.RECOVERY
    attempt: int
    trigger: str | None
    trigger_t: float | None
    first_step_t: float
    downtime_s: float
    recovery_s: float
    queue_wait_s: float | None
    ranks_idle_s: float | None
    new_job: bool
    in_place: bool = False
    handover: bool = False
    submitted_t: float | None = None
    running_t: float | None = None
    step: int | None = None
    loaded_step: int | None = None


@dataclass(frozen=True, kw_only=True)
class InPlaceStep(Record):
    """The job's batch script re-planned its next step on its surviving nodes: the runtime's ``in_place`` event,
    its fields written beside ``attempt`` (:data:`INLINE`), as the job's log has them."""

    kind: ClassVar[Kind] = Kind.IN_PLACE
    attempt: int
    change: InPlace


@dataclass(frozen=True, kw_only=True)
class InPlaceRefusedStep(Record):
    kind: ClassVar[Kind] = Kind.IN_PLACE_REFUSED
    attempt: int
    job_id: str
    step_index: int
    rc: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class GrowSubmitted(Record):
    """A bigger job submitted beside the attempt's running one; it becomes attempt ``next_attempt``."""

    kind: ClassVar[Kind] = Kind.GROW_SUBMITTED
    attempt: int
    next_attempt: int
    job_id: str
    job_name: str
    log: str
    plan_file: str
    script: str
    trigger_t: float
    gpus: Gpus
    throughput: float
    cost_per_hour: float


@dataclass(frozen=True, kw_only=True)
class GrowRunning(Record):
    kind: ClassVar[Kind] = Kind.GROW_RUNNING
    attempt: int
    job_id: str
    nodes: list[str]


@dataclass(frozen=True, kw_only=True)
class GateOpened(Record):
    kind: ClassVar[Kind] = Kind.GATE_OPENED
    attempt: int
    next_attempt: int
    job_id: str


@dataclass(frozen=True, kw_only=True)
class GrowCancelled(Record):
    """The bigger job will not take over; ``queue``: the idle GPUs per node when it timed out pending (partition ->
    node -> GPUs), on which a bigger job is not tried again."""

    kind: ClassVar[Kind] = Kind.GROW_CANCELLED
    attempt: int
    job_id: str
    reason: str
    state: str | None = None
    queue: dict[str, dict[str, int]] | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointSeen(Record):
    """A newer complete checkpoint (``attempt``: the job that ran when it was seen; None between jobs)."""

    kind: ClassVar[Kind] = Kind.CHECKPOINT
    step: int
    path: str | None = None
    consumed_samples: int | None = None
    attempt: int | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointPassedOver(Record):
    """A job resuming passed over a checkpoint that does not verify (the runtime's ``checkpoint_skipped``):
    ``step`` of ``path``, ``reason``, and ``using``, the checkpoint it loaded instead (None: none verified)."""

    kind: ClassVar[Kind] = Kind.CHECKPOINT_PASSED_OVER
    attempt: int
    path: str
    reason: str
    step: int | None = None
    using: str | None = None
    job_id: str | None = None


@dataclass(frozen=True, kw_only=True)
class NodeLost(Record):
    kind: ClassVar[Kind] = Kind.NODE_LOST
    attempt: int
    nodes: dict[str, str]  # node -> its state
    job_id: str | None = None


@dataclass(frozen=True, kw_only=True)
class IdleGpus(Record):
    kind: ClassVar[Kind] = Kind.IDLE_GPUS
    attempt: int
    change: dict[str, list[int]]  # partition -> [before, now]
    available: Gpus


@dataclass(frozen=True, kw_only=True)
class Decision(Record):
    """Checkpoint (and move) or resize or keep, and why; a resize judgement carries the policy's numbers."""

    kind: ClassVar[Kind] = Kind.DECISION
    attempt: int
    action: str
    reason: str
    trigger: str | None = None
    trigger_t: float | None = None
    candidate: dict[str, Any] | None = None
    current: dict[str, Any] | None = None
    restart_cost_s: float | None = None
    remaining_samples: int | None = None
    step: int | None = None
    resize: bool | None = None
    gain: float | None = None
    keep: float | None = None
    move: float | None = None


@dataclass(frozen=True, kw_only=True)
class SignalSent(Record):
    kind: ClassVar[Kind] = Kind.SIGNAL_SENT
    attempt: int
    reason: str
    signal: str = "USR1"
    job_id: str | None = None


@dataclass(frozen=True, kw_only=True)
class JobStopped(Record):
    """The attempt's job stopped training (or must): Slurm's state, why, and its runtime's last step."""

    kind: ClassVar[Kind] = Kind.JOB_STOPPED
    attempt: int
    state: str
    reason: str
    job_id: str | None = None
    step: int | None = None
    last_step_t: float | None = None
    exit_codes: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class Cancel(Record):
    kind: ClassVar[Kind] = Kind.CANCEL
    job_id: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class JobGone(Record):
    """A job is gone (``attempt`` None: a stray job of the run, cancelled; ``job_id`` None: never submitted)."""

    kind: ClassVar[Kind] = Kind.JOB_GONE
    state: str | None
    job_id: str | None = None
    attempt: int | None = None


@dataclass(frozen=True, kw_only=True)
class Failure(Record):
    kind: ClassVar[Kind] = Kind.FAILURE
    attempt: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class Backoff(Record):
    kind: ClassVar[Kind] = Kind.BACKOFF
    seconds: float
    until: float


@dataclass(frozen=True, kw_only=True)
class Finished(Record):
    """The run reached its last step (``group``/``states``: a run across clusters)."""

    kind: ClassVar[Kind] = Kind.FINISHED
    step: int
    checkpoint: str | None = None
    group: int | None = None
    states: dict[str, str] | None = None


@dataclass(frozen=True, kw_only=True)
class GaveUp(Record):
    kind: ClassVar[Kind] = Kind.GAVE_UP
    reason: str


@dataclass(frozen=True, kw_only=True)
class StopRequested(Record):
    """The user asked the run to end (``sailor-hpc run stop``/``cancel``): ``how`` is ``stop`` (every rank saves
    a complete checkpoint first) or ``cancel`` (at once); ``by`` names the user."""

    kind: ClassVar[Kind] = Kind.STOP_REQUESTED
    how: str
    by: str


@dataclass(frozen=True, kw_only=True)
class RunStopped(Record):
    """The run ended by its user's decision, not a fault: no job of it is left; ``run --resume`` continues it.
    ``how``: stop, cancel, or ``cancelled`` (the user cancelled a job outside sailor-hpc)."""

    kind: ClassVar[Kind] = Kind.RUN_STOPPED
    how: str
    by: str
    step: int  # the newest complete checkpoint the run left
    jobs: dict[str, str] = field(default_factory=dict)  # job id -> its final state


@dataclass(frozen=True, kw_only=True)
class RunResumed(Record):
    """``run --resume`` continued a run that had stopped (``was``: why, as the journal says) or given up; the
    restarts it may make count from here."""

    kind: ClassVar[Kind] = Kind.RUN_RESUMED
    was: str
    step: int


@dataclass(frozen=True, kw_only=True)
class ErrorSeen(Record):
    """An error the run goes on after (``where``: Slurm unavailable, sbatch, a job log line, ...)."""

    kind: ClassVar[Kind] = Kind.ERROR
    message: str
    where: str
    group: int | None = None


# --------------------------------------------------------------------------- a run across clusters (groups)

@dataclass(frozen=True, kw_only=True)
class GroupIntent(Record):
    """Journaled before the group's first ``sbatch``: the group exists from here on, and each cluster's job is
    found by its name in ``job_names`` (cluster -> name, unique to the run), also when only some were submitted."""

    kind: ClassVar[Kind] = Kind.GROUP_INTENT
    group: int
    job_names: dict[str, str]
    start_step: int
    plan_file: str
    gpus: Gpus = field(default_factory=dict)  # the plan's, and its simulated score (absent: written before them)
    throughput: float = 0.0
    cost_per_hour: float = 0.0


@dataclass(frozen=True, kw_only=True)
class GroupSubmitted(Record):
    kind: ClassVar[Kind] = Kind.GROUP_SUBMITTED
    group: int
    jobs: dict[str, str]  # cluster -> job id
    clusters: list[str]
    start_step: int
    plan_file: str


@dataclass(frozen=True, kw_only=True)
class GroupAdopted(Record):
    kind: ClassVar[Kind] = Kind.GROUP_ADOPTED
    group: int
    jobs: dict[str, str]
    states: dict[str, str]


@dataclass(frozen=True, kw_only=True)
class GroupRunning(Record):
    kind: ClassVar[Kind] = Kind.GROUP_RUNNING
    group: int


@dataclass(frozen=True, kw_only=True)
class GroupRecovered(Record):
    """The group answering an allocation change (``trigger``, seen at ``trigger_t``) runs whole: the change cost
    the run ``recovery_s`` (queue wait included: the group's jobs only train together)."""

    kind: ClassVar[Kind] = Kind.GROUP_RECOVERED
    group: int
    trigger: str
    recovery_s: float
    trigger_t: float | None = None  # absent: written before it was


@dataclass(frozen=True, kw_only=True)
class GroupFailed(Record):
    kind: ClassVar[Kind] = Kind.GROUP_FAILED
    group: int
    states: dict[str, str]
    clusters: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class GroupStopped(Record):
    kind: ClassVar[Kind] = Kind.GROUP_STOPPED
    group: int
    reason: str
    states: dict[str, str] | None = None


@dataclass(frozen=True, kw_only=True)
class ClusterDropped(Record):
    """Clusters whose jobs pended past the bound: the group is cancelled and re-planned without them."""

    kind: ClassVar[Kind] = Kind.CLUSTER_DROPPED
    group: int
    clusters: list[str]
    reason: str = "pending"


@dataclass(frozen=True, kw_only=True)
class ClusterLost(Record):
    kind: ClassVar[Kind] = Kind.CLUSTER_LOST
    group: int
    clusters: list[str]
    states: dict[str, str]


@dataclass(frozen=True, kw_only=True)
class RegrowDecision(Record):
    kind: ClassVar[Kind] = Kind.REGROW_DECISION
    group: int
    clusters: list[str]
    resize: bool
    reason: str
    gain: float | None = None
    keep: float | None = None
    move: float | None = None


@dataclass(frozen=True, kw_only=True)
class Regrown(Record):
    kind: ClassVar[Kind] = Kind.REGROWN
    group: int
    clusters: list[str]
    step: int


#: the record class of each kind
RECORDS: dict[str, type[Record]] = {cls.kind.value: cls for cls in Record.__subclasses__()}
assert set(RECORDS) == {k.value for k in Kind}, "every kind needs its record class"

_EDITED = "the journal was edited or corrupted, or written by another sailor-hpc version: restore it or start a new run"


#: records that embed a runtime event (record class -> its field): the event's fields are the line's own keys,
#: beside the record's, so a record reads as the event it copies and as the journals that flattened it by hand
INLINE: dict[type[Record], str] = {InPlaceStep: "change"}


def encode(rec: Record) -> dict[str, Any]:
    """The record as its journal line's JSON object: ``seq``, ``t``, ``kind`` and every field."""
    obj = {**dataclasses.asdict(rec), "kind": rec.kind.value}
    inline = INLINE.get(type(rec))
    if inline is not None:
        obj.update(obj.pop(inline))
    return obj


def _nested(cls: type[Record], obj: dict[str, Any]) -> dict[str, Any]:
    """A line's object with an embedded event's fields gathered under its field (:data:`INLINE`)."""
    inline = INLINE.get(cls)
    if inline is None:
        return obj
    names = {f.name for f in dataclasses.fields(get_type_hints(cls)[inline])}
    return {**{k: v for k, v in obj.items() if k not in names}, inline: {k: v for k, v in obj.items() if k in names}}


def decode(obj: dict[str, Any], *, file: str | Path | None = None, line: int | None = None) -> Record:
    """The typed record of one journal line's JSON object. Refuses (SailorError naming ``file``, the line and
    the field) an unknown kind, a missing or unknown field, and a field of the wrong type."""
    where = f"line {line}" if line is not None else None
    at = f"{where}: " if where else ""
    kind = obj.get("kind")
    cls = RECORDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise SailorError(f"{at}unknown record kind {kind!r}", file=file, field=where, fix=_EDITED)
    try:
        return from_json(cls, _nested(cls, obj), skip=("kind",))
    except Mismatch as exc:
        said = {"unknown": f" has {exc.message}", "missing": f" has no field {exc.field!r}", "type": f"'s {exc.message}"}
        raise SailorError(f"{at}the {kind!r} record{said[exc.problem]}", file=file, field=where, fix=_EDITED) from None
