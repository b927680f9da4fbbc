"""DeepSpeed's own per-step work, measured beside the layer times (``sailor-hpc profile --runtime deepspeed``).

A step under DeepSpeed does more than its layers' forwards and backwards and torch's AdamW step: the
engine's wrappers around every forward, backward and step (timers, loss scaling by the accumulation
steps, the accumulation boundary), ZeRO's bookkeeping (copying each gradient into its reduce bucket,
the fp32 partitions and their copies back, ZeRO 3's gather and release hooks around every module) and
the pipeline engine's instruction interpreter. None of it is in a layer's time, and on layers that take
little time it is most of a step (tiny-gpt on a CPU: up to 3x). What DeepSpeed's communication moves is
not part of it: the simulator has the links for that.

How it is measured, per micro-batch size, on the rank a profiling job at TP 1 runs (DeepSpeed's engine has
no tensor parallelism): the same module (megatron_patch's stage of all profiled layers, as
``megatron_patch.ds_runtime`` builds it) trains a step of m micro-batches once under a DeepSpeed engine and
once under plain torch (forward, backward, torch's AdamW with DeepSpeed's settings), alternately, so that
a busy node slows both alike; the engine's cost of that step is their difference (median over
``rounds``). Two micro-batch counts separate the part paid per micro-batch from the part paid once per step,
and two model sizes (one transformer block and the profiled K) the part that grows with each block from
the rest (embedding, head, the engine's own). Engines: ``engine`` (the plain engine: plans of one stage,
ZeRO 0-3) and ``pipe`` (the ``PipelineEngine`` of one stage: plans of several, ZeRO 0-1), each built as the
runtime builds it (its config from :func:`megatron_patch.ds_runtime.engine.runtime_config`).

The result goes into every measured point's provenance (``deepspeed_engine``), read by
:mod:`simulator.engine_costs`::

    {"deepspeed": "0.19.8", "micro_batches": [1, 4], "blocks": [1, K], "rounds": R,
     "costs": {"engine/0": {"fixed_s": [rest, per_block], "micro_batch_s": [rest, per_block]}, ...}}
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from megatron_patch.groups import collection, groups_of_one
from megatron_patch.layout import param_layout
from megatron_patch.model import padded_vocab_size
from megatron_patch.options import TrainOptions
from profiler.compute import profiled_blocks
from sailor_hpc.core.deepspeed_plan import PIPELINE_ZERO_STAGES, ZERO_STAGES, with_zero_stage
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import ModelSpec
from sailor_hpc.core.plan import Pipeline, Plan, Stage

MICRO_BATCHES = (1, 4)  # the two step lengths that separate per-micro-batch from per-step costs
ENGINES = {"engine": ZERO_STAGES, "pipe": PIPELINE_ZERO_STAGES}
KEY = "deepspeed_engine"  # the provenance key


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prepare(device: torch.device) -> None:
    """DeepSpeed on this job's device, as ``megatron_patch.ds_runtime.launch`` starts it: on a CPU its CPU
    accelerator (read when DeepSpeed is first imported) and no shared-memory op to compile."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed asserts it; the job's one rank
    from megatron_patch.ds_runtime.launch import _without_shm_op
    if device.type == "cpu":
        _without_shm_op()


def _config(spec: ModelSpec, mbs: int, micro: int, zero: int, dtype: str, device: torch.device) -> dict[str, Any]:
    """The runtime's ds_config for a one-stage plan of ``spec`` (batch fields, dtype, ZeRO stage, AdamW)."""
    from megatron_patch.ds_runtime.engine import runtime_config

    L = spec.num_pipeline_layers
    plan = Plan(spec.name, mbs * micro, (Pipeline(mbs, micro, (Stage(0, L - 1, 1, "profiled"),)),), dtype=dtype)
    config = runtime_config(with_zero_stage(plan, zero), TrainOptions(), device)
    config["steps_per_print"] = 2**31 - 1  # the pipeline engine would print a line per step
    return config


