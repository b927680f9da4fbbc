"""Which plans DeepSpeed's own engine can run, and the ZeRO stage a plan carries (torch-free).

DeepSpeed 0.19's ``PipelineModule``/``PipelineEngine`` (and its plain engine for one stage) train one
grid of ``stages x data-parallel`` ranks: every replica runs the same micro-batch size and count (one
``gradient_accumulation_steps``), every pipeline cuts the model at the same layers, and there is no
tensor parallelism without Megatron-DeepSpeed's mpu. GPU types may differ between stages (the engine
does not know about them). ZeRO partitions the optimizer state (1), the gradients too (2) or also the
parameters (3) over the data-parallel ranks; the pipeline engine refuses stages 2 and 3.

A plan keeps its ZeRO stage in ``notes["deepspeed"]["zero_stage"]`` (0 when absent): the planner
writes it, ``simulate``, the ds_config writer and the DeepSpeed runtime read it.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.plan import Plan

ZERO_STAGES = (0, 1, 2, 3)
PIPELINE_ZERO_STAGES = (0, 1)  # DeepSpeed's PipelineEngine asserts zero stage < 2
NOTES_KEY = "deepspeed"
# the reduce and all-gather buckets (elements) of ZeRO 1-3 that sailor_hpc.core.ds_config sets: ZeRO's
# pipeline path allocates a whole bucket up front (torch.empty(reduce_bucket_size)), so DeepSpeed's 5e8
# default would cost 2 GB of fp32 per GPU; 5e7 is what Megatron-DeepSpeed's examples use
ZERO_BUCKET_ELEMS = 50_000_000


def zero_stages_for(num_stages: int) -> tuple[int, ...]:
    """The ZeRO stages DeepSpeed runs with ``num_stages`` pipeline stages."""
    return PIPELINE_ZERO_STAGES if num_stages > 1 else ZERO_STAGES


def zero_stage_of(plan: Plan) -> int:
    """The plan's ZeRO stage (0 when the plan does not say), checked to be one DeepSpeed has."""
    section = plan.notes.get(NOTES_KEY)
    value: Any = section.get("zero_stage", 0) if isinstance(section, dict) else 0
    if not isinstance(value, int) or isinstance(value, bool) or value not in ZERO_STAGES:
        raise SailorError(f"ZeRO stage {value!r} is not one of {list(ZERO_STAGES)}", field="notes.deepspeed.zero_stage",
                          fix="use 0, 1, 2 or 3 (2 and 3 only for plans of one stage)")
    return value


def with_zero_stage(plan: Plan, zero_stage: int) -> Plan:
    """The plan with ``zero_stage`` in its notes (a new Plan; notes are not part of equality)."""
    notes = {**plan.notes, NOTES_KEY: {**plan.notes.get(NOTES_KEY, {}), "zero_stage": zero_stage}}
    return replace(plan, notes=notes)


def engine_refusals(plan: Plan) -> list[str]:
    """Why DeepSpeed's engine cannot run ``plan`` as it is (empty: it can), one reason per line."""
    reasons: list[str] = []
    pipes = plan.pipelines
    first = pipes[0]
    if len({(p.micro_batch_size, p.num_micro_batches) for p in pipes}) > 1:
        shapes = sorted({f"{p.micro_batch_size}x{p.num_micro_batches}" for p in pipes})
        reasons.append(f"pipelines run different micro-batch sizes or counts ({', '.join(shapes)}): DeepSpeed has one "
                       "train_micro_batch_size_per_gpu and one gradient_accumulation_steps for every replica")
    splits = {tuple((s.first_layer, s.last_layer) for s in p.stages) for p in pipes}
    if len(splits) > 1:
        reasons.append(f"pipelines cut the model differently ({len(splits)} layer splits): DeepSpeed's PipelineModule "
                       "partitions the layers once, for every replica")
    tps = sorted({s.tp for p in pipes for s in p.stages})
    if tps != [1]:
        reasons.append(f"stages use tensor parallelism (TP {tps}): DeepSpeed's engine has none without "
                       "Megatron-DeepSpeed; give every stage TP 1")
    zero = zero_stage_of(plan)
    if zero not in zero_stages_for(len(first.stages)):
        reasons.append(f"ZeRO stage {zero} with {len(first.stages)} pipeline stages: DeepSpeed's pipeline engine runs "
                       "ZeRO 0 and 1 only (2 and 3 need a plan of one stage)")
    return reasons


def check_engine_plan(plan: Plan, *, what: str = "plan") -> None:
    """Raise a SailorError listing every reason DeepSpeed's engine cannot run ``plan``."""
    reasons = engine_refusals(plan)
    if reasons:
        raise SailorError(f"DeepSpeed cannot run this {what}: " + "; ".join(reasons), field="--runtime",
                          fix="plan with `sailor-hpc plan --runtime deepspeed` (only plans DeepSpeed can run), or "
                              "run this plan with --runtime megatron_patch")


__all__ = ["NOTES_KEY", "ZERO_BUCKET_ELEMS", "PIPELINE_ZERO_STAGES", "ZERO_STAGES", "check_engine_plan", "engine_refusals",
           "with_zero_stage", "zero_stage_of", "zero_stages_for"]
