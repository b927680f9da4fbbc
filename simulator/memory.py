"""Peak memory of one GPU of a stage: what torch's allocator hands out, and what decides out-of-memory.

Two quantities, each a sum of terms that are each what the runtime allocates:

* ``peak_allocated`` (``torch.cuda.max_memory_allocated``; on the CPU the allocator's running total that
  torch's memory profiler reports): the larger of two phases of a step,

  - the activation phase: model state + gradient-reduction buffer + retained activations + the backward's
    working set (+ the optimizer temporary, for a runtime whose step coexists with the activations);
  - the optimizer step: model state + gradient-reduction buffer + the optimizer temporary. A step runs after
    the backward freed the activations, so the two phases never add up (:mod:`simulator.runtimes`).

* ``peak_device`` (device memory in use, ``total - free``: what decides out-of-memory): the activation phase
  plus the caching allocator's slack, or the step phase if larger, plus the fixed memory outside PyTorch.
  The planner's fit check uses it (``StageMemory.total``).

Terms:

* Model state, bytes per parameter held by the GPU (its TP shard of the stage's layers; the profile counts
  a tied embedding on the embedding and on the head, and a megatron_patch stage holding both ends holds it
  once, :func:`stage_params`; for DeepSpeed the profile's sum, :mod:`simulator.runtimes`):

  =====  ====  ====  ====================================================================
  dtype  adam  sgd   what
  =====  ====  ====  ====================================================================
  fp32   16    12    weights 4 + grads 4 + Adam m, v 8 (SGD: one momentum buffer 4)
  bf16   18    14    weights 2 + fp32 main grads 4 (megatron accumulates bf16 grads in fp32)
                     + fp32 master weights 4 + states
  fp16   18    14    as bf16: megatron_patch accumulates fp16 grads in fp32 main grads too
  =====  ====  ====  ====================================================================

* Optimizer temporary, per the runtime's Adam implementation (:class:`simulator.runtimes.OptimizerImpl`):
  torch's multi-tensor (foreach) Adam materialises ``sqrt(v)`` for a parameter group at once, one fp32
  word per parameter (charged for all of the stage's: the no-decay group, biases and norms, is the
  small one and steps on its own); the fused CUDA kernel none; SGD none.
* Gradient reduction: DeepSpeed's reduction flattens the gradients into one contiguous buffer per
  bucket (up to 5e8 elements), at any data-parallel degree (its pipeline engine reduces through the
  same path with a group of one). The caching allocator cannot carve a buffer that large out of the
  freed activation blocks, so it adds to what nvidia-smi reports. Sailor's 24 bytes/parameter for
  fp32 Adam is these three terms; the data (GH200, OPT-350M and GPT-Neo-2.7B) agrees. megatron_patch's
  buckets are the fp32 main grads themselves (in the state). Stock DeepSpeed (the ``deepspeed``
  runtime) allocates that buffer only in the reduction after the last backward, when the activations
  are freed (measured on its allocations: ZeRO 0's peak is the backward's, without it), so there it is
  a term of the step phase (``step_buffer``).
* Retained activations: the profiled bytes of the stage's layers at micro-batch 1, times the
  micro-batch size, times the micro-batches in flight, ``min(P - s, m)`` for stage s of a P-stage
  1F1B pipeline running m micro-batches (Sailor used ``P - s`` even when m is smaller), scaled from
  the profile's dtype to the plan's, plus the received input of each in-flight micro-batch, minus what
  the runtime frees of the stage's output once it is sent (``freed_output_bytes``): the profile counts
  the output among a layer's activations, but nothing in the backward reads it, and both runtimes drop
  it after the send (megatron's ``deallocate_pipeline_outputs`` keeps one element; DeepSpeed's pipeline
  engine keeps the rank's 1/t partition of it). Pure data-parallel runs have no next stage and free
  nothing, which is why only pipelines showed the overestimate. With
  recomputation (each transformer block checkpointed on its own, as megatron_patch runs it) a stage
  keeps, per micro-batch in flight, its received input, every other block's input and the activations
  of its non-block layers (embedding, head), and recomputes one layer at a time.
* Backward working set: what the backward allocates above the retained activations at its peak.
  ``deepspeed-pipe`` (Sailor's calibration): one more copy of the stage's largest layer activation, next to
  all of them. ``megatron_patch`` (per layer, :func:`backward_working`): while layer l runs backward, the
  layers above it of that micro-batch have released their activations, and l adds its transient:
  a block or the embedding one copy of its activation (the gradients of its activations stand next to the
  activations they replace; an upper bound, on the CPU the measured transient is about half); the head
  only the gradient of its input and its weight gradient in the parameter dtype (before the hook adds it to
  the fp32 main grad), since the cross entropy computes the logits' gradient in the saved softmax's place,
  plus one logits-sized copy when the vocabulary is padded (the mask's ``masked_fill`` backward). On a stage
  holding both ends of a tied embedding, the head's gradient of the shared weight waits in autograd for the
  embedding's until the embedding's backward: one more weight-sized gradient below the head.
* Allocator slack: PyTorch's caching allocator keeps freed blocks of one size class that later,
  differently sized activation requests cannot use, so what it has reserved from the driver (what
  nvidia-smi shows) exceeds what is allocated by a few percent of the activation traffic; charged as
  :data:`ALLOCATOR_SLACK` of the activation terms (expandable segments would remove most of it). The
  share is estimated from measured runs by :mod:`simulator.calibration` (the median over Sailor's 22 runs
  of the share that makes each run's peak exact); ``benchmarks/simulator_accuracy.py`` prints it with
  the leave-one-out errors.
* ZeRO (the ``deepspeed`` runtime, stage ``z`` over the ``D`` data-parallel replicas of a stage; DeepSpeed's
  ``stage_1_and_2.py`` and ``stage3.py``): the optimizer's part of the state (fp32 master copy, which
  ZeRO clones even for fp32 weights, and Adam's m and v: 12 B/param; SGD 8) is divided by D from stage 1,
  the gradients (param dtype) from stage 2, the weights from stage 3. The step's fp32 gradient partition
  (4/D B/param) and the optimizer temporary on the partition belong to the step phase. Stages 1-3 reduce
  through a bucket allocated whole (``ZERO_BUCKET_ELEMS`` of gradient elements, see
  :mod:`simulator.runtimes`); stage 3 gathers the full weights of the layer it runs (the largest layer,
  in the working set).
* Fixed overhead: CUDA context, library workspaces, NCCL communicator buffers, per GPU type and TP
  degree, from the profile archive (measured by the profiler; for the imported Sailor data estimated
  in :mod:`sailor_hpc.core.sailor_compat.profiles`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import numpy as np

from simulator.runtimes import OPTIMIZER_IMPLS, OptimizerImpl
from simulator.tables import DTYPE_BYTES, MemoryTable

STATE_BYTES = {("fp32", "adam"): 16, ("fp32", "sgd"): 12, ("bf16", "adam"): 18, ("bf16", "sgd"): 14,
               ("fp16", "adam"): 18, ("fp16", "sgd"): 14}
GRAD_BYTES = {"fp32": 4, "bf16": 4, "fp16": 4}  # element size of the gradients that are all-reduced
FP32_WORD = 4  # an optimizer temporary is fp32 (master precision)
DEFAULT_BUCKET_ELEMS = 500_000_000  # DeepSpeed's allreduce_bucket_size
ALLOCATOR_SLACK = 0.078  # share of the activation terms the caching allocator holds but cannot reuse (7.82 %)
SUMMED = OPTIMIZER_IMPLS["deepspeed"]  # the calibrated model of Sailor's runs: a temporary at the activation peak


@dataclass(frozen=True)
class HeadShape:
    """What the backward's working set needs to know of a model's head beyond the profile (per TP rank).

    ``tied_params``: elements of the tied embedding the profile counts on both the embedding and the head
    (0 for untied models and for profiles that leave it off the head); ``logits_per_sample``: logits
    elements of one sample (sequence x padded vocabulary / TP); ``padded_vocab``: the head masks padding.
    """

    tied_params: float = 0.0
    logits_per_sample: float = 0.0
    padded_vocab: bool = False


@dataclass(frozen=True)
class StageMemory:
    """Peak bytes on one GPU of a stage, by component (floats, or arrays of one shape for many stages)."""

    state: float
    optimizer_temp: float
    reduce_buffer: float
    activations: float
    working: float
    allocator_slack: float
    overhead: float
    temp_coexists: bool = field(default=True)  # the optimizer temporary is alive at the activation peak
    backward_buffer: float = 0.0  # a reduction buffer alive only while a backward runs (ZeRO 2's bucket)
    step_buffer: float = 0.0  # a reduction buffer alive only after the last backward (see stage_memory, Zero)

    @property
    def activation_phase(self):
        """Allocated at the backward's peak."""
        temp = self.optimizer_temp if self.temp_coexists else 0.0
        return self.state + self.reduce_buffer + self.backward_buffer + self.activations + self.working + temp

    @property
    def step_phase(self):
        """Allocated during the gradient reduction and optimizer step (the activations are freed)."""
        return self.state + self.reduce_buffer + self.step_buffer + self.optimizer_temp

    @property
    def peak_allocated(self):
        """What torch's allocator hands out at most (``max_memory_allocated``)."""
        return np.maximum(self.activation_phase, self.step_phase)

    @property
    def peak_device(self):
        """Device memory in use at most (reserved by the caching allocator + outside PyTorch): what decides OOM."""
        return np.maximum(self.activation_phase + self.allocator_slack, self.step_phase) + self.overhead

    @property
    def total(self):
        """What the planner fits into a GPU's memory: :attr:`peak_device`."""
        return self.peak_device

    def to_dict(self) -> dict[str, float]:
        terms = {f.name: float(getattr(self, f.name)) for f in fields(self) if f.name != "temp_coexists"}
        return {**terms, "peak_allocated": float(self.peak_allocated), "peak_device": float(self.peak_device),
                "total": float(self.total)}


