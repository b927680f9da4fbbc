"""Expected finish against GPU-hours of the plans a time search simulated (matplotlib, PNG)."""
from __future__ import annotations

from pathlib import Path

from planner.candidates import Candidate, SearchResult
from planner.pareto import save_chart
from planner.time_goal import Outlook, TimeGoal


def time_front(goal: TimeGoal, candidates: list[Candidate]) -> list[tuple[Candidate, Outlook]]:
    """Plans no other plan beats on both GPU-hours and expected finish, by increasing GPU-hours."""
    looks = sorted(((c, goal.plan_outlook(c.plan, c.result.iteration_time_s)) for c in candidates),
                   key=lambda co: (co[1].gpu_hours, co[1].finish_s))
    front: list[tuple[Candidate, Outlook]] = []
    for c, o in looks:
        if not front or o.finish_s < front[-1][1].finish_s:
            front.append((c, o))
    return front


def plot_time_pareto(result: SearchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    goal = result.request.time_goal
    assert goal is not None
    pts = result.simulated or result.candidates
    looks = [goal.plan_outlook(c.plan, c.result.iteration_time_s) for c in pts]
    front = time_front(goal, pts)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([o.gpu_hours for o in looks], [o.finish_s / 3600 for o in looks], s=14, c="#999999",
               label="simulated plans")
    ax.plot([o.gpu_hours for _, o in front], [o.finish_s / 3600 for _, o in front], "o-", c="#c0392b",
            label="Pareto front")
    ax.set_xlabel("GPU-hours")
    ax.set_ylabel("expected finish (hours from now)")
    ax.set_title(f"{result.request.model}, {goal.steps} steps of global batch {result.request.global_batch_size}")
    save_chart(fig, ax, path)
