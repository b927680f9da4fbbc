"""The shipped sites carry every link Sailor measured between their GPU types, exactly as published."""
from __future__ import annotations

import itertools
import json

import pytest

from sailor_hpc.core.network import NetworkFit
from sailor_hpc.core.sailor_compat.links import HET_LINKS_FILE, published_between
from sailor_hpc.core.site import load_site
from tests.data import SITE_CONFIGS


@pytest.mark.parametrize("site_file", ["mit-mixed.toml", "a100-v100.toml"])
def test_every_published_link_between_gpu_types_is_in_the_site(site_file: str) -> None:
    site = load_site(SITE_CONFIGS / site_file)
    for a, b in itertools.combinations(site.partitions, 2):
        if a.gpu_type == b.gpu_type:
            continue
        published = published_between(a.gpu_type, b.gpu_type)
        assert published, (a.gpu_type, b.gpu_type)
        table = site.between[frozenset((a.name, b.name))]
        assert table.fits == published
        for k in published:  # the simulator uses it, not the partitions' own fit
            assert site.inter_node_fit(a.name, b.name, k) == published[k]


def test_the_slower_direction_is_kept_and_one_way_entries_are_used() -> None:
    """Read straight from the JSON: RTX-2080 -> RTX-3090 is 0.1148 GB/s at k = 1, the other way 0.1157;
    Titan-RTX -> RTX-2080 at k = 2 is published one way only."""
    raw = json.loads(HET_LINKS_FILE.read_text())["us-central1-a"]

    def fit(src: str, dst: str, k: str) -> NetworkFit:
        return NetworkFit.from_sailor(raw[src][k]["us-central1-a"][dst][k])

    links = published_between("RTX-3090", "RTX-2080")
    assert links[1] == fit("RTX-2080", "RTX-3090", "1")
    assert fit("RTX-3090", "RTX-2080", "1").max_gbps > links[1].max_gbps
    assert "2" not in raw["RTX-2080"] or "Titan-RTX" not in raw["RTX-2080"]["2"]["us-central1-a"]
    assert published_between("RTX-2080", "Titan-RTX")[2] == fit("Titan-RTX", "RTX-2080", "2")
    # the fallback this replaces: Titan-RTX <-> RTX-2080, one stream, ~26 x too fast
    site = load_site(SITE_CONFIGS / "mit-mixed.toml")
    slow = published_between("Titan-RTX", "RTX-2080")[1]
    assert site.inter_node_fit("titan", "titan", 1).peak_bytes_per_s / slow.peak_bytes_per_s > 20
    assert published_between("GH-96", "Titan-RTX") == {}
