"""Plans: how a model is trained on a set of GPUs (JSON, versioned).

A plan is a list of *pipelines* that together process one global batch. Pipelines are fully
independent in shape (Sailor's plan cannot say this): each has its own micro-batch size and count,
its own stages and layer split, and every stage its own TP degree, GPU type, partition and
placement. Gradients of a layer are averaged over every pipeline that holds it, weighted by samples.

``load_plan`` reads our format and Sailor's ``plan_config_*.json`` alike.
"""
from __future__ import annotations

import heapq
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sailor_hpc.atomic import atomic_write_text
from sailor_hpc.errors import SailorError
from sailor_hpc.fields import Fields, read_json
from sailor_hpc.models import ModelSpec, get_model

PLAN_FORMAT = "sailor-hpc-plan"
PLAN_VERSION = 1
DTYPES = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adam", "sgd")
# how a plan gets placements: place_plan, which `simulate`, `sbatch` and `submit` run on a plan without them
PLACE_FIX = ("give every stage a placement, or none and let sailor-hpc place the plan (`sailor-hpc simulate`, "
             "`sbatch` and `submit` do; `sbatch` writes the placed plan next to its script)")


@dataclass(frozen=True)
class Placement:
    """Where a stage's TP group sits: node index inside the job's share of its partition, local GPU ids."""

    node: int
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class Stage:
    first_layer: int
    last_layer: int  # inclusive
    tp: int
    gpu_type: str
    partition: str | None = None
    placement: Placement | None = None

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.last_layer + 1)

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer + 1


@dataclass(frozen=True)
class Pipeline:
    micro_batch_size: int
    num_micro_batches: int
    stages: tuple[Stage, ...]

    @property
    def samples(self) -> int:
        return self.micro_batch_size * self.num_micro_batches

    @property
    def num_gpus(self) -> int:
        return sum(s.tp for s in self.stages)


@dataclass(frozen=True)
class Plan:
    model: str
    global_batch_size: int
    pipelines: tuple[Pipeline, ...]
    seq_len: int | None = None  # None: the model's
    dtype: str = "fp32"
    recompute: bool = False
    optimizer: str = "adam"
    notes: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def model_spec(self) -> ModelSpec:
        return get_model(self.model)

    @property
    def sequence_length(self) -> int:
        return self.seq_len or self.model_spec.seq_len

    @property
    def num_gpus(self) -> int:
        return sum(p.num_gpus for p in self.pipelines)

    def gpus_by_type(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for p in self.pipelines:
            for s in p.stages:
                out[s.gpu_type] += s.tp
        return dict(out)

    def gpus_by_partition(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for p in self.pipelines:
            for s in p.stages:
                out[s.partition or s.gpu_type] += s.tp
        return dict(out)

    def nodes_by_partition(self) -> dict[str, int]:
        """Nodes per partition the placement uses (needs placements)."""
        nodes: dict[str, set[int]] = defaultdict(set)
        for p in self.pipelines:
            for s in p.stages:
                if s.placement is None or s.partition is None:
                    raise SailorError("plan has stages without partition/placement", field="pipelines",
                                      fix=PLACE_FIX)
                nodes[s.partition].add(s.placement.node)
        return {k: len(v) for k, v in nodes.items()}

    def tp_degrees(self) -> tuple[int, ...]:
        return tuple(sorted({s.tp for p in self.pipelines for s in p.stages}))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT, "version": PLAN_VERSION, "model": self.model,
            "global_batch_size": self.global_batch_size, "seq_len": self.seq_len, "dtype": self.dtype,
            "recompute": self.recompute, "optimizer": self.optimizer,
            "pipelines": [{
                "micro_batch_size": p.micro_batch_size, "num_micro_batches": p.num_micro_batches,
                "stages": [{
                    "layers": [s.first_layer, s.last_layer], "tp": s.tp, "gpu_type": s.gpu_type,
                    "partition": s.partition,
                    "placement": None if s.placement is None else {"node": s.placement.node,
                                                                   "gpus": list(s.placement.gpus)},
                } for s in p.stages],
            } for p in self.pipelines],
            "notes": self.notes,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, self.to_json())


def _parse_stage(f: Fields) -> Stage:
    layers = f.req("layers", list)
    if len(layers) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers):
        raise f.error("layers", f"must be [first, last] layer indices (inclusive), got {layers!r}")
    placement = f.opt("placement", dict)
    pl = None
    if placement is not None:
        pf = f.sub("placement", placement)
        gpus = pf.req("gpus", list)
        node = pf.req("node", int)
        pf.done()
        if node < 0 or not all(isinstance(g, int) and g >= 0 for g in gpus):
            raise pf.error(None, "node and gpus must be non-negative integers")
        pl = Placement(node=node, gpus=tuple(gpus))
    stage = Stage(first_layer=layers[0], last_layer=layers[1], tp=f.positive("tp"), gpu_type=f.req("gpu_type", str),
                  partition=f.opt("partition", str), placement=pl)
    f.done()
    return stage