def in_flight(stage, num_stages, micro_batches):
    """Micro-batches whose activations stage ``stage`` holds at once in 1F1B (ints or arrays)."""
    return np.maximum(1, np.minimum(np.subtract(num_stages, stage), micro_batches))


def both_ends(mem: MemoryTable, first, last):
    """Whether a stage holding ``first..last`` holds the embedding and the head (ints or arrays)."""
    return (np.asarray(first) == 0) & (np.asarray(last) == mem.cum_params.size - 2)


def stage_params(mem: MemoryTable, first, last, tied_params: float = 0.0):
    """Parameters per TP rank a stage holds: the profile's per-layer sum, the tied embedding once."""
    return mem.params(first, last) - np.where(both_ends(mem, first, last), tied_params, 0.0)


def backward_working(mem: MemoryTable, first, last, *, mbs: int, scale: float, elem: int, head: HeadShape,
                     freed_output_bytes=0.0):
    """megatron_patch's backward working set (see the module doc): max over the stage's layers l of l's
    transient, plus the tied gradient waiting below the head, less the activations the layers above l of
    the micro-batch in backward have released. Ints or arrays of one shape."""
    first, last = np.asarray(first), np.asarray(last)
    L = mem.cum_act.size - 1
    if first.ndim == 0 and last.ndim == 0:  # one stage (the planner's bisection): plain floats, its layers only
        return _backward_working_one(mem, int(first), int(last), mbs, scale, elem, head, float(freed_output_bytes))
    ends = both_ends(mem, first, last)
    best = np.full(np.broadcast(first, last).shape, -np.inf)
    for layer in range(int(first.min()), int(last.max()) + 1):
        inside = (first <= layer) & (layer <= last)
        if not inside.any():
            continue
        if layer == L - 1:
            w = (mem.act_input[layer] * mbs * elem + mem.params(layer, layer) * elem
                 + (head.logits_per_sample * mbs * elem if head.padded_vocab else 0.0))
        else:
            w = mem.act_bytes(layer, layer) * mbs * scale + np.where(ends, head.tied_params * elem, 0.0)
        above = np.where(layer < last, (mem.cum_act[last + 1] - mem.cum_act[layer + 1]) * mbs * scale
                         - freed_output_bytes, 0.0)
        best = np.where(inside, np.maximum(best, w - above), best)
    return best if best.ndim else float(best)


