"""The per-collective latency's data path and counts, without a process group: what the profiler measures is
kept in the archive and the site, and the deepspeed runtime charges it once per collective DeepSpeed issues
(the counts the benchmark's meter took on a run of DeepSpeed 0.19.8; ``benchmarks/collective_latency.py`` times the
price against a timed run)."""
from __future__ import annotations

from pathlib import Path

import pytest

from sailor_hpc.core.archive import NetworkEntry, make_provenance, read_archive, write_entries
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import get_model
from sailor_hpc.core.network import NetworkFit
from sailor_hpc.core.site import load_site_dict
from simulator.network import Endpoint, collective_latency_seconds
from simulator.zero_collectives import layer_tensors, zero_collectives


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
