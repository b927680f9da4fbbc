"""Typed access to parsed TOML/JSON tables with errors that name the file and the field.

Loaders wrap each table in a :class:`Fields`; ``req``/``opt`` check types, and ``done`` refuses
unknown keys (a typo such as ``gpus_per_nod`` is an error, not a silently ignored field).
"""
from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sailor_hpc.core.errors import SailorError

_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
               list: "a list", dict: "a table"}


class Fields:
    def __init__(self, data: Any, *, file: object | None, path: str, known: tuple[str, ...] = ()) -> None:
        if not isinstance(data, Mapping):
            raise SailorError(f"expected a table, got {type(data).__name__}", file=file, field=path or None,
                              fix="write it as a table / JSON object")
        self.data = data
        self.file = file
        self.path = path
        self.known = known  # fields of this table: never suggested as the misspelling of another
        self.seen: set[str] = set()

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: str | None, message: str, fix: str | None = None) -> SailorError:
        return SailorError(message, file=self.file, field=self.name(key) if key else (self.path or None), fix=fix)

    def _check(self, key: str, value: Any, kind: type) -> Any:
        ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            raise self.error(key, f"must be {_TYPE_NAMES.get(kind, kind.__name__)}, got {value!r}")
        if kind is float and not math.isfinite(value):
            raise self.error(key, f"must be a finite number, got {value!r}")
        return value

    def req(self, key: str, kind: type) -> Any:
        self.seen.add(key)
        if key not in self.data:
            typo = difflib.get_close_matches(key, [str(k) for k in self.data if k not in self.known], n=1)
            fix = (f"rename {typo[0]!r} to {key!r}" if typo
                   else f"add {key} = <{_TYPE_NAMES.get(kind, kind.__name__)}>")
            raise self.error(key, "is missing", fix=fix)
        return self._check(key, self.data[key], kind)

    def opt(self, key: str, kind: type, default: Any = None) -> Any:
        self.seen.add(key)
        if key not in self.data or self.data[key] is None:
            return default
        return self._check(key, self.data[key], kind)

    def positive(self, key: str, default: int | None = None) -> int:
        value = self.req(key, int) if default is None else self.opt(key, int, default)
        return self.positive_value(key, value)

    def positive_value(self, key: str, value: Any) -> int:
        """``value`` (e.g. an element of a list field, named ``key``) as a positive integer."""
        value = self._check(key, value, int)
        if value <= 0:
            raise self.error(key, f"must be a positive integer, got {value}")
        return value

    def sub(self, key: str, value: Any) -> Fields:
        return Fields(value, file=self.file, path=self.name(key))

    def done(self) -> None:
        unknown = [k for k in self.data if k not in self.seen]
        if unknown:
            key = unknown[0]
            close = difflib.get_close_matches(key, sorted(self.seen), n=1)
            fix = f"did you mean {close[0]!r}?" if close else f"remove it; known fields: {', '.join(sorted(self.seen))}"
            raise self.error(key, "is not a known field", fix=fix)


def read_json(path: os.PathLike[str] | str, *, missing_fix: str) -> Any:
    """Parse a JSON file; a missing file or bad syntax becomes a SailorError naming the file."""
    path = Path(path)
    try:
        return json.loads(read_text(path, missing_fix=missing_fix))
    except json.JSONDecodeError as exc:
        raise SailorError(f"not valid JSON: {exc}", file=path, fix="fix the JSON syntax") from None


def read_text(path: Path, *, missing_fix: str) -> str:
    """A config file's text; missing, unreadable or not UTF-8 becomes a SailorError naming the file."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SailorError("file not found", file=path, fix=missing_fix) from None
    except UnicodeDecodeError as exc:
        raise SailorError(f"is not UTF-8 text ({exc.reason} at byte {exc.start})", file=path,
                          fix="pass the text file itself (saved as UTF-8)") from None
    except OSError as exc:
        raise SailorError(f"cannot be read: {exc.strerror or exc}", file=path,
                          fix="pass a readable file") from None