def _backward_working_one(mem: MemoryTable, first: int, last: int, mbs: int, scale: float, elem: int,
                          head: HeadShape, freed_output_bytes: float) -> float:
    """:func:`backward_working` of one stage, the same terms in floats (called thousands of times per search)."""
    L = mem.cum_act.size - 1
    cum_act, cum_params = mem.cum_act, mem.cum_params
    tied = head.tied_params * elem if first == 0 and last == L - 1 else 0.0
    top = float(cum_act[last + 1])
    best = -np.inf
    for layer in range(first, last + 1):
        if layer == L - 1:
            w = (float(mem.act_input[layer]) * mbs * elem + float(cum_params[layer + 1] - cum_params[layer]) * elem
                 + (head.logits_per_sample * mbs * elem if head.padded_vocab else 0.0))
        else:
            w = float(cum_act[layer + 1] - cum_act[layer]) * mbs * scale + tied
        above = (top - float(cum_act[layer + 1])) * mbs * scale - freed_output_bytes if layer < last else 0.0
        best = max(best, w - above)
    return best


@dataclass(frozen=True)
class Zero:
    """DeepSpeed's ZeRO stage and the data-parallel degree it partitions over (stage 0: nothing partitioned).

    ``pipelined``: the plan has several stages, so DeepSpeed's ``PipelineEngine`` runs it (ZeRO 0 and 1),
    else its plain engine. Where each stage's reduce bucket (``bucket_elems`` elements, ``torch.empty``
    of the whole size) lives, from DeepSpeed 0.19's ``stage_1_and_2.py``/``stage3.py`` and measured on the
    runtime's allocations (``benchmarks/simulator_vs_runtime.py --deepspeed-only``):

    * ZeRO 1: the first backward's ``setup_buckets`` allocates one, freed by the step's reduction, so it
      stands beside the activations of the later micro-batches; the pipeline engine's ``ReduceGrads``
      (``reduce_gradients(pipeline_parallel=True)``) appends a second one after the flush: two in the step;
    * ZeRO 2: every backward allocates one and releases it before the backward returns (with that
      micro-batch's activations, never in the step);
    * ZeRO 3: one from the engine's initialisation on, in both phases.
    """

    stage: int = 0
    data_parallel: int = 1
    bucket_elems: int = 0  # reduce bucket ZeRO 1-3 allocate whole
    pipelined: bool = False

    def apply(self, m: StageMemory, params, *, dtype: str, optimizer: str, temp_words: int, layer_params) -> StageMemory:
        """``m`` (a stage's memory without ZeRO) with the model state, gradient buffers and step terms of this stage."""
        if self.stage == 0:
            return m
        d = self.data_parallel
        weight = grad = DTYPE_BYTES[dtype]
        opt = (12 if optimizer == "adam" else 8) / d  # fp32 master + moments, partitioned from stage 1
        grad_part = grad / d if self.stage >= 2 else grad
        weight_part = weight / d if self.stage >= 3 else weight
        gathered = layer_params * weight if self.stage >= 3 else 0.0
        step_temp = (temp_words * FP32_WORD if optimizer == "adam" else 0) / d + FP32_WORD / d  # + fp32 grad partition
        bucket = GRAD_BYTES[dtype] * self.bucket_elems + 0.0 * params  # the shape of params (arrays)
        both, backward, step = {1: (bucket, 0.0, bucket if self.pipelined else 0.0), 2: (0.0, bucket, 0.0),
                                3: (bucket, 0.0, 0.0)}[self.stage]
        return replace(m, state=(weight_part + grad_part + opt) * params, optimizer_temp=step_temp * params,
                       reduce_buffer=both, backward_buffer=backward, step_buffer=step,
                       working=m.working + gathered, temp_coexists=False)


