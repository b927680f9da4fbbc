"""Plans: how a model is trained on a set of GPUs (JSON, versioned).

A plan is a list of *pipelines* that together process one global batch. Pipelines are fully
independent in shape (Sailor's plan cannot say this): each has its own micro-batch size and count,
its own stages and layer split, and every stage its own TP degree, GPU type, partition and
placement. Gradients of a layer are averaged over every pipeline that holds it, weighted by samples.

This module is the schema (dataclasses, JSON) and its validation; :mod:`.placement` puts a plan on a
site's nodes, :mod:`.plan_io` reads plan files of either format (ours and Sailor's ``plan_config``).
"""
from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sailor_hpc.core.atomic import atomic_write_text
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.fields import Fields
from sailor_hpc.core.models import ModelSpec, get_model
from sailor_hpc.core.precision import DTYPES
from sailor_hpc.core.site import Site

PLAN_FORMAT = "sailor-hpc-plan"
PLAN_VERSION = 1
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

    def gpus_label(self) -> str:
        """The GPUs by type, as tables and charts name a plan: ``64 A100-40 + 256 V100-16``."""
        return " + ".join(f"{n} {g}" for g, n in self.gpus_by_type().items())

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


def validate_plan(plan: Plan, site: Site | None = None, *, source: object | None = None,
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


def _validate_on_site(plan: Plan, site: Site, err: Callable[..., SailorError], check_placement: bool) -> None:
    used: dict[tuple[str, int], dict[int, str]] = defaultdict(dict)  # (partition, node) -> gpu -> stage
    for i, pipe in enumerate(plan.pipelines):
        for j, s in enumerate(pipe.stages):
            sw = f"pipelines[{i}].stages[{j}]"
            try:
                gpu = site.gpu(s.gpu_type)
            except SailorError as exc:
                raise err(f"{sw}.gpu_type", exc.message, exc.fix) from None
            if plan.dtype not in gpu.dtypes:
                raise err("dtype", f"{gpu.name} ({sw}) does not train in {plan.dtype} (it trains in "
                                   f"{', '.join(gpu.dtypes)})",
                          f"plan in {' or '.join(d for d in gpu.dtypes if d != 'fp32') or 'fp32'} (--dtype), "
                          f"or list {plan.dtype} under dtypes of [gpu_types.\"{gpu.name}\"] if it does")
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
