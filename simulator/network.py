"""Transfer times on a site's links: stage-to-stage activations and ring all-reduces of gradients.

Where a transfer runs:

* both ends on the same node (same partition, same placement node) -> the partition's intra-node fit;
* otherwise -> ``site.inter_node_fit(partition_a, partition_b, senders)`` (between partitions: the
  measured cross-partition link, else the slower partition's network).

Fits are the site's (clamped to their measured range by :class:`sailor_hpc.network.NetworkFit`); the
number of GPUs sending at once selects the fit (``k``), whose bandwidth is the aggregate of the k
streams at the per-stream message size.

Activations: one copy of the activation crosses a stage boundary as a single stream (``k = 1``). The
measured DeepSpeed runs show both halves of this: on Clariden (one NIC per GPU) a 67 MB activation
takes ~3 ms per boundary, the single-stream rate, not the 4-NIC aggregate that Sailor charged; on the
MIT cluster (one 1-Gbit NIC per RTX-3090 node) a TP-2 and a TP-8 stage pay A / 0.115 GB/s, not TP
copies of it.

Gradients: a ring all-reduce among the holders of a parameter. Every TP rank of a holder runs its own
ring (one per TP slice), at the same time, so a holder's node carries ``t`` rings through its links:
the k = t aggregate fit at the per-stream chunk size (``bytes / holders``). The ring is as slow as its
slowest link; ``2(H - 1)`` chunk transfers per ring, per bucket (DeepSpeed reduces ``bucket_elems``
elements at a time).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sailor_hpc.network import NetworkFit
from sailor_hpc.site import Site


@dataclass(frozen=True)
class Endpoint:
    """Where a stage's TP group sits: partition, node index inside the job's share of it, TP degree."""

    partition: str
    node: int | None
    tp: int

    def same_node(self, other: "Endpoint") -> bool:
        return self.partition == other.partition and self.node is not None and self.node == other.node


def link_fit(site: Site, a: Endpoint, b: Endpoint, senders: int) -> NetworkFit:
    """The fit of the link between two endpoints with ``senders`` streams at once."""
    if a.same_node(b):
        return site.intra_node_fit(a.partition, senders)
    return site.inter_node_fit(a.partition, b.partition, senders)


def p2p_seconds(site: Site, a: Endpoint, b: Endpoint, nbytes: float) -> float:
    """One activation (or its gradient) from a to b: a single stream."""
    if nbytes <= 0:
        return 0.0
    return nbytes / link_fit(site, a, b, 1).bandwidth(nbytes)


def _slowest(site: Site, holders: Sequence[Endpoint], senders: int, chunk: float) -> NetworkFit:
    """The slowest link a ring through ``holders`` must use (at message size ``chunk``)."""
    fits: dict[tuple, NetworkFit] = {}
    nodes = {(h.partition, h.node if h.node is not None else ("?", i)) for i, h in enumerate(holders)}
    parts = sorted({p for p, _ in nodes})
    if len(nodes) == 1:
        p = parts[0]
        fits[("intra", p)] = site.intra_node_fit(p, senders)
    else:
        for i, a in enumerate(parts):
            for b in parts[i:]:
                if a == b and sum(1 for p, _ in nodes if p == a) < 2:
                    continue
                fits[(a, b)] = site.inter_node_fit(a, b, senders)
    return min(fits.values(), key=lambda f: f.bandwidth(chunk))


def ring_allreduce_seconds(site: Site, holders: Sequence[Endpoint], per_gpu_bytes: Sequence[float],
                           bucket_bytes: Sequence[float] | None = None) -> float:
    """Ring all-reduce of one set of gradients among ``holders``.

    ``per_gpu_bytes[i]``: what one TP rank of holder i contributes (its shard). ``bucket_bytes[i]``:
    the largest piece reduced at once by holder i (None: all in one piece).
    """
    H = len(holders)
    if H <= 1:
        return 0.0
    worst = 0.0
    for i, (h, nbytes) in enumerate(zip(holders, per_gpu_bytes)):
        if nbytes <= 0:
            continue
        cap = nbytes if bucket_bytes is None else max(1.0, min(bucket_bytes[i], nbytes))
        full, rest = divmod(nbytes, cap)
        pieces = [cap] * int(full) + ([rest] if rest > 0 else [])
        total = 0.0
        for piece in pieces:
            chunk = piece / H
            fit = _slowest(site, holders, h.tp, chunk)
            total += 2 * (H - 1) * h.tp * chunk / fit.bandwidth(chunk)
        worst = max(worst, total)
    return worst
