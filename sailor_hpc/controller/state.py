"""The run directory and the controller's state, folded from the journal.

A run directory holds ``run.json`` (the spec), ``journal.jsonl`` (every event and decision),
``plans/attempt-NNN.json`` and ``scripts/attempt-NNN.sbatch`` (what each job ran), ``logs/`` (the
jobs' output) and ``controller.lock`` (one controller at a time). The state is never stored
separately: :func:`fold` replays the journal, and the running controller applies each record it
writes with the same :func:`apply`, so a resumed controller and the one that was killed agree by
construction.

An *attempt* is a group of one Slurm job per cluster it uses: one job on a site of one cluster, one per
cluster on a site of several (a het job cannot span clusters). Its record of intent is journaled before
``sbatch`` runs (``submit_intent``, job name ``sailor-<run id>-<attempt>``; across clusters ``group_intent``
with every cluster's name, ``sailor-<run id>-<attempt>-<cluster>``), so a controller killed between
``sbatch`` and journaling the job ids finds the jobs again by name instead of submitting duplicates. The
``group_*`` records are the attempt records of a run across clusters: they fold into the same attempts.
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sailor_hpc.controller import records
from sailor_hpc.controller.journal import Journal, read_journal, read_journal_lines
from sailor_hpc.controller.spec import RunSpec
from sailor_hpc.core.atomic import atomic_write_text
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.locking import LockTimeout, file_lock

#: the reason of a job submitted because more GPUs made a better plan worth its restart
RESIZE_REASON = records.Kind.IDLE_GPUS
#: how a user ends a run: stop (every rank saves a complete checkpoint first) or cancel (at once)
STOP_HOWS = ("stop", "cancel")


@dataclass(frozen=True)
class StopAsk:
    """A user's request to end the run, as ``sailor-hpc run stop``/``cancel`` wrote it."""

    how: str
    by: str


def job_name(run_id: str, attempt: int) -> str:
    return f"sailor-{run_id}-{attempt:03d}"


def job_name_prefix(run_id: str) -> str:
    return f"sailor-{run_id}-"


def _attempt_stem(attempt: int, try_: int) -> str:
    return f"attempt-{attempt:03d}" + (f".{try_}" if try_ > 1 else "")


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

    def plan_file(self, attempt: int, try_: int = 1) -> Path:
        """The plan of the attempt's ``try_``-th job. A later job under the same number (a bigger job dropped
        before it took over, then another one) gets a file of its own: the journal names the earlier one, and
        a plan file, once written, is never rewritten (the controller reads each once)."""
        return self.path / "plans" / f"{_attempt_stem(attempt, try_)}.json"

    def next_try(self, attempt: int) -> int:
        """The first try of ``attempt`` that has no plan file yet."""
        try_ = 1
        while self.plan_file(attempt, try_).exists():
            try_ += 1
        return try_

    def gate_file(self, attempt: int) -> Path:
        """Created once the job this attempt takes over from is gone: its ranks wait for it to load."""
        return self.path / "gates" / f"attempt-{attempt:03d}.go"

    def script_file(self, attempt: int, cluster: str | None = None, try_: int = 1) -> Path:
        """The job script of the attempt's ``try_``-th job; across clusters, ``cluster``'s job's."""
        stem = _attempt_stem(attempt, try_)
        return self.path / "scripts" / (f"{stem}.sbatch" if cluster is None else f"{stem}-{cluster}.sbatch")

    def spec(self) -> RunSpec:
        return RunSpec.read(self.spec_file)

    def journal(self) -> Journal:
        return Journal(self.journal_file)

    def records(self) -> list[records.Record]:
        return read_journal(self.journal_file)

    def state(self) -> RunState:
        """The run's state folded from its journal; an inconsistent journal is refused naming the line."""
        entries, lines = read_journal_lines(self.journal_file)
        return fold(entries, source=self.journal_file, lines=lines)

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
    def existing(cls, path: str | Path, option: str = "--resume") -> RunDir:
        """The run directory at ``path`` (``option``: the argument that named it, for the error)."""
        rd = cls(path)
        if not rd.spec_file.is_file():
            raise SailorError("not a run directory (no run.json)", file=rd.path, field=option,
                              fix="pass the --run-dir of an earlier `sailor-hpc run`")
        return rd

    @property
    def stop_request_file(self) -> Path:
        """Written by ``sailor-hpc run stop``/``cancel``: the controller that holds the lock ends the run."""
        return self.path / "stop.request"

    def request_stop(self, how: str, by: str) -> None:
        if how not in STOP_HOWS:
            raise SailorError(f"unknown way to end a run {how!r}", field="how", fix=f"use one of {', '.join(STOP_HOWS)}")
        atomic_write_text(self.stop_request_file, json.dumps({"how": how, "by": by}) + "\n")

    def stop_request(self) -> StopAsk | None:
        """The user's request to end the run, if one is waiting (a damaged one is refused, naming the file)."""
        try:
            data = json.loads(self.stop_request_file.read_text())
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SailorError(f"not valid JSON: {exc}", file=self.stop_request_file,
                              fix="remove it and run `sailor-hpc run stop` again") from None
        if not (isinstance(data, dict) and data.get("how") in STOP_HOWS and isinstance(data.get("by"), str)):
            raise SailorError("not a stop request", file=self.stop_request_file,
                              fix="remove it and run `sailor-hpc run stop` again")
        return StopAsk(data["how"], data["by"])

    def clear_stop_request(self) -> None:
        self.stop_request_file.unlink(missing_ok=True)

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

    grown: records.GrowSubmitted  # the job, its plan and score; it becomes attempt ``grown.next_attempt``
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


