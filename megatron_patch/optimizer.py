"""Adam(W) on this rank's parameter shards, with fp32 master weights for bf16/fp16 training.

Adam is elementwise, so Adam on TP shards equals Adam on the full tensors once the gradients are
synchronised; the global gradient-norm clip needs one scalar all-reduce (done by the engine). Weight
decay is decoupled (AdamW, as Megatron's Adam) and skips biases and norms. In bf16 the model keeps
bf16 parameters and the optimizer fp32 masters, as Megatron's mixed-precision optimizer does.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from megatron_patch.layout import ParamInfo
from megatron_patch.options import AdamConfig

__all__ = ["AdamConfig", "StageOptimizer", "clip_coefficient"]  # AdamConfig re-exported (profiler uses it)


class StageOptimizer:
    """Owns the fp32 master copy of this rank's parameters and their Adam state, by canonical name."""

    def __init__(self, params: "OrderedDict[str, torch.nn.Parameter]", infos: dict[str, ParamInfo],
                 cfg: AdamConfig) -> None:
        self.cfg = cfg
        self.params = params
        self.mixed = any(p.dtype != torch.float32 for p in params.values())
        self.master: OrderedDict[str, torch.Tensor] = OrderedDict()
        for name, p in params.items():
            self.master[name] = p if not self.mixed else p.detach().float().requires_grad_(True)
        decay = [self.master[n] for n in params if infos[n].decay]
        no_decay = [self.master[n] for n in params if not infos[n].decay]
        groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        self.adam = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)

    def main_grads(self) -> "OrderedDict[str, torch.Tensor]":
        """fp32 gradients by name (zeros where a parameter got none), ready for the sync."""
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        for name, p in self.params.items():
            m = self.master[name]
            main_grad = getattr(p, "main_grad", None)  # the engine's synced fp32 gradient (grad_buckets)
            if main_grad is not None:
                m.grad = main_grad
            else:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if self.mixed:
                    m.grad = p.grad.float()
            out[name] = m.grad
        return out

    def step(self, clip_coef: float) -> None:
        if clip_coef < 1.0:
            for m in self.master.values():
                m.grad.mul_(clip_coef)
        self.adam.step()
        if self.mixed:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(self.master[name])

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None
        if self.mixed:
            for m in self.master.values():
                m.grad = None

    # -- state by canonical name (what the checkpoint stores)
    def state_of(self, name: str) -> dict[str, torch.Tensor]:
        st = self.adam.state.get(self.master[name], {})
        m = self.master[name]
        return {"param": m.detach(),
                "exp_avg": st.get("exp_avg", torch.zeros_like(m)).detach(),
                "exp_avg_sq": st.get("exp_avg_sq", torch.zeros_like(m)).detach()}

    def adam_steps(self) -> int:
        for st in self.adam.state.values():
            return int(st["step"])
        return 0

    def load_state(self, name: str, param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   steps: int) -> None:
        m = self.master[name]
        with torch.no_grad():
            m.copy_(param)
            if self.mixed:
                self.params[name].copy_(param)
        if steps > 0:
            self.adam.state[m] = {"step": torch.tensor(float(steps)), "exp_avg": exp_avg.to(m).clone(),
                                  "exp_avg_sq": exp_avg_sq.to(m).clone()}


def clip_coefficient(grad_norm: float, clip: float) -> float:
    """Megatron's clip: scale by clip / (norm + 1e-6) when the norm exceeds ``clip``."""
    if clip <= 0:
        return 1.0
    return min(1.0, clip / (grad_norm + 1e-6))
