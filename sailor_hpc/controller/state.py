"""The run directory and the controller's state, folded from the journal.

A run directory holds ``run.json`` (the spec), ``journal.jsonl`` (every event and decision),
``plans/attempt-NNN.json`` and ``scripts/attempt-NNN.sbatch`` (what each job ran), ``logs/`` (the
jobs' output) and ``controller.lock`` (one controller at a time). The state is never stored
separately: :func:`fold` replays the journal, and the running controller applies each record it
writes with the same :func:`apply`, so a resumed controller and the one that was killed agree by
construction.

Each Slurm job is an *attempt*. Its record of intent (``submit_intent``, with the job name
``sailor-<run id>-<attempt>``) is journaled before ``sbatch`` runs, so a controller killed between
``sbatch`` and journaling the job id finds the job again by name instead of submitting a duplicate.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sailor_hpc.controller.journal import Journal, Kind, Record, read_journal, read_journal_lines
from sailor_hpc.controller.spec import RunSpec
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.locking import LockTimeout, file_lock

#: the reason of a job submitted because more GPUs made a better plan worth its restart
RESIZE_REASON = Kind.IDLE_GPUS


def job_name(run_id: str, attempt: int) -> str:
    return f"sailor-{run_id}-{attempt:03d}"


def job_name_prefix(run_id: str) -> str:
    return f"sailor-{run_id}-"


class RunDir:
    """Paths of one controlled run."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).absolute()

    @property
    def spec_file(self) -> Path:
        return self.path / "run.json"

    @property
    def journal_file(self) -> Path:
        return self.path / "journal.jsonl"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    def plan_file(self, attempt: int) -> Path:
        return self.path / "plans" / f"attempt-{attempt:03d}.json"

    def gate_file(self, attempt: int) -> Path:
        """Created once the job this attempt takes over from is gone: its ranks wait for it to load."""
        return self.path / "gates" / f"attempt-{attempt:03d}.go"

    def script_file(self, attempt: int) -> Path:
        return self.path / "scripts" / f"attempt-{attempt:03d}.sbatch"

    def spec(self) -> RunSpec:
        return RunSpec.read(self.spec_file)

    def journal(self) -> Journal:
        return Journal(self.journal_file)

    def records(self) -> list[Record]:
        return read_journal(self.journal_file)

    def state(self) -> RunState:
        """The run's state folded from its journal; an inconsistent journal is refused naming the line."""
        records, lines = read_journal_lines(self.journal_file)
        return fold(records, source=self.journal_file, lines=lines)

    @classmethod
    def create(cls, path: str | Path, spec: RunSpec) -> RunDir:
        rd = cls(path)
        if rd.journal_file.exists() or rd.spec_file.exists():
            raise SailorError("this directory already holds a controlled run", file=rd.path, field="--run-dir",
                              fix=f"continue it with `sailor-hpc run --resume {rd.path}` or pick another --run-dir")
        for sub in (rd.path, rd.logs, rd.path / "plans", rd.path / "scripts"):
            sub.mkdir(parents=True, exist_ok=True)
        spec.write(rd.spec_file)
        return rd

    @classmethod
    def existing(cls, path: str | Path) -> RunDir:
        rd = cls(path)
        if not rd.spec_file.is_file():
            raise SailorError("not a run directory (no run.json)", file=rd.path, field="--resume",
                              fix="pass the --run-dir of an earlier `sailor-hpc run`")
        return rd

    def controller_alive(self) -> bool:
        """Whether a controller holds the run's lock right now."""
        if not (self.path / "controller.lock").exists():
            return False
        try:
            with file_lock(self.path / "controller", timeout_s=0.0):
                return False
        except LockTimeout:
            return True

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Held for the controller's whole life; the kernel drops it when the controller dies."""
        try:
            lock = file_lock(self.path / "controller", timeout_s=1.0)
            lock.__enter__()
        except LockTimeout:
            raise SailorError("another controller is running this run", file=self.path / "controller.lock",
                              fix="stop it first (or wait for it to end); two controllers would submit twice") from None
        with contextlib.ExitStack() as stack:
            stack.push(lock)
            yield


