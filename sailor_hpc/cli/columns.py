"""Tables that fit the terminal: a column of long free text (a path, a provenance) is shortened in its middle,
where a path is least telling (its start says which tree, its end which file), so that every other column
keeps its place on the line."""
from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from typing import Any

from sailor_hpc.cli.output import table

ELLIPSIS = "…"
_SEPARATOR = 2  # spaces between columns (output.table)


def terminal_width() -> int | None:
    """Columns to fit: ``$COLUMNS`` if set, else the terminal's; None when stdout is not a terminal (a pipe or
    a file gets every character)."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    if not sys.stdout.isatty():
        return None
    return shutil.get_terminal_size().columns


def shorten_middle(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters: its start and end, an ellipsis between (the end gets more)."""
    if len(text) <= width:
        return text
    if width <= len(ELLIPSIS):
        return text[:width]
    keep = width - len(ELLIPSIS)
    head = keep * 2 // 5
    cut = text.find("/", len(text) - (keep - head))  # a path: its end from a whole directory name on, if one fits
    if cut > 0 and len(text) - cut >= (keep - head) // 2:
        head = keep - (len(text) - cut)
    return text[:head] + ELLIPSIS + text[len(text) - (keep - head):]


def fitted_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], width: int | None, *, shrink: int,
                 least: int = 16) -> str:
    """:func:`output.table` of ``rows``, with column ``shrink`` shortened so that the lines fit ``width`` (None:
    as they are); where fewer than ``least`` of its characters would fit, the column is left out, and a last
    line says so (a cell cut to a few letters tells nothing)."""
    text = table(headers, rows)
    if width is None or max(map(len, text.splitlines())) <= width:
        return text
    widths = [len(dashes) for dashes in text.splitlines()[1].split(" " * _SEPARATOR)]  # the rule under the header
    room = width - (sum(widths) - widths[shrink] + _SEPARATOR * (len(widths) - 1))
    if room < max(least, len(headers[shrink])):
        kept = [h for i, h in enumerate(headers) if i != shrink]
        return (table(kept, [[c for i, c in enumerate(row) if i != shrink] for row in rows])
                + f"\n({headers[shrink]} left out to fit {width} columns: a wider terminal or --json shows it)")
    return table(headers, [[*row[:shrink], shorten_middle(str(row[shrink]), room), *row[shrink + 1:]] for row in rows])
