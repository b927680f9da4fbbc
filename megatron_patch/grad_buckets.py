"""This rank's gradient sync, overlapped with the backward: buckets that own the ``main_grad`` buffers.

Why: a sync that starts after the whole backward adds its full time to every step. As in Megatron's
DDP, gradients accumulate in fp32 ``p.main_grad`` (``main_grad.attach_main_grads``: a
post-accumulate-grad hook adds ``p.grad`` after each micro-batch's backward and frees it; this module
passes the bucket slices as its ``views`` and its readiness callback as ``on_accumulated``), and a
bucket's all-reduce is launched from that callback as soon as every parameter in it has its last
micro-batch's gradient, while the backward goes on.

- A bucket is one flat fp32 tensor. A parameter held whole by one piece (every parameter unless its
  TP degree differs from another holder's) has its ``main_grad`` *in* the bucket: no copy. A
  parameter cut into chunks for holders with other TP degrees keeps its own ``main_grad``; its
  chunks are copied into their buckets at launch and back after the wait.
- Scaling by the piece's weight happens at launch, in place: the same products and sums as a sync
  after the backward, so results are unchanged (fp32 exact against the single-process reference).
- Buckets launch strictly in ``grad_sync.plan_buckets``' global order (a ready bucket waits for the
  ones before it), so the members of every group issue the same collectives in the same order even
  when their backward orders differ (stages of different pipelines, different micro-batch counts).
- :meth:`GradBuckets.finish` launches what is left (parameters that got no gradient), waits, and
  leaves every ``p.main_grad`` holding the synced gradient (``p.grad`` is None): the optimizer's input
  (fp16: still loss-scaled; the engine unscales the synced fp32 sums). ``main_grad.zero_main_grads``
  (the optimizer's ``zero_grad``) starts the next step's accumulation.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_patch import resident
from megatron_patch.grad_sync import Bucket, Piece
from megatron_patch.layout import ParamInfo, chunk_views
from megatron_patch.main_grad import attach_main_grads, main_grad_of


@dataclass
class _Slot:
    """One local parameter: its fp32 accumulator and the buckets waiting for it."""

    main_grad: torch.Tensor
    buckets: list[_Local] = field(default_factory=list)
    count: int = 0  # micro-batches accumulated this step


@dataclass
class _Local:
    """A bucket as this rank runs it."""

    spec: Bucket
    flat: torch.Tensor
    pieces: list[tuple[Piece, int]]  # own pieces with their offset in ``flat``
    num_params: int = 0  # distinct local parameters in it
    waiting_for: int = 0  # of those, the ones whose last micro-batch gradient is still missing
    work: Any = None
    launched_at: float = 0.0
    by_hook: bool = False


@dataclass(frozen=True)
class Launch:
    """When a bucket's all-reduce was launched (``time.perf_counter``) and whether the backward did it."""

    ranks: tuple[int, ...]
    index: int
    at: float
    by_hook: bool


