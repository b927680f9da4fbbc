"""Sites of several clusters and network islands: links, latency, egress prices, the shipped multi-zone
site against Sailor's raw JSON, and one test per validation error."""
from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.sailor_compat.multizone import HEADER, multizone_site
from sailor_hpc.core.site import load_site, load_site_dict
from sailor_hpc.core.toml_writer import dump_toml
from tests.data import SAILOR_DATA, SITE_CONFIGS

_NET = {"intra_node": {"4": {"constant_gbps": 100.0}}, "inter_node": {"1": {"constant_gbps": 10.0}}}


def _doc() -> dict[str, Any]:
    """Two clusters; the first has two islands (fabrics), the second reads its own slurm.conf."""
    def part(name: str, cluster: str, island: str = "") -> dict[str, Any]:
        return {"name": name, "gpu_type": "A100-40", "nodes": 2, "gpus_per_node": 4, "cluster": cluster,
                **({"island": island} if island else {}), "network": _NET}
    return {
        "name": "two", "gpu_types": {"A100-40": {"memory_gib": 40}},
        "clusters": [{"name": "north", "slurm_cluster": "north"}, {"name": "south", "slurm_conf": "/etc/south.conf"}],
        "partitions": [part("n1", "north", "fab1"), part("n2", "north", "fab2"), part("n3", "north", "fab2"),
                       part("s1", "south")],
        "network": {"between": [
            {"clusters": ["north", "south"], "latency_us": 500.0, "cost_per_gb": 0.02,
             "links": {"1": {"constant_gbps": 1.0}}},
            {"islands": ["fab1", "fab2"], "links": {"1": {"constant_gbps": 4.0}}},
            {"partitions": ["n1", "n3"], "links": {"1": {"constant_gbps": 8.0}}},
        ]},
    }


def test_links_resolve_partition_then_cluster_then_island_then_own_network() -> None:
    site = load_site_dict(_doc())
    mb = 1e6
    assert site.inter_node_fit("n1", "s1", 1).transfer_time(mb) == pytest.approx(500e-6 + mb / 1e9)  # WAN + latency
    assert site.inter_node_fit("n1", "n2", 1).transfer_time(mb) == pytest.approx(mb / 4e9)  # between islands
    assert site.inter_node_fit("n1", "n3", 1).transfer_time(mb) == pytest.approx(mb / 8e9)  # measured pair wins
    assert site.inter_node_fit("n2", "n3", 1).transfer_time(mb) == pytest.approx(mb / 10e9)  # same island
    assert site.inter_node_fit("n1", "s1", 1).transfer_time(0) == 0.0  # no message, no latency
    assert (site.egress_cost_per_gb("n1", "s1"), site.egress_cost_per_gb("n1", "n2")) == (0.02, 0.0)
    assert site.cluster("south").slurm_conf == "/etc/south.conf" and site.cluster_of("n2") == "north"


def test_round_trip_keeps_clusters_islands_latency_and_prices() -> None:
    site = load_site_dict(_doc())
    again = load_site_dict(site.to_dict())
    assert (again.partitions, again.clusters, again.links, again.between) == (
        site.partitions, site.clusters, site.links, site.between)


def test_one_cluster_sites_have_no_clusters_and_no_egress() -> None:
    site = load_site(SITE_CONFIGS / "a100-v100.toml")
    assert site.clusters == () and site.cluster_of("a100") == "" and site.egress_cost_per_gb("a100", "v100") == 0.0


def test_shipped_multizone_site_is_sailors_data() -> None:
    """Every link is the slower of Sailor's two measured directions, evaluated from the raw JSON."""
    site = load_site(SITE_CONFIGS / "gcp-multizone.toml")
    raw = json.loads((SAILOR_DATA / "network" / "multizone_bandwidths.json").read_text())
    egress = json.loads((SAILOR_DATA / "network" / "egress_cost_usd_per_gb.json").read_text())
    zones = [c.name for c in site.clusters]
    assert zones == ["us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f", "us-west1-b"]
    assert all(p.total_gpus == 128 and p.gpu_type == "A100-40" for p in site.partitions)
    def sailor(src: str, dst: str, k: str, u: float) -> float:
        (x, y, z), peak = raw[src]["A100-40"][k][dst]["A100-40"][k]
        return min((x * u * u + y * u + z) * 1e9, peak)

    for a in zones:
        for b in zones:
            for k in ("1", "2", "4"):
                fit = site.inter_node_fit(f"a100-{a}", f"a100-{b}", int(k))
                peaks = [raw[s]["A100-40"][k][d]["A100-40"][k][1] for s, d in ((a, b), (b, a))]
                src, dst = (a, b) if peaks[0] <= peaks[1] else (b, a)
                for nbytes in (2**20, 2**26):
                    expected = sailor(src, dst, k, math.log2(nbytes / 1e6))
                    assert fit.fitted_bandwidth(nbytes) == pytest.approx(expected, rel=1e-9)
            if a != b:
                assert site.egress_cost_per_gb(f"a100-{a}", f"a100-{b}") == egress[a][b]
    shipped = (SITE_CONFIGS / "gcp-multizone.toml").read_text()
    assert shipped == dump_toml(multizone_site(SAILOR_DATA, 128), HEADER)  # regenerated, byte for byte


@pytest.mark.parametrize("edit, field, words", [
    (lambda d: d["partitions"][0].pop("cluster"), "partitions[0].cluster", "is missing"),
    (lambda d: d["partitions"][0].update(cluster="west"), "partitions[0].cluster", "not a declared cluster"),
    (lambda d: d.pop("clusters"), "partitions[0].cluster", "declares no [[clusters]]"),
    (lambda d: d["network"]["between"].pop(0), "network.between", "no link between clusters"),
    (lambda d: d["network"]["between"][1].update(cost_per_gb=1.0), "network.between[1].cost_per_gb",
     "bytes between clusters"),
    (lambda d: d["network"]["between"][0].update(cost_per_gb=-1.0), "network.between[0].cost_per_gb", ">= 0"),
    (lambda d: d["network"]["between"][0].update(latency_us=-1.0), "network.between[0].latency_us", ">= 0"),
    (lambda d: d["network"]["between"][1].update(partitions=["n1", "n2"]), "network.between[1]", "exactly one of"),
    (lambda d: d["network"]["between"][0].update(clusters=["north", "east"]), "network.between[0].clusters",
     "two different declared clusters"),
    (lambda d: d["network"]["between"].append(copy.deepcopy(d["network"]["between"][1])),
     "network.between[3].islands", "given twice"),
    (lambda d: d["partitions"][3].update(island="fab1"), "partitions[3].island", "already in cluster"),
    (lambda d: d["clusters"][0].update(slurm_conf="x.conf"), "clusters[0].slurm_conf", "not both"),
    (lambda d: d["clusters"].append({"name": "north"}), "clusters[2].name", "declared twice"),
    (lambda d: d["clusters"][0].update(name="no rth"), "clusters[0].name", "valid Slurm name"),
])
def test_bad_multi_cluster_sites_name_the_field(edit: Any, field: str, words: str) -> None:
    doc = _doc()
    edit(doc)
    with pytest.raises(SailorError) as info:
        load_site_dict(doc, source="two.toml")
    assert info.value.field == field and words in str(info.value) and info.value.fix
    assert "two.toml" in str(info.value)
