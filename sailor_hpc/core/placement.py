"""Placement: which nodes and GPUs of a site's partitions each stage of a plan runs on.

Stages of one pipeline are packed in order onto nodes (:func:`node_segments`), the rule the planner
prices a pipeline at, so the placed plan is the one that was priced; segments go first-fit onto the
lowest-numbered node with room.
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.plan import Placement, Plan, Stage
from sailor_hpc.core.site import Partition, Site

StageKey = tuple[int, int]  # (pipeline, stage)
Group = list[tuple[StageKey, int]]  # TP groups (stage, TP) that go on one node together
Placements = dict[StageKey, Placement]


def node_segments(tps: Sequence[int], gpus_per_node: int) -> list[list[int]]:
    """Consecutive stages of one pipeline that share a node when the pipeline is packed alone, in order,
    from a fresh node (a stage that does not fit in what is left of the node opens the next one).

    This is the placement the planner prices a pipeline at (``planner.templates.endpoints`` numbers
    these segments as its nodes): a boundary inside a segment is an intra-node transfer, one between
    segments an inter-node one.
    Returns the stage indices of each segment.
    """
    out: list[list[int]] = []
    fill = gpus_per_node  # forces a new segment for the first stage
    for j, tp in enumerate(tps):
        if fill + tp > gpus_per_node:
            out.append([])
            fill = 0
        out[-1].append(j)
        fill += tp
    return out


class _Nodes:
    """First-fit over the nodes of one partition: the lowest-numbered node with room, else a new one.

    Nodes are kept in one heap per free-GPU count, so a fit costs O(gpus_per_node log nodes) even for
    plans with hundreds of nodes (the planner places a plan for every allocation it prices)."""

    def __init__(self, gpus_per_node: int) -> None:
        self.size = gpus_per_node
        self.count = 0
        self._free: list[list[int]] = [[] for _ in range(gpus_per_node + 1)]  # free count -> node heap

    def take(self, gpus: int) -> tuple[int, int]:
        """Reserve ``gpus`` GPUs on one node; returns (node, first local GPU)."""
        fits = [(h[0], free) for free, h in enumerate(self._free) if free >= max(gpus, 1) and h]
        if fits:
            node, free = min(fits)
            heapq.heappop(self._free[free])
        else:  # a new node (also for a group larger than a node: validate_plan names that error)
            node, free = self.count, self.size
            self.count += 1
        heapq.heappush(self._free[max(free - gpus, 0)], node)
        return node, self.size - free


def _first_fit(groups: Sequence[Group], gpus_per_node: int) -> tuple[int, Placements]:
    """Put each group of (stage, TP) on one node, first fit in the given order; (nodes used, placements)."""
    nodes = _Nodes(gpus_per_node)
    out: Placements = {}
    for group in groups:
        node, first = nodes.take(sum(tp for _, tp in group))
        for key, tp in group:
            out[key] = Placement(node, tuple(range(first, first + tp)))
            first += tp
    return nodes.count, out


def _by_size(groups: list[Group]) -> list[Group]:
    """Largest groups first (stable: equal sizes stay in pipeline order)."""
    return sorted(groups, key=lambda g: -sum(tp for _, tp in g))


def _place_partition(segments: list[Group], part: Partition) -> Placements:
    """Placements of one partition's stages, given the planner's node segments in pipeline order.

    The first packing within the partition's per-job node limit wins:

    1. the segments in pipeline order (nodes filled pipeline by pipeline);
    2. the segments by decreasing size (fewer nodes; like 1, it breaks no boundary the planner
       priced as intra-node);
    3. single TP groups in pipeline order: a pipeline straddles two nodes only where a node runs
       full, so the hops that must cross nodes are spread over the pipelines and over their stages
       (cutting segments apart instead puts a stage between two inter-node hops, and the slowest
       stage sets a pipeline's pace);
    4. single TP groups by decreasing size (first-fit decreasing, the tightest packing).

    A packing must also take no more nodes than 4 does: the planner counts GPUs (and idle nodes x GPUs
    per node with ``--available live``), so a placement that leaves GPUs of its nodes empty to keep
    pipelines whole (3 TP-1 stages per 4-GPU node: 64 nodes instead of 48) asks Slurm for nodes the
    allocation never had, and bills GPUs that do no work. If none fits, the one with the fewest nodes
    (validate_plan then names the limit).
    """
    limit = min(part.nodes, part.max_nodes_per_job)
    count, placed = _first_fit(segments, part.gpus_per_node)
    if count <= min(limit, -(-sum(tp for g in segments for _, tp in g) // part.gpus_per_node)):
        return placed  # as few nodes as the GPUs need: no packing can do better (the planner's common case)
    singles = [[stage] for g in segments for stage in g]
    tightest = _first_fit(_by_size(singles), part.gpus_per_node)
    limit = min(limit, tightest[0])
    if count <= limit:
        return placed
    for groups in (_by_size(segments), singles):
        count, placed = _first_fit(groups, part.gpus_per_node)
        if count <= limit:
            return placed
    return tightest[1]


def place_plan(plan: Plan, site: Site) -> Plan:
    """Give every stage a partition (if missing) and a placement on the nodes of that partition.

    The placement is the one the planner priced: a pipeline's consecutive stages that fit in one node
    together (:func:`node_segments`) share a node, so every stage-to-stage transfer that the planner's
    templates charged as intra-node is intra-node in the job (segments that land on the same node
    only make a transfer faster). Only when those segments need more nodes than the partition gives a
    job, or than the tightest packing of its TP groups, are TP groups packed one by one (see
    :func:`_place_partition`).
    """
    parts = {(i, j): _stage_partition(s, site) for i, p in enumerate(plan.pipelines) for j, s in enumerate(p.stages)}
    segments: dict[str, list[Group]] = defaultdict(list)
    for i, pipe in enumerate(plan.pipelines):
        j = 0
        while j < len(pipe.stages):  # runs of consecutive stages on one partition
            part = parts[(i, j)]
            run = [j]
            while run[-1] + 1 < len(pipe.stages) and parts[(i, run[-1] + 1)].name == part.name:
                run.append(run[-1] + 1)
            for seg in node_segments([pipe.stages[k].tp for k in run], part.gpus_per_node):
                segments[part.name].append([((i, run[k]), pipe.stages[run[k]].tp) for k in seg])
            j = run[-1] + 1
    placed: Placements = {}
    for name, segs in segments.items():
        placed.update(_place_partition(segs, site.partition(name)))
    pipes = tuple(replace(p, stages=tuple(replace(s, partition=parts[(i, j)].name, placement=placed[(i, j)])
                                          for j, s in enumerate(p.stages)))
                  for i, p in enumerate(plan.pipelines))
    return replace(plan, pipelines=pipes)


def _stage_partition(stage: Stage, site: Site) -> Partition:
    """The stage's partition: the one it names, else the first of the site with its GPU type."""
    if stage.partition is not None:
        return site.partition(stage.partition)
    candidates = site.partitions_with_gpu(stage.gpu_type)
    if not candidates:
        raise SailorError(f"no partition of site {site.name!r} has {stage.gpu_type} GPUs", file=site.source,
                          field="partitions", fix="add one, or plan for this site's GPU types")
    return candidates[0]
