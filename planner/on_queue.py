"""Plan on a queue's state: the one place a plan on the GPUs free now, or on the queue a job would wait in,
is assembled, for every objective. ``sailor-hpc plan`` (``--objective time`` included) and the controller's
re-plans (on the free GPUs, on the queue) all call :func:`plan_on_state`, so they build the same time goal
from the same terms and rank the same plans the same way.

The planner never calls Slurm: the caller reads the queue (a :class:`QueueSnapshot`) and passes Slurm's
``sbatch --test-only`` as ``test_only``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from planner.candidates import Progress, SearchResult, default_available
from planner.entry import plan_search
from planner.request import PlanRequest
from planner.time_goal import TimeGoal
from planner.time_queue import TestOnly, TimeTerms, queue_goal, refine
from sailor_hpc.core.archive import ProfileArchive
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.site import Site
from sailor_hpc.core.start_times import QueueSnapshot

NoPlan = Callable[[SailorError], SailorError]  # how a caller names "no plan on this state"
RequestFor = Callable[[dict[str, int], TimeGoal | None], PlanRequest]  # the request on these GPUs, with this goal


@dataclass(frozen=True)
class QueueState:
    """What a plan is made on: the GPUs per partition it may use ({}: every GPU a job may take) and, for
    objective time, the queue it would wait in and Slurm's answers about it (None: the timeline alone)."""

    available: dict[str, int]
    snapshot: QueueSnapshot | None = None
    test_only: TestOnly | None = None


def plan_on_state(site: Site, archive: ProfileArchive, state: QueueState, request_for: RequestFor,
                  time: TimeTerms | None = None, *, top_k: int, progress: Progress | None = None,
                  no_plan: NoPlan | None = None) -> SearchResult:
    """The best plans, best first, of ``request_for(GPUs, goal)`` on ``state``. ``time`` (objective time): the
    goal of that run on the state's queue, and the first ``top_k`` plans ranked again on Slurm's answers.
    A bad request or goal raises its SailorError as it is; when the search finds no plan, or no partition can
    start a job under the site's states, its SailorError goes through ``no_plan`` (the controller waits on it
    where ``plan`` reports it)."""
    goal = None
    available = dict(state.available)
    left_out: dict[str, str] = {}
    if time is not None:
        assert state.snapshot is not None, "objective time plans on a queue"
        goal = queue_goal(site, time, state.snapshot)
        try:
            available, left_out = startable(site, goal, available)
        except SailorError as exc:  # nothing can start now: the controller waits on it where plan reports it
            if no_plan is None:
                raise
            raise no_plan(exc) from exc
    request = request_for(available, goal)
    try:
        result = plan_search(site, archive, request, progress=progress)
    except SailorError as exc:
        if no_plan is None:
            raise
        raise no_plan(exc) from exc
    result = result if goal is None else refine(result, state.test_only, top_k)
    return replace(result, left_out=left_out)


def startable(site: Site, goal: TimeGoal, available: dict[str, int]) -> tuple[dict[str, int], dict[str, str]]:
    """The GPUs a plan may use, less the partitions where no job can start under the site's states (a DOWN
    or drained partition, one Slurm does not have, one with no usable node), and why each was left out.
    Raises when that leaves none: a plan that would wait forever is no plan."""
    left_out = {p.name: why for p in site.partitions if (why := goal.model.timeline.partition_refusal(p.name))}
    if not left_out:
        return available, {}
    usable = {name: gpus for name, gpus in (available or default_available(site)).items() if name not in left_out}
    if not any(usable.values()):
        raise SailorError("no partition the plan may use can start a job now: " + "; ".join(left_out.values()),
                          file=site.source, field="partitions",
                          fix="plan again once they can, or plan on other partitions (--available)")
    return usable, left_out

__all__ = ["NoPlan", "QueueState", "RequestFor", "plan_on_state", "startable"]