@dataclass
class Successor:
    """A bigger job submitted beside an attempt's running job (grow without a gap), from ``grow_submitted``
    on; each later step of the takeover sets its own field, so no meaning hides in a key's presence."""

    next_attempt: int  # the attempt number it becomes once the old job is gone
    job_id: str
    job_name: str
    log: str
    plan_file: str
    script: str
    trigger_t: float
    gpus: dict[str, int]
    throughput: float
    cost_per_hour: float
    submitted_t: float
    running_t: float | None = None  # grow_running: every component runs
    nodes: list[str] = field(default_factory=list)
    gate_t: float | None = None  # gate_opened: its ranks load (and save) from here on, the old job's never again
    cancelled: str | None = None  # grow_cancelled: why it will not take over


@dataclass(frozen=True)
class Recovery:
    """How long an allocation change cost the run (``recovery``): from the change to the first step after it."""

    t: float
    trigger: str | None
    trigger_t: float | None
    in_place: bool  # inside the same job (no queue), else a new job
    downtime_s: float  # the change to the first step after it
    recovery_s: float  # downtime less the new job's queue wait
    queue_wait_s: float | None  # the new job's queue wait (0 in place; None when not measured)
    ranks_idle_s: float | None  # the runtime's last step before the change to its first step after

    @property
    def idle_s(self) -> float:
        """What the change cost the ranks: their measured idle time, else the downtime."""
        return self.downtime_s if self.ranks_idle_s is None else self.ranks_idle_s


@dataclass
class InPlaceChange:
    """A step of the attempt's job re-planned on its surviving nodes (``in_place``), and what it cost."""

    step_index: int
    t_step_end: float | None  # when the step that lost nodes ended
    lost: dict[str, str]
    trigger: tuple[str, float] | None  # the change it answers, when the controller saw it first
    recovery: Recovery | None = None  # set once the next step trained


@dataclass(frozen=True)
class StopRequest:
    """The controller asked the attempt's job to checkpoint and stop (``signal_sent``)."""

    t: float
    reason: str
    signal: str


@dataclass
class Attempt:
    """One Slurm job of the run, from the intent to submit until it is gone."""

    number: int
    job_name: str
    plan_file: str
    script: str
    reason: str  # why it was submitted: start, node_lost, resize, requeued, failed, ...
    trigger: str | None  # the allocation change it answers (None for the first job)
    trigger_t: float | None
    gpus: dict[str, int]
    throughput: float
    cost_per_hour: float
    intent_t: float
    job_id: str | None = None
    log: str | None = None
    submitted_t: float | None = None
    running_t: float | None = None
    first_step_t: float | None = None
    start_step: int | None = None
    nodes: list[str] = field(default_factory=list)  # the job's nodes when it was seen running
    stop: StopRequest | None = None  # the controller asked it to checkpoint and stop
    lost_nodes: dict[str, str] = field(default_factory=dict)
    stopped: dict[str, Any] | None = None  # job_stopped: it stopped running, and why
    end_state: str | None = None
    gone: bool = False
    recovery: Recovery | None = None  # the change this (new) job answered, and what it cost
    advanced: bool = False  # a newer complete checkpoint appeared while it ran (or right after it)
    in_place: list[InPlaceChange] = field(default_factory=list)  # steps re-planned on its survivors
    released: dict[str, str] = field(default_factory=dict)  # lost nodes handled in place (not lost again)
    successor: Successor | None = None  # a bigger job submitted beside this one (grow without a gap)
    handover_from: int | None = None  # the attempt whose job this one took over from, while it trained

    @property
    def waits_for_successor(self) -> bool:
        """A bigger job was submitted beside this one and neither took over nor was cancelled."""
        return self.successor is not None and self.successor.cancelled is None

    @property
    def successor_loading(self) -> bool:
        """The bigger job's gate is open: its ranks load and save from here on, this job's never again."""
        return self.successor is not None and self.waits_for_successor and self.successor.gate_t is not None


