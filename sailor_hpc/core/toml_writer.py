"""A small TOML writer for the documents sailor-hpc writes (site configs); no extra dependency.

Supports str, int, float, bool, lists of those (nested lists too), tables (dicts) and arrays of
tables (lists of dicts). ``None`` values are left out. The output parses back with ``tomllib``
to the same data (minus the ``None`` values).
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else toml_string(key)


def toml_string(text: str) -> str:
    out = ['"']
    for ch in text:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def toml_value(value: Any) -> str:
    """An inline TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        text = repr(value)
        return text if any(c in text for c in ".eEn") else text + ".0"
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, Mapping):
        items = [f"{toml_key(str(k))} = {toml_value(v)}" for k, v in value.items() if v is not None]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    if isinstance(value, Sequence):
        return "[" + ", ".join(toml_value(v) for v in value if v is not None) + "]"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


def _is_table_array(value: Any) -> bool:
    return (isinstance(value, Sequence) and not isinstance(value, str) and len(value) > 0
            and all(isinstance(v, Mapping) for v in value))


def _write_table(lines: list[str], table: Mapping[str, Any], path: list[str], header: str | None) -> None:
    scalars = [(k, v) for k, v in table.items()
               if v is not None and not isinstance(v, Mapping) and not _is_table_array(v)]
    tables = [(k, v) for k, v in table.items() if isinstance(v, Mapping)]
    arrays = [(k, v) for k, v in table.items() if _is_table_array(v)]
    # a table holding only sub-tables needs no header of its own; an empty one keeps it
    if header is not None and (scalars or not (tables or arrays) or header.startswith("[[")):
        if lines:
            lines.append("")
        lines.append(header)
    for k, v in scalars:
        lines.append(f"{toml_key(str(k))} = {toml_value(v)}")
    for k, v in tables:
        sub = [*path, toml_key(str(k))]
        _write_table(lines, v, sub, f"[{'.'.join(sub)}]")
    for k, v in arrays:
        sub = [*path, toml_key(str(k))]
        for item in v:
            _write_table(lines, item, sub, f"[[{'.'.join(sub)}]]")


def dump_toml(doc: Mapping[str, Any], header_comments: Sequence[str] = ()) -> str:
    """``doc`` as TOML text; ``header_comments`` become ``# ...`` lines at the top."""
    lines: list[str] = []
    for c in header_comments:
        for part in str(c).splitlines() or [""]:
            lines.append(f"# {part}".rstrip())
    body: list[str] = []
    _write_table(body, doc, [], None)
    if lines and body:
        lines.append("")
    return "\n".join(lines + body) + "\n"
