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

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sailor_hpc.core.archive import (
    ComputeEntry,
    Entry,
    MemoryEntry,
    NetworkEntry,
    OverheadEntry,
    make_provenance,
    write_entries,
)
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.fields import read_json
from sailor_hpc.core.models import ModelSpec, get_model
from sailor_hpc.core.network import NetworkFit

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


_JSON_FIX = "correct this field of Sailor's data (layout: the docstring of sailor_hpc/core/sailor_compat/profiles.py)"
_MEMORY_KEYS = ("params_floats", "act_output_floats", "act_input_floats", "act_mem_bytes")


@dataclass(frozen=True)
class _At:
    """A place in one of Sailor's JSON files: every value is checked where it is read, so a wrong nesting
    or a word where a number belongs is reported with file and field, not as a traceback."""

    file: Path
    field: str = ""

    def at(self, key: object) -> _At:
        return _At(self.file, f"{self.field}.{key}" if self.field else str(key))

    def error(self, message: str, fix: str = _JSON_FIX) -> SailorError:
        return SailorError(message, file=self.file, field=self.field or None, fix=fix)

    def obj(self, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.error(f"must be a JSON object, got {type(value).__name__} {_short(value)}")
        return value

    def items(self, value: Any) -> list[tuple[_At, str, Any]]:
        return [(self.at(k), k, v) for k, v in self.obj(value).items()]

    def count(self, key: str) -> int:
        """A key that is a micro-batch size, TP degree or number of senders."""
        if not (key.isdigit() and int(key) > 0):
            raise self.error(f"key {key!r} is not a positive integer")
        return int(key)

    def number(self, value: Any, *, signed: bool = False) -> float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or (not signed and value < 0):
            kind = "a finite number" if signed else "a non-negative finite number"
            raise self.error(f"must be {kind}, got {_short(value)}")
        return float(value)

    def numbers(self, value: Any, n: int, *, signed: bool = False) -> list[float]:
        if not isinstance(value, list) or len(value) != n:
            raise self.error(f"must be a list of {n} numbers, got {_short(value)}")
        return [self.at(i).number(v, signed=signed) for i, v in enumerate(value)]

    def model(self, name: str) -> ModelSpec:
        try:
            return get_model(name)
        except SailorError as exc:
            raise self.error(exc.message, fix=exc.fix or _JSON_FIX) from None

    def layers(self, value: Any, spec: ModelSpec) -> list[tuple[_At, Any]]:
        """Per-layer values, checked against the catalog's layer count (embedding + blocks + tail): a
        profile of another depth describes another network, and the simulator would read it as this one."""
        table = self.obj(value)
        L = spec.num_pipeline_layers
        if len(table) != L:
            raise self.error(f"has {len(table)} layers, but the catalog's {spec.name} has {L} (embedding + "
                             f"{spec.num_layers} blocks + {spec.tail_layers} tail)",
                             fix=f"import a profile of {spec.name} itself, or measure it with `sailor-hpc profile`")
        missing = [i for i in range(L) if str(i) not in table]
        if missing:
            raise self.error(f"layers are not numbered 0..{L - 1} (no layer {missing[0]})")
        return [(self.at(i), table[str(i)]) for i in range(L)]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _memory_row(at: _At, value: Any) -> list[float]:
    layer = at.obj(value)
    missing = [k for k in _MEMORY_KEYS if k not in layer]
    if missing:
        raise at.error(f"has no {missing[0]!r}")
    return [at.at(k).number(layer[k]) for k in _MEMORY_KEYS]


def _checked_memory(memory: Any, at: _At) -> None:
    """Every number of the memory profiles, before the models are compared (:func:`mismatched_models`)."""
    for m_at, sailor_model, by_tp in at.items(memory):
        m_at.model(sailor_model)
        for t_at, tp, layers in m_at.items(by_tp):
            t_at.count(tp)
            for l_at, _, row in t_at.items(layers):
                _memory_row(l_at, row)


def mismatched_models(memory: dict[str, Any]) -> dict[str, str]:
    """Sailor models whose profiled transformer block is not the catalog model of that name (then their
    profiles describe another network: Sailor's LLAMA-3-8 blocks have full multi-head attention, a
    16,384 FFN and a 50,304 vocabulary), with the reason. A block is compared at TP 1, to 1 %."""
    out = {}
    for sailor_model, by_tp in memory.items():
        spec = get_model(sailor_model)
        block = by_tp.get("1", {}).get("1")
        if block is None or spec.num_layers < 1:
            continue
        theirs = float(block["params_floats"])
        ours = spec.block_params()
        if abs(theirs - ours) > 0.01 * ours:
            out[sailor_model] = (f"Sailor's {sailor_model} block has {theirs:,.0f} parameters, the catalog's "
                                 f"{spec.name} {ours:,.0f}: another model, not imported (profile {spec.name} with "
                                 "`sailor-hpc profile`)")
    return out


def _compute_entries(compute: Any, at: _At, skip: dict[str, str], prov: dict[str, Any]) -> list[Entry]:
    entries: list[Entry] = []
    for m_at, sailor_model, gpus in at.items(compute):
        spec = m_at.model(sailor_model)
        if sailor_model in skip:
            continue
        for g_at, gpu, by_mbs in m_at.items(gpus):
            for b_at, mbs, by_tp in g_at.items(by_mbs):
                for t_at, tp, layers in b_at.items(by_tp):
                    rows = [l_at.numbers(v, 3) for l_at, v in t_at.layers(layers, spec)]
                    entries.append(ComputeEntry(spec.name, gpu, b_at.count(mbs), t_at.count(tp),
                                                np.array(rows, dtype=np.float64), dict(prov)))
    return entries


def _memory_entries(memory: Any, at: _At, skip: dict[str, str], prov: dict[str, Any]) -> list[Entry]:
    entries: list[Entry] = []
    for m_at, sailor_model, by_tp in at.items(memory):
        if sailor_model in skip:
            continue
        spec = m_at.model(sailor_model)
        for t_at, tp, layers in m_at.items(by_tp):
            rows = [_memory_row(l_at, v) for l_at, v in t_at.layers(layers, spec)]
            entries.append(MemoryEntry(spec.name, t_at.count(tp), np.array(rows, dtype=np.float64), dict(prov)))
    return entries


def _network_entries(homo: Any, at: _At, prov: dict[str, Any]) -> list[Entry]:
    """Sailor's ``{kind: {gpu: {senders: [[a, b, c], max_bytes_per_s]}}}``."""
    entries: list[Entry] = []
    for k_at, kind, by_gpu in at.items(homo):
        if kind not in ("intra", "inter"):
            raise k_at.error(f"link kind {kind!r} is neither 'intra' nor 'inter'")
        for g_at, gpu, by_k in k_at.items(by_gpu):
            for s_at, k, entry in g_at.items(by_k):
                if not isinstance(entry, list) or len(entry) != 2:
                    raise s_at.error(f"must be [[a, b, c], max_bytes_per_s], got {_short(entry)}")
                coeffs, max_bps = s_at.at(0).numbers(entry[0], 3, signed=True), s_at.at(1).number(entry[1])
                entries.append(NetworkEntry("sailor", kind, gpu, gpu, s_at.count(k),
                                            NetworkFit.from_sailor([coeffs, max_bps]), dict(prov)))
    return entries


def sailor_entries(data_dir: str | Path, skipped: dict[str, str] | None = None) -> list[Entry]:
    """Every archive entry that Sailor's data directory yields; models whose profiles are of another
    network than the catalog's model of that name are left out (with the reason in ``skipped``). Any
    value that is not as described above is refused (SailorError naming file and field): nothing of a
    malformed directory is imported."""
    root = Path(data_dir)
    prov = make_provenance(SAILOR_SOURCE, dtype="fp32", data_dir=str(root.resolve()))
    compute_file, memory_file = root / "profiles" / "compute_profiles.json", root / "profiles" / "memory_profiles.json"
    homo_file = root / "network" / "network_coeffs_all_homo.json"
    compute, memory = _read(compute_file), _read(memory_file)
    _checked_memory(memory, _At(memory_file))
    other = mismatched_models(memory)
    if skipped is not None:
        skipped.update(other)
    entries = _compute_entries(compute, _At(compute_file), other, prov)
    entries += _memory_entries(memory, _At(memory_file), other, prov)
    for gpu, by_tp in OVERHEAD_ESTIMATES.items():
        entries.append(OverheadEntry(gpu, dict(by_tp), make_provenance(
            "estimate (see sailor_hpc/core/sailor_compat/profiles.py OVERHEAD_ESTIMATES)", dtype="fp32")))
    return entries + _network_entries(_read(homo_file), _At(homo_file), prov)


def import_sailor(data_dir: str | Path, archive: str | Path, skipped: dict[str, str] | None = None) -> int:
    """Merge Sailor's profiles into ``archive``; returns the number of entries written."""
    return write_entries(archive, sailor_entries(data_dir, skipped))