@dataclass
class GeoGroup:
    """One group of a run across clusters: one job per cluster, all of one plan (the co-scheduler's attempt)."""

    number: int
    clusters: list[str]
    jobs: dict[str, str]  # cluster -> job id
    start_step: int
    plan_file: str
    submitted_t: float
    running_t: float | None = None
    end: str | None = None  # why the co-scheduler stopped it (None: it may still run)


@dataclass
class RunState:
    run_id: str | None = None
    attempts: list[Attempt] = field(default_factory=list)
    finished: dict[str, Any] | None = None
    gave_up: str | None = None
    failures_in_a_row: int = 0  # jobs that ended without training a step, since the last step
    backoff_until: float | None = None
    checkpoint: dict[str, Any] | None = None  # newest complete checkpoint seen: step, consumed_samples
    baseline: dict[str, int] = field(default_factory=dict)  # GPUs available to the run when last judged
    last_replan_t: float | None = None
    trigger: tuple[str, float] | None = None  # the change the next submission answers
    recoveries: list[Recovery] = field(default_factory=list)
    controller_starts: int = 0
    groups: list[GeoGroup] = field(default_factory=list)  # a run across clusters: its groups, in order
    left: dict[str, float] = field(default_factory=dict)  # cluster -> when it was dropped or lost (not back yet)

    @property
    def current_group(self) -> GeoGroup | None:
        """The group whose jobs may still run (the co-scheduler stops one before it submits the next)."""
        if self.groups and self.groups[-1].end is None:
            return self.groups[-1]
        return None

    @property
    def current(self) -> Attempt | None:
        """The attempt whose job may still exist (at most one: a new one is only submitted after it is gone)."""
        if self.attempts and not self.attempts[-1].gone:
            return self.attempts[-1]
        return None

    @property
    def restarts(self) -> int:
        """Jobs after the first that the run had to start (a resize for more GPUs is a choice, not counted)."""
        return sum(1 for a in self.attempts[1:] if a.reason != RESIZE_REASON)

    @property
    def restarts_without_progress(self) -> int:
        """Restarts since the last job that advanced the checkpoint: what ``max_restarts`` limits, so a
        long run that checkpoints on every time limit or preemption never runs out of restarts, and one
        that fails (or cannot be submitted) again and again without progress gives up."""
        n = 0
        for i, a in enumerate(self.attempts):
            if i > 0 and a.reason != RESIZE_REASON:
                n += 1
            if a.advanced:
                n = 0
        return n

    @property
    def next_reason(self) -> str:
        """Why the next job would be submitted: the change it answers, else start / restart."""
        if self.trigger is not None:
            return self.trigger[0]
        return "start" if not self.attempts else "restart"

    def attempt(self, number: int) -> Attempt:
        for a in self.attempts:
            if a.number == number:
                return a
        raise KeyError(f"journal refers to attempt {number}, which has no submit_intent record")


