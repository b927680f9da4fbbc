"""The cost-throughput chart of a search (matplotlib, PNG): every allocation it scored, the plans it simulated and
their Pareto front, each front point labelled with its GPUs. Both axes start at zero, so that a 10 % spread
looks like 10 %."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.candidates import Candidate, SearchResult
from sailor_hpc.core.atomic import atomic_path

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def pareto_front(candidates: list[Candidate]) -> list[Candidate]:
    """Plans no other plan beats on both cost per hour and throughput, by increasing cost."""
    ordered = sorted(candidates, key=lambda c: (c.result.cost_per_hour, -c.throughput))
    front, best = [], -1.0
    for c in ordered:
        if c.throughput > best:
            front.append(c)
            best = c.throughput
    return front


def pareto_figure(result: SearchResult, cost_unit: str) -> Figure:
    """The chart as a figure (tests read it back): grey, every allocation the search scored (its estimate);
    dark, the plans simulated; red, their front, labelled; a star, the best plan of the ranking."""
    from matplotlib.figure import Figure

    pts = result.simulated or result.candidates
    front = pareto_front(pts)
    best = result.candidates[0]
    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    if result.scored:
        ax.scatter([p.cost_per_hour for p in result.scored], [p.throughput for p in result.scored], s=3,
                   c="#bbbbbb", alpha=0.5, linewidths=0, label=f"{len(result.scored)} allocations scored (estimate)")
    ax.scatter([c.result.cost_per_hour for c in pts], [c.throughput for c in pts], s=16, c="#555555",
               label=f"{len(pts)} plans simulated")
    ax.plot([c.result.cost_per_hour for c in front], [c.throughput for c in front], "o-", c="#c0392b",
            label="Pareto front of the simulated plans")
    for c in front:
        ax.annotate(c.plan.gpus_label(), (c.result.cost_per_hour, c.throughput), textcoords="offset points",
                    xytext=(-6, 4), ha="right", fontsize=7, color="#c0392b")  # above-left of a front is empty
    ax.scatter([best.result.cost_per_hour], [best.throughput], marker="*", s=160, c="#f1c40f", edgecolors="black",
               linewidths=0.6, zorder=3, label=f"best by {result.request.objective}: {best.plan.gpus_label()}")
    xs = [p.cost_per_hour for p in result.scored] + [c.result.cost_per_hour for c in pts]
    ys = [p.throughput for p in result.scored] + [c.throughput for c in pts]
    ax.set_xlim(0, max(xs) * 1.05 or 1.0)
    ax.set_ylim(0, max(ys) * 1.1 or 1.0)
    ax.set_xlabel(f"cost per hour ({cost_unit})")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title(f"{result.request.model}, global batch {result.request.global_batch_size}: "
                 f"{result.allocations_scored} allocations scored, {result.plans_simulated} plans simulated",
                 fontsize=10)
    style_chart(fig, ax, legend_loc="lower right")
    return fig


def plot_pareto(result: SearchResult, path: Path, cost_unit: str) -> None:
    """Write :func:`pareto_figure` as a PNG, atomically."""
    write_figure(pareto_figure(result, cost_unit), path)


def style_chart(fig: Any, ax: Any, legend_loc: str = "best") -> None:
    """Grid, legend and tight layout (shared by the front charts)."""
    ax.grid(alpha=0.3)
    ax.legend(loc=legend_loc, fontsize=8)
    fig.tight_layout()


def write_figure(fig: Any, path: Path) -> None:
    """The PNG of ``fig`` written atomically: the user's path in any error, nothing half-written."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)


def save_chart(fig: Any, ax: Any, path: Path) -> None:
    """Grid, legend, and the PNG written atomically (a pyplot figure: closed once written)."""
    import matplotlib.pyplot as plt

    style_chart(fig, ax)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
