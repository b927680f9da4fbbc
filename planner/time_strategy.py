"""Start now and grow later, or wait for the best allocation: which finishes first.

*Wait*: the best single plan of the time objective (it may itself start now). *Grow*: start at once on
the plan that finishes first among those whose GPUs are idle now, and when the fastest plan's GPUs free
(its expected start), checkpoint and move onto it, paying one restart (what ``sailor-hpc run`` does when
more GPUs free). Both are expected finishes from the same start model; the sooner one is chosen.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from planner.candidates import Candidate, SearchResult
from planner.time_goal import Outlook, TimeGoal


@dataclass(frozen=True)
class Strategy:
    """The choice and the figures behind it (plans are the result's candidates or simulated plans)."""

    chosen: str  # "start now" (the best single plan starts now), "wait" (for it) or "grow"
    wait_plan: Candidate
    wait: Outlook
    grow_from: Candidate | None  # the plan started now
    grow_to: Candidate | None  # the plan moved onto once its GPUs free
    grow_at_s: float  # when the move happens
    grow_finish_s: float  # math.inf when growing is not possible
    why: str


def choose(result: SearchResult, goal: TimeGoal) -> Strategy:
    """Compare waiting for the best plan with starting now and growing onto the fastest."""
    def look(c: Candidate, steps: int | None = None) -> Outlook:
        return goal.plan_outlook(c.plan, c.result.iteration_time_s, steps)

    best = result.candidates[0]
    wait = look(best)
    pool = result.simulated or result.candidates
    now = [c for c in pool if look(c).start.start_s == 0 and goal.violation(look(c)) is None]
    fastest = max(pool, key=lambda c: c.throughput)
    at = look(fastest).start.start_s
    if not now or at == 0 or not math.isfinite(at):
        why = ("every plan that finishes first starts now" if at == 0 else
               "no plan fits the GPUs idle now" if not now else "the fastest plan's start is unknown")
        return Strategy(_single(wait), best, wait, None, None, 0.0, math.inf, why)
    start = min(now, key=lambda c: look(c).finish_s)
    first = look(start)
    if first.finish_s <= at:  # done before the fastest plan's GPUs free
        grow_finish = first.finish_s
    else:
        done = min(goal.steps, int(at / start.result.iteration_time_s))
        rest = look(fastest, goal.steps - done)
        grow_finish = at + goal.restart_cost_s + rest.run_s + rest.restart_s
    if grow_finish < wait.finish_s:
        why = (f"starting now on {_gpus(start)} and moving to {_gpus(fastest)} at {at / 60:.1f} min finishes at "
               f"{grow_finish / 60:.1f} min, before the best single plan ({wait.finish_s / 60:.1f} min)")
        return Strategy("grow", best, wait, start, fastest, at, grow_finish, why)
    why = (f"the best single plan ({_gpus(best)}) finishes at {wait.finish_s / 60:.1f} min; starting now on "
           f"{_gpus(start)} and moving to {_gpus(fastest)} at {at / 60:.1f} min would finish at "
           f"{grow_finish / 60:.1f} min")
    return Strategy(_single(wait), best, wait, start, fastest, at, grow_finish, why)


def _single(wait: Outlook) -> str:
    return "start now" if wait.start.start_s == 0 else "wait"


def _gpus(c: Candidate) -> str:
    return " + ".join(f"{n} {g}" for g, n in c.plan.gpus_by_type().items())
