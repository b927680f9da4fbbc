"""Re-plan on what is free now: the planner on idle GPU counts, checked against the free GPUs per node.

The planner sees GPUs per partition; Slurm gives whole per-node shares. A plan that puts 2 ranks
on one node of a partition whose idle GPUs are 1 + 1 on two nodes would wait in the queue forever,
so every plan is checked node by node (first-fit decreasing of the job's per-node demands into the
free GPUs of usable nodes); where it does not fit, the partition's count is lowered below what
that plan used and the planner asked again.

"Free" means idle, plus the GPUs of the run's own running job: moving the job releases them.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from planner.entry import plan_search
from planner.time_goal import free_now_goal
from sailor_hpc.controller.policy import Score
from sailor_hpc.controller.spec import RunSpec
from sailor_hpc.core.archive import ProfileArchive
from sailor_hpc.core.checkpoint import newest_step
from sailor_hpc.core.errors import NoPlanFits, SailorError
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.site import Site
from sailor_hpc.jobs.layout import job_layout
from sailor_hpc.jobs.render import parse_time_limit

FreeByNode = Mapping[str, Mapping[str, int]]  # partition -> node -> free GPUs


@dataclass(frozen=True)
class Planned:
    plan: Plan
    score: Score
    iteration_s: float
    available: dict[str, int]  # GPUs per partition the planner was given

    def summary(self) -> dict[str, Any]:
        return {"gpus": gpus_by_partition(self.plan), "throughput": self.score.throughput,
                "cost_per_hour": self.score.cost_per_hour, "iteration_s": self.iteration_s,
                "pipelines": len(self.plan.pipelines)}


def gpus_by_partition(plan: Plan) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in plan.pipelines:
        for s in p.stages:
            out[s.partition or "?"] = out.get(s.partition or "?", 0) + s.tp
    return out


def node_demands(plan: Plan) -> dict[str, list[int]]:
    """GPUs per node the plan's job asks for, per partition (one entry per node of the job)."""
    out: dict[str, list[int]] = {}
    for comp in job_layout(plan).components:
        out.setdefault(comp.partition, []).extend([comp.tasks_per_node] * comp.nodes)
    return out


def misfit(plan: Plan, free: FreeByNode) -> str | None:
    """The first partition whose per-node demands do not fit its nodes' free GPUs (None: it all fits)."""
    for part, needs in node_demands(plan).items():
        slots = sorted(free.get(part, {}).values(), reverse=True)
        for need in sorted(needs, reverse=True):
            for i, have in enumerate(slots):
                if have >= need:
                    slots[i] -= need
                    break
            else:
                return part
    return None


def partitions_for_time(time_limit: str | None, site: Site) -> set[str]:
    """Partitions whose maximum walltime admits jobs of ``time_limit`` (Slurm refuses a job over it, and a
    re-plan onto such a partition would end the run). Without a limit, every partition: each job then
    gets the default time, cut to its partitions' maxima."""
    if time_limit is None:
        return {p.name for p in site.partitions}
    norm, seconds = parse_time_limit(time_limit)
    allowed = {p.name for p in site.partitions if p.max_walltime_s is None or p.max_walltime_s >= seconds}
    if not allowed:
        longest = max(site.partitions, key=lambda p: p.max_walltime_s or 0)
        raise SailorError(f"time limit {norm} exceeds every partition's maximum (longest: {longest.name!r}, "
                          f"{longest.max_walltime})", field="--time",
                          fix="ask for less time: each job checkpoints on its limit and the next one resumes")
    return allowed


def plan_on(spec: RunSpec, site: Site, archive: ProfileArchive, free: FreeByNode) -> Planned:
    """The planner's best plan for the run on the free GPUs ``free``, placeable now, on partitions that
    admit the run's time limit."""

    allowed = partitions_for_time(spec.time_limit, site)
    available = {p.name: int(sum(free.get(p.name, {}).values())) if p.name in allowed else 0 for p in site.partitions}
    for _ in range(1 + sum(available.values())):
        if sum(available.values()) <= 0:
            break
        # the run's remaining steps decide its finish: a resized or resumed run has fewer left than it began with
        goal = (free_now_goal(site, max(1, spec.steps - newest_step(spec.save)), free, time_limit=spec.time_limit,
                              time_min=spec.time_min,
                              restart_cost_s=spec.restart_cost_s) if spec.objective == "time" else None)
        request = spec.plan_request(available, goal)  # a bad request is bad input (SailorError), not a wait
        try:
            best = plan_search(site, archive, request).candidates[0]
        except NoPlanFits:
            raise
        except SailorError as exc:  # the planner finds nothing on these GPUs (memory, profiles of free types)
            raise NoPlanFits(exc.message, file=exc.file, field=exc.field,
                             fix="the controller waits for GPUs to become idle") from exc
        bad = misfit(best.plan, free)
        if bad is None:
            r = best.result
            return Planned(best.plan, Score(r.throughput_samples_per_s, r.cost_per_hour), r.iteration_time_s,
                           dict(available))
        available[bad] = max(0, min(available[bad], gpus_by_partition(best.plan).get(bad, 0)) - 1)
    raise NoPlanFits(f"no plan fits the free GPUs now ({ {p: sum(n.values()) for p, n in free.items()} })",
                      field="availability", fix="the controller waits for GPUs to become idle")
