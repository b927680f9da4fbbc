"""The per-collective latency's data path and counts, without a process group: what the profiler measures is
kept in the archive and the site, and the deepspeed runtime charges it once per collective DeepSpeed issues,
as a collective issued alone after computing costs where that was measured (the counts the benchmark's meter
took on a run of DeepSpeed 0.19.8; ``benchmarks/collective_latency.py`` times the price against a timed run)."""
from __future__ import annotations

from pathlib import Path

import pytest

from sailor_hpc.core.archive import NetworkEntry, make_provenance, read_archive, write_entries
from sailor_hpc.core.deepspeed_plan import with_zero_stage
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import get_model
from sailor_hpc.core.network import NetworkFit
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from sailor_hpc.core.site import load_site_dict
from simulator import SimOptions, simulate
from simulator.network import Endpoint, collective_latency_seconds
from simulator.zero_collectives import layer_tensors, zero_collectives
from tests.simulator.conftest import TINY_SITE, tiny_archive


def _site(link: dict) -> dict:
    return {"name": "s", "cost_unit": "GPU-hours", "gpu_types": {"CPU": {"memory_gib": 16.0}},
            "partitions": [{"name": "cpu", "gpu_type": "CPU", "nodes": 2, "gpus_per_node": 2,
                            "network": {"intra_node": link, "inter_node": {"1": {"constant_gbps": 1.0}}}}]}


def test_tiny_gpt_step_collectives_are_those_counted_on_deepspeed() -> None:
    # benchmarks/simulator_vs_runtime.py --deepspeed-only: 2 / 6 / 9 / 59 collectives a step (DP 2, 4 micro-batches)
    spec = get_model("tiny-gpt")
    tensors = layer_tensors(spec, 0, spec.num_pipeline_layers - 1)
    assert len(tensors) == 52 and sum(tensors) * 4 == 873984  # the gradients' buffer the run all-reduces
    assert [sum(zero_collectives(z, 4, 1, tensors)) for z in range(4)] == [2, 6, 9, 59]
    assert zero_collectives(3, 4, 1, tensors)[1] == 52  # one gather per tensor: all under the persistence threshold
    llama = get_model("tiny-llama")  # RMSNorm and no biases: 6 tensors a block
    assert len(layer_tensors(llama, 0, llama.num_pipeline_layers - 1)) == 1 + 2 * 6 + 1 + 1


def test_latencies_round_trip_through_site_and_archive(tmp_path: Path) -> None:
    site = load_site_dict(_site({"1": {"constant_gbps": 2.0}, "collective_latency_us": 100.0,
                                 "gather_latency_us": 250.0}), source="t")
    table = site.partitions[0].intra_node
    assert table is not None
    assert (table.collective_latency_s, table.gather_latency_s) == pytest.approx((1e-4, 2.5e-4))
    assert table.for_senders(1).transfer_time(2e6) == pytest.approx(1e-3)  # a fit's message pays no extra latency
    back = load_site_dict(site.to_dict(), source="t2").partitions[0].intra_node
    assert back is not None and back.gather_latency_s == pytest.approx(2.5e-4)
    a, b = Endpoint("cpu", 0, 1), Endpoint("cpu", 0, 1)
    assert collective_latency_seconds(site, [a, b]) == pytest.approx((2e-4, 2.5e-4))  # 2(H-1) and H-1 ring steps
    path = tmp_path / "n.h5"
    fit = NetworkFit(coeffs=(0.1, 0.2, 3.0), max_gbps=4.0, collective_latency_s=1e-4, gather_latency_s=3e-4)
    write_entries(path, [NetworkEntry("lab", "intra", "cpu", "cpu", 2, fit, make_provenance("test"))])
    (read,) = read_archive(path).network["lab"]
    assert (read.fit.collective_latency_s, read.fit.gather_latency_s) == (1e-4, 3e-4)


def test_a_bad_latency_names_its_field() -> None:
    with pytest.raises(SailorError, match=r"intra_node\.gather_latency_us: must be a latency in µs >= 0"):
        load_site_dict(_site({"1": {"constant_gbps": 2.0}, "gather_latency_us": -3}), source="t")


