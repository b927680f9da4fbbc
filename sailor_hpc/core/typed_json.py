"""Parsed JSON as a frozen dataclass, by the class's type hints: the one reader of journal records
(:mod:`sailor_hpc.controller.records`), the runtime's log events (:mod:`.runtime_events`) and ``run.json``
(:mod:`sailor_hpc.controller.spec`). A value is taken as its field's hint says, recursively:

- ``bool``, ``int``, ``str``: exactly that JSON type (``true`` is no number, though Python's bool is an int);
- ``float``: any number (JSON has one number type: ``"poll_s": 2`` means 2.0) that a float can hold;
- ``X | Y``: the first option that fits, ``None`` being ``null``; ``Any``: the value as it is;
- ``list[X]``, ``dict[str, X]``, ``tuple[X, ...]`` (from a JSON list: a frozen dataclass holds a tuple): each item;
- a dataclass: from a JSON object, by the same rules (its :class:`Mismatch` names its own field).

Two rules differ by reader, as switches of :func:`from_json`: ``ignore_unknown`` (a runtime line carries details
for people beside the fields a reader needs; an unknown key in a journal record or run.json means an edited file
or another version) and ``finite`` (a NaN knob typed into run.json would never trip, while the journal and the
runtime keep a NaN as a measured value: a diverged loss).
"""
from __future__ import annotations

import dataclasses
import math
import re
import sys
import types
from collections.abc import Collection, Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from sailor_hpc.core.errors import SailorError

T = TypeVar("T")


class Mismatch(SailorError):
    """Why a JSON object is no such dataclass, for its reader to say in its own terms (uncaught, still exit 2):
    ``problem`` and ``names`` (unknown keys, sorted; missing fields, in field order; or the one field of the
    wrong ``type``, with its hint as text, ``expected``, and the ``value`` it holds)."""

    def __init__(self, problem: Literal["unknown", "missing", "type"], names: list[str], expected: str = "",
                 value: Any = None) -> None:
        self.problem, self.names, self.expected, self.value = problem, names, expected, value
        super().__init__({"unknown": f"unknown field(s) {', '.join(map(repr, names))}",
                          "missing": f"field {names[0]!r} is missing",
                          "type": f"field {names[0]!r} must be {expected}, got {value!r}"}[problem], field=names[0])


def from_json(cls: type[T], obj: Mapping[str, Any], *, skip: Collection[str] = (), ignore_unknown: bool = False,
              finite: bool = False) -> T:
    """The dataclass ``cls`` of the JSON object ``obj`` (``skip``: envelope keys, no field); a field ``obj``
    lacks takes its default. Raises :class:`Mismatch` for unknown keys, else missing fields, else the first
    field of the wrong type."""
    fields = _fields(cls)
    unknown = [] if ignore_unknown else sorted(obj.keys() - fields.keys() - set(skip))
    if unknown:
        raise Mismatch("unknown", unknown)
    missing = [name for name, (_, required) in fields.items() if required and name not in obj]
    if missing:
        raise Mismatch("missing", missing)
    values = {name: _as(obj[name], hint, finite) for name, (hint, _) in fields.items() if name in obj}
    wrong = next((name for name, value in values.items() if value is _WRONG), None)
    if wrong is not None:
        raise Mismatch("type", [wrong], hint_text(fields[wrong][0], finite), obj[wrong])
    return cls(**values)


def hint_text(hint: Any, finite: bool = False) -> str:
    """A hint as a person reads it: ``str``, ``int | None``, ``dict[str, int]``, ``finite float``."""
    text = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
    return re.sub(r"\bfloat\b", "finite float", text) if finite else text


_FIELDS: dict[type, dict[str, tuple[Any, bool]]] = {}


def _fields(cls: type) -> dict[str, tuple[Any, bool]]:
    """Each field's resolved hint and whether it is required, resolved once per class (logs are read by line)."""
    if cls not in _FIELDS:
        hints = get_type_hints(cls)
        _FIELDS[cls] = {f.name: (hints[f.name], f.default is f.default_factory is dataclasses.MISSING)
                        for f in dataclasses.fields(cls)}
    return _FIELDS[cls]


def fits_float(value: Any, finite: bool = False) -> bool:
    """Whether a decoded JSON value is a number a float holds (``finite``: and not NaN or infinite). JSON's
    ``true`` is no number, and an int too large for a float does not fit (``float()`` would raise)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) <= sys.float_info.max
    return isinstance(value, float) and (not finite or math.isfinite(value))


_WRONG = object()  # what _as returns for a value that does not fit its hint (cheaper than raising in a union)


def _as(value: Any, hint: Any, finite: bool) -> Any:
    """``value`` as ``hint`` says (see the module), or :data:`_WRONG`."""
    if hint is Any:
        return value
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        for option in get_args(hint):
            out = _as(value, option, finite)
            if out is not _WRONG:
                return out
        return _WRONG
    if hint is type(None):
        return None if value is None else _WRONG
    if hint is bool or isinstance(value, bool):
        return value if hint is bool and isinstance(value, bool) else _WRONG
    if hint is int or hint is str:
        return value if isinstance(value, hint) else _WRONG
    if hint is float:
        return float(value) if fits_float(value, finite) else _WRONG
    if dataclasses.is_dataclass(hint) and isinstance(hint, type) and isinstance(value, dict):
        return from_json(hint, value, finite=finite)
    args = get_args(hint)
    if origin is dict and isinstance(value, dict):
        pairs = {k: _as(v, args[1], finite) for k, v in value.items()}
        return _WRONG if any(v is _WRONG for v in pairs.values()) else pairs
    if (origin is list or (origin is tuple and args[1:] == (Ellipsis,))) and isinstance(value, list):
        items = [_as(v, args[0], finite) for v in value]
        return _WRONG if any(v is _WRONG for v in items) else items if origin is list else tuple(items)
    return _WRONG
