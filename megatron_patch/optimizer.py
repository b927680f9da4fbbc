"""Adam(W) on this rank's parameter shards, with fp32 master weights for bf16/fp16 training.

Adam is elementwise, so Adam on TP shards equals Adam on the full tensors once the gradients are
synchronised; the global gradient-norm clip needs one scalar all-reduce (done by the engine). Weight
decay is decoupled (AdamW, as Megatron's Adam) and skips biases and norms. In bf16 the model keeps
bf16 parameters and the optimizer fp32 masters, as Megatron's mixed-precision optimizer does. The
gradient is ``p.main_grad`` (fp32, accumulated by ``megatron_patch.main_grad``) where a parameter has
one, else ``p.grad`` (the profiler steps without the hooks).

torch's AdamW runs fused (one kernel for all tensors) on CUDA and multi-tensor (foreach) elsewhere;
on the CPU the foreach update equals the single-tensor one within fp32 rounding, and the reference
uses the same :func:`adamw` (tests/megatron_patch compare parameters to 1e-6).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from megatron_patch.layout import ParamInfo
from megatron_patch.main_grad import main_grad_of, zero_main_grads
from megatron_patch.options import AdamConfig

__all__ = ["AdamConfig", "StageOptimizer", "adamw", "clip_coefficient", "set_lr"]  # AdamConfig re-exported (profiler uses it)


class StageOptimizer:
    """Owns the fp32 master copy of this rank's parameters and their Adam state, by canonical name."""

    def __init__(self, params: OrderedDict[str, torch.nn.Parameter], infos: dict[str, ParamInfo],
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
        self.adam = adamw(groups, cfg, next(iter(params.values())).device if params else torch.device("cpu"))

    def main_grads(self) -> OrderedDict[str, torch.Tensor]:
        """fp32 gradients by name, as the sync left them: ``p.main_grad``, else made from ``p.grad``
        (zeros where a parameter got none). The masters' ``.grad`` are these tensors."""
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        for name, p in self.params.items():
            g = main_grad_of(p)
            if g is None:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                g = p.grad.float() if self.mixed else p.grad
            self.master[name].grad = g
            out[name] = g
        return out

    def step(self, clip_coef: float, lr: float | None = None) -> None:
        """Clip by ``clip_coef`` (the engine's, from the global norm) and step at ``lr`` (None: the config's)."""
        grads = [m.grad for m in self.master.values() if m.grad is not None]
        if clip_coef < 1.0 and grads:
            torch._foreach_mul_(grads, clip_coef)
        set_lr(self.adam, self.cfg.lr if lr is None else lr)
        self.adam.step()
        if self.mixed:
            with torch.no_grad():
                torch._foreach_copy_(list(self.params.values()), list(self.master.values()))

    def zero_grad(self) -> None:
        zero_main_grads(self.params)
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
            fused = self.adam.defaults.get("fused")  # fused Adam keeps its step count on the device
            step = torch.tensor(float(steps), device=m.device if fused else "cpu")
            self.adam.state[m] = {"step": step, "exp_avg": exp_avg.to(m).clone(),
                                  "exp_avg_sq": exp_avg_sq.to(m).clone()}


def adamw(groups: list[dict], cfg: AdamConfig, device: torch.device) -> torch.optim.AdamW:
    """torch's AdamW, fused on CUDA, foreach elsewhere (the runtime's and the reference's)."""
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **fast)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's learning rate (AdamW's decoupled decay is scaled by it too, as in Megatron)."""
    for g in optimizer.param_groups:
        g["lr"] = lr


def clip_coefficient(grad_norm: float, clip: float) -> float:
    """Megatron's clip: scale by clip / (norm + 1e-6) when the norm exceeds ``clip``."""
    if clip <= 0:
        return 1.0
    return min(1.0, clip / (grad_norm + 1e-6))
