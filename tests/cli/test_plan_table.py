"""The plan table, read back: every stage's GPU type, TP and layers, the micro-batches and the numbers of each
plan, against the plan JSON of the same search; two plans of the same GPUs differ in what the table shows."""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from sailor_hpc.cli import main

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "site_configs" / "local-lab.toml"  # at global batch 32: mixed plans, two of the same GPUs


def read_table(text: str) -> list[dict[str, str]]:
    """The table's lines as {header: cell}, the columns cut where the dashes under the headers start."""
    lines = text.splitlines()
    dash = next(i for i, line in enumerate(lines) if line.startswith("-  "))
    starts = [m.start() for m in re.finditer(r"-+", lines[dash])]
    cut = list(zip(starts, [*starts[1:], None]))
    headers = [lines[dash - 1][a:b].strip() for a, b in cut]
    rows = []
    for line in lines[dash + 1:]:
        if not line.strip() or not (line[:1].isdigit() or line.startswith(" ")):
            break
        rows.append({h: line[a:b].strip() for h, (a, b) in zip(headers, cut)})
    return rows


def plan_blocks(rows: list[dict[str, str]]) -> list[list[dict[str, str]]]:
    """A plan's numbered line and the lines under it."""
    blocks: list[list[dict[str, str]]] = []
    for r in rows:
        if r["#"]:
            blocks.append([])
        blocks[-1].append(r)
    return blocks


def parse_stages(cell: str) -> list[tuple[str, int, int, int]]:
    """'A100-40 TP2 0-12,13-25 | V100-16 TP1 26-30' -> (GPU type, TP, first, last) of each stage."""
    out = []
    for group in cell.split(" | "):
        gpu, tp, ranges = group.split(" ")
        assert tp.startswith("TP")
        for r in ranges.split(","):
            first, last = r.split("-")
            out.append((gpu, int(tp[2:]), int(first), int(last)))
    return out


def _plan(site: Path, *args: str) -> tuple[list[list[dict[str, str]]], dict]:
    base = ["plan", "--site", str(site), "--model", "OPT-350M", *args]
    text = CliRunner().invoke(main, base)
    data = CliRunner().invoke(main, [*base, "--json"])
    assert text.exit_code == 0 and data.exit_code == 0, text.output + data.output
    return plan_blocks(read_table(text.output)), json.loads(data.output)


@pytest.fixture(scope="module")
def lab() -> tuple[list[list[dict[str, str]]], dict]:
    return _plan(LAB, "--gbs", "32")


def test_the_table_shows_every_stage_and_the_numbers_of_the_json(lab) -> None:
    blocks, data = lab
    assert any(len(p["gpus"]) > 1 for p in data["plans"])
    assert len(blocks) == len(data["plans"])
    for k, (block, p) in enumerate(zip(blocks, data["plans"])):
        head = block[0]
        assert head["#"] == str(k + 1)
        assert head["GPUs"] == " + ".join(f"{n} {g}" for g, n in p["gpus"].items())
        assert head["iteration s"] == f"{p['iteration_time_s']:.4g}"
        assert head["GPU-hours/hour"] == f"{p['cost_per_hour']:.2f}"
        # the pipelines the table lists, copies included, are the plan's: stages, mbs, micro-batch counts
        shown: Counter = Counter()
        for line in block:
            if not line["pipelines"]:
                continue
            mbs, micro = line["mbs x micro-batches"].split("x")
            lo, hi = (int(x) for x in (micro.split("-") if "-" in micro else (micro, micro)))
            shown[(tuple(parse_stages(line["stages: GPU type TP layers"])), int(mbs), lo, hi)] += int(
                line["pipelines"].rstrip("x"))
        want: Counter = Counter()
        counts: dict[tuple, list[int]] = {}
        for pipe in p["plan"]["pipelines"]:
            stages = tuple((s["gpu_type"], s["tp"], *s["layers"]) for s in pipe["stages"])
            counts.setdefault((stages, pipe["micro_batch_size"]), []).append(pipe["num_micro_batches"])
        for (stages, mbs), ms in counts.items():
            want[(stages, mbs, min(ms), max(ms))] = len(ms)
        assert shown == want
        memory = {line["peak memory / capacity"] for line in block} - {""}
        assert memory == {f"{g} {d['peak_bytes'] / 2**30:.2f} GiB / {d['capacity_bytes'] / 2**30:.2f} GiB"
                          for g, d in p["memory_by_gpu_type"].items()}


def test_plans_of_the_same_gpus_differ_in_what_the_table_shows(lab) -> None:
    blocks, _ = lab
    shapes: dict[str, list[tuple]] = {}
    for block in blocks:
        shapes.setdefault(block[0]["GPUs"], []).append(
            tuple((r["pipelines"], r["stages: GPU type TP layers"], r["mbs x micro-batches"]) for r in block))
    same = [v for v in shapes.values() if len(v) > 1]
    assert same, "no two plans of the same GPUs here: the check would be empty"
    for v in same:
        assert len(set(v)) == len(v), v


def test_vs_first_is_time_and_cost_against_the_best(lab) -> None:
    blocks, data = lab
    best = data["plans"][0]
    assert blocks[0][0]["vs #1"] == "-"
    for block, p in zip(blocks[1:], data["plans"][1:]):
        dt = p["iteration_time_s"] / best["iteration_time_s"] - 1
        dc = p["cost_per_hour"] / best["cost_per_hour"] - 1
        assert block[0]["vs #1"] == f"{dt:+.1%} time, {dc:+.1%} cost"
