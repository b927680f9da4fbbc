"""Transfer times on a site's links: stage-to-stage activations and ring all-reduces of gradients.

Where a transfer runs:

* both ends on the same node (same partition, same placement node) -> the partition's intra-node fit;
* otherwise -> ``site.inter_node_fit(partition_a, partition_b, senders)`` (between partitions: the
  measured cross-partition link, else the slower partition's network).

Fits are the site's (clamped to their measured range by :class:`sailor_hpc.core.network.NetworkFit`); the
number of GPUs sending at once selects the fit (``k``), whose bandwidth is the aggregate of the k
streams at the per-stream message size.

Activations (and their gradients back): the streams a runtime sends across a stage boundary at once
share one path between the two nodes and move their total bytes at one stream's rate (:func:`p2p_transfer`;
the ``k = 1`` fit at the total size). DeepSpeed sends TP partitions (t streams of A/t): the GH200 runs
move a 67 MB activation in four 16.7 MB partitions in ~3 ms, one stream's rate, not the 4-NIC aggregate
Sailor charged; on the MIT cluster's one 1-Gbit NIC per RTX-3090 node a TP-2 and a TP-8 stage both pay
A / 0.115 GB/s. megatron_patch sends a full copy to every rank of the receiving stage
(:mod:`simulator.runtimes`), so its boundary moves that many copies. The message size of one stream (what
decides whether NCCL can buffer it) is returned beside the time.

Gradients: a ring all-reduce among the holders of a parameter. Every TP rank of a holder runs its own
ring (one per TP slice), at the same time, so a holder's node carries ``t`` rings through its links:
the k = t aggregate fit at the per-stream chunk size (``bytes / holders``). The ring is as slow as its
slowest link; ``2(H - 1)`` chunk transfers per ring, per bucket (DeepSpeed reduces ``bucket_elems``
elements at a time).

Latency: a fit's time holds one message's latency, so a collective priced by its bytes pays it once. A
runtime that issues many small collectives (DeepSpeed's ZeRO 3 gathers every parameter tensor on its own)
pays it for each: the profiler measures a link's latency per ring step of a small all-reduce and of a small
all-gather (``collective_latency_us``, ``gather_latency_us`` of a partition's link table; gloo's all-gather
is several times slower than its all-reduce), and :func:`collective_latency_seconds` prices one collective
of each kind (the alpha of an alpha-beta model). It measures both back to back, as a stream, and each issued
alone after a burst of compute (``issued_latency_us``, ``issued_gather_latency_us``), as a training step issues
them between its layers: there the ranks' communication threads and the peer must be woken first. The
issued figure prices a runtime's collectives (``issued=True``; the streamed one where it was not measured);
the streamed one is what a fit's time already holds.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sailor_hpc.core.network import NetworkFit
from sailor_hpc.core.plan import Stage
from sailor_hpc.core.site import Site


@dataclass(frozen=True)
class Endpoint:
    """Where a stage's TP group sits: partition, node index inside the job's share of it, TP degree."""

    partition: str
    node: int | None
    tp: int

    @classmethod
    def of(cls, stage: Stage) -> Endpoint:
        """A plan stage's endpoint (its partition, or its GPU type before placement; its node if placed)."""
        return cls(partition=stage.partition or stage.gpu_type,
                   node=None if stage.placement is None else stage.placement.node, tp=stage.tp)

    def same_node(self, other: Endpoint) -> bool:
        return self.partition == other.partition and self.node is not None and self.node == other.node


def link_fit(site: Site, a: Endpoint, b: Endpoint, senders: int) -> NetworkFit:
    """The fit of the link between two endpoints with ``senders`` streams at once."""
    if a.same_node(b):
        return site.intra_node_fit(a.partition, senders)
    return site.inter_node_fit(a.partition, b.partition, senders)


