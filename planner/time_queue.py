"""The time objective on a queue read from Slurm: the goal from the run's terms, the shown plans ranked again
on Slurm's own answers (composed by :func:`planner.on_queue.plan_on_state`, which every caller uses). The Slurm
calls themselves stay with the caller (the planner never calls Slurm): the queue comes in as a snapshot,
Slurm's answers through ``test_only``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from planner.candidates import SearchResult, ranking, time_infeasible
from planner.time_goal import TimeGoal, plan_shape
from planner.time_strategy import choose
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.site import Site, parse_walltime
from sailor_hpc.core.start_times import QueueSnapshot, RequestShape

TestOnly = Callable[[QueueSnapshot, Sequence[tuple[RequestShape, int]]], QueueSnapshot]


@dataclass(frozen=True)
class TimeTerms:
    """What objective time asks beside the plan request: the steps to train, each job's time limits as Slurm
    times (--time, --time-min), the seconds a restart costs, and the bounds on the result (``deadline_s``:
    seconds from the queue's read)."""

    steps: int
    time_limit: str | None = None
    time_min: str | None = None
    restart_cost_s: float = 60.0
    deadline_s: float | None = None
    max_gpu_hours: float | None = None


def queue_goal(site: Site, terms: TimeTerms, snapshot: QueueSnapshot) -> TimeGoal:
    """The goal of ``terms`` on the queue ``snapshot``."""
    limit = float(parse_walltime(terms.time_limit)) if terms.time_limit else None
    tmin = float(parse_walltime(terms.time_min)) if terms.time_min else None
    if tmin is not None and limit is not None and tmin > limit:
        raise SailorError(f"--time-min {terms.time_min} is longer than --time {terms.time_limit}", field="--time-min",
                          fix="give a minimum below --time")
    return TimeGoal.for_site(site, terms.steps, snapshot, time_limit_s=limit, time_min_s=tmin,
                             restart_cost_s=terms.restart_cost_s, deadline_s=terms.deadline_s,
                             max_gpu_hours=terms.max_gpu_hours)


def refine(result: SearchResult, test_only: TestOnly | None, top_k: int) -> SearchResult:
    """Ask Slurm (``test_only``: ``sbatch --test-only``) when the first ``top_k`` plans and the grow strategy's
    plans would start, and rank the plans again on those answers (with --time-min, the timeline's estimate
    stays: Slurm answers for the full time limit, not for the shorter window)."""
    goal = result.request.time_goal
    assert goal is not None
    if test_only is None or goal.time_min_s is not None:
        return result
    strategy = choose(result, goal)
    plans = [*result.candidates[:top_k], *(c for c in (strategy.grow_from, strategy.grow_to) if c is not None)]
    keys = []
    for c in plans:
        shape = plan_shape(c.plan)
        keys.append((shape, round(goal.job_time_s(shape, goal.steps * c.result.iteration_time_s))))
    refined = replace(goal, snapshot=test_only(goal.snapshot, keys))
    request = replace(result.request, time_goal=refined)
    kept = [c for c in result.candidates
            if refined.violation(refined.plan_outlook(c.plan, c.result.iteration_time_s)) is None]
    if not kept:
        raise time_infeasible(request, result.candidates)
    return replace(result, request=request, candidates=sorted(kept, key=ranking(request)))
