"""Stage-boundary communication for pipelines whose stages have different TP degrees (patches P4, P5).

Activations and their gradients at a stage boundary are replicated over the TP ranks of a stage (no
sequence parallelism), so any TP rank can serve any rank of the neighbour stage:

- forward: TP rank ``j`` of stage ``i+1`` receives from TP rank ``j % t_i`` of stage ``i``;
- backward: TP rank ``k`` of stage ``i`` receives from TP rank ``k % t_{i+1}`` of stage ``i+1``.

So a sender serves every neighbour rank that maps to it (a TP1 -> TP2 boundary sends twice, a TP2 ->
TP1 boundary once from TP rank 0). Everything else of megatron's ``P2PCommunicator`` (the
send/recv entry points the 1F1B schedule calls) is inherited unchanged; only ``_communicate``, which
talks to the neighbours, is replaced. The sends and receives run in the pipeline's own ``groups.P2P``
group, never in the world group: on NCCL a batched send in the world group needs a communicator of
all ranks, which ranks of a one-stage pipeline never join (a hang), and a group of its own keeps the
sends apart from the gradient buckets all-reducing meanwhile.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_patch.mcore_import import import_megatron

import_megatron()  # before megatron's first module (why: mcore_import)

from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator  # noqa: E402


class StageGroup:
    """A pipeline's stages as the schedule sees a pp group: rank() = stage index, size() = stage count (P5)."""

    def __init__(self, stage: int, num_stages: int) -> None:
        self.stage, self.num_stages = stage, num_stages

    def rank(self) -> int:
        return self.stage

    def size(self) -> int:
        return self.num_stages


def neighbours(stage_ranks: list[tuple[int, ...]], stage: int, tp_rank: int) -> dict[str, Any]:
    """Peers of TP rank ``tp_rank`` of ``stage`` given the global ranks of every stage of its pipeline."""
    mine = stage_ranks[stage]
    t = len(mine)
    out: dict[str, Any] = {"recv_prev": None, "send_next": [], "recv_next": None, "send_prev": []}
    if stage > 0:
        prev = stage_ranks[stage - 1]
        out["recv_prev"] = prev[tp_rank % len(prev)]
        out["send_prev"] = [prev[k] for k in range(len(prev)) if k % t == tp_rank]
    if stage < len(stage_ranks) - 1:
        nxt = stage_ranks[stage + 1]
        out["recv_next"] = nxt[tp_rank % len(nxt)]
        out["send_next"] = [nxt[j] for j in range(len(nxt)) if j % t == tp_rank]
    return out


class HeteroP2PCommunicator(P2PCommunicator):
    """megatron's P2PCommunicator with neighbours from the plan instead of one pp group (P4)."""

    def __init__(self, stage_ranks: list[tuple[int, ...]], stage: int, tp_rank: int, config: Any,
                 device: torch.device, group: Any = None) -> None:
        """``group``: the pipeline's P2P group (every rank of ``stage_ranks``; None for one stage)."""
        # P2PCommunicator.__init__ derives prev/next from a real pp group; there is none here.
        self.pp_group = StageGroup(stage, len(stage_ranks))
        self.config = config
        self.virtual_pipeline_model_parallel_size = None
        self.device = device
        self.peers = neighbours(stage_ranks, stage, tp_rank)
        self.group = group

    def _communicate(self, *, tensor_send_next: torch.Tensor | None, tensor_send_prev: torch.Tensor | None,
                     recv_prev: bool, recv_next: bool, tensor_shape: Any,
                     wait_on_reqs: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        ops = []
        dtype = self.config.pipeline_dtype

        def buffer() -> torch.Tensor:
            return torch.empty(tensor_shape, requires_grad=True, device=self.device, dtype=dtype)

        recv_prev_t = buffer() if recv_prev else None
        recv_next_t = buffer() if recv_next else None
        if tensor_send_prev is not None:
            ops += [dist.P2POp(dist.isend, tensor_send_prev, r, self.group) for r in self.peers["send_prev"]]
        if recv_prev_t is not None:
            ops.append(dist.P2POp(dist.irecv, recv_prev_t, self.peers["recv_prev"], self.group))
        if tensor_send_next is not None:
            ops += [dist.P2POp(dist.isend, tensor_send_next, r, self.group) for r in self.peers["send_next"]]
        if recv_next_t is not None:
            ops.append(dist.P2POp(dist.irecv, recv_next_t, self.peers["recv_next"], self.group))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return recv_prev_t, recv_next_t, None
