"""The replicas' drift the profiler measures on a link (``profiler.netbench.replica_jitter``): kept in the
archive and the site beside the link's latencies, and charged by the simulator as a partition's
``replica_jitter`` is (the larger of the two), so a profiled site prices the wait for the slowest replica
without a hand-set figure."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import h5py
import pytest

from sailor_hpc.core.archive import NetworkEntry, make_provenance, read_archive, write_entries
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.network import NetworkFit
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from sailor_hpc.core.site import load_site_dict
from simulator import SimOptions, simulate
from tests.simulator.conftest import TINY_SITE, tiny_archive

JITTER = 0.04
# two replicas of one stage on one node of p1: their gradient all-reduce crosses p1's intra-node link
DP2 = Plan("tiny-gpt", 8, (Pipeline(1, 4, (Stage(0, 5, 1, "G1"),)),) * 2)


def _site(partition: float = 0.0, link: float | None = None):
    doc = copy.deepcopy(TINY_SITE)
    p1 = doc["partitions"][0]
    if partition:
        p1["replica_jitter"] = partition
    if link is not None:
        p1["network"]["intra_node"]["replica_jitter"] = link
    return load_site_dict(doc, source="<tiny>")


@pytest.mark.parametrize("runtime", ["megatron_patch", "deepspeed"])
def test_a_links_measured_jitter_is_charged_as_a_partitions(runtime: str) -> None:
    archive, options = tiny_archive(), SimOptions(runtime=runtime)
    calm = simulate(DP2, _site(), archive, options=options)
    by_link = simulate(DP2, _site(link=JITTER), archive, options=options)
    by_partition = simulate(DP2, _site(partition=JITTER), archive, options=options)
    assert by_link.iteration_time_s == pytest.approx(by_partition.iteration_time_s, rel=1e-12)
    # the two replicas meet first at the gradient all-reduce, after the whole flush: the wait for the slower is
    # jitter * E[max of 2 standard normals] (1/sqrt(pi), in closed form) * the flush
    wait = JITTER / math.sqrt(math.pi) * calm.breakdown["flush_s"]
    assert by_link.iteration_time_s - calm.iteration_time_s == pytest.approx(wait, rel=1e-4)
    # the larger of the two figures counts
    both = simulate(DP2, _site(partition=JITTER / 2, link=JITTER), archive, options=options)
    assert both.iteration_time_s == pytest.approx(by_link.iteration_time_s, rel=1e-12)


def test_measured_jitter_round_trips_through_site_and_archive(tmp_path: Path) -> None:
    site = _site(link=JITTER)
    table = site.partitions[0].intra_node
    assert table is not None and table.replica_jitter == JITTER
    back = load_site_dict(site.to_dict(), source="t2").partitions[0].intra_node
    assert back is not None and back.replica_jitter == JITTER
    assert "replica_jitter" not in (_site().partitions[0].intra_node or table).to_site_dict()  # not measured: absent
    path = tmp_path / "n.h5"
    fits = {2: NetworkFit(coeffs=(0.1, 0.2, 3.0), collective_latency_s=1e-4, replica_jitter=0.07),
            4: NetworkFit(coeffs=(0.1, 0.2, 3.0), collective_latency_s=1e-4)}
    write_entries(path, [NetworkEntry("lab", "intra", "cpu", "cpu", k, fit, make_provenance("test"))
                         for k, fit in fits.items()])
    by_k = {e.senders: e.fit.replica_jitter for e in read_archive(path).network["lab"]}
    assert by_k == {2: 0.07, 4: 0.0}  # an entry measured before the drift was: none


@pytest.mark.parametrize("value", [-0.01, 0.5, "0.02", True])
def test_a_bad_measured_jitter_names_its_field(value: object) -> None:
    with pytest.raises(SailorError, match=r"intra_node\.replica_jitter: must be a fraction in \[0, 0\.5\)"):
        _site(link=value)  # type: ignore[arg-type]


def test_an_archive_with_an_impossible_jitter_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "n.h5"
    write_entries(path, [NetworkEntry("lab", "intra", "cpu", "cpu", 2, NetworkFit(coeffs=(0.1, 0.2, 3.0)),
                                      make_provenance("test"))])
    with h5py.File(path, "r+") as h5:
        (name,) = list(h5["network/lab"])
        h5[f"network/lab/{name}"].attrs["replica_jitter"] = 0.9
    with pytest.raises(SailorError, match="replica_jitter of 0.5 or more"):
        read_archive(path)
