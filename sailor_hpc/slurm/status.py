"""State of Slurm jobs from ``squeue`` (live) and ``sacct`` (finished), het components and arrays included.

A het job shows up as one row per component (``12+0``, ``12+1``), a job array as one row per started
element (``13_4``) plus one row for the still-pending rest (``13_[5-7%2]``). :func:`job_status` merges
both sources into one :class:`JobStatus` per job with an aggregate state: the job is final only when
every component is, and a failed, cancelled or lost component makes the whole job failed. Sites without
accounting (``sacct`` disabled) still work while slurmctld remembers the job (``MinJobAge``).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sailor_hpc.core.errors import SailorError
from sailor_hpc.slurm.commands import AcctJob, QueueJob, SlurmCommandMissing, SlurmRefused, sacct, squeue
from sailor_hpc.slurm.safety import BUNDLE_SEP, job_ids

#: states after which a job never runs again (unless requeued by hand)
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                          "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED", "LOST"})
#: final states that mean "did not complete", most telling first (a het job reports the first one present)
FAILED_ORDER = ("NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "TIMEOUT", "DEADLINE", "PREEMPTED", "FAILED", "CANCELLED",
                "SPECIAL_EXIT", "REVOKED", "LOST")
RUNNING_STATES = frozenset({"RUNNING", "COMPLETING", "CONFIGURING", "STAGE_OUT", "SIGNALING", "RESIZING"})
UNKNOWN = "UNKNOWN"

_ROW_ID = re.compile(r"^(?P<base>\d+)(?:\+(?P<het>\d+)|_(?P<idx>\d+)|_\[(?P<range>[^\]]+)\])?$")


@dataclass(frozen=True)
class JobRef:
    """A job id as Slurm prints it: plain, het component (``+N``), array element (``_N``) or pending range."""

    base: str
    het: int | None = None
    index: int | None = None
    indices: frozenset[int] | None = None  # a pending array range

    @classmethod
    def parse(cls, text: str) -> JobRef | None:
        m = _ROW_ID.match(text.strip())
        if not m:
            return None
        rng = m.group("range")
        return cls(base=m.group("base"), het=int(m.group("het")) if m.group("het") else None,
                   index=int(m.group("idx")) if m.group("idx") else None,
                   indices=expand_array_range(rng) if rng else None)

    def covers(self, row: JobRef) -> bool:
        """Whether a row of squeue/sacct belongs to the job this reference names."""
        if row.base != self.base:
            return False
        if self.index is not None:
            return row.index == self.index or (row.indices is not None and self.index in row.indices)
        if self.het is not None:
            return row.het == self.het
        return True


def expand_array_range(text: str) -> frozenset[int]:
    """``0-3%2`` / ``1,4-6`` (squeue's pending array elements) as a set of indices."""
    out: set[int] = set()
    for part in text.split("%")[0].split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            step = 1
            if ":" in hi:
                hi, s = hi.split(":", 1)
                step = int(s)
            out.update(range(int(lo), int(hi) + 1, step))
        else:
            out.add(int(part))
    return frozenset(out)


@dataclass(frozen=True)
class ComponentStatus:
    """One row: a het component, an array element (or pending range) or a plain job."""

    job_id: str
    partition: str
    state: str  # base state: RUNNING, COMPLETED, CANCELLED, ...
    nodes: str
    reason: str = ""
    exit_code: str = ""
    elapsed: str = ""
    source: str = "squeue"
    cancelled_by: int | None = None  # the uid that cancelled it, once accounting has the job

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


@dataclass
class JobStatus:
    job_id: str
    components: list[ComponentStatus] = field(default_factory=list)
    state: str = UNKNOWN

    @property
    def known(self) -> bool:
        return bool(self.components)

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    @property
    def ok(self) -> bool:
        return self.state == "COMPLETED"

    @property
    def nodes(self) -> list[str]:
        return [c.nodes for c in self.components if c.nodes and c.nodes not in ("None assigned", "(null)")]

    @property
    def cancelled_by(self) -> int | None:
        """Who cancelled the job (a uid), as accounting says; None if not cancelled or not yet accounted."""
        return next((c.cancelled_by for c in self.components if c.cancelled_by is not None), None)

    def to_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "state": self.state, "final": self.final,
                "components": [asdict(c) for c in self.components]}


def aggregate_state(states: Sequence[str]) -> str:
    """One state for a job from its components' states (see module doc)."""
    if not states:
        return UNKNOWN
    if all(s in FINAL_STATES for s in states):
        if all(s == "COMPLETED" for s in states):
            return "COMPLETED"
        return next(s for s in FAILED_ORDER if s in states)
    if any(s in RUNNING_STATES for s in states):
        return "RUNNING"
    if any(s in ("REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED") for s in states):
        return "REQUEUED"
    if any(s in ("PENDING", "SUSPENDED", "STOPPED", "RESV_DEL_HOLD") for s in states):
        return next(s for s in states if s not in FINAL_STATES)
    return next((s for s in states if s not in FINAL_STATES), states[0])


def _from_queue(row: QueueJob) -> ComponentStatus:
    # squeue says "None" where a job waits for nothing (it runs): no reason, not one called None
    reason = "" if row.reason == "None" else row.reason
    return ComponentStatus(job_id=row.job_id, partition=row.partition, state=row.state.split()[0] if row.state else "",
                           nodes=row.nodelist, reason=reason, source="squeue")