def test_issued_latencies_round_trip_and_default_to_the_streamed_ones(tmp_path: Path) -> None:
    streamed = {"1": {"constant_gbps": 2.0}, "collective_latency_us": 100.0, "gather_latency_us": 250.0}
    site = load_site_dict(_site({**streamed, "issued_latency_us": 400.0, "issued_gather_latency_us": 900.0}),
                          source="t")
    a, b = Endpoint("cpu", 0, 1), Endpoint("cpu", 0, 1)
    assert collective_latency_seconds(site, [a, b]) == pytest.approx((2e-4, 2.5e-4))  # the stream's, kept
    assert collective_latency_seconds(site, [a, b], issued=True) == pytest.approx((8e-4, 9e-4))
    back = load_site_dict(site.to_dict(), source="t2").partitions[0].intra_node
    assert back is not None and (back.issued_latency_s, back.issued_gather_latency_s) == pytest.approx((4e-4, 9e-4))
    # a site (or archive) from before the issued latency was measured: the streamed one stands in
    old = load_site_dict(_site(streamed), source="t3")
    assert collective_latency_seconds(old, [a, b], issued=True) == pytest.approx((2e-4, 2.5e-4))
    assert "issued_latency_us" not in (old.partitions[0].intra_node or back).to_site_dict()
    path = tmp_path / "n.h5"
    fit = NetworkFit(coeffs=(0.1, 0.2, 3.0), max_gbps=4.0, collective_latency_s=1e-4, gather_latency_s=3e-4,
                     issued_latency_s=5e-4, issued_gather_latency_s=7e-4)
    write_entries(path, [NetworkEntry("lab", "intra", "cpu", "cpu", 2, fit, make_provenance("test")),
                         NetworkEntry("lab", "intra", "cpu", "cpu", 4, NetworkFit(coeffs=(0.1, 0.2, 3.0),
                                      collective_latency_s=1e-4), make_provenance("test"))])
    by_k = {e.senders: e.fit for e in read_archive(path).network["lab"]}
    assert (by_k[2].issued_latency_s, by_k[2].issued_gather_latency_s) == (5e-4, 7e-4)
    assert (by_k[4].issued_latency_s, by_k[4].issued_gather_latency_s) == (0.0, 0.0)  # not measured


def _ds_tiny(zero: int, m: int = 4) -> Plan:
    """tiny-gpt on one stage of G1 x 2 replicas (one node: the intra-node link), ``m`` micro-batches."""
    return with_zero_stage(Plan("tiny-gpt", 2 * m, (Pipeline(1, m, (Stage(0, 5, 1, "G1"),)),) * 2), zero)


def _tiny_with_latency(**lat_us: float) -> dict:
    doc = {**TINY_SITE, "partitions": [dict(p) for p in TINY_SITE["partitions"]]}
    p1 = doc["partitions"][0]
    p1["network"] = {**p1["network"], "intra_node": {**p1["network"]["intra_node"], **lat_us}}
    return doc


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_the_deepspeed_runtime_charges_each_collective_its_issued_latency(zero: int) -> None:
    # the step's collectives as counted on DeepSpeed's run (tiny-gpt, DP 2, 4 micro-batches: 2 / 6 / 9 / 59),
    # split into all-reduces or reduce-scatters (a ring's 2(H-1) = 2 steps) and all-gathers (H-1 = 1 step)
    reduces, gathers = [(2, 0), (4, 2), (7, 2), (7, 52)][zero]
    streamed = {"collective_latency_us": 100.0, "gather_latency_us": 250.0}
    archive, options = tiny_archive(), SimOptions(runtime="deepspeed")

    def step(**lat_us: float) -> float:
        site = load_site_dict(_tiny_with_latency(**lat_us), source="<tiny>")
        return simulate(_ds_tiny(zero), site, archive, options=options).iteration_time_s

    base = step(**streamed)
    # no issued latency measured: the streamed one prices every collective, as one measured equal to it would
    assert base == step(**streamed, issued_latency_us=100.0, issued_gather_latency_us=250.0) > step()
    issued = step(**streamed, issued_latency_us=400.0, issued_gather_latency_us=900.0)
    assert issued - base == pytest.approx(reduces * 2 * 300e-6 + gathers * 650e-6, rel=1e-6)
    # megatron_patch prices its buckets by their fits alone: no latency, streamed or issued, is added
    mp = [simulate(_ds_tiny(0), load_site_dict(_tiny_with_latency(**lat), source="<tiny>"), archive,
                   options=SimOptions.megatron_patch()).iteration_time_s
          for lat in ({}, {**streamed, "issued_latency_us": 400.0})]
    assert mp[0] == mp[1]
