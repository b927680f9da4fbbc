"""Fixtures of the simulator tests: the shipped sites, the embedded archive, and a tiny synthetic world
(tiny-gpt on one GPU type with constant-bandwidth links) where every number can be computed by hand."""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

from sailor_hpc.core.archive import ComputeEntry, MemoryEntry, OverheadEntry, ProfileArchive, open_archive
from sailor_hpc.core.site import Site, load_site, load_site_dict
from tests.data import SAILOR_DATA

REPO = Path(__file__).resolve().parents[2]
SITES = REPO / "site_configs"
VALIDATION = SAILOR_DATA / "validation"  # Sailor's measured runs, shipped with the package

# tiny-gpt: layer 0 embedding, 1..4 blocks, 5 head -> 6 pipeline layers
TINY_L = 6
TINY_FWD = np.array([0.001, 0.010, 0.010, 0.010, 0.010, 0.004])  # seconds at mbs 1, tp 1
TINY_BWD = 2 * TINY_FWD
TINY_UPDATE = 0.003
TINY_PARAMS = np.array([1000.0, 500.0, 500.0, 500.0, 500.0, 1000.0])  # elements per TP rank at tp 1
TINY_ACT = np.array([1e6, 4e6, 4e6, 4e6, 4e6, 6e6])  # retained bytes at mbs 1
TINY_OUT = np.full(TINY_L, 2048.0)  # elements of each layer's output
OVERHEAD = 1e9
TINY_SITE = {
    "name": "tiny", "cost_unit": "GPU-hours",
    "gpu_types": {"G1": {"memory_gib": 1.0, "dtypes": ["fp32", "bf16", "fp16"]}, "G2": {"memory_gib": 2.0}},
    "partitions": [
        {"name": "p1", "gpu_type": "G1", "nodes": 4, "gpus_per_node": 4, "cost_per_gpu_hour": 2.0,
         "network": {"intra_node": {"1": {"constant_gbps": 100.0}},
                     "inter_node": {"1": {"constant_gbps": 10.0}, "2": {"constant_gbps": 16.0}}}},
        {"name": "p2", "gpu_type": "G2", "nodes": 4, "gpus_per_node": 4, "cost_per_gpu_hour": 1.0,
         "network": {"intra_node": {"1": {"constant_gbps": 50.0}},
                     "inter_node": {"1": {"constant_gbps": 5.0}, "2": {"constant_gbps": 8.0}}}},
    ],
}


WAN_BPS, WAN_LATENCY_S, WAN_PRICE = 1e9, 100e-6, 0.5  # the link between the two clusters of two_cluster_site


def two_cluster_site() -> Site:
    """The tiny site with p1 in cluster c1 and p2 in cluster c2, joined by a 1 GB/s, 100 µs link priced
    0.5 per GB."""
    doc = copy.deepcopy(TINY_SITE)
    doc["clusters"] = [{"name": "c1"}, {"name": "c2", "slurm_cluster": "c2"}]
    doc["partitions"][0]["cluster"], doc["partitions"][1]["cluster"] = "c1", "c2"
    doc["network"] = {"between": [{"clusters": ["c1", "c2"], "latency_us": WAN_LATENCY_S * 1e6,
                                   "cost_per_gb": WAN_PRICE, "links": {"1": {"constant_gbps": WAN_BPS / 1e9}}}]}
    return load_site_dict(doc, source="<two clusters>")


def tiny_archive() -> ProfileArchive:
    """Profiles of tiny-gpt on G1 (mbs 1, 2; tp 1, 2) and G2 (twice as slow), memory at tp 1 and 2."""
    a = ProfileArchive()
    for gpu, slow in (("G1", 1.0), ("G2", 2.0)):
        for mbs in (1, 2):
            for tp in (1, 2):
                times = np.column_stack([TINY_FWD * mbs * slow / tp, TINY_BWD * mbs * slow / tp,
                                         np.full(TINY_L, TINY_UPDATE / tp)])
                a.add(ComputeEntry("tiny-gpt", gpu, mbs, tp, times, {"source": "test"}))
        a.add(OverheadEntry(gpu, {1: OVERHEAD, 2: OVERHEAD * 1.5}, {"source": "test"}))
    for tp in (1, 2):
        a.add(MemoryEntry("tiny-gpt", tp, np.column_stack([TINY_PARAMS / tp, TINY_OUT, TINY_OUT, TINY_ACT / tp]),
                          {"source": "test"}))
    return a


@pytest.fixture(scope="session")
def tiny_site() -> Site:
    return load_site_dict(TINY_SITE, source="<tiny>")


@pytest.fixture(scope="session")
def tiny() -> ProfileArchive:
    return tiny_archive()


@pytest.fixture(scope="session")
def clariden() -> Site:
    return load_site(SITES / "clariden.toml")


@pytest.fixture(scope="session")
def mit() -> Site:
    return load_site(SITES / "mit-mixed.toml")


@pytest.fixture(scope="session")
def a100v100() -> Site:
    return load_site(SITES / "a100-v100.toml")


@pytest.fixture(scope="session")
def sailor_archive() -> ProfileArchive:
    return open_archive()


def validation_dir() -> Path:
    if not VALIDATION.exists():
        pytest.fail(f"Sailor's measured runs are missing from the package ({VALIDATION}): reinstall it")
    return VALIDATION


# Two GPU types of different sizes and fixed overheads, one node each: the site of the tests that run a
# pipeline over mixed GPUs on CPU ranks (the runtime does not read the types, the simulator does)
MIXED_OVERHEAD = {"small": 300e6, "large": 900e6}  # per type, as a profile records it


def _mixed_partition(name: str) -> dict:
    return {"name": name, "gpu_type": name, "nodes": 1, "gpus_per_node": 2,
            "network": {"intra_node": {"1": {"constant_gbps": 1.0}}, "inter_node": {"1": {"constant_gbps": 1.0}}}}


MIXED_SITE = {"name": "mixed", "cost_unit": "GPU-hours",
              "gpu_types": {"small": {"memory_gib": 8.0}, "large": {"memory_gib": 24.0}},
              "partitions": [_mixed_partition("small"), _mixed_partition("large")],
              "network": {"between": [{"partitions": ["small", "large"], "links": {"1": {"constant_gbps": 1.0}}}]}}


def mixed_archive(model: str, mbs: int, profile: dict) -> ProfileArchive:
    """The layer profile one rank took (``{"times", "memory"}`` at TP 1) on both GPU types, each with its overhead."""
    archive = ProfileArchive()
    prov = {"source": "test"}
    for gpu, overhead in MIXED_OVERHEAD.items():
        archive.add(ComputeEntry(model, gpu, mbs, 1, np.array(profile["times"]), prov))
        archive.add(OverheadEntry(gpu, {1: overhead}, prov))
    archive.add(MemoryEntry(model, 1, np.array(profile["memory"]), prov))
    return archive
