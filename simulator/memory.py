"""Peak memory of one GPU of a stage, as ``nvidia-smi`` sees it.

peak = model state + optimizer temporaries + gradient-reduction buffer
       + retained activations + backward working set + allocator slack + fixed per-GPU overhead

* Model state, bytes per parameter held by the GPU (its TP shard of the stage's layers):

  =====  ====  ====  ====================================================================
  dtype  adam  sgd   what
  =====  ====  ====  ====================================================================
  fp32   16    12    weights 4 + grads 4 + Adam m, v 8 (SGD: one momentum buffer 4)
  bf16   18    14    weights 2 + fp32 main grads 4 (megatron accumulates bf16 grads in fp32)
                     + fp32 master weights 4 + states
  fp16   18    14    as bf16: megatron_patch accumulates fp16 grads in fp32 main grads too
  =====  ====  ====  ====================================================================

* Optimizer temporaries: torch's multi-tensor (foreach) Adam materialises ``sqrt(v)`` for all
  parameters of a step at once, one fp32 word per parameter (SGD needs none).
* Gradient reduction: DeepSpeed's reduction flattens the gradients into one contiguous buffer per
  bucket (up to 5e8 elements), at any data-parallel degree (its pipeline engine reduces through the
  same path with a group of one). The caching allocator cannot carve a buffer that large out of the
  freed activation blocks, so it adds to what nvidia-smi reports. Sailor's 24 bytes/parameter for
  fp32 Adam is these three terms; the data (GH200, OPT-350M and GPT-Neo-2.7B) agrees.
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
* Backward working set: while a layer runs backward, the gradients of its activations live next to
  the activations they replace: about one more copy of the stage's largest layer activation.
* Allocator slack: PyTorch's caching allocator keeps freed blocks of one size class that later,
  differently sized activation requests cannot use, so what it has reserved from the driver (what
  nvidia-smi shows) exceeds what is allocated by a few percent of the activation traffic; charged as
  :data:`ALLOCATOR_SLACK` of the activation terms (expandable segments would remove most of it). The
  share is estimated from measured runs by :mod:`simulator.calibration` (the median over Sailor's 22 runs
  of the share that makes each run's peak exact); ``benchmarks/simulator_accuracy.py`` prints it with
  the leave-one-out errors.
* Fixed overhead: CUDA context, library workspaces, NCCL communicator buffers, per GPU type and TP
  degree, from the profile archive (measured by the profiler; for the imported Sailor data estimated
  in :mod:`sailor_hpc.core.sailor_compat.profiles`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from simulator.tables import DTYPE_BYTES, MemoryTable

STATE_BYTES = {("fp32", "adam"): 16, ("fp32", "sgd"): 12, ("bf16", "adam"): 18, ("bf16", "sgd"): 14,
               ("fp16", "adam"): 18, ("fp16", "sgd"): 14}
GRAD_BYTES = {"fp32": 4, "bf16": 4, "fp16": 4}  # element size of the gradients that are all-reduced
OPTIMIZER_TEMP_BYTES = {"adam": 4, "sgd": 0}  # per parameter, fp32 (master) precision
DEFAULT_BUCKET_ELEMS = 500_000_000  # DeepSpeed's allreduce_bucket_size
ALLOCATOR_SLACK = 0.078  # share of the activation terms the caching allocator holds but cannot reuse (7.82 %)


@dataclass(frozen=True)
class StageMemory:
    """Peak bytes on one GPU of a stage, by component."""

    state: float
    optimizer_temp: float
    reduce_buffer: float
    activations: float
    working: float
    allocator_slack: float
    overhead: float

    @property
    def total(self) -> float:
        return (self.state + self.optimizer_temp + self.reduce_buffer + self.activations + self.working
                + self.allocator_slack + self.overhead)

    def to_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in {**asdict(self), "total": self.total}.items()}


def in_flight(stage, num_stages, micro_batches):
    """Micro-batches whose activations stage ``stage`` holds at once in 1F1B (ints or arrays)."""
    return np.maximum(1, np.minimum(np.subtract(num_stages, stage), micro_batches))


def stage_memory(mem: MemoryTable, first, last, *, stage, num_stages, mbs: int, micro_batches, dtype: str,
                 optimizer: str, recompute: bool, input_bytes, overhead, bucket_elems: int = DEFAULT_BUCKET_ELEMS,
                 allocator_slack: float = ALLOCATOR_SLACK, freed_output_bytes=0.0) -> StageMemory:
    """Peak memory of one GPU of a stage holding layers ``first..last`` at TP ``mem.tp``.

    ``input_bytes``: the activation a non-first stage receives per micro-batch (0 for stage 0);
    ``freed_output_bytes``: what the runtime frees of the output it sent, per micro-batch.
    Layer ranges, stage indices, micro-batch counts and inputs may be arrays of one shape (many
    stages at once, same TP); every component then is an array of that shape.
    """
    params = mem.params(first, last)
    scale = DTYPE_BYTES[dtype] / DTYPE_BYTES[mem.dtype]
    layer_max = mem.max_layer_act(first, last) * mbs * scale
    flight = in_flight(stage, num_stages, micro_batches)
    if recompute:  # every block's input kept per micro-batch in flight; one layer recomputed at a time
        acts = flight * (mem.recompute_keep(first, last) * mbs * scale + input_bytes) + layer_max
    else:
        acts = flight * (mem.act_bytes(first, last) * mbs * scale + input_bytes - freed_output_bytes)
    return StageMemory(state=STATE_BYTES[(dtype, optimizer)] * params,
                       optimizer_temp=OPTIMIZER_TEMP_BYTES[optimizer] * params,
                       reduce_buffer=GRAD_BYTES[dtype] * np.minimum(params, bucket_elems),
                       activations=acts, working=layer_max, allocator_slack=allocator_slack * (acts + layer_max),
                       overhead=overhead)
