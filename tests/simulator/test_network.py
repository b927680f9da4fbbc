"""Transfer times: which link, how many streams, and the ring all-reduce, by hand."""
from __future__ import annotations

import dataclasses
import math

import pytest

from simulator.network import Endpoint, link_fit, ring_allreduce_seconds


def p2p_seconds(site, a: Endpoint, b: Endpoint, nbytes: float) -> float:
    """One message from a to b on its own (a single stream)."""
    return link_fit(site, a, b, 1).transfer_time(nbytes)


def gbps(coeffs, nbytes):
    a, b, c = coeffs
    u = math.log2(nbytes / 1e6)
    return (a * u * u + b * u + c) * 1e9


def test_activation_between_gh200_nodes_is_one_stream(clariden):
    # OPT-350M at micro-batch 8: 8 * 2048 * 1024 fp32 = 67 MB; single-stream inter-node fit of clariden.toml
    nbytes = 8 * 2048 * 1024 * 4
    want = nbytes / gbps((-0.16570216, 2.79431173, 11.74409677), nbytes)
    got = p2p_seconds(clariden, Endpoint("normal", 0, 4), Endpoint("normal", 1, 4), nbytes)
    assert got == pytest.approx(want, rel=1e-12)
    assert 2.5e-3 < got < 3.5e-3  # ~3 ms, what the measured 4-stage runs need per boundary


def test_same_node_uses_intra_node_link(tiny_site):
    a, b = Endpoint("p1", 0, 1), Endpoint("p1", 0, 1)
    assert p2p_seconds(tiny_site, a, b, 1e9) == pytest.approx(1e9 / 100e9)
    assert p2p_seconds(tiny_site, a, Endpoint("p1", 1, 1), 1e9) == pytest.approx(1e9 / 10e9)
    assert p2p_seconds(tiny_site, a, b, 0) == 0.0


def test_between_partitions_takes_the_slower_network(mit, tiny_site):
    # no measured cross-partition link: the slower partition's fit (RTX-3090 nodes: 1-Gbit class)
    unmeasured = dataclasses.replace(mit, links=dataclasses.replace(mit.links, partitions={}))
    fit = link_fit(unmeasured, Endpoint("rtx3090", 0, 2), Endpoint("titan", 0, 2), 1)
    assert fit.peak_bytes_per_s == pytest.approx(0.1157e9)
    assert p2p_seconds(tiny_site, Endpoint("p1", 0, 1), Endpoint("p2", 0, 1), 1e9) == pytest.approx(1e9 / 5e9)


def test_ring_allreduce_by_hand(tiny_site):
    # 4 holders, TP 2 each: 2 rings per node share the k=2 link (16 GB/s aggregate); per GPU 1e9 bytes in
    # buckets of 5e8: per bucket 2*(4-1) chunk transfers of 5e8/4 bytes, times 2 streams
    holders = [Endpoint("p1", n, 2) for n in range(4)]
    t = ring_allreduce_seconds(tiny_site, holders, [1e9] * 4, [5e8] * 4)
    per_bucket = 2 * 3 * 2 * (5e8 / 4) / 16e9
    assert t == pytest.approx(2 * per_bucket)


def test_ring_is_as_slow_as_its_slowest_link(tiny_site):
    fast = [Endpoint("p1", 0, 1), Endpoint("p1", 1, 1)]
    mixed = [Endpoint("p1", 0, 1), Endpoint("p2", 0, 1)]
    assert ring_allreduce_seconds(tiny_site, fast, [1e9, 1e9]) == pytest.approx(2 * 1 * 5e8 / 10e9)
    assert ring_allreduce_seconds(tiny_site, mixed, [1e9, 1e9]) == pytest.approx(2 * 1 * 5e8 / 5e9)
    assert ring_allreduce_seconds(tiny_site, fast[:1], [1e9]) == 0.0
    # both holders on one node: intra-node
    same = [Endpoint("p1", 2, 1), Endpoint("p1", 2, 1)]
    assert ring_allreduce_seconds(tiny_site, same, [1e9, 1e9]) == pytest.approx(2 * 1 * 5e8 / 100e9)
