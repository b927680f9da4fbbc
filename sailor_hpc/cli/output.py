"""Printing helpers shared by the commands: JSON for machines, aligned tables for people."""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=1, default=str))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def human_bytes(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB"