def plan_from_dict(data: dict[str, Any], source: object | None = None) -> Plan:
    """Parse our JSON plan format (structure and types only; see :func:`validate_plan`)."""
    f = Fields(data, file=source, path="")
    fmt = f.opt("format", str, PLAN_FORMAT)
    if fmt != PLAN_FORMAT:
        raise f.error("format", f"unknown plan format {fmt!r}", fix=f"expected {PLAN_FORMAT!r} or a Sailor plan_config")
    version = f.opt("version", int, PLAN_VERSION)
    if version != PLAN_VERSION:
        raise f.error("version", f"plan version {version} is not supported", fix=f"this sailor-hpc reads version {PLAN_VERSION}")
    pipes = []
    for i, raw in enumerate(f.req("pipelines", list)):
        pf = f.sub(f"pipelines[{i}]", raw)
        stages = tuple(_parse_stage(pf.sub(f"stages[{j}]", s)) for j, s in enumerate(pf.req("stages", list)))
        pipes.append(Pipeline(micro_batch_size=pf.positive("micro_batch_size"),
                              num_micro_batches=pf.positive("num_micro_batches"), stages=stages))
        pf.done()
    seq = f.opt("seq_len", int)
    plan = Plan(model=f.req("model", str), global_batch_size=f.positive("global_batch_size"), pipelines=tuple(pipes),
                seq_len=seq, dtype=f.opt("dtype", str, "fp32"), recompute=f.opt("recompute", bool, False),
                optimizer=f.opt("optimizer", str, "adam"), notes=f.opt("notes", dict, {}))
    f.done()
    return plan


def validate_plan(plan: Plan, site: Any | None = None, *, source: object | None = None,
                  check_placement: bool = True) -> None:
    """Check a plan's invariants; raise :class:`SailorError` naming the first broken one.

    Without a site only the model-level invariants are checked; with one, GPU types, partitions,
    TP within a node and the placement against the partitions' sizes are checked too.
    """
    def err(fld: str, msg: str, fix: str | None = None) -> SailorError:
        return SailorError(msg, file=source, field=fld, fix=fix)

    try:
        model = get_model(plan.model)
    except SailorError as exc:
        raise err("model", exc.message, exc.fix) from None
    if plan.dtype not in DTYPES:
        raise err("dtype", f"unknown dtype {plan.dtype!r}", f"use one of {', '.join(DTYPES)}")
    if plan.optimizer not in OPTIMIZERS:
        raise err("optimizer", f"unknown optimizer {plan.optimizer!r}", f"use one of {', '.join(OPTIMIZERS)}")
    if plan.seq_len is not None and plan.seq_len <= 0:
        raise err("seq_len", f"must be positive, got {plan.seq_len}")
    if not plan.pipelines:
        raise err("pipelines", "is empty", "a plan needs at least one pipeline")
    L = model.num_pipeline_layers
    for i, pipe in enumerate(plan.pipelines):
        where = f"pipelines[{i}]"
        if not pipe.stages:
            raise err(f"{where}.stages", "is empty")
        expect = 0
        for j, s in enumerate(pipe.stages):
            sw = f"{where}.stages[{j}]"
            if s.first_layer != expect:
                what = "missing" if s.first_layer > expect else "assigned twice"
                raise err(f"{sw}.layers", f"starts at layer {s.first_layer}, but layer {expect} is {what}",
                          f"stages must cover layers 0..{L - 1} of {model.name} in order, each exactly once")
            if s.last_layer < s.first_layer:
                raise err(f"{sw}.layers", f"[{s.first_layer}, {s.last_layer}] is empty")
            if model.num_heads % s.tp or model.ffn_hidden_size % s.tp:
                raise err(f"{sw}.tp", f"TP {s.tp} does not divide {model.name}'s {model.num_heads} heads")
            expect = s.last_layer + 1
        if expect != L:
            raise err(f"{where}.stages", f"covers layers 0..{expect - 1}, but {model.name} has {L} pipeline layers",
                      f"the last stage must end at layer {L - 1}")
    total = sum(p.samples for p in plan.pipelines)
    if total != plan.global_batch_size:
        raise err("pipelines", f"micro_batch_size x num_micro_batches adds up to {total} samples, "
                               f"not the global batch of {plan.global_batch_size}",
                  "make the pipelines' samples add up to global_batch_size")
    if site is not None:
        _validate_on_site(plan, site, err, check_placement)


