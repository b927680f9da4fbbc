"""Journaling for the controller, whatever its attempts (a job, or a group of jobs across clusters): one way to
write a record and apply it, and one way to open a run's journal, so a run and its resume fold the same."""
from __future__ import annotations

import os
import socket
from collections.abc import Callable

from sailor_hpc.controller import records
from sailor_hpc.controller.journal import Journal, R
from sailor_hpc.controller.spec import RunSpec
from sailor_hpc.controller.state import RunDir, RunState, apply, fold
from sailor_hpc.controller.story import describe

#: how a run's driver exits (``sailor-hpc run`` returns it): done, gave up, interrupted by a signal
EXIT_FINISHED, EXIT_GAVE_UP, EXIT_INTERRUPTED = 0, 1, 130


class Recorder:
    """The journal side of the controller, and the base of its policy mixins (so each calls :meth:`note`
    itself); the :class:`~sailor_hpc.controller.loop.Controller` provides these attributes."""

    rundir: RunDir
    spec: RunSpec
    state: RunState
    journal: Journal  # opened by begin(), under the run's lock (opening repairs a torn last line)
    echo: Callable[[str], None]
    _said: dict[str, str]  # what was last journaled about a repeating condition, per kind

    def note(self, record: R) -> R:
        """Journal a record, then let it change the state (the same :func:`apply` a resume uses); returns it
        stamped with its ``seq`` and time."""
        rec = self.journal.append(record)
        apply(self.state, rec)
        self.echo(describe(rec))
        return rec

    def note_once(self, rec: records.ErrorSeen | records.NoPlan) -> None:
        """Journal a condition that repeats every poll (no plan fits, Slurm unreachable) only when it changes."""
        if self._said.get(rec.kind) != rec.message:
            self.note(rec)
            self._said[rec.kind] = rec.message

    def begin(self) -> None:
        """Open the journal (the caller holds the lock) and fold it into the state."""
        self.journal = self.rundir.journal()
        self.state = fold(self.journal.records, source=self.journal.path, lines=self.journal.lines)
        resumed = bool(self.journal.records)
        if not resumed:
            self.note(records.RunStarted(run_id=self.spec.run_id, spec=self.spec.to_dict()))
        self.note(records.ControllerStarted(pid=os.getpid(), host=socket.gethostname(), resumed=resumed,
                  repaired_torn_line=self.journal.repaired))
