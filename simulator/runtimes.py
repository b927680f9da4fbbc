"""The runtimes a plan can be simulated as: what each does that the simulator must model differently.

A plan is simulated as the runtime that will run it runs it; both share every other part of the model
(profiles, 1F1B step order, memory, all-reduces), so a runtime is a handful of facts, not a code path:

``deepspeed-pipe``: DeepSpeed's pipeline engine, the runtime of Sailor's measured runs.
    * Stage-to-stage messages are TP-partitioned: each of the sending stage's t ranks sends 1/t of the
      activation (the receiver all-gathers), so t streams of A/t bytes leave the sending node together.
    * Its instruction order sends the activation of the last forward only after receiving the
      gradient of the next backward (``serial``).
    * Gradients are reduced after the flush through one flattened bucket buffer (``extra_reduce_buffer``).
    * Once a stage's output is sent, only the rank's partition of it is kept (``PartitionedTensor``).
``megatron_patch``: this project's runtime (megatron-core's non-interleaved 1F1B, ``megatron_patch.p2p``).
    * Activations are replicated over the TP ranks, and every rank of the receiving stage gets a full
      copy from one sender rank: as many streams of A bytes as the receiving stage has ranks.
    * Each step's sends and receives go out as one batch (``batch_isend_irecv``), in both directions at
      once (not ``serial``).
    * Gradients go in size-capped buckets started during the last backward (``overlap_grad_sync``),
      the buckets being the fp32 main grads themselves.
    * Once a stage's output is sent, it is freed (``deallocate_pipeline_outputs``).

On GPUs both run on NCCL, which copies a send that fits its staging buffer (``NCCL_BUFFSIZE``, 4 MiB
by default) and lets the sender's GPU go on: such a message moves while both GPUs compute and only a late
receiver waits (an *asynchronous* transfer, :func:`simulator.schedule._exchange`). A larger one needs the
receiver to drain the buffer as it fills, so both GPUs wait until it has moved (*blocking*). A boundary is
asynchronous when each rank's message in both directions fits.

Without CUDA the runtime communicates over gloo, which stages nothing: a send completes only once the
receiver has posted the matching receive, at any size (``tests/megatron_patch/test_p2p_backend.py``: a
64 B send waits as long as a 16 MiB one for a receiver that posts late). Every gloo transfer is blocking.
"""
from __future__ import annotations

from dataclasses import dataclass

from sailor_hpc.core.errors import SailorError

NCCL_BUFFSIZE = 4 * 2**20  # NCCL's default staging buffer per channel and peer (bytes)
# what a sender may hand off and go on, by communication backend (bytes per message)
STAGING_BYTES: dict[str, float] = {"nccl": NCCL_BUFFSIZE, "gloo": 0.0}


@dataclass(frozen=True)
class Runtime:
    name: str
    partitioned_p2p: bool  # each sending TP rank sends 1/t of the activation (else full copies per receiver)
    serial_exchange: bool  # the activation is sent only after the gradient was received
    overlap_grad_sync: bool
    extra_reduce_buffer: bool


RUNTIMES: dict[str, Runtime] = {
    "deepspeed-pipe": Runtime("deepspeed-pipe", partitioned_p2p=True, serial_exchange=True, overlap_grad_sync=False,
                              extra_reduce_buffer=True),
    "megatron_patch": Runtime("megatron_patch", partitioned_p2p=False, serial_exchange=False, overlap_grad_sync=True,
                              extra_reduce_buffer=False),
}


def _one_of(table: dict, key: str, what: str, field: str):
    try:
        return table[key]
    except KeyError:
        raise SailorError(f"unknown {what} {key!r}", field=field, fix=f"use one of {', '.join(table)}") from None


def get_runtime(name: str) -> Runtime:
    return _one_of(RUNTIMES, name, "runtime", "runtime")


def staging_bytes(backend: str) -> float:
    return _one_of(STAGING_BYTES, backend, "communication backend", "backend")


__all__ = ["NCCL_BUFFSIZE", "RUNTIMES", "Runtime", "STAGING_BYTES", "get_runtime", "staging_bytes"]