def _validate_on_site(plan: Plan, site: Any, err: Any, check_placement: bool) -> None:
    used: dict[tuple[str, int], dict[int, str]] = defaultdict(dict)  # (partition, node) -> gpu -> stage
    for i, pipe in enumerate(plan.pipelines):
        for j, s in enumerate(pipe.stages):
            sw = f"pipelines[{i}].stages[{j}]"
            try:
                gpu = site.gpu(s.gpu_type)
            except SailorError as exc:
                raise err(f"{sw}.gpu_type", exc.message, exc.fix) from None
            if s.partition is None:
                if check_placement:
                    raise err(f"{sw}.partition", "is missing", "name the partition the stage runs on")
                continue
            try:
                part = site.partition(s.partition)
            except SailorError as exc:
                raise err(f"{sw}.partition", exc.message, exc.fix) from None
            if part.gpu_type != gpu.name:
                raise err(f"{sw}.gpu_type", f"partition {part.name!r} has {part.gpu_type} GPUs, not {gpu.name}")
            if s.tp > part.gpus_per_node:
                raise err(f"{sw}.tp", f"TP {s.tp} does not fit in one node of {part.name!r} "
                                      f"({part.gpus_per_node} GPUs per node)", "TP groups must stay inside a node")
            if not check_placement:
                continue
            if s.placement is None:
                raise err(f"{sw}.placement", "is missing", PLACE_FIX)
            pl = s.placement
            if len(pl.gpus) != s.tp or len(set(pl.gpus)) != s.tp:
                raise err(f"{sw}.placement.gpus", f"must list {s.tp} distinct local GPUs, got {list(pl.gpus)}")
            if max(pl.gpus) >= part.gpus_per_node:
                raise err(f"{sw}.placement.gpus", f"GPU {max(pl.gpus)} does not exist on a {part.gpus_per_node}-GPU node")
            taken = used[(part.name, pl.node)]
            clash = sorted(g for g in pl.gpus if g in taken)
            if clash:
                raise err(f"{sw}.placement", f"GPU(s) {clash} of node {pl.node} in {part.name!r} "
                                             f"are also used by {taken[clash[0]]}", "give every stage its own GPUs")
            taken.update({g: sw for g in pl.gpus})
    for part_name, count in plan.nodes_by_partition().items() if check_placement else ():
        part = site.partition(part_name)
        limit = min(part.nodes, part.max_nodes_per_job)
        if count > limit:
            raise err("pipelines", f"the plan uses {count} nodes of partition {part_name!r}, "
                                   f"which allows {limit} per job", "use fewer GPUs of that partition")
        highest = max(n for (p, n) in used if p == part_name)
        if highest >= limit:
            raise err("pipelines", f"placement uses node index {highest} of {part_name!r}; indices must be < {limit}")


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