@dataclass(frozen=True)
class Trigger:
    """An allocation change the run has seen and not yet answered: the next attempt (or in-place step) answers
    it, and its recovery is measured from ``t``. Folded from the journal like the rest of the state."""

    kind: str  # node_lost, idle_gpus (a resize), cluster_lost, a job's stop reason, ...
    t: float


@dataclass
class InPlaceChange:
    """A step of the attempt's job re-planned on its surviving nodes (``in_place``), and what it cost."""

    step_index: int
    t_step_end: float | None  # when the step that lost nodes ended
    lost: dict[str, str]
    trigger: Trigger | None  # the change it answers, when the controller saw it first
    recovery: Recovery | None = None  # set once the next step trained


@dataclass(frozen=True)
class StopRequest:
    """The controller asked the attempt's job to checkpoint and stop (``signal_sent``)."""

    t: float
    reason: str
    signal: str


#: the key of an attempt's job on a site of one cluster (the site's only cluster, whatever its name)
ONE_CLUSTER = ""


@dataclass
class Attempt:
    """One try of the run: its Slurm jobs (one per cluster it uses), from the intent to submit until they are gone."""

    number: int
    job_name: str  # on one cluster; across clusters each cluster's is in ``job_names``
    plan_file: str
    script: str
    reason: str  # why it was submitted: start, node_lost, resize, requeued, failed, ...
    trigger: str | None  # the allocation change it answers (None for the first job)
    trigger_t: float | None
    gpus: dict[str, int]
    throughput: float
    cost_per_hour: float
    intent_t: float
    jobs: dict[str, str] = field(default_factory=dict)  # cluster (ONE_CLUSTER on one cluster) -> job id
    job_names: dict[str, str] = field(default_factory=dict)  # across clusters: cluster -> job name
    log: str | None = None
    submitted_t: float | None = None
    running_t: float | None = None
    first_step_t: float | None = None
    start_step: int | None = None
    nodes: list[str] = field(default_factory=list)  # the job's nodes when it was seen running
    stop: StopRequest | None = None  # the controller asked it to checkpoint and stop
    lost_nodes: dict[str, str] = field(default_factory=dict)
    stopped: records.JobStopped | None = None  # it stopped running, and why
    end_state: str | None = None
    gone: bool = False
    recovery: Recovery | None = None  # the change this (new) job answered, and what it cost
    advanced: bool = False  # a newer complete checkpoint appeared while it ran (or right after it)
    in_place: list[InPlaceChange] = field(default_factory=list)  # steps re-planned on its survivors
    released: dict[str, str] = field(default_factory=dict)  # lost nodes handled in place (not lost again)
    successor: Successor | None = None  # a bigger job submitted beside this one (grow without a gap)
    handover_from: int | None = None  # the attempt whose job this one took over from, while it trained
    end: str | None = None  # across clusters: why the controller stopped its jobs

    @property
    def across(self) -> bool:
        """An attempt of a run across clusters (its jobs are keyed by cluster)."""
        return bool(self.job_names)

    @property
    def job_id(self) -> str | None:
        """The attempt's job on a site of one cluster (None before it is submitted)."""
        return self.jobs.get(ONE_CLUSTER)

    @property
    def clusters(self) -> list[str]:
        """Across clusters: the clusters its plan uses."""
        return list(self.job_names)

    @property
    def waits_for_successor(self) -> bool:
        """A bigger job was submitted beside this one and neither took over nor was cancelled."""
        return self.successor is not None and self.successor.cancelled is None

    @property
    def successor_loading(self) -> bool:
        """The bigger job's gate is open: its ranks load and save from here on, this job's never again."""
        return self.successor is not None and self.waits_for_successor and self.successor.gate_t is not None


