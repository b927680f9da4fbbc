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

:class:`StageOptimizer` keeps the Adam state itself and calls the function ``torch.optim.AdamW.step`` calls
(``torch.optim.adamw.adamw``, torch's functional AdamW), with the same arguments and state: the same update, bit for
bit (tests/megatron_patch/test_optimizer.py). The class would import ``torch._dynamo`` at its first parameter
group and every step (for its ``torch.compile`` support): 0.9 s of CPU at every rank's start, a quarter of
what a rank spends before its first step.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw as adamw_update

from megatron_patch.layout import ParamInfo
from megatron_patch.main_grad import main_grad_of, zero_main_grads
from megatron_patch.options import AdamConfig

__all__ = ["AdamConfig", "StageOptimizer", "adamw", "clip_coefficient", "set_lr"]  # AdamConfig re-exported (profiler uses it)


@dataclass
class AdamState:
    """One parameter's Adam state, as ``torch.optim.Adam`` keeps it (``step``: a 0-d float32 tensor, on the
    device for the fused kernel, else on the CPU)."""

    step: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


@dataclass(frozen=True)
class ParamGroup:
    """Masters that share a weight decay, by canonical name, in the order Adam updates them."""

    names: tuple[str, ...]
    weight_decay: float


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
        decay = tuple(n for n in params if infos[n].decay)
        no_decay = tuple(n for n in params if not infos[n].decay)
        self.groups = [g for g in (ParamGroup(decay, cfg.weight_decay), ParamGroup(no_decay, 0.0)) if g.names]
        device = next(iter(params.values())).device if params else torch.device("cpu")
        self.fused = device.type == "cuda"  # as adamw(): fused on CUDA, foreach elsewhere
        self.lr = cfg.lr
        self.state: dict[str, AdamState] = {}  # by name; made at a parameter's first step, as torch does

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
        self.lr = self.cfg.lr if lr is None else lr
        with torch.no_grad():
            for group in self.groups:
                self._adam(group)
            if self.mixed:
                torch._foreach_copy_(list(self.params.values()), list(self.master.values()))

    def _adam(self, group: ParamGroup) -> None:
        """``torch.optim.AdamW.step`` for one group: its masters that have a gradient, their state made as
        ``Adam._init_group`` makes it, the same call."""
        names = [n for n in group.names if self.master[n].grad is not None]
        if not names:
            return
        for n in names:
            if n not in self.state:
                m = self.master[n]
                step = (torch.zeros((), dtype=torch.float32, device=m.device) if self.fused
                        else torch.tensor(0.0, dtype=torch.float64 if torch.get_default_dtype() == torch.float64
                                          else torch.float32, device="cpu"))
                self.state[n] = AdamState(step, torch.zeros_like(m, memory_format=torch.preserve_format),
                                          torch.zeros_like(m, memory_format=torch.preserve_format))
        masters = [self.master[n] for n in names]
        states = [self.state[n] for n in names]
        adamw_update(masters, [m.grad for m in masters], [s.exp_avg for s in states],  # type: ignore[misc]
                     [s.exp_avg_sq for s in states], [], [s.step for s in states], foreach=not self.fused,
                     capturable=False, differentiable=False, fused=self.fused, grad_scale=None, found_inf=None,
                     has_complex=any(torch.is_complex(m) for m in masters), amsgrad=False, beta1=self.cfg.beta1,
                     beta2=self.cfg.beta2, lr=self.lr, weight_decay=group.weight_decay, eps=self.cfg.eps,
                     maximize=False)

    def zero_grad(self) -> None:
        zero_main_grads(self.params)
        for m in self.master.values():
            m.grad = None

    # -- state by canonical name (what the checkpoint stores)
    def state_of(self, name: str) -> dict[str, torch.Tensor]:
        st = self.state.get(name)
        m = self.master[name]
        return {"param": m.detach(),
                "exp_avg": (st.exp_avg if st else torch.zeros_like(m)).detach(),
                "exp_avg_sq": (st.exp_avg_sq if st else torch.zeros_like(m)).detach()}

    def adam_steps(self) -> int:
        for st in self.state.values():
            return int(st.step)
        return 0

    def load_state(self, name: str, param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   steps: int) -> None:
        m = self.master[name]
        with torch.no_grad():
            m.copy_(param)
            if self.mixed:
                self.params[name].copy_(param)
        if steps > 0:  # fused Adam keeps its step count on the device
            step = torch.tensor(float(steps), device=m.device if self.fused else "cpu")
            self.state[name] = AdamState(step, exp_avg.to(m).clone(), exp_avg_sq.to(m).clone())


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
