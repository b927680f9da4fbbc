"""What every step of a run's controller shares, whatever its attempts are: the run directory and spec, the
journal and the state folded from it, the site, the profile archive, the clock, and the clusters' Slurm.

One :class:`RunContext` per controller; the attempt kinds (:mod:`~sailor_hpc.controller.one_job`,
:mod:`~sailor_hpc.controller.groups`) each hold it and act through it, so a run and its resume journal and fold
the same way, and no kind reaches into another's methods.
"""
from __future__ import annotations

import os
import pwd
import socket
from collections.abc import Callable, Mapping
from pathlib import Path

from sailor_hpc.controller import records
from sailor_hpc.controller.journal import Journal, R
from sailor_hpc.controller.state import RESIZE_REASON, Attempt, RunDir, RunState, apply, fold
from sailor_hpc.controller.story import describe
from sailor_hpc.core.archive import open_archive
from sailor_hpc.core.checkpoint import latest_complete, read_manifest
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.runtime_events import CheckpointSkipped
from sailor_hpc.core.site import Site, load_site
from sailor_hpc.jobs.render import site_cluster
from sailor_hpc.slurm.handle import SlurmCluster

#: how a run's driver exits (``sailor-hpc run`` returns it): done, gave up, interrupted by a signal, stopped by its
#: user (a decision, not a failure)
EXIT_FINISHED, EXIT_GAVE_UP, EXIT_INTERRUPTED, EXIT_STOPPED = 0, 1, 130, 0
SLURM_BACKOFF_MAX_S = 30.0  # the longest wait between polls while Slurm does not answer


def user_name(uid: int) -> str:
    """A uid as a user name (the uid itself where this machine has no such user)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


class RunContext:
    """A run's journal, state, inputs and clock (see the module doc)."""

    def __init__(self, rundir: RunDir, env: Mapping[str, str] | None = None, *,
                 echo: Callable[[str], None] | None = None, clock: Callable[[], float],
                 sleep: Callable[[float], None]) -> None:
        self.rundir = rundir
        self.spec = rundir.spec()
        self.env = env  # None: this process's own environment
        self.echo = echo or (lambda _line: None)
        self.clock = clock
        self.sleep = sleep
        self.state = RunState()
        self.journal: Journal | None = None  # opened by begin(), under the run's lock
        self.site: Site = load_site(self.spec.planning.site)
        self.archive = open_archive(self.spec.planning.profiles, self.site)
        self.said: dict[str, str] = {}  # what was last journaled about a repeating condition, per kind
        self._plans: dict[str, Plan] = {}

    # ------------------------------------------------------------------------------------------- journal

    def begin(self) -> None:
        """Open the journal (the caller holds the lock) and fold it into the state."""
        self.journal = self.rundir.journal()
        self.state = fold(self.journal.records, source=self.journal.path, lines=self.journal.lines)
        resumed = bool(self.journal.records)
        if not resumed:
            self.note(records.RunStarted(run_id=self.spec.run_id, spec=self.spec.to_dict()))
        self.note(records.ControllerStarted(pid=os.getpid(), host=socket.gethostname(), resumed=resumed,
                  repaired_torn_line=self.journal.repaired))

    def note(self, record: R) -> R:
        """Journal a record, then let it change the state (the same :func:`apply` a resume uses); returns it
        stamped with its ``seq`` and time."""
        if self.journal is None:
            raise RuntimeError("RunContext.note before begin(): the journal is opened under the run's lock")
        rec = self.journal.append(record)
        apply(self.state, rec)
        self.echo(describe(rec))
        return rec

    def note_once(self, rec: records.ErrorSeen | records.NoPlan) -> None:
        """Journal a condition that repeats every poll (no plan fits, Slurm unreachable) only when it changes."""
        if self.said.get(rec.kind) != rec.message:
            self.note(rec)
            self.said[rec.kind] = rec.message

    # -------------------------------------------------------------------------------------------- Slurm

    def cluster(self, name: str | None = None) -> SlurmCluster:
        """The Slurm of ``name`` (its own ``SLURM_CONF``), or with None the one this process reaches."""
        return site_cluster(self.site, name, self.env)

    def wait_for_slurm(self, answers: Callable[[], bool]) -> None:
        """Wait, with back-off (poll x 2^k, at most ``SLURM_BACKOFF_MAX_S``), until ``answers()``."""
        waits = 0
        while True:
            waits += 1
            self.sleep(min(SLURM_BACKOFF_MAX_S, self.spec.control.poll_s * 2 ** min(waits, 10)))
            if answers():
                return

    # ------------------------------------------------------------------------------ plans and checkpoints

    def plan(self, path: str | Path) -> Plan:
        """A plan file of this run (each is written once, so it is read once)."""
        if str(path) not in self._plans:
            self._plans[str(path)] = load_plan(path, validate=False)
        return self._plans[str(path)]

    def checkpoint(self, cur: Attempt | None) -> None:
        """Journal a newer complete checkpoint (the one a next job would load). Not while a bigger job's
        gate is open: newer checkpoints are that job's, journaled once it is the run's job (a controller
        resumed between the gate and the handover would otherwise credit them to the old job)."""
        if cur is not None and cur.successor_loading:
            return
        path = latest_complete(self.spec.job.save, deep=False)
        if path is None:
            return
        manifest = read_manifest(path)
        if self.state.checkpoint is None or manifest["step"] > self.state.checkpoint.step:
            self.note(records.CheckpointSeen(attempt=cur.number if cur else None, step=manifest["step"],
                      consumed_samples=manifest.get("consumed_samples"), path=str(path)))

    def passed_over(self, cur: Attempt, skipped: list[CheckpointSkipped]) -> None:
        """Journal each checkpoint the job passed over as it resumed (its log says so; the journal keeps it for
        ``run status``), once per job: a resumed controller reads the log again from the start."""
        seen = {(p.attempt, p.path) for p in self.state.passed_over}
        for e in skipped:
            if (cur.number, e.path) not in seen:
                self.note(records.CheckpointPassedOver(attempt=cur.number, job_id=cur.job_id, path=e.path,
                                                       reason=e.reason, step=e.step, using=e.using))
                seen.add((cur.number, e.path))

    def users_own(self, uid: int | None) -> str | None:
        """The run's user's name if ``uid`` (who cancelled a job) is this user: a cancel that is the user's decision,
        not a fault (an administrator's, or a preemption by Slurm's own user, is a fault to recover from)."""
        return user_name(uid) if uid is not None and uid == os.getuid() else None

    def checkpoint_step(self) -> int:
        return self.state.checkpoint.step if self.state.checkpoint else 0

    def next_attempt_due(self) -> bool:
        """Before any new attempt (a job, or a group across clusters): journal the newest checkpoint; the run is
        finished once it holds the last step, gives up after ``max_restarts`` restarts in a row without a new
        checkpoint (a resize for more GPUs is not a restart), and waits out a back-off."""
        st, spec = self.state, self.spec
        self.checkpoint(None)
        if self.checkpoint_step() >= spec.job.steps:
            self.note(records.Finished(step=self.checkpoint_step(), checkpoint=st.checkpoint.path if st.checkpoint else None))
            return False
        if st.next_reason != RESIZE_REASON and st.restarts_without_progress >= spec.control.max_restarts and st.attempts:
            self.note(records.GaveUp(reason=f"all {spec.control.max_restarts} restarts used without a new checkpoint"))
            return False
        return st.backoff_until is None or self.clock() >= st.backoff_until
