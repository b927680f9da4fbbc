"""Errors that carry their handling: what went wrong, for a person, and what the program does about it.

Four meanings, four types, so that no caller guesses a meaning from where it caught an error or from
its text:

- :class:`SailorError`: bad input or an impossible request. Every loader raises it instead of letting a
  KeyError or a numpy traceback reach a user: the message names what is wrong, where (file and field)
  and what to do. The CLI exits with :data:`EXIT_BAD_INPUT` (2).
- :class:`SlurmUnavailable`: Slurm did not answer (a timeout, slurmctld down). Nothing is wrong with the
  input; the controller retries with back-off, the CLI exits with :data:`EXIT_SLURM_UNAVAILABLE` (3).
- :class:`NoPlanFits` (a :class:`SailorError`): no plan fits the GPUs offered now. ``sailor-hpc plan``
  refuses it like bad input; the controller waits for resources.
- :class:`JobFailed`: a job of the run failed; the run's policy decides (retry, re-plan, give up).
"""
from __future__ import annotations

from typing import ClassVar

EXIT_BAD_INPUT = 2
#: the CLI's exit code when Slurm did not answer: try again later, nothing needs fixing in the input
EXIT_SLURM_UNAVAILABLE = 3


class Problem(Exception):
    """What every error of sailor-hpc says: a message, the file and field it concerns, and the fix.

    ``exit_code`` is what the CLI exits with when the error reaches it."""

    exit_code: ClassVar[int] = EXIT_BAD_INPUT

    def __init__(self, message: str, *, file: object | None = None, field: str | None = None,
                 fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.file = None if file is None else str(file)
        self.field = field
        self.fix = fix

    def __str__(self) -> str:
        where = ": ".join(p for p in (self.file, self.field) if p)
        text = f"{where}: {self.message}" if where else self.message
        if self.fix:
            text += f" (fix: {self.fix})"
        return text

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, file={self.file!r}, field={self.field!r}, fix={self.fix!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Problem) and type(other) is type(self) and self.to_dict() == other.to_dict()

    __hash__ = Exception.__hash__

    def to_dict(self) -> dict[str, str | None]:
        return {"error": self.message, "file": self.file, "field": self.field, "fix": self.fix}


class SailorError(Problem):
    """Bad input or an impossible request, explained for a person (exit 2)."""


class NoPlanFits(SailorError):
    """No plan fits the GPUs offered (now): a controller waits for resources, a one-off request is refused."""


class SlurmUnavailable(Problem):
    """Slurm did not answer in time or its controller is down: retry later with back-off (exit 3)."""

    exit_code: ClassVar[int] = EXIT_SLURM_UNAVAILABLE


class JobFailed(Problem):
    """A job of the run failed (its state and exit codes say how); the run's policy decides what follows."""

    exit_code: ClassVar[int] = 1

    def __init__(self, message: str, *, job_id: str | None = None, state: str | None = None,
                 file: object | None = None, field: str | None = None, fix: str | None = None) -> None:
        super().__init__(message, file=file, field=field, fix=fix)
        self.job_id = job_id
        self.state = state


def require(condition: bool, message: str, *, file: object | None = None, field: str | None = None,
            fix: str | None = None) -> None:
    """Raise a :class:`SailorError` unless ``condition`` holds (validation one-liner)."""
    if not condition:
        raise SailorError(message, file=file, field=field, fix=fix)
