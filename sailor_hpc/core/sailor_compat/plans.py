"""Sailor's ``plan_config`` format: its plan (replicas of one stage list) and what was measured when it ran."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sailor_hpc.core.fields import Fields
from sailor_hpc.core.models import get_model
from sailor_hpc.core.plan import Pipeline, Plan, Stage


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