@dataclass
class RunState:
    run_id: str | None = None
    attempts: list[Attempt] = field(default_factory=list)
    finished: records.Finished | None = None
    gave_up: str | None = None
    stopped: records.RunStopped | None = None  # ended by its user's decision (run stop / cancel, or a scancel)
    stop_requested: records.StopRequested | None = None  # the user asked; the run's jobs are being ended
    resumed_at: int = 0  # attempts before the last run --resume of a stopped or given-up run: their restarts are spent
    failures_in_a_row: int = 0  # jobs that ended without training a step, since the last step
    backoff_until: float | None = None
    checkpoint: records.CheckpointSeen | None = None  # the newest complete checkpoint seen
    passed_over: list[records.CheckpointPassedOver] = field(default_factory=list)  # checkpoints a job could not use
    baseline: dict[str, int] = field(default_factory=dict)  # GPUs available to the run when last judged
    last_replan_t: float | None = None
    trigger: Trigger | None = None  # the change the next attempt answers
    recoveries: list[Recovery] = field(default_factory=list)
    controller_starts: int = 0
    left: dict[str, float] = field(default_factory=dict)  # across clusters: cluster -> when it left (not back yet)
    grow_blocked: dict[str, dict[str, int]] | None = None  # idle GPUs per node when a bigger job timed out pending

    @property
    def current(self) -> Attempt | None:
        """The attempt whose jobs may still exist (at most one: a new one is only submitted after it is gone)."""
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
            if i > self.resumed_at and a.reason != RESIZE_REASON:
                n += 1
            if a.advanced:
                n = 0
        return n

    @property
    def restart_costs(self) -> list[float]:
        """What each move to a new job (or group) cost the ranks, as measured: the data of the restart-cost
        policy (:func:`~sailor_hpc.controller.policy.restart_cost`)."""
        return [r.idle_s for r in self.recoveries if not r.in_place]

    @property
    def next_reason(self) -> str:
        """Why the next job would be submitted: the change it answers, else start / restart."""
        if self.trigger is not None:
            return self.trigger.kind
        return "start" if not self.attempts else "restart"

    def attempt(self, number: int) -> Attempt:
        for a in self.attempts:
            if a.number == number:
                return a
        raise KeyError(f"journal refers to attempt {number}, which has no submit_intent record")