class GradBuckets:
    """Owns the ``main_grad`` of every local parameter and syncs them in buckets during the backward."""

    def __init__(self, buckets: list[Bucket], params: OrderedDict[str, torch.nn.Parameter],
                 infos: dict[str, ParamInfo], num_micro_batches: int, device: torch.device,
                 groups: Mapping[tuple[int, ...], Any]) -> None:
        """``buckets``: the plan's, in launch order (``grad_sync.plan_buckets``); ``groups``: the process group
        of every rank set of several ranks this rank is in (``groups.PlanGroups.sync``)."""
        self.rank = dist.get_rank()
        self.groups = groups
        self.infos = infos
        self.num_micro_batches = num_micro_batches
        self.order: list[_Local] = []
        self.owned: list[Piece] = []  # pieces this rank counts in the global norm
        in_bucket: dict[str, torch.Tensor] = {}
        for b in buckets:
            own = b.own(self.rank)
            if not own:
                continue
            local = _Local(b, torch.zeros(b.numel, dtype=torch.float32, device=device), [])
            offset = 0
            for p in own:
                local.pieces.append((p, offset))
                if p.whole:
                    in_bucket[p.name] = local.flat[offset:offset + p.numel].view(params[p.name].shape)
                offset += p.numel
            assert offset == b.numel, "a member lacks a slot of its bucket"  # grad_sync.rank_sets' invariant
            self.order.append(local)
            first: dict[tuple[str, int], int] = {}  # (parameter, chunk) -> its first holder in the bucket
            for p in b.pieces:
                first.setdefault((p.name, p.chunk), p.rank)
            self.owned += [p for p in own if first[(p.name, p.chunk)] == self.rank]
        self._handles = attach_main_grads(params, views=in_bucket, on_accumulated=self._accumulated)
        self.slots: dict[str, _Slot] = {}
        for name, param in params.items():
            buf = main_grad_of(param)
            if buf is None:
                raise ValueError(f"{name}: a frozen parameter cannot take part in the gradient sync")
            self.slots[name] = _Slot(buf)  # the contract: fp32, param's shape, synced after finish()
        for local in self.order:
            names = {p.name for p, _ in local.pieces}
            for n in names:
                self.slots[n].buckets.append(local)
            local.num_params = local.waiting_for = len(names)
        self.num_groups = len({lb.spec.ranks for lb in self.order if len(lb.spec.ranks) > 1})
        self.next = 0  # index in self.order of the next bucket to launch
        self.last_launches: list[Launch] = []

    def _accumulated(self, name: str) -> None:
        """``attach_main_grads``' callback: ``name``'s gradient of one more micro-batch is in its main_grad."""
        slot = self.slots[name]
        if slot.count == self.num_micro_batches:
            raise RuntimeError(f"{name}: more backward passes than the {self.num_micro_batches} micro-batches "
                               "of a step (its bucket was already launched)")
        slot.count += 1
        if slot.count == self.num_micro_batches:
            for local in slot.buckets:
                local.waiting_for -= 1
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self.next < len(self.order) and self.order[self.next].waiting_for == 0:
            self._launch(self.order[self.next], by_hook=True)

    def _views(self, p: Piece) -> list[torch.Tensor]:
        return chunk_views(self.slots[p.name].main_grad, self.infos[p.name], p.n_local, p.local)

    def _staged(self, local: _Local, p: Piece, offset: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(``main_grad`` view, bucket region) pairs of a chunk piece, in the buffer layout all members share."""
        for v in self._views(p):
            yield v, local.flat[offset:offset + v.numel()].view(v.shape)
            offset += v.numel()

    def _launch(self, local: _Local, by_hook: bool) -> None:
        for p, offset in local.pieces:
            if not p.whole:  # a chunk of a parameter: stage it
                for v, region in self._staged(local, p, offset):
                    region.copy_(v)
            if p.scale != 1.0:
                local.flat[offset:offset + p.numel].mul_(p.scale)
        if len(local.spec.ranks) > 1:
            local.work = dist.all_reduce(local.flat, group=self.groups[local.spec.ranks], async_op=True)
        local.launched_at, local.by_hook = time.perf_counter(), by_hook
        self.next += 1

    def finish(self) -> None:
        """After the last backward: launch the rest, wait for all, leave the synced sums in ``main_grad``."""
        while self.next < len(self.order):
            self._launch(self.order[self.next], by_hook=False)
        for local in self.order:
            if local.work is not None:
                resident.wait(local.work)
                local.work = None
            for p, offset in local.pieces:
                if not p.whole:
                    for v, region in self._staged(local, p, offset):
                        v.copy_(region)
        self.last_launches = [Launch(lb.spec.ranks, lb.spec.index, lb.launched_at, lb.by_hook) for lb in self.order]
        for slot in self.slots.values():
            slot.count = 0
        for local in self.order:
            local.waiting_for = local.num_params
        self.next = 0

    def owned_sq_norm(self) -> float:
        """Sum of squares of the gradient chunks this rank owns (after :meth:`finish`)."""
        views = [v for p in self.owned for v in self._views(p)]
        if not views:
            return 0.0
        norms = torch.stack(torch._foreach_norm(views)).double()  # fp32 per piece, as clip_grad_norm_
        return float(norms.pow(2).sum())
