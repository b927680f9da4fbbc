"""``sailor-hpc profiles show`` on a real archive: its table fits the terminal (the provenance shortened in the
middle), and a point measured on a busy node or out of order with a smaller micro-batch size is marked and
explained, while a gap inside two quiet spreads is left alone."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from sailor_hpc.cli import main
from sailor_hpc.core.archive import ComputeEntry, PointSpread, make_provenance, write_entries

L = 6
SOURCE = "sailor-hpc profile (/scratch/users/someone/projects/llm/sailor-profile/local-lab-tiny-gpt-2026-11-28)"


def _point(mbs: int, tp: int, ms: float, spread: tuple[float, float] | None) -> ComputeEntry:
    """A point whose whole-model forward and backward each take ``ms`` milliseconds (spread over the layers)."""
    times = np.full((L, 3), ms * 1e-3 / L)
    sp = None if spread is None else PointSpread(np.full((L, 3), spread[0]), spread, 20)
    return ComputeEntry("tiny-gpt", "cpu-A100-40", mbs, tp, times, make_provenance(SOURCE), spread=sp)


def _archive(tmp_path: Path) -> Path:
    """TP 1: mbs 2 measured on a busy node (54 %, 180 %) and faster than mbs 1, as in the issue; mbs 4 fine.
    TP 2: mbs 2 a little faster than mbs 1 inside quiet spreads (noise), mbs 4 below mbs 2 with no spread
    recorded (an archive without the profiler's check: any gap counts)."""
    path = tmp_path / "a.h5"
    write_entries(path, [_point(1, 1, 15.0, (0.03, 0.04)), _point(2, 1, 12.0, (0.54, 1.8)), _point(4, 1, 40.0, (0.02, 0.02)),
                         _point(1, 2, 10.0, (0.05, 0.05)), _point(2, 2, 9.8, (0.05, 0.05)), _point(4, 2, 9.0, None)])
    return path


def _show(path: Path, *args: str, columns: int | None = None):
    env = {"COLUMNS": str(columns)} if columns else {"COLUMNS": ""}
    res = CliRunner().invoke(main, ["profiles", "show", "tiny-gpt", "cpu-A100-40", "--archive", str(path), *args],
                             env=env)
    assert res.exit_code == 0, res.output
    return res.output


def _table(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("mbs "))
    return lines[start:start + 8]  # header, rule, six points


def test_the_table_fits_the_terminal_and_keeps_the_ends_of_the_source(tmp_path: Path) -> None:
    path = _archive(tmp_path)
    for columns in (110, 130):
        table = _table(_show(path, columns=columns))
        assert max(map(len, table)) <= columns
        at = table[0].index("source")
        for row in table[2:]:
            cell = row[at:]
            assert "…" in cell and SOURCE.startswith(cell.split("…")[0]) and SOURCE.endswith(cell.split("…")[1])
    narrow = _show(path, columns=90)  # not even 16 characters of the source would fit: it is left out, said so
    assert max(map(len, _table(narrow))) <= 90 and "source" not in _table(narrow)[0]
    assert "(source left out to fit 90 columns: a wider terminal or --json shows it)" in narrow
    wide = _table(_show(path))  # not a terminal and no $COLUMNS: every character
    assert all(row.endswith(SOURCE) for row in wide[2:])


def test_busy_and_out_of_order_points_are_marked_and_explained(tmp_path: Path) -> None:
    text = _show(_archive(tmp_path), columns=200)
    rows = {(r.split()[0], r.split()[1]): r for r in _table(text)[2:]}
    at = _table(text)[0].index("flag")
    flags = {k: r[at:].split("  ")[0].strip() for k, r in rows.items()}
    assert flags == {("1", "1"): "NOT MONOTONIC", ("2", "1"): "noisy, NOT MONOTONIC", ("4", "1"): "-",
                     ("1", "2"): "NOT MONOTONIC", ("2", "2"): "NOT MONOTONIC", ("4", "2"): "NOT MONOTONIC"}
    assert ("warning: mbs 2 tp 1: noisy: spread forward 54 %, backward 180 % over 20 repetitions, above 20 %: the node "
            "was busy") in text
    assert ("warning: tp 1: mbs 2 is faster than mbs 1: forward 12 ms (mbs 1: 15 ms) and backward 12 ms (mbs 1: 15 ms); "
            "a larger micro-batch cannot take less time, and the spreads are too wide to tell which is wrong") in text
    # a gap wider than the spreads allow (none recorded at mbs 4): named; 9.8 ms below 10 ms inside 5 % spreads: not
    assert "warning: tp 2: mbs 4 is faster than mbs 2: forward 9 ms (mbs 2: 9.8 ms)" in text
    assert "warning: tp 2: mbs 4 is faster than mbs 1" in text and "mbs 2 is faster than mbs 1: forward 9.8" not in text
    assert text.count("warning: tp 1:") == 1  # one line per pair, both directions in it


def test_json_carries_the_same_judgement(tmp_path: Path) -> None:
    doc = json.loads(_show(_archive(tmp_path), "--json"))
    points = {(p["mbs"], p["tp"]): p for p in doc["points"]}
    assert doc["noisy_spread"] == 0.2
    assert points[(2, 1)]["noisy"].startswith("noisy: spread forward 54 %") and not points[(1, 1)]["noisy"]
    assert points[(2, 1)]["out_of_order"] == points[(1, 1)]["out_of_order"] != []
    assert points[(4, 1)]["out_of_order"] == [] and points[(4, 1)]["flags"] == "-"
    assert points[(2, 1)]["provenance"]["source"] == SOURCE  # machines get the whole text