def apply(state: RunState, rec: records.Record) -> None:
    """Advance ``state`` by one journal record (the one place that gives records their meaning)."""
    t = rec.t
    match rec:
        case records.RunStarted():
            state.run_id = rec.run_id
        case records.ControllerStarted():
            state.controller_starts += 1
        case records.PlanChosen() | records.Baseline():
            state.baseline = dict(rec.available)
        case records.SubmitIntent():
            state.attempts.append(Attempt(
                number=rec.attempt, job_name=rec.job_name, plan_file=rec.plan_file, script=rec.script,
                reason=rec.reason, trigger=rec.trigger, trigger_t=rec.trigger_t, gpus=dict(rec.gpus),
                throughput=rec.throughput, cost_per_hour=rec.cost_per_hour, intent_t=t, handover_from=rec.handover_from))
            state.trigger = None
            state.backoff_until = None
        case records.Submitted():
            att = state.attempt(rec.attempt)
            att.jobs[ONE_CLUSTER], att.log = rec.job_id, rec.log or att.log
            att.submitted_t = att.submitted_t or rec.submitted_t or t
        case records.Adopted():
            att = state.attempt(rec.attempt)
            att.jobs[ONE_CLUSTER], att.log = rec.job_id, rec.log or att.log
            att.submitted_t = att.submitted_t or att.intent_t
        case records.JobRunning():
            att = state.attempt(rec.attempt)
            att.running_t = att.running_t or rec.since or t
            att.nodes = sorted(set(att.nodes) | set(rec.nodes))
        case records.FirstStep():
            att = state.attempt(rec.attempt)
            att.first_step_t = att.first_step_t or t
            att.start_step = rec.loaded_step
            state.failures_in_a_row = 0
        case records.RecoveryMeasured():
            att = state.attempt(rec.attempt)
            recovery = Recovery(t=t, trigger=rec.trigger, trigger_t=rec.trigger_t, in_place=rec.in_place,
                                downtime_s=rec.downtime_s, recovery_s=rec.recovery_s, queue_wait_s=rec.queue_wait_s,
                                ranks_idle_s=rec.ranks_idle_s)
            if recovery.in_place:
                att.in_place[-1].recovery = recovery
            else:
                att.recovery = recovery
            state.recoveries.append(recovery)
        case records.GrowSubmitted():
            state.attempt(rec.attempt).successor = Successor(grown=rec)
        case records.GrowRunning():
            succ = _successor(state, rec.attempt)
            succ.running_t, succ.nodes = t, list(rec.nodes)
        case records.GateOpened():
            succ = _successor(state, rec.attempt)
            succ.gate_t = succ.gate_t or t
        case records.GrowCancelled():
            _successor(state, rec.attempt).cancelled = rec.reason
            state.trigger = None
            if rec.queue is not None:
                state.grow_blocked = rec.queue
        case records.InPlaceStep(change=ch):
            att = state.attempt(rec.attempt)
            att.in_place.append(InPlaceChange(step_index=ch.step_index, t_step_end=ch.t_step_end, lost=dict(ch.lost),
                                              trigger=state.trigger))
            att.plan_file, att.gpus, att.nodes = ch.plan_file, dict(ch.gpus), list(ch.nodes)
            att.throughput, att.cost_per_hour = ch.throughput, ch.cost_per_hour
            att.released.update({**att.lost_nodes, **ch.lost})
            att.lost_nodes, att.stop, state.trigger = {}, None, None
        case records.CheckpointSeen():
            state.checkpoint = rec
            if state.attempts:  # one job at a time: a new checkpoint is the latest job's (also if seen after it ended)
                state.attempts[-1].advanced = True
        case records.CheckpointPassedOver():
            state.passed_over.append(rec)
        case records.NodeLost():
            state.attempt(rec.attempt).lost_nodes.update(rec.nodes)
            state.trigger = state.trigger or Trigger(records.Kind.NODE_LOST, t)
        case records.IdleGpus():
            state.last_replan_t = t
        case records.Decision():
            if rec.action in ("resize", "checkpoint"):
                state.trigger = Trigger(rec.trigger or rec.action, t if rec.trigger_t is None else rec.trigger_t)
        case records.SignalSent():
            state.attempt(rec.attempt).stop = StopRequest(t=t, reason=rec.reason, signal=rec.signal)
        case records.JobStopped():
            state.attempt(rec.attempt).stopped = rec
            state.trigger = state.trigger or Trigger(rec.reason, t)
        case records.JobGone():
            if rec.attempt is not None:  # without an attempt: a stray job of the run, cancelled
                att = state.attempt(rec.attempt)
                att.gone, att.end_state = True, rec.state
        case records.Failure():
            state.failures_in_a_row += 1
        case records.Backoff():
            state.backoff_until = rec.until
        case records.Finished():
            state.finished = rec
        case records.GaveUp():
            state.gave_up = rec.reason
        case records.StopRequested():
            state.stop_requested = rec
        case records.RunStopped():
            state.stopped, state.stop_requested = rec, None
        case records.RunResumed():  # the next attempt answers the resume (its recovery is measured from it)
            state.stopped = state.stop_requested = state.gave_up = None
            state.trigger = Trigger(records.Kind.RUN_RESUMED.value, t)
            state.resumed_at, state.failures_in_a_row, state.backoff_until = len(state.attempts), 0, None
        case records.GroupIntent():
            state.attempts.append(_group_attempt(state, rec.group, rec.job_names, rec.start_step, rec.plan_file, t,
                                                 gpus=rec.gpus, throughput=rec.throughput,
                                                 cost_per_hour=rec.cost_per_hour))
        case records.GroupSubmitted():
            if not (state.attempts and state.attempts[-1].number == rec.group):  # a journal without intents
                state.attempts.append(_group_attempt(state, rec.group, {c: "" for c in rec.clusters}, rec.start_step,
                                                     rec.plan_file, t))
            att = state.attempts[-1]
            att.jobs, att.submitted_t = dict(rec.jobs), t
            att.job_names = {c: att.job_names.get(c, "") for c in rec.clusters}
        case records.GroupAdopted():  # its jobs, some found by name only
            _group(state, rec.group).jobs = dict(rec.jobs)
        case records.ClusterDropped() | records.ClusterLost() | records.GroupFailed():
            _group(state, rec.group)
            state.left.update({c: t for c in rec.clusters})
            state.trigger = Trigger(rec.kind.value, t)
        case records.Regrown():  # more GPUs (a cluster back) made a better plan worth its restart: a resize
            _group(state, rec.group)
            for c in rec.clusters:
                state.left.pop(c, None)
            state.trigger = Trigger(RESIZE_REASON, t)
        case records.GroupRunning():
            group = _group(state, rec.group)
            group.running_t = group.running_t or t
        case records.GroupRecovered():
            recovery = Recovery(t=t, trigger=rec.trigger, trigger_t=t - rec.recovery_s if rec.trigger_t is None
                                else rec.trigger_t, in_place=False, downtime_s=rec.recovery_s,
                                recovery_s=rec.recovery_s, queue_wait_s=None, ranks_idle_s=None)
            _group(state, rec.group).recovery = recovery
            state.recoveries.append(recovery)
        case records.GroupStopped():
            group = _group(state, rec.group)
            group.end, group.gone = rec.reason, True
        case _:  # said for people (story), no change to what the controller knows
            pass


