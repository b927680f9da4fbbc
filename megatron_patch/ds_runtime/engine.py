"""One rank's trainer under stock DeepSpeed: the plan's stage in DeepSpeed's engine, megatron_patch's data.

It offers what ``megatron_patch.launch`` and ``megatron_patch.checkpoint_io`` use of
:class:`megatron_patch.engine.Trainer` (``train_step``, ``step``, ``consumed_samples``, ``role``,
``layout``, ``infos``, ``params``, ``optimizer.state_of``/``load_state``...), so checkpoints are the
layout-free ones and the launch loop is shared.

Pipelines of several stages run DeepSpeed's ``PipelineEngine`` (``train_batch``: its 1F1B, the tied
and data-parallel gradient reductions, clipping, AdamW); a plan of one stage runs its plain engine
(forward, backward and step per micro-batch, stepping at the accumulation boundary), which also runs
ZeRO 2 and 3. The config is :func:`sailor_hpc.core.ds_config.ds_config` of the plan and the run's
options, with two runtime-only changes: the learning rate is set each step from megatron_patch's
schedule (:class:`~megatron_patch.ds_runtime.state.SampleSchedule`, so warm-up and decay in samples
are exact), and Adam runs foreach on the CPU as megatron_patch's (torch picks the per-tensor loop there).

DeepSpeed's fp32 path without ZeRO computes its clipping norm from the stage of model-parallel rank 0
only and counts a tied copy twice (its ZeRO and mixed-precision paths skip ``ds_pipe_replicated``
copies); :func:`_clip_counting_once` replaces that one method with megatron_patch's clip over the
replica's stages (measured: with clipping active, 1.3e-3 apart from megatron_patch after 3 steps before,
equal after).
"""
from __future__ import annotations

import math
import time
import types
from typing import Any

import torch
import torch.distributed as dist

from megatron_patch import patch
from megatron_patch.data import Samples
from megatron_patch.ds_runtime.pipe import PlanPipelineModule, StageBuild, StageLayer, stage_of
from megatron_patch.ds_runtime.state import DsOptimizerState, SampleSchedule
from megatron_patch.engine import StepResult
from megatron_patch.groups import collection, groups_of_one
from megatron_patch.layout import param_layout
from megatron_patch.model import padded_vocab_size
from megatron_patch.options import TrainOptions
from sailor_hpc.core.deepspeed_plan import check_engine_plan, zero_stage_of
from sailor_hpc.core.ds_config import ds_config
from sailor_hpc.core.models import ModelSpec
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.roles import Role, role_of


def runtime_config(plan: Plan, opts: TrainOptions, device: torch.device) -> dict[str, Any]:
    """The plan's ds_config for this run (its optimizer options; the schedule is applied per step)."""
    a = opts.adam
    train = {"lr": a.lr, "adam_eps": a.eps, "weight_decay": a.weight_decay, "clip_grad": a.clip_grad}
    config = ds_config(plan, train, steps=1)
    config.pop("scheduler", None)  # SampleSchedule sets every step's rate
    if device.type == "cpu":
        config["optimizer"]["params"]["foreach"] = True  # as megatron_patch.optimizer.adamw on the CPU
    return config


def _clip_counting_once(engine: Any, clip: float) -> None:
    """megatron_patch's global-norm clip in DeepSpeed's fp32 path without ZeRO (see the module doc): the norm
    of every gradient of the replica's stages, each tied weight once, then ``clip / (norm + 1e-6)``."""
    from megatron_patch.optimizer import clip_coefficient

    def clip_grads(self: Any) -> None:
        grads = [p.grad for p in self.module.parameters()
                 if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)]
        sq = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum().reshape(1).double()
        group = self.mpu.get_pipe_parallel_group() if self.mpu is not None else None
        if group is not None:
            dist.all_reduce(sq, group=group)  # gradients are replica-averaged already: one pipeline's sum
        norm = math.sqrt(float(sq[0]))
        coef = clip_coefficient(norm, clip)
        if coef < 1.0:
            torch._foreach_mul_([p.grad for p in self.module.parameters() if p.grad is not None], coef)
        self._global_grad_norm = norm
    engine.clip_fp32_gradients = types.MethodType(clip_grads, engine)


