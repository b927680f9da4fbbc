"""A DeepSpeed config (ds_config.json) from a plan and the training options (login side: no DeepSpeed import).

What it says, and why each field has its value:

* batch: ``train_batch_size`` = the plan's global batch = ``train_micro_batch_size_per_gpu`` (the plan's
  micro-batch size) x ``gradient_accumulation_steps`` (its micro-batch count) x data-parallel degree (its
  pipelines): DeepSpeed's own rule, which it checks at ``deepspeed.initialize``;
* precision: ``bf16`` or ``fp16`` (dynamic loss scale, as megatron_patch: 2^16, window 1000, min 1) as
  the plan's dtype;
* ``zero_optimization``: the plan's ZeRO stage, with 5e7-element buckets (:mod:`sailor_hpc.core.deepspeed_plan`);
* ``gradient_clipping``, and ``optimizer`` AdamW with the run's learning rate, Megatron's betas
  (0.9, 0.95), epsilon and weight decay, on torch's multi-tensor AdamW (``torch_adam``: no op to build);
* ``scheduler``: Megatron's schedule in steps, where DeepSpeed has the same curve: constant (with a
  linear warm-up from 0: ``WarmupLR``) or linear decay (``WarmupDecayLR``, which warms up from
  ``min_lr``: the same curve with ``--min-lr 0`` or no warm-up). DeepSpeed applies a scheduler's first
  rate after the first optimizer step, so optimizer step k runs at the rate Megatron gives step k - 1
  (step 0 at the warm-up's start): one step later, measured in ``tests/deepspeed/test_ds_runtime.py``.
  (``megatron_patch.ds_runtime`` sets each step's rate itself and is exact.) Cosine is refused: its
  ``WarmupCosineLR`` counts the decay from another step than its warm-up, a curve Megatron has not.

Megatron exempts biases and norms from weight decay; a config cannot say that, the script's parameter
groups do (``megatron_patch.ds_runtime`` passes them). DeepSpeed has no SGD: SGD plans are refused.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sailor_hpc.core.atomic import atomic_write_text
from sailor_hpc.core.deepspeed_plan import ZERO_BUCKET_ELEMS, check_engine_plan, zero_stage_of
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.training import DEFAULTS, LrSchedule

ADAM_BETAS = (0.9, 0.95)  # Megatron's (megatron_patch.options.AdamConfig)
LOSS_SCALE = {"initial_scale_power": 16, "loss_scale_window": 1000, "min_loss_scale": 1}


def batch_fields(plan: Plan) -> dict[str, int]:
    """DeepSpeed's three batch fields; ``train_batch_size = micro x accumulation x data-parallel``."""
    pipe = plan.pipelines[0]
    out = {"train_batch_size": plan.global_batch_size, "train_micro_batch_size_per_gpu": pipe.micro_batch_size,
           "gradient_accumulation_steps": pipe.num_micro_batches}
    if pipe.micro_batch_size * pipe.num_micro_batches * len(plan.pipelines) != plan.global_batch_size:
        raise SailorError(f"global batch {plan.global_batch_size} != {pipe.micro_batch_size} x {pipe.num_micro_batches} "
                          f"x {len(plan.pipelines)} replicas", field="global_batch_size")
    return out


def _steps(samples: int, global_batch: int, what: str, flag: str) -> int:
    if samples % global_batch:
        raise SailorError(f"the {what} ends at sample {samples}, inside a step of {global_batch} samples: "
                          "DeepSpeed's schedulers count steps", field=flag,
                          fix=f"use a multiple of {global_batch} samples, or give it in steps")
    return samples // global_batch


def scheduler(schedule: LrSchedule, global_batch: int) -> dict[str, Any] | None:
    """DeepSpeed's scheduler section for Megatron's schedule (None: a constant rate, no scheduler)."""
    warmup = _steps(schedule.warmup, global_batch, "warm-up", "--lr-warmup-samples")
    if schedule.style == "constant":
        if warmup == 0:
            return None
        return {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": schedule.lr,
                                               "warmup_num_steps": warmup, "warmup_type": "linear"}}
    if schedule.style == "linear":
        if warmup and schedule.min_lr:
            raise SailorError("DeepSpeed's WarmupDecayLR warms up from min_lr, Megatron's schedule from 0",
                              field="--min-lr", fix="use --min-lr 0 with a warm-up, or no warm-up")
        return {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": schedule.min_lr, "warmup_max_lr": schedule.lr, "warmup_num_steps": warmup,
            "warmup_type": "linear",
            "total_num_steps": _steps(schedule.decay, global_batch, "decay", "--lr-decay-samples")}}
    raise SailorError(f"DeepSpeed has no scheduler with Megatron's {schedule.style} decay (its WarmupCosineLR "
                      "counts the decay from another step than its warm-up)", field="--lr-decay-style",
                      fix="use --lr-decay-style linear or constant, or set the learning rate in your script")