def _successor(state: RunState, attempt: int) -> Successor:
    succ = state.attempt(attempt).successor
    if succ is None:
        raise KeyError(f"journal refers to a bigger job beside attempt {attempt}, which has no grow_submitted record")
    return succ


def _group_attempt(state: RunState, number: int, job_names: dict[str, str], start_step: int, plan_file: str,
                   t: float, *, gpus: dict[str, int] | None = None, throughput: float = 0.0,
                   cost_per_hour: float = 0.0) -> Attempt:
    """The attempt a run across clusters journals as a group; its plan's GPUs and simulated score come with its
    intent (none in a journal written before ``group_intent`` carried them, or without intents)."""
    trigger, state.trigger = state.trigger, None
    return Attempt(number=number, job_name="", plan_file=plan_file, script="", reason=state.next_reason if trigger is None
                   else trigger.kind, trigger=trigger.kind if trigger else None, trigger_t=trigger.t if trigger else None,
                   gpus=dict(gpus or {}), throughput=throughput, cost_per_hour=cost_per_hour, intent_t=t,
                   job_names=dict(job_names), start_step=start_step)


def _group(state: RunState, number: int) -> Attempt:
    for a in state.attempts:
        if a.number == number and a.across:
            return a
    raise KeyError(f"journal refers to group {number}, which has no group_submitted record")


class InconsistentJournal(SailorError):
    """Well-formed records that do not fit together (a record of an attempt never submitted, a field of the
    wrong type): the journal was edited or mixed with another run's, and replaying it would guess."""


def fold(entries: Iterable[records.Record], *, source: str | Path | None = None, lines: list[int] | None = None) -> RunState:
    """The state after every record, in order. A record :func:`apply` cannot give a meaning is refused as
    :class:`InconsistentJournal`, naming the file (``source``), the record's line and the fix."""
    state = RunState()
    for i, rec in enumerate(entries):
        try:
            apply(state, rec)
        except (KeyError, TypeError, ValueError, AssertionError, AttributeError, IndexError) as exc:
            line = lines[i] if lines is not None and i < len(lines) else i + 1
            raise InconsistentJournal(
                f"line {line}: record seq {rec.seq} ({rec.kind.value!r}) does not fit the records before "
                f"it ({type(exc).__name__}: {exc})", file=source, field=f"line {line}",
                fix="the journal was edited or mixed with another run's: restore it, or start a new run "
                    "(sailor-hpc run without --resume)") from None
    return state
