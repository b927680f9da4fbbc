"""Watch Slurm jobs until they end, are lost, or time runs out: never wait forever.

submitit decides that a job ended by finding its result file or by asking ``sacct`` for the job id
it submitted. Both fail in cases the profiler meets: a het job shows up in sacct as ``12+0``/``12+1``
(submitit looks up ``12`` and never learns its state), and a job that is cancelled or loses its node
writes no result. :class:`JobWatcher` asks Slurm itself (:func:`sailor_hpc.slurm.status.poll_jobs`, one
squeue and one sacct call per round for all jobs, het components and array elements understood):

- a job whose every component is in a final state is *done* (COMPLETED, or the failure state);
- a job that neither squeue nor sacct knows for ``lost_after_s`` (never seen after submission, or
  forgotten) is *LOST*;
- :meth:`JobWatcher.wait` returns at ``timeout_s`` at the latest, with the jobs still open marked.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from sailor_hpc.slurm.status import JobStatus, poll_jobs

LOST = "LOST"


@dataclass
class _Tracked:
    added: float
    last_seen: float | None = None
    status: JobStatus | None = None


@dataclass
class WatchResult:
    statuses: dict[str, JobStatus]
    timed_out: list[str] = field(default_factory=list)  # still open at the deadline

    @property
    def failed(self) -> dict[str, JobStatus]:
        return {j: s for j, s in self.statuses.items() if s.final and not s.ok}


class JobWatcher:
    """Tracks a set of job ids (plain, het leader, array element) until each is final or lost."""

    def __init__(self, env: Mapping[str, str] | None = None, *, poll_s: float = 1.0, lost_after_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.env = env
        self.poll_s = poll_s
        self.lost_after_s = lost_after_s
        self._clock = clock
        self._sleep = sleep
        self._jobs: dict[str, _Tracked] = {}

    def add(self, job_ids: Iterable[str]) -> None:
        now = self._clock()
        for j in job_ids:
            self._jobs.setdefault(str(j), _Tracked(added=now))

    @property
    def open(self) -> list[str]:
        return [j for j, t in self._jobs.items() if t.status is None or not t.status.final]

    def status(self, job_id: str) -> JobStatus | None:
        return self._jobs[job_id].status

    def poll(self) -> dict[str, JobStatus]:
        """One round over the open jobs; returns the statuses that changed state (lost ones as LOST)."""
        ids = self.open
        if not ids:
            return {}
        now = self._clock()
        fresh = poll_jobs(ids, self.env)
        changed: dict[str, JobStatus] = {}
        for j in ids:
            tr = self._jobs[j]
            st = fresh[j]
            if st.known:
                tr.last_seen = now
            elif now - (tr.last_seen if tr.last_seen is not None else tr.added) >= self.lost_after_s:
                st = JobStatus(job_id=j, components=[], state=LOST)
            elif tr.status is not None:
                continue  # momentarily invisible (between squeue and sacct): keep the last state
            if tr.status is None or tr.status.state != st.state:
                changed[j] = st
            tr.status = st
        return changed

    def wait(self, timeout_s: float | None = None,
             on_update: Callable[[dict[str, JobStatus]], None] | None = None) -> WatchResult:
        """Poll until every job is final or lost, or ``timeout_s`` passed; ``on_update`` gets each change."""
        deadline = None if timeout_s is None else self._clock() + timeout_s
        while True:
            changed = self.poll()
            if changed and on_update is not None:
                on_update(changed)
            if not self.open:
                break
            if deadline is not None and self._clock() >= deadline:
                break
            self._sleep(self.poll_s)
        statuses = {j: t.status or JobStatus(job_id=j) for j, t in self._jobs.items()}
        return WatchResult(statuses=statuses, timed_out=self.open)
