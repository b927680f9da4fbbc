"""A small heterogeneous site and a tiny-gpt archive made from measured OPT-350M layers."""
from __future__ import annotations

import pytest

from sailor_hpc.core.archive import EMBEDDED_ARCHIVE, read_archive
from sailor_hpc.core.site import Site, load_site_dict
from tests.data.tiny_archive import write_tiny_archive


def small_site(a100_nodes: int = 1, v100_nodes: int = 1, gpus_per_node: int = 2) -> Site:
    fit = {"1": {"constant_gbps": 2.0}, "2": {"constant_gbps": 3.0}}
    intra = {"2": {"constant_gbps": 100.0}}

    def part(name: str, gpu: str, nodes: int, cost: float) -> dict:
        return {"name": name, "gpu_type": gpu, "gres": f"gpu:{name}", "nodes": nodes, "gpus_per_node": gpus_per_node,
                "cost_per_gpu_hour": cost, "network": {"intra_node": intra, "inter_node": fit}}

    return load_site_dict({"name": "small", "gpu_types": {"A100-40": {"memory_gib": 39.43}, "V100-16": {"memory_gib": 16}},
                           "partitions": [part("a100", "A100-40", a100_nodes, 1.0),
                                          part("v100", "V100-16", v100_nodes, 0.25)]}, source="small.toml")


@pytest.fixture(scope="session")
def tiny_archive(tmp_path_factory: pytest.TempPathFactory):
    path = write_tiny_archive(tmp_path_factory.mktemp("tiny") / "tiny.h5")
    return read_archive(path, EMBEDDED_ARCHIVE)
