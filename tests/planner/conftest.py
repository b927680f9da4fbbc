"""A small heterogeneous site and a tiny-gpt archive made from measured OPT-350M layers."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sailor_hpc.archive import (EMBEDDED_ARCHIVE, ComputeEntry, MemoryEntry, make_provenance, read_archive,
                                write_entries)
from sailor_hpc.site import Site, load_site_dict

# tiny-gpt's 6 pipeline layers borrow OPT-350M's embedding, first four blocks and head
OPT_ROWS = [0, 1, 2, 3, 4, 25]


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
    path = tmp_path_factory.mktemp("tiny") / "tiny.h5"
    opt = read_archive(EMBEDDED_ARCHIVE)
    prov = make_provenance("test: OPT-350M layers 0-4 and 25 of the Sailor profiles")
    entries = []
    for gpu in ("A100-40", "V100-16"):
        for (mbs, tp), e in opt.compute_points("OPT-350M", gpu).items():
            if mbs <= 4 and tp <= 2:
                entries.append(ComputeEntry("tiny-gpt", gpu, mbs, tp, np.asarray(e.times)[OPT_ROWS], prov))
    for tp in (1, 2):
        entries.append(MemoryEntry("tiny-gpt", tp, np.asarray(opt.memory_table("OPT-350M", tp).table)[OPT_ROWS], prov))
    write_entries(path, entries)
    return read_archive(path, EMBEDDED_ARCHIVE)
