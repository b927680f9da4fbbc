"""Adam's state by megatron name under DeepSpeed, and megatron_patch's learning-rate schedule as a DeepSpeed one.

``megatron_patch.checkpoint_io`` saves and loads a trainer's ``optimizer.state_of(name)`` /
``load_state(...)``; :class:`DsOptimizerState` gives it DeepSpeed's state in those terms:

* ZeRO 0: DeepSpeed steps torch's AdamW on the parameters themselves: their tensors and state;
* ZeRO 1-3: each replica holds a fragment of the flat fp32 partition; DeepSpeed's
  ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` assemble the full tensors (a
  collective over the replicas of the stage), so :meth:`DsOptimizerState.collect` reads every local
  parameter, in one order on every rank, before a save. Loading writes this rank's fragments with the
  matching setters (``safe_set_full_*``). Those need Adam's state of the flat partitions, which torch
  creates only at the first step: :meth:`DsOptimizerState.load_state` creates it first (zeros, the
  checkpoint's step count), as torch would, then links DeepSpeed's per-parameter views to it. The
  model's own copy of each weight (ZeRO 3: its partition, gathered and re-partitioned) is set too.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from megatron_patch.optimizer import set_lr
from megatron_patch.options import TrainOptions

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
        """Set one parameter's weights and moments (``steps`` 0: Adam starts afresh, no moments are kept).
        ZeRO 3: a collective over the replicas (every rank loads the same names in the same order)."""
        p = self.params[name]
        if self.zero == 0:
            with torch.no_grad():
                p.copy_(param)
            if steps > 0:
                self._torch_optimizer().state[p] = {"step": torch.tensor(float(steps)),
                                                    "exp_avg": exp_avg.to(p).clone(),
                                                    "exp_avg_sq": exp_avg_sq.to(p).clone()}
            return
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
        self._set_model_copy(p, param)
        safe_set_full_fp32_param(p, param.float())
        if steps > 0:
            self._create_flat_state(steps)
            for key, value in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                safe_set_full_optimizer_state(p, value.float(), key)

    def _set_model_copy(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        """The weight the forward reads (ZeRO 1-2: a view of DeepSpeed's flat buffer; ZeRO 3: partitioned)."""
        if self.zero == 3:
            import deepspeed
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
                p.copy_(value)  # rank 0's value (equal on every rank) is partitioned again on exit
            return
        with torch.no_grad():
            p.copy_(value)

    def _create_flat_state(self, steps: int) -> None:
        """Adam's state of the flat fp32 partitions, as torch creates it at a first step (zero moments),
        once per load, with the checkpoint's step count; then DeepSpeed's views into it (ZeRO 1-2)."""
        opt = self._torch_optimizer()
        # ZeRO 3 puts its flat partitions in torch's param groups only during its step
        flats = getattr(self.engine.optimizer, "fp32_partitioned_groups_flat", None) or \
            [f for g in opt.param_groups for f in g["params"]]
        # "exp_avg", not mere presence: torch's state is a defaultdict, and DeepSpeed's reads leave empty entries
        if all("exp_avg" in opt.state.get(f, {}) for f in flats):
            return
        for f in flats:
            opt.state[f] = {"step": torch.tensor(float(steps)), "exp_avg": torch.zeros_like(f),
                            "exp_avg_sq": torch.zeros_like(f)}
        link = getattr(self.engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:
            self.engine.optimizer._hp_optimizer_states_linked = False
            link()


__all__ = ["DsOptimizerState", "SampleSchedule"]
