"""Cost of a plan in the site's units (``cost_unit``, e.g. GPU-hours or a currency).

Every GPU a plan holds is charged for the whole iteration at its partition's ``cost_per_gpu_hour``,
busy or idle (Slurm bills an allocation, not its use). Traffic inside a cluster is not billed; bytes
sent from one cluster to another are, at the price of their link (``cost_per_gb``: a cloud's egress, a
consortium's accounting), so a plan across clusters pays for what it moves.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from sailor_hpc.core.plan import Plan
from sailor_hpc.core.site import Site

Transfer = tuple[str, str, float]  # (from partition, to partition, bytes per iteration)


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


def pipeline_transfers(plan: Plan, out_bytes: Sequence[Sequence[float]]) -> Iterator[Transfer]:
    """Stage-to-stage traffic: per micro-batch one activation forward and its gradient back
    (``out_bytes[i][s]``: what stage s of pipeline i sends on)."""
    for pipe, sent in zip(plan.pipelines, out_bytes):
        for a, b, nbytes in zip(pipe.stages, pipe.stages[1:], sent):
            total = nbytes * pipe.num_micro_batches
            yield str(a.partition), str(b.partition), total
            yield str(b.partition), str(a.partition), total


def ring_transfers(partitions: Sequence[str], nbytes: float) -> Iterator[Transfer]:
    """A ring all-reduce of ``nbytes`` (the whole tensor) among holders in this order: each holder sends
    2(H - 1) chunks of nbytes / H to the next one (reduce-scatter, then all-gather), ring order = rank
    order, as gloo's ring and the runtime's groups do."""
    H = len(partitions)
    if H < 2:
        return
    for i, src in enumerate(partitions):
        yield src, partitions[(i + 1) % H], 2 * (H - 1) * nbytes / H


def egress(site: Site, transfers: Iterable[Transfer]) -> tuple[float, float]:
    """(bytes that cross clusters, their price in the site's cost unit) of one iteration's transfers."""
    crossing = price = 0.0
    for src, dst, nbytes in transfers:
        if src != dst and site.cluster_of(src) != site.cluster_of(dst):
            crossing += nbytes
            price += nbytes / 1e9 * site.egress_cost_per_gb(src, dst)
    return crossing, price
