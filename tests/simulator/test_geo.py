"""Plans across clusters: transfers over the measured cluster link (with its latency) and egress priced
per byte, every number computed by hand on the tiny synthetic world of ``conftest``."""
from __future__ import annotations

import pytest

from sailor_hpc.core.plan import Pipeline, Plan, Stage
from sailor_hpc.core.site import Site
from simulator import simulate
from simulator.cost import egress, ring_transfers
from tests.simulator.conftest import TINY_OUT, TINY_PARAMS, WAN_BPS, WAN_LATENCY_S, WAN_PRICE, two_cluster_site

LATENCY_S, PRICE = WAN_LATENCY_S, WAN_PRICE


@pytest.fixture(scope="module")
def two_clusters() -> Site:
    return two_cluster_site()


def _plan(*pipes: Pipeline) -> Plan:
    return Plan(model="tiny-gpt", global_batch_size=sum(p.samples for p in pipes), pipelines=pipes)


def test_a_pipeline_across_clusters_sends_over_the_link_and_pays_for_it(two_clusters, tiny) -> None:
    plan = _plan(Pipeline(1, 4, (Stage(0, 2, 1, "G1", "p1"), Stage(3, 5, 1, "G2", "p2"))))
    res = simulate(plan, two_clusters, tiny)
    act = TINY_OUT[2] * 4  # fp32 activation of layer 2, one micro-batch
    assert res.stages[0].act_send_s == pytest.approx(LATENCY_S + act / WAN_BPS)
    tied = TINY_PARAMS[5] * 4  # the head's tied embedding, all-reduced between the two stages (H = 2)
    crossing = act * 2 * 4 + 2 * tied  # 4 micro-batches forward and back; each end sends its whole tensor once
    assert res.egress_bytes == pytest.approx(crossing)
    assert res.egress_cost == pytest.approx(crossing / 1e9 * PRICE)
    assert res.cost_per_iteration == pytest.approx(res.cost_per_hour * res.iteration_time_s / 3600 + res.egress_cost)


def test_data_parallel_across_clusters_pays_the_gradient_ring(two_clusters, tiny) -> None:
    plan = _plan(Pipeline(1, 2, (Stage(0, 5, 1, "G1", "p1"),)), Pipeline(1, 2, (Stage(0, 5, 1, "G2", "p2"),)))
    res = simulate(plan, two_clusters, tiny)
    grads = TINY_PARAMS.sum() * 4
    assert res.egress_bytes == pytest.approx(2 * grads)  # H = 2: each replica sends 2(H-1)/H of the tensor
    [sync] = [c for c in res.collectives if c.kind == "grads"]
    assert sync.seconds == pytest.approx(2 * (LATENCY_S + grads / 2 / WAN_BPS))  # 2(H-1) chunks of grads/H


def test_inside_one_cluster_nothing_is_priced(two_clusters, tiny, tiny_site) -> None:
    plan = _plan(Pipeline(1, 2, (Stage(0, 2, 1, "G1", "p1"), Stage(3, 5, 1, "G1", "p1"))),
                 Pipeline(1, 2, (Stage(0, 5, 1, "G1", "p1"),)))
    for site in (two_clusters, tiny_site):
        res = simulate(plan, site, tiny)
        assert (res.egress_bytes, res.egress_cost) == (0.0, 0.0)
        assert res.cost_per_iteration == pytest.approx(res.cost_per_hour * res.iteration_time_s / 3600)


def test_ring_order_decides_how_often_it_crosses(two_clusters) -> None:
    """Holders in rank order p1, p2, p1, p2 cross four times; grouped by cluster, twice."""
    interleaved = list(ring_transfers(["p1", "p2", "p1", "p2"], 4e9))
    grouped = list(ring_transfers(["p1", "p1", "p2", "p2"], 4e9))
    assert all(nbytes == pytest.approx(6e9) for _, _, nbytes in interleaved)  # 2(H-1)/H of 4 GB
    assert egress(two_clusters, interleaved) == pytest.approx((24e9, 24 * PRICE))
    assert egress(two_clusters, grouped) == pytest.approx((12e9, 12 * PRICE))
