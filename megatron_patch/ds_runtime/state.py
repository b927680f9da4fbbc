"""Adam's state by megatron name under DeepSpeed, and megatron_patch's learning-rate schedule as a DeepSpeed one.

``megatron_patch.checkpoint_io`` saves and loads a trainer's ``optimizer.state_of(name)`` /
``load_state(...)``; :class:`DsOptimizerState` gives it DeepSpeed's state in those terms:

* ZeRO 0: DeepSpeed steps torch's AdamW on the parameters themselves: their tensors and state;
* ZeRO 1-3: each replica holds a fragment of the flat fp32 partition; DeepSpeed's
  ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` assemble the full tensors (a
  collective over the replicas of the stage), so :meth:`DsOptimizerState.collect` reads every local
  parameter, in one order on every rank, before a save. Loading into ZeRO 1-3 is refused: DeepSpeed
  creates the partitioned state only at the first step, and its setters need it to exist.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from megatron_patch.optimizer import set_lr
from megatron_patch.options import TrainOptions
from sailor_hpc.core.errors import SailorError

FIELDS = ("exp_avg", "exp_avg_sq")


class SampleSchedule:
    """megatron_patch's schedule (a function of consumed samples) stepped by DeepSpeed after each optimizer
    step: the rate of the step that starts after ``samples`` consumed samples, as ``Trainer.train_step``."""

    def __init__(self, optimizer: torch.optim.Optimizer, opts: TrainOptions, global_batch: int) -> None:
        self.optimizer, self.opts, self.global_batch = optimizer, opts, global_batch
        self.samples = 0
        self._apply()

    def _apply(self) -> None:
        set_lr(self.optimizer, self.opts.lr_at(self.samples))

    def reset(self, samples: int) -> None:
        self.samples = samples
        self._apply()

    def step(self, **_: Any) -> None:
        self.samples += self.global_batch
        self._apply()

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        return self.get_lr()

    def state_dict(self) -> dict[str, int]:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.reset(int(state["samples"]))


class DsOptimizerState:
    """The DeepSpeed engine's Adam state of this rank's parameters, by canonical (megatron) name."""

    def __init__(self, engine: Any, params: OrderedDict[str, torch.nn.Parameter], zero_stage: int) -> None:
        self.engine, self.params, self.zero = engine, params, zero_stage
        self._full: dict[str, dict[str, torch.Tensor]] = {}
        self._steps = 0

    def _torch_optimizer(self) -> torch.optim.Optimizer:
        opt = self.engine.optimizer
        return getattr(opt, "optimizer", opt)  # a wrapper (bf16, fp16) holds torch's AdamW inside

    def collect(self) -> None:
        """Collective over the stage's replicas (ZeRO 1-3): read every full tensor before a save."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
        self._full = {}
        link = getattr(self.engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if self.zero and link is not None:  # DeepSpeed links the moments to the parameters once, maybe before
            self.engine.optimizer._hp_optimizer_states_linked = False  # the first step made them: link again
            link()
        for name, p in self.params.items():
            if self.zero == 0:
                st = self._torch_optimizer().state.get(p, {})
                self._full[name] = {"param": p.detach().float(),
                                    **{k: st.get(k, torch.zeros_like(p)).detach().float() for k in FIELDS}}
            else:
                full = {"param": safe_get_full_fp32_param(p)}
                for k in FIELDS:
                    value = safe_get_full_optimizer_state(p, k)
                    full[k] = value if value is not None else torch.zeros_like(full["param"])
                self._full[name] = full
        self._steps = self._count_steps()

    def _count_steps(self) -> int:
        for st in self._torch_optimizer().state.values():
            if "step" in st:
                return int(st["step"])
        return 0

    def state_of(self, name: str) -> dict[str, torch.Tensor]:
        return self._full[name]

    def adam_steps(self) -> int:
        return self._steps

    def load_state(self, name: str, param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   steps: int) -> None:
        """Set one parameter's weights and moments (ZeRO 0; ZeRO 1-3 are refused, see the module doc)."""
        p = self.params[name]
        if self.zero == 0:
            with torch.no_grad():
                p.copy_(param)
            if steps > 0:
                self._torch_optimizer().state[p] = {"step": torch.tensor(float(steps)),
                                                    "exp_avg": exp_avg.to(p).clone(),
                                                    "exp_avg_sq": exp_avg_sq.to(p).clone()}
            return
        raise SailorError(f"resuming a ZeRO-{self.zero} DeepSpeed run from a layout-free checkpoint is not supported: "
                          "DeepSpeed creates its partitioned Adam state only at the first step",
                          field="notes.deepspeed.zero_stage",
                          fix="resume with a ZeRO-0 plan (or under megatron_patch), then continue under ZeRO")


__all__ = ["DsOptimizerState", "SampleSchedule"]