def p2p_transfer(site: Site, a: Endpoint, b: Endpoint, nbytes: float, *, partitioned: bool) -> tuple[float, float]:
    """An activation of ``nbytes`` (or its gradient) from stage a to stage b: (seconds, bytes per rank's message).

    ``partitioned``: each of a's ``tp`` ranks sends ``nbytes / tp``; else each of b's ranks receives a full
    copy. The streams leave together and share one stream's rate."""
    streams = a.tp if partitioned else b.tp
    message = nbytes / a.tp if partitioned else nbytes
    return link_fit(site, a, b, 1).transfer_time(streams * message), message


def _ring_links(site: Site, holders: Sequence[Endpoint], senders: int) -> list[NetworkFit]:
    """The fits of every link kind a ring through ``holders`` uses (the slowest one sets its pace)."""
    nodes = {(h.partition, h.node if h.node is not None else ("?", i)) for i, h in enumerate(holders)}
    parts = sorted({p for p, _ in nodes})
    if len(nodes) == 1:
        return [site.intra_node_fit(parts[0], senders)]
    fits = []
    for i, a in enumerate(parts):
        for b in parts[i:]:
            if a == b and sum(1 for p, _ in nodes if p == a) < 2:
                continue
            fits.append(site.inter_node_fit(a, b, senders))
    return fits


def ring_allreduce_seconds(site: Site, holders: Sequence[Endpoint], per_gpu_bytes: Sequence[float],
                           bucket_bytes: Sequence[float] | None = None) -> float:
    """Ring all-reduce of one set of gradients among ``holders``.

    ``per_gpu_bytes[i]``: what one TP rank of holder i contributes (its shard). ``bucket_bytes[i]``:
    the largest piece reduced at once by holder i (None: all in one piece).
    """
    H = len(holders)
    if H <= 1:
        return 0.0
    links: dict[int, list[NetworkFit]] = {}
    step: dict[tuple[int, float], float] = {}  # (streams, chunk bytes) -> seconds on the slowest link

    def chunk_seconds(tp: int, chunk: float) -> float:
        key = (tp, chunk)
        if key not in step:
            if tp not in links:
                links[tp] = _ring_links(site, holders, tp)
            step[key] = max(f.transfer_time(chunk) for f in links[tp])
        return step[key]

    worst = 0.0
    for i, (h, nbytes) in enumerate(zip(holders, per_gpu_bytes)):
        if nbytes <= 0:
            continue
        cap = nbytes if bucket_bytes is None else max(1.0, min(bucket_bytes[i], nbytes))
        full, rest = divmod(nbytes, cap)
        total = int(full) * chunk_seconds(h.tp, cap / H) + (chunk_seconds(h.tp, rest / H) if rest > 0 else 0.0)
        worst = max(worst, 2 * (H - 1) * h.tp * total)
    return worst


def collective_latency_seconds(site: Site, holders: Sequence[Endpoint], *, issued: bool = False) -> tuple[float, float]:
    """The latency of one small collective among ``holders`` on their slowest-latency link: (all-reduce: a
    ring's ``2(H - 1)`` steps, all-gather: ``H - 1``); zeros where the site has none measured. ``issued``: as a
    collective issued alone after computing costs (the streamed latency where that was not measured), else as
    one of a back-to-back stream."""
    H = len(holders)
    if H <= 1:
        return 0.0, 0.0
    fits = _ring_links(site, holders, max(h.tp for h in holders))
    reduce = [f.collective_latency_s for f in fits]
    gather = [f.gather_latency_s or f.collective_latency_s for f in fits]
    if issued:
        reduce = [f.issued_latency_s or r for f, r in zip(fits, reduce, strict=True)]
        gather = [f.issued_gather_latency_s or g for f, g in zip(fits, gather, strict=True)]
    return 2 * (H - 1) * max(reduce), (H - 1) * max(gather)


def measured_jitter(site: Site, holders: Sequence[Endpoint]) -> float:
    """How far the holders drift apart as the profiler measured it on their ring's links (0: not measured,
    or one holder)."""
    if len(holders) <= 1:
        return 0.0
    return max(f.replica_jitter for f in _ring_links(site, holders, max(h.tp for h in holders)))
