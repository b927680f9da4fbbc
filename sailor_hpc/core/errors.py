"""One error type for every bad input, so the CLI can answer with file, field, fix and exit code 2.

Every loader in sailor-hpc raises :class:`SailorError` instead of letting a KeyError or a numpy
traceback reach a user: the message names what is wrong, where (file and field) and what to do.
"""
from __future__ import annotations

from dataclasses import dataclass

EXIT_BAD_INPUT = 2


@dataclass
class SailorError(Exception):
    """Bad input or an impossible request, explained for a person."""

    message: str
    file: str | None = None
    field: str | None = None
    fix: str | None = None

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

    def to_dict(self) -> dict[str, str | None]:
        return {"error": self.message, "file": self.file, "field": self.field, "fix": self.fix}


def require(condition: bool, message: str, *, file: object | None = None, field: str | None = None,
            fix: str | None = None) -> None:
    """Raise a :class:`SailorError` unless ``condition`` holds (validation one-liner)."""
    if not condition:
        raise SailorError(message, file=file, field=field, fix=fix)
