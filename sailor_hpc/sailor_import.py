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

from pathlib import Path
from typing import Any

import numpy as np

from sailor_hpc.archive import (ComputeEntry, Entry, MemoryEntry, NetworkEntry, OverheadEntry, make_provenance,
                                write_entries)
from sailor_hpc.fields import read_json
from sailor_hpc.models import get_model
from sailor_hpc.network import NetworkFit

SAILOR_SOURCE = "Sailor published profiles (eth-easl/sailor cf2c8e3, MIT licence, (c) ETH Zurich)"

# Fixed per-GPU memory overhead in bytes, by TP degree: what nvidia-smi shows on the fullest GPU of a node
# besides the model state and activations (which the simulator models separately). Sailor never measured
# it; these are estimates from the parts that make it up, not a fit to the measured runs. The profiler
# measures the real value per GPU type (`sailor-hpc profile`), which then hides these estimates.
#
#   own CUDA context      PyTorch + CUDA 12 with lazy module loading: ~0.6 GB on Hopper (sm_90, the
#                         GH200's 64 KiB-page system), 0.5 GB A100, 0.4 GB V100, 0.3-0.35 GB consumer
#                         Turing/Ampere cards.
#   NCCL, network         communicators over the node's network (data-parallel, world, model-parallel,
#                         tied-embedding, one per pipeline neighbour): with GPUDirect RDMA (Clariden's
#                         Slingshot) every channel's SIMPLE (4 MiB) and LL128 (~4.6 MiB) buffers per
#                         direction live in GPU memory, ~0.1-0.15 GB per communicator -> 0.6 GB; over TCP
#                         sockets (the GCP VMs, the MIT cluster's Ethernet) they live in host memory -> 0.1.
#   NCCL, TP group        one ring/tree communicator inside the node when TP > 1: NVLink nodes run 16-32
#                         channels x ~18 MiB -> 0.4 GB; PCIe-only nodes 2-4 channels -> 0.2 GB.
#   workspaces, pools     cuBLAS/cuBLASLt workspaces and the caching allocator's small-block pool -> 0.3 GB.
#   other ranks' contexts the DeepSpeed/Megatron launch that produced Sailor's runs creates a CUDA context
#                         (and an NCCL barrier communicator) on device 0 for every local rank before it
#                         binds its own device (torch.distributed's "using GPU 0 to perform barrier"), so
#                         GPU 0 of a node carries (ranks per node - 1) x (context + 0.1 GB); in these runs a
#                         node hosts one TP group, so ranks per node = TP. nvidia-smi's max over ranks is
#                         that GPU. (A runtime that binds devices first does not pay this; the profiler's
#                         measurement then shows it.)
_CONTEXT_GB = {"GH-96": 0.6, "A100-80": 0.5, "A100-40": 0.5, "V100-16": 0.4, "Titan-RTX": 0.3, "RTX-2080": 0.3,
               "RTX-3090": 0.35}
_NET_GB = {"GH-96": 0.6, "A100-80": 0.1, "A100-40": 0.1, "V100-16": 0.1, "Titan-RTX": 0.1, "RTX-2080": 0.1,
           "RTX-3090": 0.1}
_TP_COMM_GB = {"GH-96": 0.4, "A100-80": 0.4, "A100-40": 0.4, "V100-16": 0.4, "Titan-RTX": 0.2, "RTX-2080": 0.2,
               "RTX-3090": 0.2}
_WORKSPACE_GB = 0.3
_BARRIER_COMM_GB = 0.1


def _overhead_estimate(gpu: str, tp: int) -> float:
    own = _CONTEXT_GB[gpu] + _NET_GB[gpu] + _WORKSPACE_GB + (_TP_COMM_GB[gpu] if tp > 1 else 0.0)
    others = (tp - 1) * (_CONTEXT_GB[gpu] + _BARRIER_COMM_GB)
    return round((own + others) * 1e9, -7)


OVERHEAD_ESTIMATES: dict[str, dict[int, float]] = {
    gpu: {tp: _overhead_estimate(gpu, tp) for tp in (1, 2, 4, 8)} for gpu in _CONTEXT_GB
}


def _read(path: Path) -> Any:
    return read_json(path, missing_fix="pass Sailor's data directory (with profiles/ and network/)")


def mismatched_models(memory: dict[str, Any]) -> dict[str, str]:
    """Sailor models whose profiled transformer block is not the catalog model of that name (then their
    profiles describe another network: Sailor's LLAMA-3-8 blocks have full multi-head attention, a
    16,384 FFN and a 50,304 vocabulary), with the reason. A block is compared at TP 1, to 1 %."""
    out = {}
    for sailor_model, by_tp in memory.items():
        spec = get_model(sailor_model)
        if "1" not in by_tp or spec.num_layers < 1:
            continue
        theirs = float(by_tp["1"]["1"]["params_floats"])
        ours = spec.block_params()
        if abs(theirs - ours) > 0.01 * ours:
            out[sailor_model] = (f"Sailor's {sailor_model} block has {theirs:,.0f} parameters, the catalog's "
                                 f"{spec.name} {ours:,.0f}: another model, not imported (profile {spec.name} with "
                                 "`sailor-hpc profile`)")
    return out


def sailor_entries(data_dir: str | Path, skipped: dict[str, str] | None = None) -> list[Entry]:
    """Every archive entry that Sailor's data directory yields; models whose profiles are of another
    network than the catalog's model of that name are left out (with the reason in ``skipped``)."""
    root = Path(data_dir)
    prov = make_provenance(SAILOR_SOURCE, dtype="fp32", data_dir=str(root.resolve()))
    entries: list[Entry] = []
    compute = _read(root / "profiles" / "compute_profiles.json")
    memory = _read(root / "profiles" / "memory_profiles.json")
    other = mismatched_models(memory)
    if skipped is not None:
        skipped.update(other)
    for sailor_model, gpus in compute.items():
        if sailor_model in other:
            continue
        model = get_model(sailor_model).name
        for gpu, by_mbs in gpus.items():
            for mbs, by_tp in by_mbs.items():
                for tp, layers in by_tp.items():
                    times = np.array([layers[str(i)] for i in range(len(layers))], dtype=np.float64)
                    entries.append(ComputeEntry(model, gpu, int(mbs), int(tp), times, dict(prov)))
    for sailor_model, by_tp in memory.items():
        if sailor_model in other:
            continue
        model = get_model(sailor_model).name
        for tp, layers in by_tp.items():
            rows = [[layers[str(i)][k] for k in ("params_floats", "act_output_floats", "act_input_floats", "act_mem_bytes")]
                    for i in range(len(layers))]
            entries.append(MemoryEntry(model, int(tp), np.array(rows, dtype=np.float64), dict(prov)))
    for gpu, by_tp in OVERHEAD_ESTIMATES.items():
        entries.append(OverheadEntry(gpu, dict(by_tp), make_provenance(
            "estimate (see sailor_hpc/sailor_import.py OVERHEAD_ESTIMATES)", dtype="fp32")))
    homo = _read(root / "network" / "network_coeffs_all_homo.json")
    for kind, by_gpu in homo.items():
        for gpu, by_k in by_gpu.items():
            for k, entry in by_k.items():
                entries.append(NetworkEntry("sailor", kind, gpu, gpu, int(k), NetworkFit.from_sailor(entry), dict(prov)))
    return entries


def import_sailor(data_dir: str | Path, archive: str | Path, skipped: dict[str, str] | None = None) -> int:
    """Merge Sailor's profiles into ``archive``; returns the number of entries written."""
    return write_entries(archive, sailor_entries(data_dir, skipped))