def ds_config(plan: Plan, train: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """The ds_config of ``plan`` trained to step ``steps`` with the training options ``train``
    (``sailor_hpc.core.training`` destinations; missing or None: the runtime's defaults)."""
    check_engine_plan(plan)
    if plan.optimizer != "adam":
        raise SailorError(f"DeepSpeed has no {plan.optimizer.upper()} optimizer", field="optimizer",
                          fix="plan with Adam (the default)")
    v = {**DEFAULTS, **{k: x for k, x in train.items() if x is not None}}
    zero = zero_stage_of(plan)
    config: dict[str, Any] = {
        **batch_fields(plan),
        "bf16": {"enabled": plan.dtype == "bf16"},
        "fp16": {"enabled": plan.dtype == "fp16", "loss_scale": 0, **LOSS_SCALE},
        "zero_optimization": {"stage": zero, "reduce_bucket_size": ZERO_BUCKET_ELEMS,
                              "allgather_bucket_size": ZERO_BUCKET_ELEMS, "contiguous_gradients": True,
                              "overlap_comm": False},
        "gradient_clipping": float(v["clip_grad"]),
        "optimizer": {"type": "AdamW", "params": {"lr": float(v["lr"]), "betas": list(ADAM_BETAS),
                                                  "eps": float(v["adam_eps"]),
                                                  "weight_decay": float(v["weight_decay"]), "torch_adam": True}},
        "steps_per_print": max(1, steps),
        "wall_clock_breakdown": False,
    }
    sched = scheduler(LrSchedule.resolve(v, plan.global_batch_size, steps), plan.global_batch_size)
    if sched is not None:
        config["scheduler"] = sched
    return config


def ds_config_text(config: Mapping[str, Any]) -> str:
    """The file's text: sorted keys, so one config is always the same bytes (jobs name it by its hash)."""
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def write_ds_config(path: Path, plan: Plan, train: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """Write :func:`ds_config` atomically (nothing is written when the plan or options are refused)."""
    config = ds_config(plan, train, steps)
    atomic_write_text(Path(path), ds_config_text(config))
    return config


def check_ds_config_file(path: Path, plan: Plan) -> None:
    """Refuse a ds_config.json that does not belong to ``plan``: a job would start the user's script under the
    plan's allocation, and DeepSpeed would refuse (batch) or silently train otherwise (ZeRO stage)."""
    try:
        config = json.loads(Path(path).read_text())
    except OSError as exc:
        raise SailorError(f"cannot read the DeepSpeed config: {exc.strerror}", file=path, field="ds_config",
                          fix="write it with `sailor-hpc plan --runtime deepspeed --ds-config` or render again") from None
    except ValueError as exc:
        raise SailorError(f"not JSON: {exc}", file=path, field="ds_config", fix="write it again from the plan") from None
    if not isinstance(config, dict):
        raise SailorError("not a JSON object", file=path, field="ds_config", fix="write it again from the plan")
    zero = config.get("zero_optimization")
    got = {**{k: config.get(k) for k in batch_fields(plan)},
           "zero_optimization.stage": zero.get("stage", 0) if isinstance(zero, dict) else 0}
    want: dict[str, Any] = {**batch_fields(plan), "zero_optimization.stage": zero_stage_of(plan)}
    for key, value in want.items():
        if got.get(key) != value:
            raise SailorError(f"{key} is {got.get(key)!r}, the plan's is {value!r}", file=path, field=key,
                              fix="write the config from this plan (render again, or sailor-hpc plan --ds-config)")


__all__ = ["ADAM_BETAS", "batch_fields", "check_ds_config_file", "ds_config", "ds_config_text", "scheduler", "write_ds_config"]