def stage_memory(mem: MemoryTable, first, last, *, stage, num_stages, mbs: int, micro_batches, dtype: str,
                 optimizer: str, recompute: bool, input_bytes, overhead, bucket_elems: int = DEFAULT_BUCKET_ELEMS,
                 allocator_slack: float = ALLOCATOR_SLACK, freed_output_bytes=0.0,
                 optimizer_impl: OptimizerImpl = SUMMED, head: HeadShape | None = None,
                 per_layer_working: bool = False, zero: Zero = Zero(), reduce_at_peak: bool = True) -> StageMemory:
    """Peak memory of one GPU of a stage holding layers ``first..last`` at TP ``mem.tp``.

    ``input_bytes``: the activation a non-first stage receives per micro-batch (0 for stage 0);
    ``freed_output_bytes``: what the runtime frees of the output it sent, per micro-batch;
    ``optimizer_impl``: the runtime's Adam (:mod:`simulator.runtimes`); ``head``: the model's head
    (tied embedding, logits); ``per_layer_working``: megatron_patch's backward working set (else the
    largest layer activation); ``zero``: DeepSpeed's ZeRO partitioning (:class:`Zero`); ``reduce_at_peak``:
    the flattened reduction buffer stands beside the activations (Sailor's calibrated DeepSpeed), else it
    exists only in the reduction after the last backward (stock DeepSpeed's ``allreduce_gradients``). Layer ranges,
    stage indices, micro-batch counts and inputs may be arrays of
    one shape (many stages at once, same TP); every component then is an array of that shape.
    """
    head = head or HeadShape()
    params = stage_params(mem, first, last, head.tied_params)
    scale = DTYPE_BYTES[dtype] / DTYPE_BYTES[mem.dtype]
    layer_max = mem.max_layer_act(first, last) * mbs * scale
    flight = in_flight(stage, num_stages, micro_batches)
    if recompute:  # every block's input kept per micro-batch in flight; one layer recomputed at a time
        acts = flight * (mem.recompute_keep(first, last) * mbs * scale + input_bytes) + layer_max
        working = layer_max
    else:
        acts = flight * (mem.act_bytes(first, last) * mbs * scale + input_bytes - freed_output_bytes)
        working = (backward_working(mem, first, last, mbs=mbs, scale=scale, elem=DTYPE_BYTES[dtype], head=head,
                                    freed_output_bytes=freed_output_bytes) if per_layer_working else layer_max)
    temp = optimizer_impl.temp_words * FP32_WORD if optimizer == "adam" else 0
    flat = GRAD_BYTES[dtype] * np.minimum(params, bucket_elems)
    out = StageMemory(state=STATE_BYTES[(dtype, optimizer)] * params, optimizer_temp=temp * params,
                      reduce_buffer=flat if reduce_at_peak else 0.0 * flat,
                      activations=acts, working=working, allocator_slack=allocator_slack * (acts + working),
                      overhead=overhead, temp_coexists=optimizer_impl.coexists,
                      step_buffer=0.0 * flat if reduce_at_peak else flat)
    if zero.stage == 0:
        return out
    return zero.apply(out, params, dtype=dtype, optimizer=optimizer, temp_words=optimizer_impl.temp_words,
                      layer_params=mem.max_layer_params(first, last) if zero.stage >= 3 else 0.0)
