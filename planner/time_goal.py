"""The ``time`` objective: expected finish = expected start + run time + what the restarts cost.

A plan's run time is its steps times its simulated iteration time. Each job asks for the time its
remaining steps need (rounded up to a minute, with the checkpoint grace), at most the time limit (the
user's ``--time``, else the shortest ``max_walltime`` of the partitions it uses); a run longer than that
is cut into jobs, and each cut costs a checkpoint and restart (``restart_cost_s``) plus a new wait in the
queue (the site's median wait for that request in its ``sacct`` history; none known, none counted). With
``--time-min`` the first job may start in a shorter backfill window and is cut at its end. The start is
:class:`planner.start_model.StartModel`'s. ``--deadline`` and ``--max-gpu-hours`` are constraints on the
result.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from planner.start_model import StartModel
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.site import Site
from sailor_hpc.core.start_times import QueueSnapshot, RequestShape, StartEstimate, request_shape

MAX_GRACE_S = 300.0  # the job checkpoints this long before its limit (at most a tenth of it), as jobs render it


def grace_s(limit_s: float) -> float:
    """Seconds before a job's limit at which it checkpoints and stops: lost to training."""
    return min(MAX_GRACE_S, limit_s / 10)


def minutes_up(seconds: float) -> float:
    """Slurm time limits are whole minutes."""
    return 60.0 * math.ceil(max(seconds, 1.0) / 60.0)


@dataclass(frozen=True)
class Outlook:
    """One plan's expected time to result."""

    start: StartEstimate
    run_s: float  # steps x iteration time
    restarts: int
    restart_s: float  # the restarts' checkpoints, relaunches and new waits
    job_time_s: float  # the time limit the first job asks for
    gpu_hours: float

    @property
    def finish_s(self) -> float:
        return self.start.start_s + self.run_s + self.restart_s


@dataclass(frozen=True)
class TimeGoal:
    """What the time objective needs beside the plan request: how much to train and the queue."""

    steps: int
    snapshot: QueueSnapshot
    partition_limits_s: Mapping[str, float]  # partition -> max walltime (math.inf: none)
    time_limit_s: float | None = None  # each job's limit (--time); None: the partitions' maxima
    time_min_s: float | None = None  # --time-min
    restart_cost_s: float = 60.0
    deadline_s: float | None = None  # from the snapshot
    max_gpu_hours: float | None = None
    model: StartModel = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", StartModel(self.snapshot))

    @staticmethod
    def for_site(site: Site, steps: int, snapshot: QueueSnapshot, **kw: float | None) -> TimeGoal:
        """The goal on ``site``: each partition's time limit is the site file's ``max_walltime`` or Slurm's
        MaxTime read into the snapshot, whichever is shorter (a job asking more is refused)."""
        limits = {}
        for p in site.partitions:
            mine = float(p.max_walltime_s) if p.max_walltime_s else math.inf
            state = snapshot.partitions.get(p.name)
            limits[p.name] = min(mine, state.max_time_s) if state is not None else mine
        return TimeGoal(steps=steps, snapshot=snapshot, partition_limits_s=limits, **kw)  # type: ignore[arg-type]

    def limit_s(self, shape: RequestShape) -> float:
        limits = [self.partition_limits_s.get(p, math.inf) for p, _ in shape]
        if self.time_limit_s is not None:
            limits.append(self.time_limit_s)
        return min(limits, default=math.inf)

    def job_time_s(self, shape: RequestShape, remaining_s: float) -> float:
        """The time limit a job with ``remaining_s`` of training asks for: enough for it, at most the limit."""
        need = remaining_s + self.restart_cost_s
        want = minutes_up(need + min(MAX_GRACE_S, need / 9))  # then want - grace_s(want) >= need
        return min(want, self.limit_s(shape))

    def outlook(self, shape: RequestShape, iteration_s: float, gpus: int, steps: int | None = None) -> Outlook:
        """Expected start, run, restarts and finish of ``steps`` (default: all) on a plan of this shape."""
        run_s = (self.steps if steps is None else steps) * iteration_s
        job_s = self.job_time_s(shape, run_s)
        window = self.model.window(shape, job_s, self.time_min_s)
        restarts, restart_s = 0, 0.0
        remaining = run_s - min(run_s, self.trains_s(window.granted_s))
        if remaining > 0:
            per_job = self.trains_s(self.limit_s(shape))
            if per_job <= 0:
                return Outlook(window.estimate, run_s, 0, math.inf, job_s, math.inf)
            restarts = math.ceil(remaining / per_job)
            restart_s = restarts * (self.restart_cost_s + self._requeue_wait(shape))
        hours = gpus * (run_s + restart_s) / 3600.0
        return Outlook(window.estimate, run_s, restarts, restart_s, job_s, hours)

    def trains_s(self, granted_s: float) -> float:
        """Training a job granted ``granted_s`` does: less its start-up and the checkpoint before its limit."""
        return max(0.0, granted_s - grace_s(granted_s) - self.restart_cost_s)

    def _requeue_wait(self, shape: RequestShape) -> float:
        waits = [self.snapshot.history_wait(p, len(g)) for p, g in shape]
        return max((w.median_wait_s for w in waits if w is not None), default=0.0)

    def plan_outlook(self, plan: Plan, iteration_s: float, steps: int | None = None) -> Outlook:
        return self.outlook(plan_shape(plan), iteration_s, plan.num_gpus, steps)

    def violation(self, outlook: Outlook) -> str | None:
        """The constraint an outlook breaks, if any (``never_starts``: no start under the site's states)."""
        if not math.isfinite(outlook.start.start_s):
            return "never_starts"
        if self.deadline_s is not None and outlook.finish_s > self.deadline_s:
            return "deadline"
        if self.max_gpu_hours is not None and outlook.gpu_hours > self.max_gpu_hours:
            return "max_gpu_hours"
        return None


def plan_shape(plan: Plan) -> RequestShape:
    """The request a placed plan's job makes: GPUs per node of each partition it uses."""
    per_node: dict[tuple[str, int], int] = {}
    for p in plan.pipelines:
        for s in p.stages:
            node = s.placement.node if s.placement is not None else 0
            per_node[(s.partition or "?", node)] = per_node.get((s.partition or "?", node), 0) + s.tp
    demands: dict[str, list[int]] = {}
    for (part, _), gpus in per_node.items():
        demands.setdefault(part, []).append(gpus)
    return request_shape(demands)


def packed_shape(site: Site, gpus_by_partition: Mapping[str, int]) -> RequestShape:
    """The shape of an allocation before placement: its GPUs packed into full nodes, the rest on one more."""
    demands: dict[str, list[int]] = {}
    for name, gpus in gpus_by_partition.items():
        per = site.partition(name).gpus_per_node
        demands[name] = [per] * (gpus // per) + ([gpus % per] if gpus % per else [])
    return request_shape(demands)