def _from_acct(row: AcctJob) -> ComponentStatus:
    return ComponentStatus(job_id=row.job_id, partition=row.partition, state=row.base_state, nodes=row.nodelist,
                           exit_code=row.exit_code, elapsed=row.elapsed, source="sacct", cancelled_by=row.cancelled_by)


def _sacct_rows(env: Mapping[str, str] | None, ids: Sequence[str]) -> list[AcctJob]:
    """sacct rows, or none where accounting is disabled (squeue then carries the state)."""
    try:
        return sacct(env, jobs=ids, allocations_only=True)
    except SlurmCommandMissing:
        return []
    except SlurmRefused as exc:  # Slurm's own words for a cluster without accounting
        if "accounting storage is disabled" in exc.output.lower():
            return []
        raise


def merge_rows(queue: Iterable[ComponentStatus], acct: Iterable[ComponentStatus]) -> list[ComponentStatus]:
    """Per component: squeue's row (live, and it notices a final state first) unless both sources
    say final, then sacct's (it has the exit code and elapsed time)."""
    queue, acct = list(queue), list(acct)
    queue_ranges = {ref.base for ref in map(JobRef.parse, (r.job_id for r in queue))
                    if ref is not None and ref.indices is not None}
    rows: dict[str, ComponentStatus] = {}
    for row in acct:
        ref = JobRef.parse(row.job_id)
        if ref is not None and ref.indices is not None and ref.base in queue_ranges:
            continue  # squeue's pending range is newer (started elements have left it)
        rows[row.job_id] = row
    for row in queue:
        have = rows.get(row.job_id)
        if have is None or row.state not in FINAL_STATES or have.state not in FINAL_STATES:
            rows[row.job_id] = row
    refs = [r for r in map(JobRef.parse, rows) if r is not None]
    started = {(r.base, r.index) for r in refs if r.index is not None}
    split_bases = {r.base for r in refs if r.het is not None or r.index is not None or r.indices is not None}
    out = []
    for key, row in rows.items():
        ref = JobRef.parse(key)
        if ref is not None and ref.indices is not None and all((ref.base, i) in started for i in ref.indices):
            continue  # a stale pending range whose elements all have rows of their own
        if key in split_bases:
            continue  # sacct's leader row of a het job cancelled while pending, or of an array element
            # whose index accounting has not recorded yet: the component/element rows describe it
        out.append(row)
    return sorted(out, key=lambda r: _sort_key(r.job_id))


def _sort_key(job_id: str) -> tuple[int, int, int]:
    ref = JobRef.parse(job_id)
    if ref is None:
        return (0, 0, 0)
    sub = ref.het if ref.het is not None else ref.index if ref.index is not None else (
        min(ref.indices) if ref.indices else -1)
    return (int(ref.base), sub, 1 if ref.indices else 0)


def poll_jobs(job_ids: Sequence[str], env: Mapping[str, str] | None = None) -> dict[str, JobStatus]:
    """Status of several jobs with one squeue and one sacct call (ids as Slurm prints them). A bundle's
    (``12,13``: see :data:`~sailor_hpc.slurm.safety.BUNDLE_SEP`) has its jobs as components, in the bundle's
    order, and their aggregate state, as a het job's."""
    ids = list(dict.fromkeys(str(j) for j in job_ids))
    if not ids:
        return {}
    refs = {j: [JobRef.parse(p) for p in j.split(BUNDLE_SEP)] for j in ids}  # a bundle: each of its jobs
    bad = [j for j, r in refs.items() if None in r]
    if bad:
        raise SailorError(f"{bad[0]!r} is not a Slurm job id", field="JOBID", fix="e.g. 1234, 1234_5 or 1234+1")
    plain = list(dict.fromkeys(p for j in ids for p in j.split(BUNDLE_SEP)))
    queue = [_from_queue(r) for r in squeue(env, jobs=plain, all_states=True)]
    acct = [_from_acct(r) for r in _sacct_rows(env, plain)]
    out = {}
    for j, parts in refs.items():
        def covered(row: ComponentStatus, parts: list[JobRef | None] = parts) -> bool:
            rr = JobRef.parse(row.job_id)
            return rr is not None and any(ref is not None and ref.covers(rr) for ref in parts)
        mine_q, mine_a = [r for r in queue if covered(r)], [r for r in acct if covered(r)]
        if not mine_q and not mine_a and len(plain) == 1:
            mine_q, mine_a = queue, acct  # e.g. "12" asked for, Slurm answers with its het name "11+1"
        comps = merge_rows(mine_q, mine_a)
        out[j] = JobStatus(job_id=j, components=comps, state=aggregate_state([c.state for c in comps]))
    return out


def job_status(job_id: str | int, env: Mapping[str, str] | None = None) -> JobStatus:
    """Status of one job (all its het components or array elements; every job of a bundle)."""
    jid = BUNDLE_SEP.join(job_ids(job_id))
    return poll_jobs([jid], env)[jid]


def list_jobs(env: Mapping[str, str] | None = None, user: str | None = None) -> list[JobStatus]:
    """The queue (pending and running jobs) grouped by job: one entry per het job or array."""
    groups: dict[str, list[ComponentStatus]] = {}
    for row in squeue(env, user=user):
        ref = JobRef.parse(row.job_id)
        key = ref.base if ref is not None and (ref.het is not None or ref.indices is not None or ref.index is not None) \
            else row.job_id
        groups.setdefault(key, []).append(_from_queue(row))
    return [JobStatus(job_id=k, components=sorted(v, key=lambda r: _sort_key(r.job_id)),
                      state=aggregate_state([c.state for c in v]))
            for k, v in sorted(groups.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0)]