def _place_partition(segments: list[Group], part: Any) -> Placements:
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


def place_plan(plan: Plan, site: Any) -> Plan:
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


def _stage_partition(stage: Stage, site: Any) -> Any:
    """The stage's partition: the one it names, else the first of the site with its GPU type."""
    if stage.partition is not None:
        return site.partition(stage.partition)
    candidates = site.partitions_with_gpu(stage.gpu_type)
    if not candidates:
        raise SailorError(f"no partition of site {site.name!r} has {stage.gpu_type} GPUs", file=site.source,
                          field="partitions", fix="add one, or plan for this site's GPU types")
    return candidates[0]


# ---------------------------------------------------------------- Sailor's plan_config format

@dataclass(frozen=True)
class SailorRun:
    """A Sailor ``plan_config`` file: the plan plus what was measured when it ran (if anything)."""

    plan: Plan
    real_s: float | None
    max_mem_bytes: float | None
    red_grads_s: float | None = None  # the measured gradient reduction, when the file has it


# fields of a Sailor plan_config this reader uses (a typo suggestion never proposes renaming one of them)
SAILOR_FIELDS = ("mbs", "gbs", "pipeline_list", "real", "max_mem", "red_grads")


def is_sailor_plan(data: Any) -> bool:
    return isinstance(data, dict) and "pipeline_list" in data


def plan_from_sailor(data: dict[str, Any], model: str, source: object | None = None) -> SailorRun:
    """Convert Sailor's plan: replica j of every stage becomes our pipeline j.

    Sailor runs m = ceil(gbs / (mbs * D)) micro-batches on every replica, so the converted plan's
    global batch is m * mbs * D (equal to gbs whenever gbs divides evenly, as in all published runs).
    """
    f = Fields(data, file=source, path="", known=SAILOR_FIELDS)
    mbs = f.positive("mbs")
    gbs = f.positive("gbs")
    raw = f.req("pipeline_list", list)
    if not raw:
        raise f.error("pipeline_list", "is empty", fix="a plan needs at least one pipeline")
    pipes: list[Pipeline] = []
    warnings: list[str] = []
    for pi, rp in enumerate(raw):
        pf = f.sub(f"pipeline_list[{pi}]", rp)
        dp = [pf.positive_value(f"dp[{s}]", v) for s, v in enumerate(pf.req("dp", list))]
        layers = [_layer_list(pf, f"layers_per_stage[{s}]", v) for s, v in enumerate(pf.req("layers_per_stage", list))]
        tmp = pf.req("tmp_per_stage", list)
        if not dp or len(set(dp)) != 1:
            raise pf.error("dp", f"stages with different DP degrees {dp} cannot be expressed as pipelines",
                           fix="give every stage the same dp")
        if not (len(dp) == len(layers) == len(tmp)):
            raise pf.error(None, "dp, layers_per_stage and tmp_per_stage must have one entry per stage")
        d = dp[0]
        m = math.ceil(gbs / (mbs * d))
        for s, lay in enumerate(layers):
            if sorted(lay) != list(range(lay[0], lay[0] + len(lay))):
                # a published file lists [16, 17, 18, 29, 20, ...]: its run used the contiguous range
                warnings.append(f"pipeline_list[{pi}].layers_per_stage[{s}] = {lay} is not contiguous; "
                                f"read as layers {lay[0]}..{lay[0] + len(lay) - 1}")
        replicas = [_replicas(pf, f"tmp_per_stage[{s}]", reps, d) for s, reps in enumerate(tmp)]
        for j in range(d):
            stages = tuple(Stage(first_layer=lay[0], last_layer=lay[0] + len(lay) - 1, tp=reps[j][1], gpu_type=reps[j][0])
                           for lay, reps in zip(layers, replicas))
            pipes.append(Pipeline(micro_batch_size=mbs, num_micro_batches=m, stages=stages))
    total = sum(p.samples for p in pipes)
    notes: dict[str, Any] = {"source": "sailor plan_config", "sailor_gbs": gbs}
    if warnings:
        notes["warnings"] = warnings
    plan = Plan(model=get_model(model).name, global_batch_size=total, pipelines=tuple(pipes), notes=notes)
    measured = {}
    for key in ("real", "max_mem", "red_grads"):
        value = f.opt(key, float)
        if value is not None and value < 0:
            raise f.error(key, f"a measured value cannot be negative, got {value}", fix="fix or remove it")
        measured[key] = value or None  # 0: not measured
    return SailorRun(plan=plan, real_s=measured["real"], max_mem_bytes=measured["max_mem"],
                     red_grads_s=measured["red_grads"])