class _GroupOfOne:
    """DeepSpeed's ``mpu`` over a group of this rank alone: its engine reduces and partitions over no other rank.
    A profiling job's world is one rank and needs none; several ranks measuring at once (a benchmark keeping
    every core as busy as the runs it predicts) each pass their own."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def _group(self) -> Any:
        return self.group

    def _one(self) -> int:
        return 1

    def _zero(self) -> int:
        return 0

    get_data_parallel_group = get_model_parallel_group = get_tensor_model_parallel_group = _group
    get_pipeline_model_parallel_group = _group
    get_data_parallel_world_size = get_model_parallel_world_size = get_tensor_model_parallel_world_size = _one
    get_pipeline_model_parallel_world_size = _one
    get_data_parallel_rank = get_model_parallel_rank = get_tensor_model_parallel_rank = _zero
    get_pipeline_model_parallel_rank = _zero


class _Runner:
    """One model size under one engine and ZeRO stage, and the same module under plain torch."""

    def __init__(self, kind: str, zero: int, spec: ModelSpec, mbs: int, device: torch.device, dtype: str,
                 seed: int, group: Any = None) -> None:
        import deepspeed
        from deepspeed.pipe import LayerSpec, PipelineModule
        from deepspeed.runtime.pipe.topology import ProcessTopology

        from megatron_patch.ds_runtime.pipe import StageBuild, StageLayer

        self.kind, self.device, self.mbs = kind, device, mbs
        alone = groups_of_one()
        padded = padded_vocab_size(spec, (1,))
        build = StageBuild(dtype=dtype, padded_vocab=padded, device=device, seed=seed, recompute=False,
                           pg_collection=collection(alone, alone))
        L = spec.num_pipeline_layers
        infos = {p.name: p for p in param_layout(spec, padded)}
        config = _config(spec, mbs, MICRO_BATCHES[-1], zero, dtype, device)
        opt = config["optimizer"]["params"]

        def groups(module: Any) -> list[dict[str, Any]]:
            layer = module if isinstance(module, StageLayer) else module.forward_funcs[0]
            assert isinstance(layer, StageLayer)  # a PipelineModule's one layer
            params = layer.stage.canonical_params()
            return [g for g in ({"params": [p for n, p in params.items() if infos[n].decay],
                                 "weight_decay": opt["weight_decay"]},
                                {"params": [p for n, p in params.items() if not infos[n].decay], "weight_decay": 0.0})
                    if g["params"]]

        module: torch.nn.Module = (StageLayer(spec, 0, L - 1, build) if kind == "engine" else PipelineModule(
            [LayerSpec(StageLayer, spec, 0, L - 1, build)], topology=ProcessTopology(axes=["data", "pipe"], dims=[1, 1]),
            partition_method="uniform", loss_fn=None))
        mpu = None if group is None else _GroupOfOne(group)
        self.engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=groups(module), config=config,
                                                    mpu=mpu)
        self.plain = StageLayer(spec, 0, L - 1, build)
        self.adamw = torch.optim.AdamW(groups(self.plain), lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"],
                                       foreach=opt.get("foreach"))
        g = torch.Generator().manual_seed(seed + mbs)
        shape = (mbs, spec.seq_len)
        self.tokens = torch.randint(0, spec.vocab_size, shape, generator=g).to(device)
        self.labels = torch.randint(0, spec.vocab_size, shape, generator=g).to(device)

    def ds_step(self, micro: int) -> float:
        """Seconds of one DeepSpeed step of ``micro`` micro-batches."""
        self.engine.set_train_batch_size(self.mbs * micro)
        inputs = (self.tokens, self.labels)
        _sync(self.device)
        t0 = time.perf_counter()
        if self.kind == "pipe":
            self.engine.train_batch(data_iter=iter([(inputs, self.labels)] * micro))
        else:
            for _ in range(micro):
                loss = self.engine(inputs)
                self.engine.backward(loss)
                self.engine.step()
        _sync(self.device)
        return time.perf_counter() - t0

    def plain_step(self, micro: int) -> float:
        """Seconds of the same step without DeepSpeed: forwards and backwards, then torch's AdamW."""
        inputs = (self.tokens, self.labels)
        _sync(self.device)
        t0 = time.perf_counter()
        for _ in range(micro):
            (self.plain(inputs) / micro).backward()
        self.adamw.step()
        self.adamw.zero_grad(set_to_none=True)
        _sync(self.device)
        return time.perf_counter() - t0

    def warm_up(self) -> None:
        """First steps pay for allocations and lazy state."""
        for micro in MICRO_BATCHES:
            self.ds_step(micro)
            self.plain_step(micro)

    def costs(self, rounds: int) -> tuple[float, float]:
        """(per-step, per-micro-batch) seconds the engine adds, from the medians of the paired differences."""
        diff: dict[int, list[float]] = {m: [] for m in MICRO_BATCHES}
        for r in range(rounds):
            for micro in MICRO_BATCHES:  # each goes first every other round: a drifting load hits both alike
                if r % 2 == 0:
                    ds = self.ds_step(micro)
                    plain = self.plain_step(micro)
                else:
                    plain = self.plain_step(micro)
                    ds = self.ds_step(micro)
                diff[micro].append(ds - plain)
        lo, hi = MICRO_BATCHES
        d_lo, d_hi = statistics.median(diff[lo]), statistics.median(diff[hi])
        per_micro = (d_hi - d_lo) / (hi - lo)
        return d_lo - lo * per_micro, per_micro


