"""The simulator's public entry points: :func:`simulate` for a whole plan, :class:`StageEvaluator` for
callers (the planner) that score stages and pipelines without building plans.

:func:`simulate` is written on top of :class:`StageEvaluator`, :func:`simulator.schedule.pipeline_schedule`
and :func:`simulator.iteration.finish_iteration`; there is no other copy of the time or memory model.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from sailor_hpc.core.archive import ProfileArchive, open_archive
from sailor_hpc.core.deepspeed_plan import ZERO_STAGES, check_engine_plan, zero_stage_of
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import ModelSpec, get_model
from sailor_hpc.core.placement import place_plan
from sailor_hpc.core.plan import Plan, validate_plan
from sailor_hpc.core.site import Site
from simulator.cost import Transfer, egress, pipeline_transfers, plan_cost_per_hour, ring_transfers
from simulator.iteration import Collective, IterationEnd, expected_max_normal, finish_iteration, gradient_segments
from simulator.memory import (
    ALLOCATOR_SLACK,
    DEFAULT_BUCKET_ELEMS,
    GRAD_BYTES,
    HeadShape,
    StageMemory,
    Zero,
    in_flight,
    stage_memory,
)
from simulator.network import Endpoint, collective_latency_seconds, measured_jitter, p2p_transfer, ring_allreduce_seconds
from simulator.runtimes import ZERO_BUCKET_ELEMS, OptimizerImpl, Runtime, get_runtime, optimizer_impl, staging_bytes
from simulator.schedule import ScheduleResult, pipeline_schedule
from simulator.tables import ComputeTable, MemoryTable, ProfileTables, tables_for
from simulator.timeline import Timeline, build_programs, run_programs
from simulator.zero_collectives import PARAM_PERSISTENCE_THRESHOLD, buckets_of, layer_tensors, zero_collectives


def zero_traffic(stage: int, micro_batches: int, gathers_weights: bool) -> float:
    """All-reduces' worth of the data-parallel traffic one step of DeepSpeed moves under ZeRO ``stage``
    (a ring all-gather or reduce-scatter moves half an all-reduce's bytes). From DeepSpeed 0.19's
    ``stage_1_and_2.py`` and ``stage3.py``, and counted on the runtime's collectives (tiny-gpt, DP 2, 4
    micro-batches: ZeRO 0 one all-reduce of the gradients; 1 the same and two all-gathers of the updated
    partitions; 2 an all-reduce in every micro-batch's backward and the all-gathers; 3 a reduce-scatter in
    every backward and the weights' all-gathers):

    * ZeRO 0: the gradients' all-reduce at the accumulation boundary;
    * ZeRO 1: the same, then the step's all-gather of the updated fp32 partitions' weights;
    * ZeRO 2: every micro-batch's backward all-reduces its gradients into the owners' partitions (the
      reduction does not wait for the boundary), then the step's all-gather;
    * ZeRO 3: every backward reduce-scatters its gradients, every forward and backward all-gathers the
      partitioned weights (``gathers_weights``: the model has weights above DeepSpeed's persistence
      threshold), and the step gathers the updated ones once.

    Under ZeRO 2 and 3 (plans of one stage only) a micro-batch's reduction blocks its backward
    (``overlap_comm`` off); after the flush or inside it, the step's time is the same.
    """
    m = micro_batches
    return {0: 1.0, 1: 1.5, 2: m + 0.5, 3: 0.5 * m + (m if gathers_weights else 0.0) + 0.5}[stage]


@dataclass(frozen=True)
class SimOptions:
    """The runtime being modelled (:mod:`simulator.runtimes`) and the simulator's knobs.

    ``runtime`` names who runs the plan: ``"deepspeed-pipe"`` (the default here, and what Sailor's
    measured runs used: ``validate-sim``) or ``"megatron_patch"`` (this project's runtime: the planner and
    ``sailor-hpc plan/simulate``). ``overlap_grad_sync``, ``extra_reduce_buffer`` and ``optimizer_impl``
    follow the runtime unless given (tests take one part of a runtime away to measure it).
    """

    runtime: str = "deepspeed-pipe"
    bucket_elems: int = DEFAULT_BUCKET_ELEMS  # gradient all-reduce bucket (elements)
    allocator_slack: float = ALLOCATOR_SLACK  # see simulator.memory
    # Charge the profiler's chain timing per layer boundary (simulator.tables). Off by default: on CPU
    # (benchmarks/simulator_vs_runtime.py) it moves predictions away from the measured runtime, and it
    # has not been checked on a GPU yet, where it is meant to capture launch overlap.
    chain_timing: bool = False
    # megatron_patch's gradient sync: size-capped buckets started during the last micro-batch's backward
    # (simulator.iteration), the buckets being the fp32 main grads themselves (no extra flattened buffer)
    overlap_grad_sync: bool | None = None  # None: the runtime's
    overlap_bucket_bytes: float = 40 * 2**20  # the runtime's --grad-bucket-mb default
    extra_reduce_buffer: bool | None = None  # DeepSpeed flattens each bucket into a buffer of its own
    # "nccl" on GPUs, "gloo" where the runtime runs without CUDA (simulator.runtimes)
    backend: str = "nccl"
    staging_bytes: float | None = None  # a stage-to-stage message up to this size is sent asynchronously; None: the backend's
    # the Adam implementation that steps (simulator.runtimes.OPTIMIZER_IMPLS): what the optimizer step allocates;
    # None: the runtime's on the backend's device (megatron_patch: "fused" on CUDA, "foreach" on the CPU)
    optimizer_impl: str | None = None
    # the deepspeed runtime's ZeRO stage (simulator.memory.Zero), partitioned over the plan's replicas
    # (simulate sets zero_dp to the plan's pipeline count; the planner per candidate)
    zero_stage: int = 0
    zero_dp: int = 1
    # the deepspeed runtime: the plan has several stages, so DeepSpeed's PipelineEngine runs it (else its plain
    # engine); which engine's profiled costs and ZeRO buffers apply (simulate sets it from the plan)
    pipelined: bool = False

    def __post_init__(self) -> None:
        rt = get_runtime(self.runtime)
        if self.zero_stage and self.runtime != "deepspeed":
            raise SailorError(f"ZeRO stage {self.zero_stage} is a setting of the deepspeed runtime, not of {self.runtime}",
                              field="zero_stage", fix="use --runtime deepspeed, or ZeRO stage 0")
        if self.zero_stage not in ZERO_STAGES:
            raise SailorError(f"ZeRO stage {self.zero_stage!r} is not one of {list(ZERO_STAGES)}", field="zero_stage")
        backend_staging = staging_bytes(self.backend)  # also rejects an unknown backend
        if self.staging_bytes is None:
            object.__setattr__(self, "staging_bytes", backend_staging)
        if self.overlap_grad_sync is None:
            object.__setattr__(self, "overlap_grad_sync", rt.overlap_grad_sync)
        if self.extra_reduce_buffer is None:
            object.__setattr__(self, "extra_reduce_buffer", rt.extra_reduce_buffer)
        impl = rt.optimizer_impl(self.backend) if self.optimizer_impl is None else optimizer_impl(self.optimizer_impl)
        object.__setattr__(self, "optimizer_impl", impl.name)  # an unknown name was rejected above

    @classmethod
    def megatron_patch(cls, **changes: Any) -> SimOptions:
        """The runtime this project trains with."""
        return cls(runtime="megatron_patch", **changes)

    @classmethod
    def deepspeed_pipe(cls, **changes: Any) -> SimOptions:
        """DeepSpeed's pipeline engine, the runtime of Sailor's measured runs."""
        return cls(runtime="deepspeed-pipe", **changes)

    @property
    def runtime_model(self) -> Runtime:
        return get_runtime(self.runtime)

    @property
    def reduce_buffer_elems(self) -> int:
        return self.bucket_elems if self.extra_reduce_buffer else 0

    @property
    def zero(self) -> Zero:
        """The ZeRO partitioning the memory model charges (stage 0: none)."""
        return Zero(self.zero_stage, self.zero_dp, ZERO_BUCKET_ELEMS if self.zero_stage else 0, self.pipelined)

    @property
    def optimizer_model(self) -> OptimizerImpl:
        assert self.optimizer_impl is not None  # set from the runtime when the options are made
        return optimizer_impl(self.optimizer_impl)


@dataclass(frozen=True)
class StageCost:
    """One stage's numbers per micro-batch, on one GPU of its TP group."""

    gpu: str
    tp: int
    mbs: int
    first: int
    last: int
    fwd_s: float
    bwd_s: float  # includes the forward recomputation when the plan recomputes
    update_s: float  # optimizer step of the stage
    out_bytes: float  # activation sent to the next stage per micro-batch (and its gradient back)
    in_bytes: float  # activation received from the previous stage per micro-batch (0 for layer 0)
    params: float  # parameters per TP rank
    grad_bytes: float  # gradient bytes per GPU (what its all-reduce moves)
    # the deepspeed runtime: what its engine adds (simulator.engine_costs), already in bwd_s and update_s;
    # None: the profile point has no engine costs (nothing charged)
    engine_s: tuple[float, float] | None = None  # (per step, per micro-batch)


class StageEvaluator:
    """O(1) per-stage numbers from the archive's prefix sums, for one model, dtype and optimizer.

    The planner's fast path: ``stage(...)`` costs a dictionary lookup after the first call with the
    same key; :meth:`pipeline_times` scores a batch of equal-length pipelines in one numpy pass.
    """

    def __init__(self, archive: ProfileArchive, site: Site, model: str | ModelSpec, *, dtype: str = "fp32",
                 optimizer: str = "adam", recompute: bool = False, options: SimOptions | None = None) -> None:
        self.model = model if isinstance(model, ModelSpec) else get_model(model)
        self.site = site
        self.archive = archive
        self.tables: ProfileTables = tables_for(archive, self.model)
        self.dtype, self.optimizer, self.recompute = dtype, optimizer, recompute
        self.options = options or SimOptions()
        self._stages: dict[tuple[str, int, int, int, int], StageCost] = {}
        self._memory: dict[tuple, StageMemory] = {}
        self._p2p: dict[tuple, tuple[float, float]] = {}  # (seconds, bytes of one rank's message)
        self._heads: dict[int, HeadShape] = {}
        self._schedules: dict[tuple, ScheduleResult] = {}  # one pipeline's schedule: its per-stage numbers -> result
        self._rings: dict[tuple, float] = {}
        self._jitters: dict[tuple, float] = {}

    # ------------------------------------------------------------------ stages
    def compute_table(self, gpu: str, mbs: int, tp: int) -> ComputeTable:
        return self.tables.compute(self._gpu(gpu), mbs, tp, self.dtype, self.options.chain_timing)

    def memory_table(self, tp: int) -> MemoryTable:
        return self.tables.memory(tp)

    def _gpu(self, gpu: str) -> str:
        return self.site.gpu(gpu).name

    def stage(self, gpu: str, tp: int, mbs: int, first: int, last: int) -> StageCost:
        key = (gpu, tp, mbs, first, last)
        cost = self._stages.get(key)
        if cost is None:
            cost = self._stages[key] = self._stage(gpu, tp, mbs, first, last)
        return cost

    def _stage(self, gpu: str, tp: int, mbs: int, first: int, last: int) -> StageCost:
        L = self.model.num_pipeline_layers
        if not 0 <= first <= last < L:
            raise SailorError(f"layers {first}..{last} are outside {self.model.name}'s 0..{L - 1}", field="layers",
                              fix=f"use layers within 0..{L - 1}")
        table = self.compute_table(gpu, mbs, tp)
        mem = self.memory_table(tp)
        fwd, bwd = table.fwd(first, last), table.bwd(first, last)
        if self.recompute:
            bwd += fwd
        out = self.tables.boundary_bytes(last, mbs, tp, self.dtype) if last < L - 1 else 0.0
        inp = self.tables.boundary_bytes(first - 1, mbs, tp, self.dtype) if first > 0 else 0.0
        params = mem.params(first, last)
        update = self.tables.update_seconds(table, first, last, self.optimizer)
        if self.options.zero_stage:  # each replica steps its 1/D partition
            update /= self.options.zero_dp
        engine = self._engine_costs(table.gpu, tp, mbs, first, last)
        if engine is not None:
            update += engine[0]
            bwd += engine[1]
        return StageCost(gpu=table.gpu, tp=tp, mbs=mbs, first=first, last=last, fwd_s=fwd, bwd_s=bwd,
                         update_s=update, out_bytes=out, in_bytes=inp,
                         params=params, grad_bytes=params * GRAD_BYTES[self.dtype], engine_s=engine)

    def _engine_costs(self, gpu: str, tp: int, mbs: int, first: int, last: int) -> tuple[float, float] | None:
        """(per step, per micro-batch) seconds DeepSpeed's engine adds to the stage (the deepspeed runtime, from
        the profile: :mod:`simulator.engine_costs`); None for other runtimes and for points without them."""
        if self.options.runtime != "deepspeed":
            return None
        costs = self.tables.engine_costs(gpu, mbs, tp, self.dtype)
        if costs is None:
            return None
        blocks = max(0, min(last, self.model.num_layers) - max(first, 1) + 1)  # layers 1..T are the blocks
        return costs.stage("pipe" if self.options.pipelined else "engine", self.options.zero_stage, blocks)

    def stage_memory(self, cost: StageCost, *, stage: int, num_stages: int, micro_batches: int) -> StageMemory:
        """Peak memory of one GPU of the stage (see :mod:`simulator.memory`); cached per in-flight count."""
        key = (cost.gpu, cost.tp, cost.mbs, cost.first, cost.last, in_flight(stage, num_stages, micro_batches))
        hit = self._memory.get(key)
        if hit is None:
            hit = self._memory[key] = self._stage_memory(cost, stage, num_stages, micro_batches)
        return hit

    def _stage_memory(self, cost: StageCost, stage: int, num_stages: int, micro_batches: int) -> StageMemory:
        return self._memory_of(cost.tp, cost.first, cost.last, stage=stage, num_stages=num_stages, mbs=cost.mbs,
                               micro_batches=micro_batches, input_bytes=cost.in_bytes,
                               overhead=self.archive.overhead_bytes(cost.gpu, cost.tp),
                               freed_output_bytes=self.freed_output(cost.out_bytes, cost.tp))

    def first_stage_totals(self, gpu: str, tp: int, mbs: int, in_flight_counts: Sequence[int]) -> np.ndarray:
        """(K, L, L) table: ``[c, i, j]`` is :meth:`stage_memory`'s ``total`` of layers ``i..j`` at TP ``tp``
        holding ``in_flight_counts[c]`` micro-batches (stage 0 of that many, as the planner's fit checks
        ask), ``inf`` below the diagonal. One array pass of the same formulas instead of one call per layer
        range and count: the planner bisects over ``j`` for every ``i`` and count (tests/simulator checks
        it float for float against the per-stage path)."""
        L = self.model.num_pipeline_layers
        first, last = np.triu_indices(L)
        gpu = self.compute_table(gpu, mbs, tp).gpu  # the name a StageCost carries (the overhead's key)
        out = np.where(last < L - 1, self.tables.boundary_bytes(np.minimum(last, L - 2), mbs, tp, self.dtype), 0.0)
        inp = np.where(first > 0, self.tables.boundary_bytes(np.maximum(first - 1, 0), mbs, tp, self.dtype), 0.0)
        counts = np.asarray(in_flight_counts, dtype=np.int64)[:, None]  # broadcast against the layer ranges
        mem = self._memory_of(tp, first, last, stage=0, num_stages=counts, mbs=mbs, micro_batches=counts,
                              input_bytes=inp, overhead=self.archive.overhead_bytes(gpu, tp),
                              freed_output_bytes=self.freed_output(out, tp))
        totals = np.full((counts.size, L, L), np.inf)
        totals[:, first, last] = np.broadcast_to(mem.total, (counts.size, first.size))
        return totals

    def _memory_of(self, tp: int, first, last, **stage: Any) -> StageMemory:
        """:func:`simulator.memory.stage_memory` with this evaluator's model, dtype, optimizer and runtime."""
        rt = self.options.runtime_model
        return stage_memory(self.memory_table(tp), first, last, dtype=self.dtype, optimizer=self.optimizer,
                            recompute=self.recompute, bucket_elems=self.options.reduce_buffer_elems,
                            allocator_slack=self.options.allocator_slack, optimizer_impl=self.options.optimizer_model,
                            head=self.head_shape(tp) if rt.ties_within_stage else replace(self.head_shape(tp), tied_params=0.0),
                            per_layer_working=rt.per_layer_working, zero=self.options.zero,
                            reduce_at_peak=rt.reduce_at_peak, **stage)

    def head_shape(self, tp: int) -> HeadShape:
        """The model's head at TP ``tp`` (:class:`simulator.memory.HeadShape`), from the spec and the profile.

        The tied embedding the profile counts twice is what its head layer holds beyond the final norm
        (LayerNorm weight and bias, RMSNorm weight; replicated on every TP rank): Sailor's GPT-Neo profile
        leaves the embedding off its head, so nothing is counted twice there. The padded vocabulary is the
        stage's TP degree's (a plan mixing TP degrees pads to all of them)."""
        hit = self._heads.get(tp)
        if hit is None:
            spec, mem = self.model, self.memory_table(tp)
            L = spec.num_pipeline_layers
            tied = 0.0
            if spec.tied_embeddings and spec.tail_layers == 1:
                norm = spec.hidden_size * (1 if spec.family == "llama" else 2)
                tied = float(np.clip(mem.params(L - 1, L - 1) - norm, 0.0, mem.params(0, 0)))
            vocab = spec.padded_vocab_size((tp,))
            hit = self._heads[tp] = HeadShape(tied_params=tied, logits_per_sample=spec.seq_len * vocab / tp,
                                              padded_vocab=vocab != spec.vocab_size)
        return hit

    def freed_output(self, out_bytes, tp: int):
        """Bytes of a stage's sent output the runtime frees per micro-batch (ints or arrays; see simulator.memory)."""
        return out_bytes * (1.0 - 1.0 / tp) if self.options.runtime_model.partitioned_p2p else out_bytes

    def capacity(self, gpu: str) -> int:
        return self.site.gpu(gpu).memory_bytes

    # ------------------------------------------------------------------ network
    def p2p(self, a: Endpoint, b: Endpoint, nbytes: float) -> float:
        """Seconds to move an activation of ``nbytes`` (or its gradient) from stage a to stage b, as the
        runtime sends it (cached per link kind, TP degrees and size)."""
        return self._transfer(a, b, nbytes)[0]

    def _transfer(self, a: Endpoint, b: Endpoint, nbytes: float) -> tuple[float, float]:
        key = (a.same_node(b), a.partition, b.partition, a.tp, b.tp, nbytes)
        hit = self._p2p.get(key)
        if hit is None:
            hit = self._p2p[key] = p2p_transfer(self.site, a, b, nbytes,
                                                partitioned=self.options.runtime_model.partitioned_p2p)
        return hit

    def replica_jitter(self, holders: Sequence[Endpoint]) -> float:
        """The largest step-time variation among the partitions the holders run on, or measured on the links
        between them (:func:`profiler.netbench.replica_jitter`), whichever is larger."""
        key = tuple(holders)
        if key not in self._jitters:
            names = {p.name for p in self.site.partitions}
            given = max((self.site.partition(h.partition).replica_jitter for h in holders if h.partition in names),
                        default=0.0)
            self._jitters[key] = max(given, measured_jitter(self.site, holders))
        return self._jitters[key]

    def allreduce(self, holders: Sequence[Endpoint], per_gpu_bytes: Sequence[float], elem_bytes: float) -> float:
        """Seconds of one ring all-reduce (cached: the planner's plans repeat each other's rings)."""
        key = (tuple(holders), tuple(per_gpu_bytes), elem_bytes)
        hit = self._rings.get(key)
        if hit is None:
            buckets = [self.options.bucket_elems * elem_bytes] * len(holders)
            hit = self._rings[key] = ring_allreduce_seconds(self.site, holders, per_gpu_bytes, buckets)
        return hit

    # ------------------------------------------------------------------ pipelines
    def exchanges(self, costs: Sequence[StageCost], ends: Sequence[Endpoint]) -> Exchanges:
        """Activation and gradient seconds of each boundary of one pipeline, and whether it is asynchronous
        (every rank's message in both directions fits the staging buffer, :mod:`simulator.runtimes`)."""
        act, grad, asy = [], [], []
        for j in range(len(costs) - 1):
            a, g, asynchronous = self._boundary(ends[j], ends[j + 1], costs[j].out_bytes)
            act.append(a)
            grad.append(g)
            asy.append(asynchronous)
        return Exchanges(act, grad, asy)

    def _boundary(self, a: Endpoint, b: Endpoint, nbytes: float) -> tuple[float, float, bool]:
        """One boundary from ``a`` to ``b``: activation seconds, gradient seconds, and whether it is
        asynchronous (every rank's message both ways fits the staging buffer)."""
        act, act_msg = self._transfer(a, b, nbytes)
        grad, grad_msg = self._transfer(b, a, nbytes)
        limit = self.options.staging_bytes
        assert limit is not None  # set from the backend when the options are made
        return act, grad, max(act_msg, grad_msg) <= limit

    def pipeline(self, costs: Sequence[StageCost], ends: Sequence[Endpoint], micro_batches: int) -> ScheduleResult:
        """Finish time of every stage of one pipeline."""
        x = self.exchanges(costs, ends)
        return self.pipeline_times([c.fwd_s for c in costs], [c.bwd_s for c in costs], x.act, x.grad, micro_batches,
                                   x.asynchronous)

    def pipeline_times(self, F: np.ndarray | Sequence[float], B: np.ndarray | Sequence[float],
                       act: np.ndarray | Sequence[float], grad: np.ndarray | Sequence[float], m: np.ndarray | int,
                       asynchronous: np.ndarray | Sequence[bool] | None = None) -> ScheduleResult:
        """Batch form for the planner: (N, P) stage times, (N, P-1) transfers and asynchronous flags,
        (N,) micro-batches; scheduled in the runtime's exchange order."""
        return pipeline_schedule(F, B, act, grad, m, asynchronous, self.options.runtime_model.serial_exchange)

    # ------------------------------------------------------------------ whole iterations
    def collectives(self, costs: Sequence[Sequence[StageCost]], ends: Sequence[Sequence[Endpoint]],
                    micro_batches: Sequence[int] = ()) -> list[Collective]:
        """Tied-embedding all-reduces, then one gradient all-reduce per segment (see :mod:`simulator.iteration`);
        with ``overlap_grad_sync``, per bucket of each segment, last layers first, then the tied ones. Under
        DeepSpeed's ZeRO a segment moves :func:`zero_traffic` all-reduces' worth (``micro_batches``: each
        pipeline's count; ZeRO 2 and 3 reduce in every micro-batch)."""
        tied: list[Collective] = []
        grads: list[Collective] = []
        L = self.model.num_pipeline_layers
        elem = GRAD_BYTES[self.dtype]
        overlap = self.options.overlap_grad_sync
        if self.model.tied_embeddings:
            for i, c in enumerate(costs):
                if len(c) < 2:
                    continue
                first, last = c[0], c[-1]
                nbytes = self.memory_table(last.tp).params(L - 1, L - 1) * elem  # what the last stage holds
                secs = self.allreduce([ends[i][0], ends[i][-1]], [nbytes * last.tp / first.tp, nbytes], elem)
                # the head's gradient comes first in the last stage's backward, the embedding's last in the first's
                lead: tuple[float, ...] = (0.0, self._backward_below(last, L - 1)) if overlap else ()
                tied.append(Collective("tied", ((i, 0), (i, len(c) - 1)), secs, 0, L - 1, lead=lead))
        if len(costs) > 1:
            for lo, hi, holders in gradient_segments([[(x.first, x.last) for x in c] for c in costs]):
                eps = [ends[i][s] for i, s in holders]
                skew = self.replica_jitter(eps) * expected_max_normal(len(holders))
                for blo, bhi in self._buckets(lo, hi, [costs[i][s].tp for i, s in holders]) if overlap else [(lo, hi)]:
                    per_gpu = [self.memory_table(costs[i][s].tp).params(blo, bhi) * elem for i, s in holders]
                    lead = tuple(self._backward_below(costs[i][s], blo) for i, s in holders) if overlap else ()
                    secs = self._segment_seconds(eps, per_gpu, elem, holders, micro_batches, blo, bhi)
                    grads.append(Collective("grads", holders, secs, blo, bhi, skew=skew, lead=lead))
        if overlap:  # one global order, as the runtime launches its buckets: backward order, last layers first
            return sorted(grads, key=lambda c: -c.last_layer) + tied
        return tied + grads

    def _segment_seconds(self, eps: Sequence[Endpoint], per_gpu: Sequence[float], elem: float,
                         holders: Sequence[tuple[int, int]], micro_batches: Sequence[int], lo: int, hi: int) -> float:
        """One gradient segment's collectives in a step: its all-reduce; under the deepspeed runtime its ZeRO
        traffic in bytes, and the link's latency once per collective DeepSpeed issues
        (:mod:`simulator.zero_collectives`), as a collective issued alone after computing costs: DeepSpeed
        issues them one at a time between its layers and its optimizer's work, never as a stream."""
        ring = self.allreduce(eps, per_gpu, elem)
        if self.options.runtime != "deepspeed":
            return ring
        streamed, _ = collective_latency_seconds(self.site, eps)
        alpha, gather = collective_latency_seconds(self.site, eps, issued=True)
        buckets = buckets_of(max(per_gpu), self.options.bucket_elems * elem)
        m = max((micro_batches[i] for i, _ in holders), default=1) if micro_batches else 1
        reduces, gathers = zero_collectives(self.options.zero_stage, m, buckets, layer_tensors(self.model, lo, hi))
        # the ring's bytes (its time less the one streamed latency per bucket its fit holds) as often as ZeRO
        # moves them, then each collective's latency as issued
        return ((ring - streamed * buckets) * self._zero_traffic(holders, micro_batches)
                + alpha * reduces + gather * gathers)

    def _zero_traffic(self, holders: Sequence[tuple[int, int]], micro_batches: Sequence[int]) -> float:
        """:func:`zero_traffic` of the deepspeed runtime's ZeRO stage for a segment held by ``holders``
        (DeepSpeed runs one micro-batch count for every replica: the largest is taken); 1 without ZeRO."""
        zero = self.options.zero_stage
        if not zero:
            return 1.0
        m = max((micro_batches[i] for i, _ in holders), default=1) if micro_batches else 1
        return zero_traffic(zero, m, self.model.hidden_size ** 2 >= PARAM_PERSISTENCE_THRESHOLD)

    def _backward_below(self, cost: StageCost, layer: int) -> float:
        """Seconds of the stage's last backward still to run once ``layer``'s gradients are complete."""
        if layer <= cost.first:
            return 0.0
        return self.stage(cost.gpu, cost.tp, cost.mbs, cost.first, layer - 1).bwd_s

    def _buckets(self, lo: int, hi: int, tps: Sequence[int]) -> list[tuple[int, int]]:
        """Layer runs of ``lo..hi``, from the last layer down, whose gradients fill one bucket of
        ``overlap_bucket_bytes`` on the holder with the most bytes per GPU (a larger layer is a bucket alone)."""
        cap, elem = self.options.overlap_bucket_bytes, GRAD_BYTES[self.dtype]
        tables = [self.memory_table(tp) for tp in set(tps)]
        out: list[tuple[int, int]] = []
        top, size = hi, 0.0
        for layer in range(hi, lo - 1, -1):
            nbytes = max(t.params(layer, layer) for t in tables) * elem
            if size and size + nbytes > cap:
                out.append((layer + 1, top))
                top, size = layer, 0.0
            size += nbytes
        out.append((lo, top))
        return out

    def iteration(self, costs: Sequence[Sequence[StageCost]], ends: Sequence[Sequence[Endpoint]],
                  micro_batches: Sequence[int]) -> IterationTiming:
        """One iteration of several pipelines given their stages: schedules, collectives, optimizer steps.

        What :func:`simulate` computes for a plan, for callers that hold per-stage numbers instead.
        """
        scheds, transfers = [], []
        same = self._schedules  # plans repeat pipelines (and the planner's plans each other's): schedule each once
        for c, e, m in zip(costs, ends, micro_batches):
            x = self.exchanges(c, e)
            transfers.append((x.act, x.grad))
            F, B = [s.fwd_s for s in c], [s.bwd_s for s in c]
            key = (tuple(F), tuple(B), tuple(x.act), tuple(x.grad), tuple(x.asynchronous), m)
            if key not in same:
                same[key] = self.pipeline_times(F, B, x.act, x.grad, m, x.asynchronous)
            scheds.append(same[key])
        colls = self.collectives(costs, ends, micro_batches)
        flush = {(i, s): float(sch.finish[0, s]) for i, sch in enumerate(scheds) for s in range(sch.finish.shape[1])}
        update = {(i, s): x.update_s for i, c in enumerate(costs) for s, x in enumerate(c)}
        return IterationTiming(scheds, transfers, colls, finish_iteration(flush, colls, update))

    # ------------------------------------------------------------------ batches (vectorised)
    def score_batch(self, batch: CandidateBatch) -> BatchScores:
        """Time and memory of N single pipelines at once, straight from the prefix sums.

        The same formulas as :meth:`stage`, :meth:`stage_memory` and :meth:`pipeline`, evaluated on
        (N, P) arrays: per stage kind (GPU type, TP, partition) one fancy-indexing pass over the
        prefix sums, one cached transfer time per distinct (link, bytes), one schedule pass.
        """
        first, last = np.asarray(batch.first), np.asarray(batch.last)
        kind = np.asarray(batch.kind)
        n, P = first.shape
        m = np.broadcast_to(np.asarray(batch.micro_batches, dtype=np.int64), (n,))
        F, Bw, U, out, mem_total = (np.zeros((n, P)) for _ in range(5))
        fits = np.ones((n, P), dtype=bool)
        stage_idx = np.broadcast_to(np.arange(P), (n, P))
        mcol = np.broadcast_to(m[:, None], (n, P))
        for k in np.unique(kind):
            gpu, tp, _part = batch.stage_kinds[int(k)]
            sel = kind == k
            a, b = first[sel], last[sel]
            table = self.compute_table(gpu, batch.mbs, tp)
            f = table.fwd(a, b)
            F[sel] = f
            Bw[sel] = table.bwd(a, b) + (f if self.recompute else 0.0)
            U[sel] = self.tables.update_seconds(table, a, b, self.optimizer)
            L = self.model.num_pipeline_layers
            out[sel] = np.where(b < L - 1, self.tables.boundary_bytes(np.minimum(b, L - 2), batch.mbs, tp, self.dtype), 0.0)
            inp = np.where(a > 0, self.tables.boundary_bytes(np.maximum(a - 1, 0), batch.mbs, tp, self.dtype), 0.0)
            mem = self._memory_of(tp, a, b, stage=stage_idx[sel], num_stages=P, mbs=batch.mbs,
                                  micro_batches=mcol[sel], input_bytes=inp,
                                  overhead=self.archive.overhead_bytes(table.gpu, tp),
                                  freed_output_bytes=self.freed_output(out[sel], tp))
            mem_total[sel] = mem.total
            fits[sel] = mem.total <= self.capacity(gpu)
        act = np.zeros((n, max(P - 1, 0)))
        grad, asy = act.copy(), np.zeros(act.shape, dtype=bool)
        if P > 1:
            same = np.zeros((n, P - 1), dtype=bool) if batch.same_node is None else np.asarray(batch.same_node)
            keys = np.stack([kind[:, :-1], kind[:, 1:], same.astype(np.int64)], axis=-1).reshape(-1, 3)
            sizes = out[:, :-1].reshape(-1)
            uniq, inv = np.unique(np.column_stack([keys, sizes]), axis=0, return_inverse=True)
            vals = np.empty((len(uniq), 3))
            for u, row in enumerate(uniq):
                ka, kb, sm, nbytes = int(row[0]), int(row[1]), bool(row[2]), float(row[3])
                _, ta, pa = batch.stage_kinds[ka]
                _, tb, pb = batch.stage_kinds[kb]
                a, b = Endpoint(pa, 0, ta), Endpoint(pb, 0 if sm else 1, tb)
                vals[u] = self._boundary(a, b, nbytes)
            act, grad = (vals[inv.reshape(-1), c].reshape(n, P - 1) for c in (0, 1))
            asy = vals[inv.reshape(-1), 2].reshape(n, P - 1) > 0
        sched = self.pipeline_times(F, Bw, act, grad, m, asy)
        return BatchScores(flush=sched.finish, update=U, time_s=(sched.finish + U).max(axis=1),
                           steady_period=sched.steady_period, memory=mem_total, fits=np.asarray(fits.all(axis=1)))


@dataclass(frozen=True)
class Exchanges:
    """Per boundary j of one pipeline (stage j -> j + 1): activation and gradient seconds, asynchronous or not."""

    act: list[float]
    grad: list[float]
    asynchronous: list[bool]


@dataclass(frozen=True)
class CandidateBatch:
    """N candidate pipelines with P stages each, for :meth:`StageEvaluator.score_batch`.

    ``kind[i, s]`` indexes ``stage_kinds``, a list of (GPU type, TP, partition); ``same_node[i, j]``
    says boundary j (stage j -> j+1) stays inside one node (default: no boundary does).
    """

    mbs: int
    micro_batches: np.ndarray  # (N,) or a scalar
    first: np.ndarray  # (N, P) first layer of each stage
    last: np.ndarray  # (N, P) last layer (inclusive)
    kind: np.ndarray  # (N, P) index into stage_kinds
    stage_kinds: Sequence[tuple[str, int, str]]
    same_node: np.ndarray | None = None  # (N, P-1) bool


@dataclass(frozen=True)
class BatchScores:
    flush: np.ndarray  # (N, P) when each stage ends its last backward and exchange
    update: np.ndarray  # (N, P) optimizer step per stage
    time_s: np.ndarray  # (N,) pipeline time without data-parallel sync: max over stages of flush + update
    steady_period: np.ndarray  # (N,) seconds per micro-batch in the steady state
    memory: np.ndarray  # (N, P) peak device memory per GPU of each stage (StageMemory.total)
    fits: np.ndarray  # (N,) every stage within its GPU's memory


@dataclass(frozen=True)
class IterationTiming:
    schedules: list[ScheduleResult]  # per pipeline
    transfers: list[tuple[list[float], list[float]]]  # per pipeline: activation, gradient seconds per boundary
    collectives: list[Collective]
    end: IterationEnd

    @property
    def time_s(self) -> float:
        return self.end.time_s


# ---------------------------------------------------------------------- whole plans

@dataclass(frozen=True)
class StageReport:
    pipeline: int
    stage: int
    first_layer: int
    last_layer: int
    gpu_type: str
    partition: str
    tp: int
    fwd_s: float
    bwd_s: float
    update_s: float
    act_send_s: float  # to the next stage, per micro-batch
    grad_send_s: float  # back to the previous stage, per micro-batch
    flush_s: float  # when the stage ended its last backward (and exchange)
    end_s: float  # when it ended its optimizer step
    memory: StageMemory
    capacity_bytes: int
    engine_s: tuple[float, float] | None = None  # DeepSpeed's engine: (per step, per micro-batch), in update/bwd

    @property
    def fits(self) -> bool:
        return bool(self.memory.total <= self.capacity_bytes)  # a plain bool, also from numpy numbers

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("pipeline", "stage", "first_layer", "last_layer", "gpu_type", "partition",
                                           "tp", "fwd_s", "bwd_s", "update_s", "act_send_s", "grad_send_s",
                                           "flush_s", "end_s", "capacity_bytes", "fits")}
        d["memory_bytes"] = self.memory.total  # peak device memory in use: what decides out-of-memory
        d["peak_allocated_bytes"] = float(self.memory.peak_allocated)
        d["memory"] = self.memory.to_dict()
        if self.engine_s is not None:
            d["deepspeed_engine_s"] = {"per_step": self.engine_s[0], "per_micro_batch": self.engine_s[1]}
        return d


