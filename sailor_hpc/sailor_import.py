"""Convert Sailor's published profiles (eth-easl/sailor, MIT licence) into a profile archive.

Sailor's data (see ``sailor_hpc/data/SAILOR_LICENSE``): per-layer compute times
``{model: {gpu: {mbs: {tp: {layer: [fwd, bwd, update]}}}}}`` and per-layer memory
``{model: {tp: {layer: {params_floats, act_output_floats, act_input_floats, act_mem_bytes, ...}}}}``,
both fp32, plus network fits per GPU type. Model names are mapped to the catalog's (OPT-350 -> OPT-350M).

Sailor never measured the fixed per-GPU memory overhead (CUDA context, communicator buffers, caching
allocator slack): its simulator uses one constant tuned on GH200. The estimates written here are
documented in :data:`OVERHEAD_ESTIMATES`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from sailor_hpc.archive import (ComputeEntry, Entry, MemoryEntry, NetworkEntry, OverheadEntry, make_provenance,
                                write_entries)
from sailor_hpc.errors import SailorError
from sailor_hpc.models import get_model
from sailor_hpc.network import NetworkFit

SAILOR_SOURCE = "Sailor published profiles (eth-easl/sailor cf2c8e3, MIT licence, (c) ETH Zurich)"

# Fixed per-GPU memory overhead in bytes, by TP degree (TP>1 adds NCCL communicator buffers).
# Estimate, not a fit to measured runs: a CUDA context with cuBLAS/cuDNN handles and workspaces
# (~0.6-1.0 GB, larger on newer architectures), NCCL buffers per communicator (~0.2-0.5 GB) and the
# caching allocator's reserved-but-unallocated slack that nvidia-smi counts. The profiler measures the
# real value per GPU type (`sailor-hpc profile`), which then hides these estimates.
OVERHEAD_ESTIMATES: dict[str, dict[int, float]] = {
    "GH-96": {1: 1.6e9, 2: 2.2e9},
    "A100-80": {1: 1.2e9, 2: 1.7e9},
    "A100-40": {1: 1.2e9, 2: 1.7e9},
    "V100-16": {1: 0.9e9, 2: 1.3e9},
    "Titan-RTX": {1: 0.9e9, 2: 1.3e9},
    "RTX-2080": {1: 0.8e9, 2: 1.2e9},
    "RTX-3090": {1: 1.0e9, 2: 1.4e9},
}


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SailorError("file not found", file=path, fix="pass Sailor's data directory (with profiles/ and network/)") from None
    except json.JSONDecodeError as exc:
        raise SailorError(f"not valid JSON: {exc}", file=path) from None


def sailor_entries(data_dir: str | Path) -> list[Entry]:
    """Every archive entry that Sailor's data directory yields."""
    root = Path(data_dir)
    prov = make_provenance(SAILOR_SOURCE, dtype="fp32", data_dir=str(root.resolve()))
    entries: list[Entry] = []
    compute = _load_json(root / "profiles" / "compute_profiles.json")
    for sailor_model, gpus in compute.items():
        model = get_model(sailor_model).name
        for gpu, by_mbs in gpus.items():
            for mbs, by_tp in by_mbs.items():
                for tp, layers in by_tp.items():
                    times = np.array([layers[str(i)] for i in range(len(layers))], dtype=np.float64)
                    entries.append(ComputeEntry(model, gpu, int(mbs), int(tp), times, dict(prov)))
    memory = _load_json(root / "profiles" / "memory_profiles.json")
    for sailor_model, by_tp in memory.items():
        model = get_model(sailor_model).name
        for tp, layers in by_tp.items():
            rows = [[layers[str(i)][k] for k in ("params_floats", "act_output_floats", "act_input_floats", "act_mem_bytes")]
                    for i in range(len(layers))]
            entries.append(MemoryEntry(model, int(tp), np.array(rows, dtype=np.float64), dict(prov)))
    for gpu, by_tp in OVERHEAD_ESTIMATES.items():
        entries.append(OverheadEntry(gpu, dict(by_tp), make_provenance(
            "estimate (see sailor_hpc/sailor_import.py OVERHEAD_ESTIMATES)", dtype="fp32")))
    homo = _load_json(root / "network" / "network_coeffs_all_homo.json")
    for kind, by_gpu in homo.items():
        for gpu, by_k in by_gpu.items():
            for k, entry in by_k.items():
                entries.append(NetworkEntry("sailor", kind, gpu, gpu, int(k), NetworkFit.from_sailor(entry), dict(prov)))
    return entries


def import_sailor(data_dir: str | Path, archive: str | Path) -> int:
    """Merge Sailor's profiles into ``archive``; returns the number of entries written."""
    return write_entries(archive, sailor_entries(data_dir))