ENGINE_ROUNDS = 5  # paired DeepSpeed/plain steps per cost: the difference of two noisy steps needs several


class EngineMeter:
    """What one DeepSpeed engine (``kind``: ``engine`` or ``pipe``) adds under one ZeRO stage, at one transformer
    block and at the profiled ``blocks`` (the engines built once, measured as often as asked)."""

    def __init__(self, kind: str, zero: int, spec: ModelSpec, mbs: int, *, device: torch.device, dtype: str = "fp32",
                 blocks: int | None = None, seed: int = 1234, group: Any = None) -> None:
        _prepare(device)
        self.key, self.device = f"{kind}/{zero}", device
        self.sizes = sorted({1, profiled_blocks(spec, blocks)})
        self.runners = [_Runner(kind, zero, dataclasses.replace(spec, num_layers=n), mbs, device, dtype, seed, group)
                        for n in self.sizes]
        for runner in self.runners:
            runner.warm_up()

    def measure(self, rounds: int) -> dict[str, list[float]]:
        """``{"fixed_s": [rest, per block], "micro_batch_s": [rest, per block]}``."""
        fixed, per_micro = zip(*(runner.costs(rounds) for runner in self.runners), strict=True)
        return {"fixed_s": _split(self.sizes, fixed), "micro_batch_s": _split(self.sizes, per_micro)}

    def close(self) -> None:
        self.runners.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def document(costs: dict[str, dict[str, list[float]]], sizes: Sequence[int], rounds: int) -> dict[str, Any]:
    """The provenance entry (``deepspeed_engine``) of measured costs (see the module doc)."""
    import deepspeed

    return {"deepspeed": deepspeed.__version__, "micro_batches": list(MICRO_BATCHES), "blocks": list(sizes),
            "rounds": rounds, "costs": costs}


def _split(sizes: Sequence[int], values: Sequence[float]) -> list[float]:
    """[rest, per block] of a cost measured at ``sizes`` blocks (one size: all of it is the rest)."""
    if len(sizes) == 1:
        return [values[0], 0.0]
    per_block = (values[-1] - values[0]) / (sizes[-1] - sizes[0])
    return [values[0] - sizes[0] * per_block, per_block]


def engine_costs(spec: ModelSpec, mbs: int, *, device: torch.device, dtype: str = "fp32", blocks: int | None = None,
                 zero_stages: Sequence[int] = ZERO_STAGES, engines: Sequence[str] = tuple(ENGINES), rounds: int = ENGINE_ROUNDS,
                 seed: int = 1234) -> dict[str, Any]:
    """What DeepSpeed's engines add to a step of micro-batch ``mbs`` (see the module doc); a world of one rank.
    ``zero_stages`` and ``engines`` choose what is measured (default: everything each engine runs)."""
    import torch.distributed as dist
    if dist.get_world_size() != 1:
        raise SailorError(f"DeepSpeed's engine costs are measured by a job of one rank, this one has "
                          f"{dist.get_world_size()}", field="--tp", fix="profile --runtime deepspeed at TP 1")
    costs: dict[str, dict[str, list[float]]] = {}
    sizes = sorted({1, profiled_blocks(spec, blocks)})
    for kind, stages in ((k, v) for k, v in ENGINES.items() if k in engines):
        for zero in (z for z in stages if z in zero_stages):
            meter = EngineMeter(kind, zero, spec, mbs, device=device, dtype=dtype, blocks=blocks, seed=seed)
            costs[meter.key] = meter.measure(rounds)
            meter.close()
    return document(costs, sizes, rounds)


__all__ = ["ENGINE_ROUNDS", "ENGINES", "EngineMeter", "KEY", "MICRO_BATCHES", "document", "engine_costs"]
