"""The --pareto chart, read back from its matplotlib figure: both axes from zero, every allocation the search
scored drawn, the simulated plans and their front, the front labelled with its GPUs."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner import PlanRequest
from planner.candidates import SearchResult
from planner.pareto import pareto_figure
from planner.search import search
from sailor_hpc.cli import main
from sailor_hpc.core.archive import open_archive
from sailor_hpc.core.site import load_site

LAB = Path(__file__).resolve().parents[2] / "site_configs" / "local-lab.toml"


@pytest.fixture(scope="module")
def result() -> SearchResult:
    site = load_site(LAB)
    return search(site, open_archive(site=site), PlanRequest("OPT-350M", 32))


def _gpus_text(plan) -> str:
    """The GPUs of each type counted from the stages (each stage holds TP GPUs of its type)."""
    count: Counter[str] = Counter()
    for p in plan.pipelines:
        for s in p.stages:
            count[s.gpu_type] += s.tp
    return " + ".join(f"{n} {g}" for g, n in count.items())


def test_the_search_keeps_every_scored_allocation(result: SearchResult) -> None:
    assert len(result.scored) == result.allocations_scored > len(result.simulated)
    points = {(p.gpus, round(p.cost_per_hour, 9)) for p in result.scored}
    for c in result.simulated:  # every simulated plan was scored first, on the same GPUs and price
        assert (c.plan.num_gpus, round(c.result.cost_per_hour, 9)) in points


def test_the_chart_starts_at_zero_and_draws_every_point(result: SearchResult) -> None:
    ax = pareto_figure(result, "GPU-hours").axes[0]
    assert ax.get_xlim()[0] == 0 and ax.get_ylim()[0] == 0
    scored, simulated, best = ax.collections
    assert len(scored.get_offsets()) == result.allocations_scored
    assert len(simulated.get_offsets()) == len(result.simulated)
    assert [tuple(xy) for xy in best.get_offsets()] == [(result.candidates[0].result.cost_per_hour,
                                                         result.candidates[0].throughput)]
    top = max([p.throughput for p in result.scored] + [c.throughput for c in result.simulated])
    assert ax.get_ylim()[1] >= top and ax.get_xlim()[1] >= max(p.cost_per_hour for p in result.scored)
    assert ax.get_xlabel() == "cost per hour (GPU-hours)" and ax.get_ylabel() == "throughput (samples/s)"
    assert ax.get_title() == (f"OPT-350M, global batch 32: {result.allocations_scored} allocations scored, "
                              f"{result.plans_simulated} plans simulated")


def test_the_front_is_the_undominated_plans_each_labelled_with_its_gpus(result: SearchResult) -> None:
    ax = pareto_figure(result, "GPU-hours").axes[0]
    sims = result.simulated

    def dominated(c) -> bool:
        return any(o.result.cost_per_hour <= c.result.cost_per_hour and o.throughput >= c.throughput
                   and (o.result.cost_per_hour, o.throughput) != (c.result.cost_per_hour, c.throughput) for o in sims)

    want = sorted({(c.result.cost_per_hour, c.throughput) for c in sims if not dominated(c)})
    (line,) = ax.lines
    assert sorted(zip(line.get_xdata(), line.get_ydata())) == want
    labels = {(t.xy, t.get_text()) for t in ax.texts}
    assert labels == {((c.result.cost_per_hour, c.throughput), _gpus_text(c.plan))
                      for c in sims if (c.result.cost_per_hour, c.throughput) in want}
    assert labels


def test_plan_pareto_writes_a_small_png(tmp_path: Path) -> None:
    out = tmp_path / "front.png"
    r = CliRunner().invoke(main, ["plan", "--site", str(LAB), "--model", "OPT-350M", "--gbs", "32", "--pareto", str(out)])
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size < 200_000