def apply(state: RunState, rec: Record) -> None:
    """Advance ``state`` by one journal record (the one place that gives records their meaning)."""
    kind, t = rec["kind"], float(rec["t"])
    att = state.attempt(rec["attempt"]) if rec.get("attempt") is not None and kind != Kind.SUBMIT_INTENT else None
    if kind == Kind.RUN_STARTED:
        state.run_id = rec.get("run_id")
    elif kind == Kind.CONTROLLER_STARTED:
        state.controller_starts += 1
    elif kind == Kind.PLAN:
        state.baseline = {k: int(v) for k, v in rec.get("available", {}).items()}
    elif kind == Kind.BASELINE:
        state.baseline = {k: int(v) for k, v in rec["available"].items()}
    elif kind == Kind.SUBMIT_INTENT:
        state.attempts.append(Attempt(
            number=rec["attempt"], job_name=rec["job_name"], plan_file=rec["plan_file"], script=rec["script"],
            reason=rec["reason"], trigger=rec.get("trigger"), trigger_t=rec.get("trigger_t"),
            gpus=dict(rec.get("gpus", {})), throughput=float(rec.get("throughput", 0.0)),
            cost_per_hour=float(rec.get("cost_per_hour", 0.0)), intent_t=t, handover_from=rec.get("handover_from")))
        state.trigger = None
        state.backoff_until = None
    elif kind in (Kind.SUBMITTED, Kind.ADOPTED):
        assert att is not None
        att.job_id = str(rec["job_id"])
        att.log = rec.get("log") or att.log
        att.submitted_t = att.submitted_t or rec.get("submitted_t") or (t if kind == Kind.SUBMITTED else att.intent_t)
    elif kind == Kind.JOB_RUNNING:
        assert att is not None
        att.running_t = att.running_t or rec.get("since") or t
        att.nodes = sorted(set(att.nodes) | set(rec.get("nodes", [])))
    elif kind == Kind.FIRST_STEP:
        assert att is not None
        att.first_step_t = att.first_step_t or t
        att.start_step = rec.get("loaded_step", 0)
        state.failures_in_a_row = 0
    elif kind == Kind.RECOVERY:
        assert att is not None
        recovery = Recovery(t=t, trigger=rec.get("trigger"), trigger_t=_opt_float(rec.get("trigger_t")),
                            in_place=bool(rec.get("in_place")), downtime_s=float(rec["downtime_s"]),
                            recovery_s=float(rec["recovery_s"]), queue_wait_s=_opt_float(rec.get("queue_wait_s")),
                            ranks_idle_s=_opt_float(rec.get("ranks_idle_s")))
        if recovery.in_place:
            att.in_place[-1].recovery = recovery
        else:
            att.recovery = recovery
        state.recoveries.append(recovery)
    elif kind == Kind.GROW_SUBMITTED:
        assert att is not None
        att.successor = Successor(
            next_attempt=int(rec["next_attempt"]), job_id=str(rec["job_id"]), job_name=str(rec["job_name"]),
            log=str(rec["log"]), plan_file=str(rec["plan_file"]), script=str(rec["script"]),
            trigger_t=float(rec["trigger_t"]), gpus=dict(rec.get("gpus", {})), throughput=float(rec.get("throughput", 0.0)),
            cost_per_hour=float(rec.get("cost_per_hour", 0.0)), submitted_t=t)
    elif kind == Kind.GROW_RUNNING:
        assert att is not None and att.successor is not None
        att.successor.running_t, att.successor.nodes = t, list(rec.get("nodes", []))
    elif kind == Kind.GATE_OPENED:
        assert att is not None and att.successor is not None
        att.successor.gate_t = att.successor.gate_t or t
    elif kind == Kind.GROW_CANCELLED:
        assert att is not None and att.successor is not None
        att.successor.cancelled = str(rec.get("reason") or "cancelled")
        state.trigger = None
    elif kind == Kind.IN_PLACE:
        assert att is not None
        att.in_place.append(InPlaceChange(step_index=int(rec["step_index"]), t_step_end=_opt_float(rec.get("t_step_end")),
                                          lost=dict(rec.get("lost", {})), trigger=state.trigger))
        att.plan_file, att.gpus, att.nodes = rec["plan_file"], dict(rec["gpus"]), list(rec["nodes"])
        att.throughput, att.cost_per_hour = float(rec["throughput"]), float(rec["cost_per_hour"])
        att.released.update({**att.lost_nodes, **rec.get("lost", {})})
        att.lost_nodes, att.stop, state.trigger = {}, None, None
    elif kind == Kind.CHECKPOINT:
        state.checkpoint = {"step": rec["step"], "consumed_samples": rec.get("consumed_samples"), "path": rec.get("path")}
        if state.attempts:  # one job at a time: a new checkpoint is the latest job's (also if seen after it ended)
            state.attempts[-1].advanced = True
    elif kind == Kind.NODE_LOST:
        assert att is not None
        att.lost_nodes.update(rec["nodes"])
        state.trigger = state.trigger or (Kind.NODE_LOST, t)
    elif kind == Kind.IDLE_GPUS:
        state.last_replan_t = t
    elif kind == Kind.DECISION:
        if rec["action"] in ("resize", "checkpoint"):
            state.trigger = (str(rec.get("trigger") or rec["action"]), float(rec.get("trigger_t", t)))
    elif kind == Kind.SIGNAL_SENT:
        assert att is not None
        att.stop = StopRequest(t=t, reason=str(rec.get("reason") or "asked to stop"), signal=str(rec.get("signal") or "USR1"))
    elif kind == Kind.JOB_STOPPED:
        assert att is not None
        att.stopped = {k: v for k, v in rec.items() if k not in ("seq", "kind", "attempt")}
        state.trigger = state.trigger or (rec.get("reason", "stopped"), t)
    elif kind == Kind.JOB_GONE and att is not None:  # without an attempt: a stray job of the run, cancelled
        att.gone = True
        att.end_state = rec.get("state")
    elif kind in _GEO:
        _apply_geo(state, rec, t)
    elif kind == Kind.FAILURE:
        state.failures_in_a_row += 1
    elif kind == Kind.BACKOFF:
        state.backoff_until = float(rec["until"])
    elif kind == Kind.FINISHED:
        state.finished = {k: v for k, v in rec.items() if k not in ("seq", "kind")}
    elif kind == Kind.GAVE_UP:
        state.gave_up = rec.get("reason", "gave up")


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


