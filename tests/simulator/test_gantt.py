"""The --timeline chart stays readable for large plans: identical replicas share a row, a plan with many
micro-batches is drawn binned with its first micro-batches in full, waiting is drawn as waiting."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sailor_hpc.core.archive import open_archive
from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.site import load_site
from simulator import plan_timeline
from simulator.timeline import DENSE_EVENTS, Event, _binned, chart_rows, write_gantt
from tests.simulator.conftest import SITES, validation_dir

PNG = b"\x89PNG\r\n\x1a\n"


def _deep_plan(path: Path, micro_batches: int) -> Path:
    """Two different pipelines, one of them four stages over A100s and a V100 (placed by hand)."""
    def stage(first: int, last: int, tp: int, gpu: str, part: str, node: int, gpus: list[int]) -> dict:
        return {"layers": [first, last], "tp": tp, "gpu_type": gpu, "partition": part,
                "placement": {"node": node, "gpus": gpus}}
    doc = {"format": "sailor-hpc-plan", "version": 1, "model": "OPT-350M", "global_batch_size": 8 * micro_batches,
           "dtype": "fp32", "pipelines": [
               {"micro_batch_size": 4, "num_micro_batches": micro_batches, "stages": [
                   stage(0, 6, 1, "A100-40", "a100", 0, [0]), stage(7, 13, 1, "A100-40", "a100", 0, [1]),
                   stage(14, 20, 1, "A100-40", "a100", 1, [0]), stage(21, 25, 1, "V100-16", "v100", 0, [0])]},
               {"micro_batch_size": 4, "num_micro_batches": micro_batches, "stages": [
                   stage(0, 12, 2, "A100-40", "a100", 2, [0, 1]), stage(13, 25, 2, "A100-40", "a100", 2, [2, 3])]}]}
    path.write_text(json.dumps(doc))
    return path


def test_identical_replicas_share_a_row_and_different_ones_do_not(tmp_path: Path) -> None:
    clariden = load_site(SITES / "clariden.toml")
    plan = load_plan(validation_dir() / "clariden/OPT-350/N4/plan_config_N4_D2.json", model="OPT-350M", site=clariden)
    tl = plan_timeline(plan, clariden, open_archive(site=clariden))
    assert {(p, s) for p, s in ((e.pipeline, e.stage) for e in tl.events)} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert [label for label, _ in chart_rows(tl)] == ["GH-96 stage 0 (p0 +1 identical)", "GH-96 stage 1 (p0 +1 identical)"]
    site = load_site(SITES / "a100-v100.toml")
    deep = plan_timeline(load_plan(_deep_plan(tmp_path / "deep.json", 8), site=site), site, open_archive(site=site))
    assert [label for label, _ in chart_rows(deep)] == [  # named by GPU type: the mixed pipeline's V100 stage shows
        "A100-40 stage 0 (p0)", "A100-40 stage 1 (p0)", "A100-40 stage 2 (p0)", "V100-16 stage 3 (p0)",
        "A100-40 stage 0 (p1)", "A100-40 stage 1 (p1)"]


def test_binning_keeps_what_takes_most_of_each_slice() -> None:
    events = [Event(0, 0, "fwd", 0, 0.0, 30.0), Event(0, 0, "bwd", 0, 30.0, 60.0),
              Event(0, 0, "idle", None, 60.0, 90.0), Event(0, 0, "grads", None, 90.0, 100.0)]
    runs = _binned(events, 100.0)
    assert [k for _, _, k in runs] == ["compute", "idle", "grads"]  # forward and backward together
    assert [(round(a, 6), round(a + w, 6)) for a, w, _ in runs] == [(0.0, 60.0), (60.0, 90.0), (90.0, 100.0)]


@pytest.mark.parametrize("micro_batches", [8, 128])
def test_chart_of_a_large_plan_renders(tmp_path: Path, micro_batches: int) -> None:
    site = load_site(SITES / "a100-v100.toml")
    tl = plan_timeline(load_plan(_deep_plan(tmp_path / "deep.json", micro_batches), site=site), site,
                       open_archive(site=site))
    per_row = max(sum(1 for e in tl.events if (e.pipeline, e.stage) == k and e.kind in ("fwd", "bwd"))
                  for _, k in chart_rows(tl))
    assert (per_row > DENSE_EVENTS) == (micro_batches == 128)
    assert any(e.kind == "idle" and e.end > e.start for e in tl.events)  # the V100 stage holds the others up
    write_gantt(tl, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG



def test_the_chart_names_rows_by_gpu_type_and_its_title_the_model_plan_and_time(tmp_path: Path) -> None:
    """Read back from the figure: one y tick label per row, each naming its stage's GPU type (taken from the
    plan file itself), and the title the CLI gives (model, plan, iteration time)."""
    from sailor_hpc.cli.simulate_cmds import timeline_title
    from simulator import simulate

    site = load_site(SITES / "a100-v100.toml")
    path = _deep_plan(tmp_path / "deep.json", 8)
    plan = load_plan(path, site=site)
    tl = plan_timeline(plan, site, open_archive(site=site))
    doc = json.loads(path.read_text())
    gpu_of = {(p, s): st["gpu_type"] for p, pipe in enumerate(doc["pipelines"]) for s, st in enumerate(pipe["stages"])}
    res = simulate(plan, site, open_archive(site=site))
    title = timeline_title(plan, site.name, path.name, res.iteration_time_s)
    assert title == (f"OPT-350M on a100-v100, plan deep.json (7 A100-40 + 1 V100-16, 2 pipelines): "
                     f"{res.iteration_time_s:.4g} s per iteration")
    ax = tl.figure(title).axes[0]
    assert ax.get_title() == title
    ticks = [t.get_text() for t in ax.get_yticklabels()]
    assert ticks == [f"{gpu_of[k]} stage {k[1]} (p{k[0]})" for _, k in chart_rows(tl)]
    assert sum("V100-16" in t for t in ticks) == 1  # the one V100 stage of the mixed pipeline


def test_simulate_timeline_png_is_small(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from sailor_hpc.cli import main

    out = tmp_path / "t.png"
    plan = _deep_plan(tmp_path / "deep.json", 128)
    r = CliRunner().invoke(main, ["simulate", str(plan), "--site", str(SITES / "a100-v100.toml"), "--timeline", str(out)])
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:8] == PNG and out.stat().st_size < 200_000