@dataclass(frozen=True)
class SimResult:
    """What one training iteration of a plan costs."""

    plan: Plan
    iteration_time_s: float
    throughput_samples_per_s: float
    tokens_per_s: float
    peak_memory_bytes: float  # max over GPUs of the peak device memory in use (StageMemory.peak_device)
    peak_allocated_bytes: float  # max over GPUs of what torch's allocator hands out (StageMemory.peak_allocated)
    stages: tuple[StageReport, ...]
    fits: bool
    cost_per_hour: float
    cost_per_iteration: float
    cost_unit: str
    breakdown: dict[str, Any] = field(default_factory=dict)
    collectives: tuple[Collective, ...] = ()
    collective_starts: tuple[float, ...] = ()
    egress_bytes: float = 0.0  # sent from one cluster to another per iteration
    egress_cost: float = 0.0  # their price per iteration (included in cost_per_iteration)

    @property
    def stage_memory(self) -> list[float]:
        return [s.memory.total for s in self.stages]

    def memory_by_gpu_type(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for s in self.stages:
            d = out.setdefault(s.gpu_type, {"peak_bytes": 0.0, "capacity_bytes": float(s.capacity_bytes)})
            d["peak_bytes"] = max(d["peak_bytes"], s.memory.total)
        return out

    def to_dict(self) -> dict[str, Any]:
        oom = [f"pipeline {s.pipeline} stage {s.stage}" for s in self.stages if not s.fits]
        return {
            "model": self.plan.model, "global_batch_size": self.plan.global_batch_size,
            "iteration_time_s": self.iteration_time_s, "throughput_samples_per_s": self.throughput_samples_per_s,
            "tokens_per_s": self.tokens_per_s, "peak_memory_bytes": self.peak_memory_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes, "fits": self.fits,
            "out_of_memory": oom, "cost_per_iteration": self.cost_per_iteration, "cost_per_hour": self.cost_per_hour,
            "cost_unit": self.cost_unit, "egress_bytes_per_iteration": self.egress_bytes,
            "egress_cost_per_iteration": self.egress_cost, "memory_by_gpu_type": self.memory_by_gpu_type(),
            "stages": [s.to_dict() for s in self.stages], "breakdown": self.breakdown,
        }


def prepare_plan(plan: Plan, site: Site) -> Plan:
    """Validate the plan and place it on the site when it carries no placement."""
    validate_plan(plan, site, check_placement=False)
    if any(s.placement is None or s.partition is None for p in plan.pipelines for s in p.stages):
        plan = place_plan(plan, site)
    validate_plan(plan, site, check_placement=True)
    model = plan.model_spec
    if plan.seq_len is not None and plan.seq_len != model.seq_len:
        raise SailorError(f"profiles of {model.name} are taken at sequence length {model.seq_len}, the plan asks for "
                          f"{plan.seq_len}", field="seq_len", fix="drop seq_len, or profile at that length")
    return plan


@dataclass
class _Assembled:
    """A placed plan's per-stage numbers, shared by :func:`simulate` and :func:`plan_timeline`."""

    plan: Plan
    ev: StageEvaluator
    costs: list[list[StageCost]]
    ends: list[list[Endpoint]]

    @property
    def micro_batches(self) -> list[int]:
        return [p.num_micro_batches for p in self.plan.pipelines]


def _assemble(plan: Plan, site: Site, archive: ProfileArchive | None, options: SimOptions | None) -> _Assembled:
    plan = prepare_plan(plan, site)
    if options is not None and options.runtime == "deepspeed":  # what DeepSpeed's engine cannot run is refused
        check_engine_plan(plan)
        options = replace(options, zero_stage=zero_stage_of(plan), zero_dp=len(plan.pipelines),
                          pipelined=len(plan.pipelines[0].stages) > 1)
    archive = archive if archive is not None else open_archive(site=site)
    ev = StageEvaluator(archive, site, plan.model, dtype=plan.dtype, optimizer=plan.optimizer,
                        recompute=plan.recompute, options=options)
    costs = [[ev.stage(s.gpu_type, s.tp, pipe.micro_batch_size, s.first_layer, s.last_layer) for s in pipe.stages]
             for pipe in plan.pipelines]
    ends = [[Endpoint.of(s) for s in pipe.stages] for pipe in plan.pipelines]
    return _Assembled(plan, ev, costs, ends)


def simulate(plan: Plan, site: Site, archive: ProfileArchive | None = None, *,
             options: SimOptions | None = None) -> SimResult:
    """Iteration time, throughput, peak memory per GPU and cost of ``plan`` on ``site``.

    ``archive``: profiles (default: the site's archive, then the embedded Sailor profiles). Raises
    :class:`SailorError` for plans that cannot be evaluated (layers missing, unknown GPU type, a
    profile point the archive lacks); a plan that runs out of memory is evaluated and reported with
    ``fits = False`` and the stages that overflow.
    """
    a = _assemble(plan, site, archive, options)
    timing = a.ev.iteration(a.costs, a.ends, a.micro_batches)
    return _result(a.plan, site, a.ev, a.costs, timing)


def plan_timeline(plan: Plan, site: Site, archive: ProfileArchive | None = None, *,
                  options: SimOptions | None = None) -> Timeline:
    """The per-rank events of one iteration, from the event-driven engine of :mod:`simulator.timeline`
    (same stage costs as :func:`simulate`, scheduled independently)."""
    a = _assemble(plan, site, archive, options)
    xs = [a.ev.exchanges(c, e) for c, e in zip(a.costs, a.ends)]
    update = {(i, s): x.update_s for i, c in enumerate(a.costs) for s, x in enumerate(c)}
    progs = build_programs([[x.fwd_s for x in c] for c in a.costs], [[x.bwd_s for x in c] for c in a.costs],
                           [x.act for x in xs], [x.grad for x in xs], a.micro_batches,
                           a.ev.collectives(a.costs, a.ends, a.micro_batches), update, [x.asynchronous for x in xs],
                           a.ev.options.runtime_model.serial_exchange)
    gpu_types = {(i, s): stage.gpu_type for i, pipe in enumerate(a.plan.pipelines) for s, stage in enumerate(pipe.stages)}
    return Timeline(tuple(run_programs(progs)), gpu_types)


def _result(plan: Plan, site: Site, ev: StageEvaluator, costs, timing: IterationTiming) -> SimResult:
    scheds, transfers, collectives, end = timing.schedules, timing.transfers, timing.collectives, timing.end
    reports = []
    for i, (pipe, c) in enumerate(zip(plan.pipelines, costs)):
        act, grad = transfers[i]
        P = len(c)
        for s, (stage, x) in enumerate(zip(pipe.stages, c)):
            mem = ev.stage_memory(x, stage=s, num_stages=P, micro_batches=pipe.num_micro_batches)
            reports.append(StageReport(
                pipeline=i, stage=s, first_layer=x.first, last_layer=x.last, gpu_type=x.gpu,
                partition=stage.partition or "", tp=x.tp, fwd_s=x.fwd_s, bwd_s=x.bwd_s, update_s=x.update_s,
                act_send_s=act[s] if s < P - 1 else 0.0, grad_send_s=grad[s - 1] if s > 0 else 0.0,
                flush_s=float(scheds[i].finish[0, s]), end_s=end.stage_end[(i, s)], memory=mem,
                capacity_bytes=ev.capacity(x.gpu), engine_s=x.engine_s))
    T = end.time_s
    per_hour = plan_cost_per_hour(plan, site)
    seq = plan.sequence_length
    pipes = []
    for i, (pipe, sched) in enumerate(zip(plan.pipelines, scheds)):
        busy = sum(x.fwd_s + x.bwd_s for x in costs[i]) * pipe.num_micro_batches
        pipes.append({"pipeline": i, "micro_batch_size": pipe.micro_batch_size,
                      "micro_batches": pipe.num_micro_batches, "stages": len(costs[i]),
                      "flush_s": float(sched.makespan[0]), "steady_period_s": float(sched.steady_period[0]),
                      "compute_share": busy / (len(costs[i]) * float(sched.makespan[0]))})
    breakdown = {
        "pipelines": pipes,
        "flush_s": max(p["flush_s"] for p in pipes),
        "collectives": [{"kind": c.kind, "layers": [c.first_layer, c.last_layer], "holders": [list(h) for h in c.holders],
                         "start_s": st, "seconds": c.seconds} for c, st in zip(collectives, end.collective_start)],
        "sync_s": max(end.stage_sync_end.values()) - max(p["flush_s"] for p in pipes),
        "optimizer_s": max(x.update_s for c in costs for x in c),
    }
    if ev.options.runtime == "deepspeed":
        breakdown["deepspeed_engine"] = _engine_breakdown(costs)
    crossing, egress_cost = egress(site, _transfers(plan, ev, costs, collectives))
    return SimResult(plan=plan, iteration_time_s=T, throughput_samples_per_s=plan.global_batch_size / T,
                     tokens_per_s=plan.global_batch_size * seq / T,
                     peak_memory_bytes=max(r.memory.total for r in reports),
                     peak_allocated_bytes=max(float(r.memory.peak_allocated) for r in reports), stages=tuple(reports),
                     fits=all(r.fits for r in reports), cost_per_hour=per_hour,
                     cost_per_iteration=per_hour * T / 3600.0 + egress_cost, cost_unit=site.cost_unit,
                     breakdown=breakdown, collectives=tuple(collectives), collective_starts=end.collective_start,
                     egress_bytes=crossing, egress_cost=egress_cost)


def _engine_breakdown(costs: Sequence[Sequence[StageCost]]) -> dict[str, Any]:
    """What DeepSpeed's engine adds per stage, and which GPU types' profiles lack it (charged nothing)."""
    stages = [x for c in costs for x in c]
    missing = sorted({x.gpu for x in stages if x.engine_s is None})
    charged = [x.engine_s for x in stages if x.engine_s is not None]
    out: dict[str, Any] = {"profiled": not missing,
                           "per_step_s": max((e[0] for e in charged), default=0.0),
                           "per_micro_batch_s": max((e[1] for e in charged), default=0.0)}
    if missing:
        out["not_profiled"] = (f"no DeepSpeed engine costs in the profiles of {', '.join(missing)} "
                               "(`sailor-hpc profile --runtime deepspeed` measures them): its per-step work is "
                               "not charged there")
    return out


def _transfers(plan: Plan, ev: StageEvaluator, costs: Sequence[Sequence[StageCost]],
               collectives: Sequence[Collective]) -> Iterator[Transfer]:
    """Every byte an iteration sends between nodes, by partition pair (what egress is priced on):
    activations and their gradients, then each all-reduce's ring over its holders' whole tensor."""
    yield from pipeline_transfers(plan, [[x.out_bytes for x in c] for c in costs])
    last = ev.model.num_pipeline_layers - 1
    elem = GRAD_BYTES[ev.dtype]
    for c in collectives:
        i, s = c.holders[-1]
        lo, hi = (last, last) if c.kind == "tied" else (c.first_layer, c.last_layer)
        nbytes = ev.memory_table(costs[i][s].tp).params(lo, hi) * elem * costs[i][s].tp
        yield from ring_transfers([str(plan.pipelines[j].stages[t].partition) for j, t in c.holders], nbytes)


__all__ = ["SimOptions", "StageCost", "StageEvaluator", "CandidateBatch", "BatchScores", "Exchanges", "StageReport",
           "SimResult", "simulate", "plan_timeline", "prepare_plan", "IterationTiming"]
