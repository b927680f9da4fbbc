"""Sailor's measured links between two GPU types (``network/multizone_bandwidths_het.json``).

The file keys a fit by sender (zone, GPU type, k) and receiver (zone, GPU type, k). A site's
``[[network.between]]`` entry is one symmetric table per partition pair, so where both directions are
published for a k the slower one is kept (a stage boundary carries activations one way and gradients
the other, and the exchange is as slow as its slower direction). The shipped site configs copy these
tables (``tests/core/test_site_links.py`` checks they still match), so a heterogeneous link never falls
back to a partition's own inter-node fit when a measurement exists: on the MIT cluster that fallback
charged Titan-RTX <-> RTX-2080 at 2.86 GB/s where Sailor measured 0.11 GB/s.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from sailor_hpc.core.fields import read_json
from sailor_hpc.core.network import NetworkFit
from sailor_hpc.core.sailor_compat import SAILOR_DATA

HET_LINKS_FILE = SAILOR_DATA / "network" / "multizone_bandwidths_het.json"
DEFAULT_ZONE = "us-central1-a"  # the zone every Clariden and MIT measurement is filed under


def _fit(table: Any, zone: str, src: str, dst: str, k: str) -> NetworkFit | None:
    entry = table.get(zone, {}).get(src, {}).get(k, {}).get(zone, {}).get(dst, {}).get(k)
    return None if entry is None else NetworkFit.from_sailor(entry)


def published_between(gpu_a: str, gpu_b: str, *, zone: str = DEFAULT_ZONE,
                      path: str | Path = HET_LINKS_FILE) -> dict[int, NetworkFit]:
    """Fits of the link between nodes of ``gpu_a`` and ``gpu_b`` by senders k; empty when none is published."""
    table = read_json(Path(path), missing_fix="pass Sailor's data directory (with network/)")
    ks = set(table.get(zone, {}).get(gpu_a, {})) | set(table.get(zone, {}).get(gpu_b, {}))
    out: dict[int, NetworkFit] = {}
    for k in sorted(ks, key=int):
        fits = [f for f in (_fit(table, zone, gpu_a, gpu_b, k), _fit(table, zone, gpu_b, gpu_a, k)) if f is not None]
        if fits:
            out[int(k)] = min(fits, key=lambda f: f.peak_bytes_per_s)
    return out


__all__ = ["HET_LINKS_FILE", "DEFAULT_ZONE", "published_between"]
