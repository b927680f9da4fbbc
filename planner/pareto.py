"""The cost-throughput front of the plans a search simulated (matplotlib, PNG)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from planner.candidates import Candidate, SearchResult
from sailor_hpc.core.atomic import atomic_path


def pareto_front(candidates: list[Candidate]) -> list[Candidate]:
    """Plans no other plan beats on both cost per hour and throughput, by increasing cost."""
    ordered = sorted(candidates, key=lambda c: (c.result.cost_per_hour, -c.throughput))
    front, best = [], -1.0
    for c in ordered:
        if c.throughput > best:
            front.append(c)
            best = c.throughput
    return front


def plot_pareto(result: SearchResult, path: Path, cost_unit: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result.simulated or result.candidates
    front = pareto_front(pts)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([c.result.cost_per_hour for c in pts], [c.throughput for c in pts], s=14, c="#999999",
               label="simulated plans")
    ax.plot([c.result.cost_per_hour for c in front], [c.throughput for c in front], "o-", c="#c0392b",
            label="Pareto front")
    ax.set_xlabel(f"cost per hour ({cost_unit})")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title(f"{result.request.model}, global batch {result.request.global_batch_size}")
    save_chart(fig, ax, path)


def save_chart(fig: Any, ax: Any, path: Path) -> None:
    """Grid, legend, and the PNG written atomically (shared by the front charts)."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
