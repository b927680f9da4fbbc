"""Slurm host lists (``a100-[1-2],v100-[01-03,7]``) as host names, in Python.

What ``scontrol show hostnames`` prints, without a subprocess: the controller expands the node lists of
its jobs every poll, and a compute node's batch script after a step lost nodes, also while slurmctld does
not answer. Ranges keep their zero padding (``[01-03]`` -> 01, 02, 03); several bracket groups in one name
multiply (``r[1-2]n[1-2]`` -> r1n1, r1n2, r2n1, r2n2); duplicates are dropped, first kept.
"""
from __future__ import annotations

import itertools
import re
from collections.abc import Iterable

from sailor_hpc.core.errors import SailorError

_EMPTY = frozenset({"", "(null)", "None assigned", "N/A"})
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(text: str) -> list[str]:
    """Host names of one Slurm host list expression (its order; duplicates dropped)."""
    text = text.strip()
    if text in _EMPTY:
        return []
    out: dict[str, None] = {}
    for item in _split_top(text):
        for host in _expand_one(item, text):
            out.setdefault(host, None)
    return list(out)


def expand_hostlists(lists: Iterable[str]) -> list[str]:
    """Host names of several host list expressions, in order, each once."""
    return list(dict.fromkeys(h for text in lists for h in expand_hostlist(text)))


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if depth < 0 or depth > 1:
            raise _bad(text, "unbalanced or nested brackets")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise _bad(text, "a bracket is not closed")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_one(item: str, whole: str) -> list[str]:
    """``rack[1-2]-n[01-02]``: the product of every bracket group's values, with the text between."""
    pieces = re.split(r"\[([^\]]*)\]", item)  # text, group, text, group, ..., text
    choices: list[list[str]] = []
    for i, piece in enumerate(pieces):
        choices.append([piece] if i % 2 == 0 else _values(piece, whole))
    return ["".join(combo) for combo in itertools.product(*choices)]


def _values(group: str, whole: str) -> list[str]:
    out: list[str] = []
    for part in group.split(","):
        m = _RANGE.match(part.strip())
        if m is None:
            raise _bad(whole, f"[{group}] is not a list of numbers and ranges")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise _bad(whole, f"range {part} runs backwards")
        width = len(lo) if lo.startswith("0") else 0
        out.extend(f"{n:0{width}d}" for n in range(int(lo), int(hi) + 1))
    return out


def _bad(text: str, why: str) -> SailorError:
    return SailorError(f"{text!r} is not a Slurm host list: {why}", field="node list",
                       fix="e.g. a100-[1-2],v100-1 (what squeue and scontrol print)")
