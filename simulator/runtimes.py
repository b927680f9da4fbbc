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
``deepspeed``: stock DeepSpeed (0.19) running megatron_patch's layers (``megatron_patch.ds_runtime``, or a
    user's own DeepSpeed script under a plan of ``sailor-hpc plan --runtime deepspeed``): the pipeline engine's
    exchange order and flattened reduction, no tensor parallelism (a TP-1 stage keeps its whole output until
    its backward), torch's AdamW (``torch_adam``, multi-tensor) and a ZeRO stage (``SimOptions.zero_stage``,
    :mod:`simulator.memory`). Its flattened reduction buffer exists only after the last backward
    (``reduce_at_peak`` off), and its engine's own per-step work comes from the profile
    (:mod:`simulator.engine_costs`).
``megatron_patch``: this project's runtime (megatron-core's non-interleaved 1F1B, ``megatron_patch.p2p``).
    * Activations are replicated over the TP ranks, and every rank of the receiving stage gets a full
      copy from one sender rank: as many streams of A bytes as the receiving stage has ranks.
    * Each step's sends and receives go out as one batch (``batch_isend_irecv``), in both directions at
      once (not ``serial``).
    * Gradients go in size-capped buckets started during the last backward (``overlap_grad_sync``),
      the buckets being the fp32 main grads themselves.
    * Once a stage's output is sent, it is freed (``deallocate_pipeline_outputs``).

Memory (:mod:`simulator.memory`): the two differ in how their Adam step is implemented and in what the
backward's working set is modelled from:

``deepspeed-pipe``
    Sailor's measured runs: fp32 Adam needs 24 B/param (weights, grads, m, v, one fp32 optimizer temporary
    and DeepSpeed's flattened reduction buffer), all charged at the activation peak, and one more copy of the
    stage's largest layer activation as the backward's working set; the allocator slack is estimated from
    these runs (:mod:`simulator.calibration`) with exactly this model, so it stays as it is. A stage's
    parameters are the profile's per-layer sum: Sailor's OPT profile gives the head a weight of its own
    (their DeepSpeed model held one: the single-stage MIT runs N4_D4 and N6_D6 are 0.4 and 0.2 % off with
    it, 2.0 and 1.9 % without), its GPT-Neo profile none.
``megatron_patch``
    torch's AdamW, ``fused`` on CUDA (one kernel over all tensors: no temporary) and ``foreach`` elsewhere
    (``torch._foreach_sqrt(exp_avg_sq)`` materialises one fp32 word per parameter of a parameter group
    while the step runs). The step runs after the backward has freed the activations, so its temporary is a
    peak of its own, never added to the activation peak. A stage holding both ends of a tied embedding holds
    it once (the head reads the embedding's weight). The backward's working set is per layer, next to
    only the activations not yet released (``tests/simulator/test_memory_terms_vs_runtime.py`` measures both
    on the runtime's own allocations).

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

from collections.abc import Mapping
from dataclasses import dataclass

from sailor_hpc.core.deepspeed_plan import ZERO_BUCKET_ELEMS  # re-exported: the simulator's ZeRO bucket
from sailor_hpc.core.errors import SailorError

NCCL_BUFFSIZE = 4 * 2**20  # NCCL's default staging buffer per channel and peer (bytes)
# what a sender may hand off and go on, by communication backend (bytes per message)
STAGING_BYTES: dict[str, float] = {"nccl": NCCL_BUFFSIZE, "gloo": 0.0}


@dataclass(frozen=True)
class OptimizerImpl:
    """What an Adam implementation allocates besides its state (SGD steps allocate nothing)."""

    name: str
    temp_words: int  # fp32 words per parameter (of the largest parameter group) alive during the step
    coexists: bool  # charged on top of the activation peak (else the step's own peak, after the backward)


OPTIMIZER_IMPLS: dict[str, OptimizerImpl] = {
    "fused": OptimizerImpl("fused", temp_words=0, coexists=False),  # torch AdamW(fused=True), CUDA
    "foreach": OptimizerImpl("foreach", temp_words=1, coexists=False),  # torch AdamW(foreach=True): sqrt(v)
    # Sailor's DeepSpeed runs: one fp32 word per parameter at the activation peak (their 24 B/param)
    "deepspeed": OptimizerImpl("deepspeed", temp_words=1, coexists=True),
}


@dataclass(frozen=True)
class Runtime:
    name: str
    partitioned_p2p: bool  # each sending TP rank sends 1/t of the activation (else full copies per receiver)
    serial_exchange: bool  # the activation is sent only after the gradient was received
    overlap_grad_sync: bool
    extra_reduce_buffer: bool
    optimizer_by_backend: Mapping[str, str]  # communication backend (device) -> OPTIMIZER_IMPLS key
    per_layer_working: bool  # backward working set per layer next to unreleased activations (else the largest)
    ties_within_stage: bool  # a stage holding both ends of a tied embedding holds it once (else as profiled)
    reduce_at_peak: bool = True  # the flattened reduction buffer stands beside the activations (else step only)

    def optimizer_impl(self, backend: str) -> OptimizerImpl:
        """The Adam implementation this runtime steps with where it talks ``backend`` (nccl: CUDA, gloo: CPU)."""
        return optimizer_impl(_one_of(self.optimizer_by_backend, backend, "communication backend", "backend"))


RUNTIMES: dict[str, Runtime] = {
    "deepspeed-pipe": Runtime("deepspeed-pipe", partitioned_p2p=True, serial_exchange=True, overlap_grad_sync=False,
                              extra_reduce_buffer=True,
                              optimizer_by_backend={"nccl": "deepspeed", "gloo": "deepspeed"}, per_layer_working=False,
                              ties_within_stage=False),
    # megatron_patch.optimizer.adamw: fused on CUDA (NCCL), foreach on the CPU (gloo)
    "megatron_patch": Runtime("megatron_patch", partitioned_p2p=False, serial_exchange=False, overlap_grad_sync=True,
                              extra_reduce_buffer=False, optimizer_by_backend={"nccl": "fused", "gloo": "foreach"},
                              per_layer_working=True, ties_within_stage=True),
    # stock DeepSpeed with the ds_config of sailor_hpc.core.ds_config: torch AdamW, foreach on every device
    "deepspeed": Runtime("deepspeed", partitioned_p2p=True, serial_exchange=True, overlap_grad_sync=False,
                         extra_reduce_buffer=True, optimizer_by_backend={"nccl": "foreach", "gloo": "foreach"},
                         per_layer_working=True, ties_within_stage=True, reduce_at_peak=False),
}


def _one_of(table: Mapping, key: str, what: str, field: str):
    try:
        return table[key]
    except KeyError:
        raise SailorError(f"unknown {what} {key!r}", field=field, fix=f"use one of {', '.join(table)}") from None


def get_runtime(name: str) -> Runtime:
    return _one_of(RUNTIMES, name, "runtime", "runtime")


def staging_bytes(backend: str) -> float:
    return _one_of(STAGING_BYTES, backend, "communication backend", "backend")


def optimizer_impl(name: str) -> OptimizerImpl:
    return _one_of(OPTIMIZER_IMPLS, name, "optimizer implementation", "optimizer_impl")


__all__ = ["ZERO_BUCKET_ELEMS",
           "NCCL_BUFFSIZE", "OPTIMIZER_IMPLS", "OptimizerImpl", "RUNTIMES", "Runtime", "STAGING_BYTES", "get_runtime",
           "optimizer_impl", "staging_bytes"]