class DsTrainer:
    """Everything one rank needs to train ``plan`` under DeepSpeed; every rank of the plan builds one."""

    def __init__(self, plan: Plan, samples: Samples, opts: TrainOptions = TrainOptions(),
                 device: torch.device | None = None, spec: ModelSpec | None = None,
                 valid: Samples | None = None) -> None:
        import deepspeed
        check_engine_plan(plan)
        self.plan, self.samples, self.valid, self.opts = plan, samples, valid, opts
        self.spec = spec or plan.model_spec
        self.device = device or torch.device("cpu")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.role: Role = role_of(plan, self.rank, self.world)
        self.seq_len = plan.seq_len or self.spec.seq_len
        self.zero = zero_stage_of(plan)
        self.patches = patch.apply(cpu=self.device.type == "cpu")
        patch.seed_model_parallel_rng(opts.seed, 0)
        alone = groups_of_one()  # created by every rank, before DeepSpeed's groups
        self.pgc = collection(alone, alone)  # a stage at TP 1
        self.padded_vocab = padded_vocab_size(self.spec, plan.tp_degrees())
        self.layout = param_layout(self.spec, self.padded_vocab)
        self.infos = {p.name: p for p in self.layout}
        self.pipe = plan.pipelines[self.role.pipeline]
        build = StageBuild(dtype=plan.dtype, padded_vocab=self.padded_vocab, device=self.device, seed=opts.seed,
                           recompute=plan.recompute, pg_collection=self.pgc)
        pipelined = len(self.pipe.stages) > 1
        module: torch.nn.Module = (PlanPipelineModule(plan, self.spec, build) if pipelined else
                                   StageLayer(self.spec, 0, self.spec.num_pipeline_layers - 1, build))
        self.params = stage_of(module).canonical_params()
        groups = [{"params": [p for n, p in self.params.items() if self.infos[n].decay],
                   "weight_decay": opts.adam.weight_decay},
                  {"params": [p for n, p in self.params.items() if not self.infos[n].decay], "weight_decay": 0.0}]
        self.engine, _, _, _ = deepspeed.initialize(
            model=module, model_parameters=[g for g in groups if g["params"]],
            config=runtime_config(plan, opts, self.device),
            lr_scheduler=lambda opt: SampleSchedule(opt, opts, plan.global_batch_size))
        if self.zero == 0 and plan.dtype == "fp32":
            _clip_counting_once(self.engine, opts.adam.clip_grad)
        self.pipelined = pipelined
        self.optimizer = DsOptimizerState(self.engine, self.params, self.zero)
        self.scaler = None  # fp16's loss scale is DeepSpeed's own (not in the checkpoint)
        self.sample_offset = sum(p.samples for p in plan.pipelines[:self.role.pipeline])
        self.step = 0
        self.consumed_samples = 0

    # -- data: this replica's micro-batches of the global batch (megatron_patch's assignment)
    def _micro_batches(self, source: Samples, first: int) -> list[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]]:
        data = source.batch(first + self.sample_offset, self.pipe.samples).to(self.device)
        mbs = self.pipe.micro_batch_size
        out = []
        for m in range(self.pipe.num_micro_batches):
            chunk = data[m * mbs:(m + 1) * mbs]
            tokens, labels = chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
            out.append(((tokens, labels), labels))
        return out

    def resume_at(self, step: int, consumed_samples: int) -> None:
        """After a checkpoint was loaded: the step count and the schedule's position."""
        self.step, self.consumed_samples = step, consumed_samples
        self.engine.lr_scheduler.reset(consumed_samples)

    def train_step(self, stop_requested: bool = False) -> StepResult:
        t0 = time.perf_counter()
        lr = self.opts.lr_at(self.consumed_samples)
        batches = self._micro_batches(self.samples, self.consumed_samples)
        if self.pipelined:
            loss = float(self.engine.train_batch(data_iter=iter(batches)))
        else:
            total = 0.0
            for inputs, _ in batches:
                out = self.engine(inputs)
                self.engine.backward(out)
                self.engine.step()
                total += float(out.detach())
            loss = total / len(batches)
        vec = torch.tensor([loss if not self.pipelined else 0.0, float(stop_requested)], dtype=torch.float64)
        dist.all_reduce(vec)
        if not self.pipelined:  # the plain engine leaves each replica its own micro-batches' mean
            loss = float(vec[0]) / self.world
        norm = self.engine.get_global_grad_norm()
        self.step += 1
        self.consumed_samples += self.plan.global_batch_size
        return StepResult(step=self.step, loss=loss, lr=lr, grad_norm=float(norm) if norm is not None else math.nan,
                          stop=bool(vec[1] > 0), seconds=time.perf_counter() - t0, sync_seconds=0.0)

    def save_state(self) -> None:
        """Collective: gather what a layout-free checkpoint stores (before ``checkpoint_io.save``)."""
        self.optimizer.collect()


__all__ = ["DsTrainer", "runtime_config"]
