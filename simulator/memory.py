"""Peak memory of one GPU of a stage, as ``nvidia-smi`` sees it.

peak = model state + retained activations + backward working set + gradient-reduction buffer
       + fixed per-GPU overhead

* Model state, bytes per parameter held by the GPU (its TP shard of the stage's layers):

  ============  =====  ===================================================================
  dtype         adam   sgd (momentum)
  ============  =====  ===================================================================
  fp32          16     12   weights 4 + grads 4 + Adam m, v 8 (SGD: one momentum buffer)
  bf16          18     14   weights 2 + fp32 main grads 4 (megatron accumulates bf16 in fp32)
                            + fp32 master weights 4 + states
  fp16          16     12   weights 2 + grads 2 + fp32 master weights 4 + states
  ============  =====  ===================================================================

* Retained activations: the profiled bytes of the stage's layers at micro-batch 1, times the
  micro-batch size, times the micro-batches in flight, ``min(P - s, m)`` for stage s of a P-stage
  1F1B pipeline running m micro-batches (Sailor used ``P - s`` even when m is smaller), scaled from
  the profile's dtype to the plan's. With recomputation a stage keeps only each in-flight micro-batch's
  input and recomputes one layer at a time.
* Backward working set: while a layer runs backward, the gradients of its activations live next to
  the activations they replace, about one more copy of that layer's activation; the stage's largest
  layer sets it.
* Gradient reduction: the data-parallel all-reduce flattens gradients into one contiguous buffer per
  bucket (DeepSpeed: up to 5e8 elements) when the stage shares its layers with other pipelines. The
  caching allocator cannot carve a buffer that large out of the freed activation blocks, so the bucket
  adds to the peak nvidia-smi reports.
* Fixed overhead: CUDA context, library workspaces, NCCL communicator buffers and allocator slack, per
  GPU type and TP degree, from the profile archive (measured by the profiler; for the imported Sailor
  data, estimated in :mod:`sailor_hpc.sailor_import`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from simulator.tables import DTYPE_BYTES, MemoryTable

STATE_BYTES = {("fp32", "adam"): 16, ("fp32", "sgd"): 12, ("bf16", "adam"): 18, ("bf16", "sgd"): 14,
               ("fp16", "adam"): 16, ("fp16", "sgd"): 12}
GRAD_BYTES = {"fp32": 4, "bf16": 4, "fp16": 2}  # element size of the gradients that are all-reduced
DEFAULT_BUCKET_ELEMS = 500_000_000  # DeepSpeed's allreduce_bucket_size


@dataclass(frozen=True)
class StageMemory:
    """Peak bytes on one GPU of a stage, by component."""

    state: float
    activations: float
    working: float
    reduce_buffer: float
    overhead: float

    @property
    def total(self) -> float:
        return self.state + self.activations + self.working + self.reduce_buffer + self.overhead

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def in_flight(stage: int, num_stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once in 1F1B."""
    return max(1, min(num_stages - stage, micro_batches))


def stage_memory(mem: MemoryTable, first: int, last: int, *, stage: int, num_stages: int, mbs: int,
                 micro_batches: int, dtype: str, optimizer: str, recompute: bool, synced: bool,
                 input_bytes: float, overhead: float, bucket_elems: int = DEFAULT_BUCKET_ELEMS) -> StageMemory:
    """Peak memory of one GPU of a stage holding layers ``first..last`` at TP ``mem.tp``.

    ``input_bytes``: the activation a non-first stage receives per micro-batch (0 for stage 0);
    ``synced``: whether its gradients are all-reduced with other pipelines.
    """
    params = mem.params(first, last)
    scale = DTYPE_BYTES[dtype] / DTYPE_BYTES[mem.dtype]
    layer_max = mem.max_layer_act(first, last) * mbs * scale
    flight = in_flight(stage, num_stages, micro_batches)
    if recompute:
        acts = flight * input_bytes + layer_max  # inputs kept, one layer recomputed at a time
    else:
        acts = flight * (mem.act_bytes(first, last) * mbs * scale + input_bytes)
    reduce_buffer = GRAD_BYTES[dtype] * min(params, bucket_elems) if synced else 0.0
    return StageMemory(state=STATE_BYTES[(dtype, optimizer)] * params, activations=acts, working=layer_max,
                       reduce_buffer=reduce_buffer, overhead=overhead)