_GEO = frozenset({Kind.GROUP_SUBMITTED, Kind.GROUP_RUNNING, Kind.GROUP_STOPPED, Kind.CLUSTER_DROPPED,
                  Kind.CLUSTER_LOST, Kind.REGROWN})


def _apply_geo(state: RunState, rec: Record, t: float) -> None:
    """The co-scheduler's records (a run across clusters): its groups and the clusters that left."""
    kind = rec["kind"]
    if kind == Kind.GROUP_SUBMITTED:
        state.groups.append(GeoGroup(number=rec["group"], clusters=list(rec["clusters"]), jobs=dict(rec["jobs"]),
                                     start_step=int(rec.get("start_step", 0)), plan_file=rec["plan_file"],
                                     submitted_t=t))
        return
    if kind in (Kind.CLUSTER_DROPPED, Kind.CLUSTER_LOST):
        state.left.update({c: t for c in rec.get("clusters", [])})
    elif kind == Kind.REGROWN:
        for c in rec.get("clusters", []):
            state.left.pop(c, None)
    group = next((g for g in state.groups if g.number == rec.get("group")), None)
    if group is None:
        raise KeyError(f"journal refers to group {rec.get('group')}, which has no group_submitted record")
    if kind == Kind.GROUP_RUNNING:
        group.running_t = group.running_t or t
    elif kind == Kind.GROUP_STOPPED:
        group.end = str(rec.get("reason", "stopped"))


class InconsistentJournal(SailorError):
    """Well-formed records that do not fit together (a record of an attempt never submitted, a field of the
    wrong type): the journal was edited or mixed with another run's, and replaying it would guess."""


def fold(records: Iterable[Record], *, source: str | Path | None = None, lines: list[int] | None = None) -> RunState:
    """The state after every record, in order. A record :func:`apply` cannot give a meaning is refused as
    :class:`InconsistentJournal`, naming the file (``source``), the record's line and the fix."""
    state = RunState()
    for i, rec in enumerate(records):
        try:
            apply(state, rec)
        except (KeyError, TypeError, ValueError, AssertionError, AttributeError, IndexError) as exc:
            line = lines[i] if lines is not None and i < len(lines) else i + 1
            raise InconsistentJournal(
                f"line {line}: record seq {rec.get('seq')} ({rec.get('kind')!r}) does not fit the records before "
                f"it ({type(exc).__name__}: {exc})", file=source, field=f"line {line}",
                fix="the journal was edited or mixed with another run's: restore it, or start a new run "
                    "(sailor-hpc run without --resume)") from None
    return state
