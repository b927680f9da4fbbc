"""Precision settings of a plan's ``dtype``: TF32 for fp32 on CUDA, dynamic loss scaling for fp16.

bf16 needs neither (its exponent range is fp32's); what it needs, fp32 gradient accumulation and fp32
master weights, is ``main_grad`` and ``optimizer``. fp16 (V100s have no bf16) underflows small
gradients: the loss is multiplied by a scale before the backward, the fp32 ``main_grad`` is divided by
it afterwards, and a step whose gradients hold an inf/nan anywhere is skipped on every rank (the flag
rides on the engine's one scalar all-reduce), halving the scale. The scale state is part of the
checkpoint, so a resumed run scales exactly as an uninterrupted one.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from megatron_patch.options import LossScaleConfig


def configure_tf32(device: torch.device, dtype: str, allow: bool) -> bool:
    """Allow TF32 matmuls/cuDNN for fp32 plans on CUDA (Megatron's default); returns whether it is on.

    Process-wide torch flags: only the runtime (one plan per process) calls this, not the profiler.
    """
    on = allow and device.type == "cuda" and dtype == "fp32"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on
    return on


@dataclass
class LossScaler:
    """Dynamic loss scale: ``scale`` halves on an overflow (not below ``min_scale``) and doubles after
    ``growth_interval`` consecutive good steps (torch.amp.GradScaler's rule)."""

    cfg: LossScaleConfig
    scale: float = 0.0
    good_steps: int = 0

    def __post_init__(self) -> None:
        if self.scale == 0.0:
            self.scale = float(self.cfg.initial)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """megatron's ``config.grad_scale_func``: applied to the last stage's loss before its backward."""
        return loss * self.scale

    def unscale(self, grads: Iterable[torch.Tensor]) -> bool:
        """Divide the fp32 gradients by the scale in place; True when any of them is not finite."""
        grads = list(grads)
        if not grads:
            return False
        found = torch.zeros(1, device=grads[0].device)
        inv = torch.full((1,), 1.0 / self.scale, device=grads[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        return bool(found.item())

    def update(self, overflow: bool) -> None:
        """After the step (all ranks agreed on ``overflow``)."""
        if overflow:
            self.scale = max(self.scale / 2.0, self.cfg.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.cfg.growth_interval:
            self.scale *= 2.0
            self.good_steps = 0

    def state(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load(self, state: dict[str, float | int]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
