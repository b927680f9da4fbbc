"""One rank's trainer under a plan: stage module, 1F1B, gradient sync, Adam, step bookkeeping.

A training step is:

1. megatron's non-interleaved 1F1B schedule (``forward_backward_pipelining_without_interleaving``)
   over this pipeline's micro-batches, with the plan's stage-boundary communicator (P4/P5).
   Gradients accumulate over micro-batches in fp32 ``main_grad`` buffers that are slices of the
   gradient buckets (``grad_buckets`` on ``main_grad``); during the last micro-batch's backward the
   buckets start their all-reduces. fp16 scales the loss first (``precision.LossScaler``);
2. the rest of the per-layer, per-TP-chunk, sample-weighted gradient sync (``grad_sync``): the
   buckets not launched yet, and the wait for all of them;
3. fp16: unscale the synced fp32 gradients and look for inf/nan; one scalar all-reduce over all
   ranks carrying the gradient norm, the weighted loss, the "stop" flag (a signal reached some rank)
   and the overflow flag, so every rank clips, logs, skips and stops alike;
4. Adam on the local shards at the schedule's learning rate for the samples consumed so far
   (skipped on an fp16 overflow; the loss scale halves).

:meth:`Trainer.evaluate` runs the same schedule forward only over the valid samples.

Every process group the plan needs is created up front, in one call (:func:`megatron_patch.groups.plan_groups`),
and handed to the stage module, the p2p communicator and the gradient buckets.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_patch import patch, resident
from megatron_patch.data import Samples
from megatron_patch.grad_buckets import GradBuckets
from megatron_patch.grad_sync import plan_buckets, rank_sets
from megatron_patch.groups import PlanGroups, plan_groups
from megatron_patch.init_weights import init_shard
from megatron_patch.layout import param_layout
from megatron_patch.model import build_stage_module, padded_vocab_size
from megatron_patch.optimizer import StageOptimizer, clip_coefficient
from megatron_patch.options import TrainOptions
from megatron_patch.p2p import HeteroP2PCommunicator, StageGroup
from megatron_patch.precision import LossScaler, configure_tf32
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import ModelSpec
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.roles import Role, role_of, stage_rank_table


@dataclass(frozen=True)
class StepResult:
    step: int  # optimizer steps done after this one
    loss: float  # global weighted loss of the step (mean over all samples)
    lr: float  # the learning rate of this step (the schedule's, at the samples consumed before it)
    grad_norm: float
    stop: bool  # some rank asked to stop (signal)
    seconds: float
    sync_seconds: float  # waiting for the gradient sync after the backward (the part not overlapped)
    skipped: bool = False  # fp16 overflow on some rank: no optimizer step
    loss_scale: float = 1.0


class Trainer:
    """Everything one rank needs to train under ``plan``; every rank of the plan builds one."""

    def __init__(self, plan: Plan, samples: Samples, opts: TrainOptions = TrainOptions(),
                 device: torch.device | None = None, spec: ModelSpec | None = None,
                 valid: Samples | None = None, deferred_init: bool = False) -> None:
        """``spec`` overrides the plan's catalog model (benchmarks and tests with other shapes);
        ``valid``: the samples :meth:`evaluate` reads; ``deferred_init``: the initial weights are drawn only by
        :meth:`initialise`, which a rank that found no checkpoint to load calls."""
        self.plan = plan
        self.spec = spec or plan.model_spec
        self.samples = samples
        self.valid = valid
        self.opts = opts
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.role: Role = role_of(plan, self.rank, self.world)
        self.device = device or torch.device("cpu")
        self.seq_len = plan.seq_len or self.spec.seq_len
        if any(p.stages[-1].last_layer != self.spec.num_pipeline_layers - 1 for p in plan.pipelines):
            raise SailorError(f"the plan's stages do not cover {self.spec.name}'s {self.spec.num_pipeline_layers} "
                              "pipeline layers", field="pipelines")
        if self.seq_len > self.spec.seq_len:
            raise SailorError(f"seq_len {self.seq_len} exceeds {self.spec.name}'s {self.spec.seq_len} positions",
                              field="seq_len")
        if samples.seq_len != self.seq_len:
            raise SailorError(f"data samples have {samples.seq_len} tokens, the plan trains {self.seq_len}",
                              field="seq_len")
        self.tf32 = configure_tf32(self.device, plan.dtype, opts.tf32)
        self.patches = patch.apply(cpu=self.device.type == "cpu")
        patch.seed_model_parallel_rng(opts.seed, self.role.tp_rank)

        table = stage_rank_table(plan)
        self.padded_vocab = padded_vocab_size(self.spec, plan.tp_degrees())
        self.layout = param_layout(self.spec, self.padded_vocab)
        self.infos = {p.name: p for p in self.layout}
        sets = rank_sets(plan, self.layout, opts.weighting)
        self.groups: PlanGroups = plan_groups(plan, self.role, sets)
        self.pgc = self.groups.collection(StageGroup(self.role.stage, self.role.num_stages))
        self.module = build_stage_module(self.spec, self.role.first_layer, self.role.last_layer,
                                         pg_collection=self.pgc, dtype=plan.dtype, padded_vocab=self.padded_vocab,
                                         device=self.device, seed=opts.seed, recompute=plan.recompute,
                                         te=opts.layer_spec == "te", init=not deferred_init)
        self.needs_init = deferred_init
        self.p2p = HeteroP2PCommunicator(table[self.role.pipeline], self.role.stage, self.role.tp_rank,
                                         self.module.config, self.device, self.groups.p2p)
        self.params = self.module.canonical_params()
        self.scaler = LossScaler(opts.loss_scale) if plan.dtype == "fp16" else None
        if self.scaler is not None:
            self.module.config.grad_scale_func = self.scaler.scale_loss  # megatron's schedule applies it
        self.pipe = plan.pipelines[self.role.pipeline]
        self.sync = GradBuckets(plan_buckets(sets, self.layout, opts.grad_bucket_mb), self.params, self.infos,
                                self.pipe.num_micro_batches, self.device, self.groups.sync)
        self.optimizer = StageOptimizer(self.params, self.infos, opts.adam)
        self.sample_offset = sum(p.samples for p in plan.pipelines[:self.role.pipeline])
        self.weight = self.pipe.samples / plan.global_batch_size
        self.step = 0
        self.consumed_samples = 0

    def initialise(self) -> None:
        """Draw the canonical initial weights a deferred build left out (as the build would have: master and model
        copies, no Adam state yet)."""
        if not self.needs_init:
            return
        for name in self.params:
            value = init_shard(self.infos[name], self.opts.seed, self.spec.vocab_size, self.role.tp, self.role.tp_rank)
            # as the build: the model's copy in its own dtype, and the master made from that copy (bf16-rounded)
            value = value.to(self.params[name].dtype).float()
            zeros = torch.zeros_like(value)
            self.optimizer.load_state(name, value.to(self.device), zeros, zeros, 0)
        self.needs_init = False

    # -- data
    def _micro_batches(self, source: Samples, first: int) -> list[dict[str, torch.Tensor]]:
        """This pipeline's micro-batches of the global batch starting at sample ``first`` of ``source``
        (only what this stage reads)."""
        if not (self.role.is_first_stage or self.role.is_last_stage):
            return [{} for _ in range(self.pipe.num_micro_batches)]
        start = first + self.sample_offset
        data = source.batch(start, self.pipe.samples).to(self.device)
        out = []
        for m in range(self.pipe.num_micro_batches):
            chunk = data[m * self.pipe.micro_batch_size:(m + 1) * self.pipe.micro_batch_size]
            mb: dict[str, torch.Tensor] = {}
            if self.role.is_first_stage:
                mb["tokens"] = chunk[:, :-1].contiguous()
            if self.role.is_last_stage:
                mb["labels"] = chunk[:, 1:].contiguous()
            out.append(mb)
        return out

    @staticmethod
    def _forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        mb = next(data_iterator)
        out = model(tokens=mb.get("tokens"), labels=mb.get("labels"))

        def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach().clone()}  # the schedule divides `loss` in place
        return out, loss_func

    def _pipeline(self, source: Samples, first: int, forward_only: bool) -> list[dict[str, torch.Tensor]]:
        """megatron's 1F1B over this pipeline's micro-batches; the last stage gets their losses."""
        from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving
        return forward_backward_pipelining_without_interleaving(
            forward_step_func=self._forward_step, data_iterator=iter(self._micro_batches(source, first)),
            model=self.module, num_microbatches=self.pipe.num_micro_batches, seq_length=self.seq_len,
            micro_batch_size=self.pipe.micro_batch_size, forward_only=forward_only,
            p2p_communicator=self.p2p, pg_collection=self.pgc)

    def _weighted_loss(self, losses: list[dict[str, torch.Tensor]]) -> float:
        """This rank's share of the global batch's mean loss (non-zero on TP rank 0 of last stages only)."""
        if not (self.role.is_last_stage and self.role.tp_rank == 0):
            return 0.0
        return self.weight * sum(float(x["loss"]) for x in losses) / len(losses)

    # -- evaluation
    def evaluate(self, iters: int) -> float:
        """Mean loss of the first ``iters`` global batches of the valid samples (collective; no update).

        The same batches at every evaluation: points of the validation curve compare with each other,
        and a resumed or resized run evaluates exactly what the uninterrupted one does."""
        if self.valid is None:
            raise SailorError("no valid split to evaluate on", field="--split", fix="e.g. --split 949,50,1")
        self.module.eval()
        total = 0.0
        with torch.no_grad():
            for k in range(iters):
                total += self._weighted_loss(self._pipeline(self.valid, k * self.plan.global_batch_size, True))
        vec = torch.tensor([total / iters], dtype=torch.float64, device=self.device)
        resident.wait(dist.all_reduce(vec, async_op=True))
        return float(vec[0])

    # -- training
    def train_step(self, stop_requested: bool = False) -> StepResult:
        t0 = time.perf_counter()
        self.module.train()
        losses = self._pipeline(self.samples, self.consumed_samples, False)
        t1 = time.perf_counter()
        self.sync.finish()
        t2 = time.perf_counter()
        grads = self.optimizer.main_grads()  # every p.main_grad, synced; the masters' .grad
        if self.scaler is not None and self.opts.inject_overflow == (self.rank, self.step + 1):
            next(iter(grads.values())).view(-1)[0] = float("inf")
        overflow = self.scaler.unscale(grads.values()) if self.scaler is not None else False
        vec = torch.tensor([self.sync.owned_sq_norm(), self._weighted_loss(losses), float(stop_requested),
                            float(overflow)],
                           dtype=torch.float64, device=self.device)
        resident.wait(dist.all_reduce(vec, async_op=True))
        skipped = bool(vec[3] > 0)
        grad_norm = math.sqrt(float(vec[0])) if not skipped else float("nan")
        scale = self.scaler.scale if self.scaler is not None else 1.0
        lr = self.opts.lr_at(self.consumed_samples)
        if not skipped:
            self.optimizer.step(clip_coefficient(grad_norm, self.opts.adam.clip_grad), lr)
        if self.scaler is not None:
            self.scaler.update(skipped)
        self.optimizer.zero_grad()
        self.step += 1  # a skipped step still consumes its batch (as Megatron's)
        self.consumed_samples += self.plan.global_batch_size
        return StepResult(step=self.step, loss=float(vec[1]), lr=lr, grad_norm=grad_norm, stop=bool(vec[2] > 0),
                          seconds=time.perf_counter() - t0, sync_seconds=t2 - t1, skipped=skipped,
                          loss_scale=scale)
