"""A plan's stages as DeepSpeed layers: one ``PipelineModule`` layer per stage, megatron_patch's modules inside.

Why one layer per stage: DeepSpeed partitions a layer list by its own methods (uniform, parameters,
type regex), none of which places an arbitrary split; with the plan's stages as the list and the
``uniform`` method, stage s gets exactly layer s, and only that stage's modules are ever built
(``LayerSpec``). Each is :func:`megatron_patch.model.build_stage_module` at TP 1: the same parameters,
names and initialisation as megatron_patch's stage.

Ranks: the plan's order (pipeline-major, :mod:`sailor_hpc.core.roles`) is DeepSpeed's topology with axes
``("data", "pipe")``: rank = replica x stages + stage, so a rank has the same role under both runtimes.

Between stages the activation travels with the labels: the first stage receives ``(tokens, labels)``
and every stage sends ``(hidden, labels)`` on (DeepSpeed sends tuples and skips the gradient of integer
tensors); the last stage returns the micro-batch's mean token loss, which the engine takes as the loss
(``loss_fn`` None). The loss is megatron_patch's: mean over the micro-batch's tokens, divided by the
accumulation steps, averaged over the replicas.

A tied embedding split over the first and last stage is two copies (one per stage, equal from the
same initialisation); their gradients are summed between the two stages of each replica before the
data-parallel reduction (:meth:`PlanPipelineModule.get_tied_weights_and_groups`, DeepSpeed's hook for
tied weights), and the last stage's copy is marked ``ds_pipe_replicated`` so the gradient norm counts
it once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.pipe.topology import ProcessTopology

from megatron_patch.model import StageModule, build_stage_module
from sailor_hpc.core.models import ModelSpec
from sailor_hpc.core.plan import Plan

TIED = "embedding.word_embeddings.weight"


@dataclass(frozen=True)
class StageBuild:
    """What every stage of a run is built with, beside its layer range (``build_stage_module``'s arguments)."""

    dtype: str
    padded_vocab: int
    device: torch.device
    seed: int
    recompute: bool
    pg_collection: Any  # the stage's process groups (groups of one: TP 1)


class StageLayer(torch.nn.Module):
    """Pipeline layers ``first..last`` (a megatron_patch stage at TP 1) with DeepSpeed's tuple interface."""

    def __init__(self, spec: ModelSpec, first: int, last: int, build: StageBuild) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.is_last = last == spec.num_pipeline_layers - 1
        self.stage: StageModule = build_stage_module(spec, first, last, dtype=build.dtype,
                                                     padded_vocab=build.padded_vocab, device=build.device,
                                                     seed=build.seed, recompute=build.recompute,
                                                     pg_collection=build.pg_collection)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> Any:
        if self.first == 0:
            tokens, labels = inputs
            self.stage.set_input_tensor(None)
            out = self.stage(tokens=tokens, labels=labels)
        else:
            hidden, labels = inputs
            self.stage.set_input_tensor(hidden)
            out = self.stage(labels=labels)
        if self.is_last:
            return out.float().mean()
        return out.contiguous(), labels


class PlanPipelineModule(PipelineModule):
    """DeepSpeed's pipeline module over a plan's stages, with the plan's rank order and tied embedding."""

    def __init__(self, plan: Plan, spec: ModelSpec, build: StageBuild) -> None:
        stages = plan.pipelines[0].stages
        P, D = len(stages), len(plan.pipelines)
        specs = [LayerSpec(StageLayer, spec, s.first_layer, s.last_layer, build) for s in stages]
        # every rank creates every group, in one order: one tie group per replica (first and last stage)
        ties = [dist.new_group([d * P, d * P + P - 1]) for d in range(D)] if P > 1 and spec.tied_embeddings else []
        super().__init__(specs, topology=ProcessTopology(axes=["data", "pipe"], dims=[D, P]),
                         partition_method="uniform", loss_fn=None)
        self.layer: StageLayer = self.forward_funcs[0]
        self.tie: tuple[torch.nn.Parameter, Any] | None = None
        if ties:
            replica = dist.get_rank() // P
            params = self.layer.stage.canonical_params()
            if self.stage_id in (0, P - 1):
                self.tie = (params[TIED], ties[replica])
            if self.stage_id == P - 1:
                params[TIED].ds_pipe_replicated = True  # the first stage's copy is the one counted

    def get_tied_weights_and_groups(self) -> list[tuple[torch.nn.Parameter, Any]]:
        """DeepSpeed all-reduces (sums) each weight's gradient in its group before the data-parallel reduce."""
        return [self.tie] if self.tie is not None else []

    def allreduce_tied_weight_gradients(self) -> None:
        for weight, group in self.get_tied_weights_and_groups():
            dist.all_reduce(weight.grad, group=group)


def stage_of(module: torch.nn.Module) -> StageModule:
    """The megatron_patch stage inside the engine's module (a pipeline module, or a one-stage layer)."""
    layer = module.layer if isinstance(module, PlanPipelineModule) else module
    assert isinstance(layer, StageLayer)
    return layer.stage


__all__ = ["PlanPipelineModule", "StageBuild", "StageLayer", "TIED", "stage_of"]
