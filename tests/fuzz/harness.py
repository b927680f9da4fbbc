"""What every fuzz test shares: the mutation strategies, the loader contract, the case counter, the watchdog.

The contract (docs/site-and-formats.md): a loader given any input returns a valid object or raises
:class:`SailorError` whose message names the file; never another exception (a traceback for the user), never
a hang, and it never leaves a half-written file behind. Mutations start from a valid document the project
ships or writes, so most cases reach deep into the loader instead of failing at the first byte.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import math
import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from click.testing import CliRunner
from hypothesis import strategies as st

from sailor_hpc.cli import main
from sailor_hpc.core.errors import SailorError

#: examples run per loader, and how many of them the loader refused, printed at the end of the session
CASES: dict[str, int] = {}
REFUSED: dict[str, int] = {}
#: a loader still busy after this long is hung (hypothesis' deadline only fails an example once it returns)
HANG_S = 20.0
#: SAILOR_FUZZ_SCALE=10 runs ten times the examples (a longer hunt than `make test` affords)
SCALE = float(os.environ.get("SAILOR_FUZZ_SCALE", "1"))

Doc = Any  # a parsed JSON/TOML document: dicts, lists, str, int, float, bool, None


def examples(n: int) -> int:
    """``n`` examples, scaled by SAILOR_FUZZ_SCALE."""
    return max(1, round(n * SCALE))


def count(loader: str) -> None:
    """One more generated case of ``loader`` (shown in the session summary)."""
    CASES[loader] = CASES.get(loader, 0) + 1


class Hang(AssertionError):
    """A loader did not return within HANG_S seconds."""


@contextlib.contextmanager
def watchdog(seconds: float = HANG_S) -> Iterator[None]:
    """Fail a loader that runs longer than ``seconds`` (SIGALRM: pytest runs tests in the main thread)."""
    def _alarm(_signum: int, _frame: FrameType | None) -> None:
        raise Hang(f"the loader did not return within {seconds} s")

    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def loads_or_refuses(loader: str, named: Path | str) -> Iterator[None]:
    """The loader contract for the block: it returns, or raises SailorError naming ``named`` (the file, or the
    folder holding the file it names). Any other exception propagates and fails the example."""
    with watchdog():
        try:
            yield
        except SailorError as exc:
            assert str(named) in str(exc), f"the refusal does not name {named}: {exc}"
            REFUSED[loader] = REFUSED.get(loader, 0) + 1


def cli_exits_cleanly(loader: str, args: list[str], named: Path | str) -> None:
    """``sailor-hpc ARGS`` ends in 0, or in 2 naming the file: never 1, never a traceback."""
    result = CliRunner().invoke(main, args)
    assert "Traceback" not in result.output, result.output
    assert result.exit_code in (0, 2), f"exit {result.exit_code}: {result.exception!r}\n{result.output}"
    if result.exit_code == 2:
        assert str(named) in result.output, f"exit 2 without naming {named}:\n{result.output}"
        REFUSED[loader] = REFUSED.get(loader, 0) + 1


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with its checksum."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@contextlib.contextmanager
def scratch(files: dict[str, bytes], *, read_only: bool = True) -> Iterator[Path]:
    """A fresh folder holding ``files`` (relative path -> bytes) for one example. ``read_only``: the block
    (a loader) must leave every file as it found it and write none: nothing half-written stays behind."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for rel, data in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
        before = snapshot(root)
        yield root
        if read_only:
            assert snapshot(root) == before, "reading wrote into the folder it read"


# ------------------------------------------------------------------------------------------- mutations

_STRINGS = ("", " ", "é", "🦀", "\x00", "nan", "-1", "../../etc/passwd", "a" * 300, "A100-40", "step_00000001")
_NUMBERS = (0, -1, 1, 2**31, 2**63, -(2**63), 10**30, 0.5, -0.0, 1e308, math.nan, math.inf, -math.inf)