def _layer_list(f: Fields, key: str, value: Any) -> list[int]:
    if (not isinstance(value, list) or not value
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)):
        raise f.error(key, f"must be a non-empty list of layer indices, got {value!r}")
    return value


def _replicas(f: Fields, key: str, value: Any, dp: int) -> list[tuple[str, int]]:
    """One stage's ``[[[gpu, gpus_per_node, zone], ...], tp]`` per replica, as (GPU type, TP)."""
    if not isinstance(value, list) or len(value) < dp:
        raise f.error(key, f"must list the stage's {dp} replica(s) as [[[gpu, gpus_per_node, zone]], tp], got {value!r}")
    out = []
    for j, rep in enumerate(value[:dp]):
        ok = (isinstance(rep, list) and len(rep) == 2 and isinstance(rep[0], list) and rep[0]
              and isinstance(rep[0][0], list) and rep[0][0] and isinstance(rep[0][0][0], str))
        if not ok:
            raise f.error(f"{key}[{j}]", f"must be [[[gpu, gpus_per_node, zone]], tp], got {rep!r}")
        out.append((rep[0][0][0], f.positive_value(f"{key}[{j}][1]", rep[1])))
    return out


def _gpu_types_on(plan: Plan, site: Any, path: Path, field_of: Any) -> None:
    """A stage's GPU type the site does not declare is the plan file's error (named there), not the site's."""
    for pi, pipe in enumerate(plan.pipelines):
        for si, stage in enumerate(pipe.stages):
            try:
                site.gpu(stage.gpu_type)
            except SailorError as exc:
                raise SailorError(f"{exc.message} on site {site.name!r} ({site.source or 'discovered'})", file=path,
                                  field=field_of(pi, si), fix=exc.fix) from None


def load_plan(path: str | Path, *, model: str | None = None, site: Any | None = None,
              validate: bool = True) -> Plan:
    """Read a plan in our format or Sailor's (``model`` is then required), optionally placed on ``site``."""
    return load_run(path, model=model, site=site, validate=validate).plan


def load_run(path: str | Path, *, model: str | None = None, site: Any | None = None,
             validate: bool = True) -> SailorRun:
    """Like :func:`load_plan`, keeping Sailor's measured time and memory when the file has them."""
    path = Path(path)
    data = read_json(path, missing_fix="pass the path of a plan JSON")
    if is_sailor_plan(data):
        if model is None:
            raise SailorError("a Sailor plan_config does not say which model it trains", file=path, field="model",
                              fix="pass --model (e.g. OPT-350M)")
        run = plan_from_sailor(data, model, source=path)
        if site is not None:
            _gpu_types_on(run.plan, site, path, lambda _p, s: f"pipeline_list[*].tmp_per_stage[{s}]")
            run = replace(run, plan=place_plan(run.plan, site))
    else:
        run = SailorRun(plan_from_dict(data, source=path), None, None)
        if model is not None:
            wanted = get_model(model).name
            try:
                have = get_model(run.plan.model).name
            except SailorError as exc:
                raise SailorError(exc.message, file=path, field="model", fix=exc.fix) from None
            if have != wanted:
                raise SailorError(f"plan is for {run.plan.model}, not {model}", file=path, field="model")
    if validate:
        validate_plan(run.plan, site, source=path,
                      check_placement=site is not None and all(s.placement for p in run.plan.pipelines for s in p.stages))
    return run
