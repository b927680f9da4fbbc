"""Cost of a plan in the site's units (``cost_unit``, e.g. GPU-hours or a currency).

Every GPU a plan holds is charged for the whole iteration at its partition's ``cost_per_gpu_hour``,
busy or idle (Slurm bills an allocation, not its use). Traffic is not billed on an HPC site.
"""
from __future__ import annotations

from sailor_hpc.core.plan import Plan
from sailor_hpc.core.site import Site


def plan_cost_per_hour(plan: Plan, site: Site) -> float:
    """Cost of holding the plan's GPUs for one hour."""
    total = 0.0
    for pipe in plan.pipelines:
        for s in pipe.stages:
            if s.partition is not None:
                rate = site.partition(s.partition).cost_per_gpu_hour
            else:
                rate = max(p.cost_per_gpu_hour for p in site.partitions_with_gpu(s.gpu_type))
            total += s.tp * rate
    return total


def cost_per_iteration(cost_per_hour: float, iteration_time_s: float) -> float:
    return cost_per_hour * iteration_time_s / 3600.0