#: any value of the wrong type or range where a field's value belongs
junk: st.SearchStrategy[Doc] = st.one_of(
    st.none(), st.booleans(), st.sampled_from(_NUMBERS), st.integers(), st.floats(),
    st.sampled_from(_STRINGS), st.text(max_size=8),
    st.lists(st.one_of(st.integers(-3, 3), st.text(max_size=3)), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(-3, 3), max_size=2),
)


def _paths(node: Doc, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield from _paths(child, (*prefix, key))


def _get(doc: Doc, path: tuple[Any, ...]) -> Doc:
    for key in path:
        doc = doc[key]
    return doc


def _near(value: int | float) -> st.SearchStrategy[Doc]:
    """Numbers a typo or a bad unit would give in place of ``value``: zero, negative, huge, NaN, text."""
    return st.sampled_from([0, -value, value * 10**6, value + 0.5, float(value), str(value), math.nan, math.inf,
                            2**64, not value])


def _typo(key: str) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from([key + "s", key[:-1] or "x", key.upper(), f" {key}", key.replace("_", "-")]),
                     st.text(min_size=1, max_size=8))


@st.composite
def mutated_doc(draw: st.DrawFn, doc: Doc, *, keep_root_table: bool = False) -> Doc:
    """``doc`` with one to three structural mutations: a key dropped, a value of another type or range
    (zero, negative, huge, NaN, empty or unicode text), an unknown or misspelt key, a list element repeated,
    a value wrapped in a list or a table unwrapped (wrong nesting). ``keep_root_table``: the root stays a
    table (TOML has no other)."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p or not keep_root_table]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        node = _get(doc, path)
        ops = ["replace", "wrap", "unwrap"]
        if path:
            ops.append("drop")
        if isinstance(node, int | float) and not isinstance(node, bool):
            ops.append("near")
        if isinstance(node, dict):
            ops.append("unknown_key")
        if isinstance(node, list) and node:
            ops.append("repeat")
        op = draw(st.sampled_from(ops))
        if op == "drop":
            parent = _get(doc, path[:-1])
            del parent[path[-1]]
            continue
        if op == "unknown_key":
            key = draw(_typo(draw(st.sampled_from(sorted(map(str, node)) or ["x"]))))
            node[key] = draw(junk)
            continue
        if op == "repeat":
            node.append(copy.deepcopy(draw(st.sampled_from(node))))
            continue
        if op == "replace":
            new = draw(junk)
        elif op == "near":
            new = draw(_near(node))
        elif op == "wrap":
            new = [node]
        elif isinstance(node, dict):  # unwrap
            new = next(iter(node.values()), None)
        else:
            new = node[0] if isinstance(node, list) and node else draw(junk)
        if not path:
            doc = new
        else:
            _get(doc, path[:-1])[path[-1]] = new
    return doc


_JUNK_BYTES = (b"\x00", b"\xff\xfe", b'"', b"[", b"{", b"]]", b"\n[x]\n", b"=", b",", "é".encode(), b"\n", b"NaN")


@st.composite
def mutated_bytes(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` with one to three byte-level mutations: truncated, a byte flipped, junk inserted, a span
    deleted, a line repeated (a duplicate key or table in a text format)."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(("truncate", "flip", "insert", "delete", "repeat_line")))
        pos = draw(st.integers(0, max(0, len(out) - 1)))
        if op == "truncate":
            del out[pos:]
        elif op == "flip" and out:
            out[pos] ^= draw(st.integers(1, 255))
        elif op == "insert":
            out[pos:pos] = draw(st.one_of(st.sampled_from(_JUNK_BYTES), st.binary(min_size=1, max_size=8)))
        elif op == "delete":
            del out[pos:pos + draw(st.integers(1, 64))]
        elif op == "repeat_line":
            start = out.rfind(b"\n", 0, pos) + 1
            end = out.find(b"\n", pos)
            end = len(out) if end < 0 else end + 1
            out[end:end] = out[start:end] if out[start:end].endswith(b"\n") else out[start:end] + b"\n"
    return bytes(out)
