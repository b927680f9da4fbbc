"""Build a site config from a live Slurm cluster, and read its current GPU availability.

``discover_site()`` asks ``scontrol`` for the partitions and nodes and returns a site document
(same schema as ``site_configs/*.toml``, loadable with ``sailor_hpc.core.site.load_site_dict``):
one partition per Slurm partition that has GPU nodes. ``dump_site_toml()`` writes it as TOML.
``live_availability()`` counts idle GPUs and nodes per partition from ``sinfo -N`` (for the
planner's ``--available live``). ``check_reachable()`` and ``missing_partitions()`` compare a site with
the live cluster before a job is queued.
"""
from __future__ import annotations

import os
import re
import shutil
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sailor_hpc.core.errors import SlurmUnavailable
from sailor_hpc.core.site import format_slurm_time, slurm_time_seconds
from sailor_hpc.core.start_times import STARTS_JOBS
from sailor_hpc.core.toml_writer import dump_toml
from sailor_hpc.slurm.commands import (
    PING_TIMEOUT_S,
    GresEntry,
    NodeInfo,
    PartitionInfo,
    SlurmCommandMissing,
    run_slurm,
    show_config,
    show_nodes,
    show_partitions,
    sinfo_nodes,
    slurm_env,
)

SITE_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class KnownGpu:
    name: str          # GPU type name used by the profile archives
    memory_gib: float
    aliases: tuple[str, ...]   # lower-case gres type strings seen on clusters


# Slurm gres types seen in the wild → profile GPU type names (see site_configs/ and the profile archive).
# Memory: what a process can allocate where it was measured (A100-40: 39.43 GiB, GH-96: 95.58 GiB, as in
# site_configs/); the marketed size elsewhere.
KNOWN_GPUS: tuple[KnownGpu, ...] = (
    KnownGpu("A100-40", 39.43, ("a100", "a100-40", "a100_40", "a100-40g", "a100_40g", "a100-40gb", "a100_40gb",
                             "a100-sxm4-40gb", "a100-pcie-40gb", "nvidia_a100-sxm4-40gb", "nvidia_a100-pcie-40gb")),
    KnownGpu("A100-80", 80, ("a100-80", "a100_80", "a100-80g", "a100_80g", "a100-80gb", "a100_80gb", "a100l",
                             "a100-sxm4-80gb", "a100-pcie-80gb", "nvidia_a100-sxm4-80gb", "nvidia_a100_80gb_pcie")),
    KnownGpu("V100-16", 16, ("v100", "v100-16", "v100_16", "v100-16g", "v100_16g", "v100-16gb", "v100_16gb",
                             "v100-sxm2-16gb", "v100-pcie-16gb", "tesla_v100-sxm2-16gb", "tesla_v100-pcie-16gb")),
    KnownGpu("V100-32", 32, ("v100-32", "v100_32", "v100-32g", "v100_32g", "v100-32gb", "v100_32gb",
                             "v100-sxm2-32gb", "tesla_v100-sxm2-32gb", "v100s")),
    KnownGpu("GH-96", 95.58, ("gh200", "gh", "gh-96", "gh200-96", "gh200_96", "nvidia_gh200_96gb", "nvidia_gh200_480gb")),
    KnownGpu("H100-80", 80, ("h100", "h100-80", "h100_80", "h100-80gb", "h100_80gb", "h100-sxm5-80gb",
                             "nvidia_h100_80gb_hbm3", "nvidia_h100_pcie", "h100_pcie")),
    KnownGpu("H200-141", 141, ("h200", "h200-141", "nvidia_h200")),
    KnownGpu("RTX-3090", 24, ("rtx3090", "3090", "rtx_3090", "rtx-3090", "geforce_rtx_3090", "nvidia_geforce_rtx_3090")),
    KnownGpu("RTX-2080", 11, ("rtx2080", "2080", "rtx_2080", "rtx-2080", "rtx2080ti", "2080ti", "rtx_2080_ti",
                              "geforce_rtx_2080_ti", "nvidia_geforce_rtx_2080_ti")),
    KnownGpu("Titan-RTX", 24, ("titanrtx", "titan_rtx", "titan-rtx", "titan", "nvidia_titan_rtx")),
    KnownGpu("L40S", 48, ("l40s", "nvidia_l40s")),
    KnownGpu("A40", 48, ("a40", "nvidia_a40")),
    KnownGpu("RTX-A6000", 48, ("a6000", "rtx_a6000", "rtxa6000", "nvidia_rtx_a6000")),
    KnownGpu("T4", 16, ("t4", "tesla_t4")),
    KnownGpu("P100", 16, ("p100", "tesla_p100", "tesla_p100-pcie-16gb")),
)
#: memory assumed for a gres type that is not in KNOWN_GPUS (the discovered TOML says to fix it)
UNKNOWN_GPU_MEMORY_GIB = 16.0
_MODEL_AND_MEMORY = re.compile(r"^([A-Za-z]+\d+)-(\d+)$")  # A100-40: model A100 with 40 GB
#: what Slurm says of a partition; a re-discovery into an existing site updates these and keeps the rest
SLURM_FACTS = ("gres", "nodes", "gpus_per_node", "cpus_per_node", "memory_per_node_mb", "max_nodes_per_job",
               "max_walltime")


def guess_gpu_type(gres_type: str | None) -> KnownGpu | None:
    """The known GPU for a Slurm gres type (``a100`` → A100-40), or None when unknown."""
    if not gres_type:
        return None
    key = gres_type.strip().lower()
    for g in KNOWN_GPUS:
        if key == g.name.lower() or key in g.aliases:
            return g
    return None


def memory_variants(known: KnownGpu) -> tuple[str, ...]:
    """The other known types of the same GPU model with another memory size (A100-40: A100-80)."""
    m = _MODEL_AND_MEMORY.match(known.name)
    if m is None:
        return ()
    return tuple(g.name for g in KNOWN_GPUS if g is not known and (v := _MODEL_AND_MEMORY.match(g.name))
                 and v.group(1) == m.group(1))


def guess_note(gres_type: str, known: KnownGpu, partitions: Sequence[str]) -> str:
    """Tell a person which GPU type discovery took a gres type for, whether the gres type says the memory, and
    which fields to edit when the guess is wrong."""
    where = ", ".join(repr(p) for p in partitions)
    fields = f"gpu_type of partition(s) {where} and [gpu_types.\"{known.name}\"] (its name and memory_gib)"
    variants = memory_variants(known)
    m = _MODEL_AND_MEMORY.match(known.name)
    said = m is not None and re.search(rf"(?<!\d){m.group(2)}(?!\d)", gres_type) is not None
    head = f"partition(s) {where}: GPU type {known.name!r} ({known.memory_gib:g} GiB per GPU)"
    if variants and not said:
        return (f"{head} guessed from gres type {gres_type!r}, which does not say the memory: if these are "
                f"{' or '.join(variants)}, edit {fields}")
    return f"{head} inferred from gres type {gres_type!r}; if that is wrong, edit {fields}"


# ------------------------------------------------------------------------------------------- walltime

def normalize_walltime(text: str | None) -> str | None:
    """Slurm time text → ``D-HH:MM:SS`` / ``HH:MM:SS``; None for UNLIMITED/INFINITE/unparseable
    (:func:`sailor_hpc.core.site.slurm_time_seconds` reads it)."""
    if text is None:
        return None
    try:
        seconds = slurm_time_seconds(text)
    except ValueError:
        return None
    return None if seconds is None else format_slurm_time(seconds)


# -------------------------------------------------------------------------------------------- discovery

@dataclass
class Discovery:
    """What :func:`discover` found: the site document and notes for a person (also TOML comments)."""

    site: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def toml(self) -> str:
        return dump_site_toml(self.site, comments=self.notes)


def _gpu_gres(node: NodeInfo) -> list[GresEntry]:
    return [g for g in node.gres if g.name == "gpu" and g.count > 0]


def _partition_doc(part: PartitionInfo, nodes: list[NodeInfo], notes: list[str],
                   gpu_types: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    gpu_nodes = [n for n in nodes if _gpu_gres(n)]
    if not gpu_nodes:
        notes.append(f"partition {part.name!r}: no GPU nodes (no gres/gpu), left out")
        return None
    if len(gpu_nodes) < len(nodes):
        notes.append(f"partition {part.name!r}: {len(nodes) - len(gpu_nodes)} of {len(nodes)} nodes have no GPU; "
                     "only the GPU nodes are counted")
    # the GPU type: the most common gres spec (by GPU count) in the partition
    by_spec: Counter[tuple[str, str | None]] = Counter()
    for n in gpu_nodes:
        for g in _gpu_gres(n):
            by_spec[(g.spec, g.type)] += g.count
    (spec, gtype), _ = by_spec.most_common(1)[0]
    if len(by_spec) > 1:
        notes.append(f"partition {part.name!r}: several GPU types ({', '.join(s for s, _ in by_spec)}); "
                     f"using {spec!r}, nodes of the other types are left out")
        gpu_nodes = [n for n in gpu_nodes if any(g.spec == spec for g in _gpu_gres(n))]
    counts = [sum(g.count for g in _gpu_gres(n) if g.spec == spec) for n in gpu_nodes]
    cpus = [n.cpus for n in gpu_nodes]
    mems = [n.real_memory_mb for n in gpu_nodes]
    for what, vals in (("GPUs", counts), ("CPUs", cpus), ("memory (MB)", mems)):
        if len(set(vals)) > 1:
            notes.append(f"partition {part.name!r}: nodes differ in {what} per node ({sorted(set(vals))}); "
                         "using the smallest")
    known = guess_gpu_type(gtype)
    if known is not None:
        type_name = known.name
        entry = gpu_types.setdefault(type_name, {"memory_gib": float(known.memory_gib), "aliases": []})
    else:
        type_name = gtype or "gpu"
        notes.append(f"partition {part.name!r}: gres type {gtype!r} is not a known GPU type; named it "
                     f"{type_name!r} with an assumed {UNKNOWN_GPU_MEMORY_GIB:g} GiB of memory: set gpu_types."
                     f"\"{type_name}\".memory_gib and rename it to the type used by your profiles")
        entry = gpu_types.setdefault(type_name, {"memory_gib": UNKNOWN_GPU_MEMORY_GIB, "aliases": []})
    if gtype and gtype != type_name and gtype not in entry["aliases"]:
        entry["aliases"].append(gtype)
    n_nodes = len(gpu_nodes)
    max_nodes = n_nodes if part.max_nodes is None else max(1, min(part.max_nodes, n_nodes))
    doc: dict[str, Any] = {
        "name": part.name,
        "gpu_type": type_name,
        "gres": spec,
        "nodes": n_nodes,
        "gpus_per_node": min(counts),
        "cpus_per_node": max(1, min(cpus)),
        "memory_per_node_mb": max(1, min(mems)),
        "max_nodes_per_job": max_nodes,
    }
    walltime = normalize_walltime(part.max_time)
    if part.max_time is not None and walltime is None:
        notes.append(f"partition {part.name!r}: cannot read MaxTime={part.max_time!r}; max_walltime left out")
    if walltime is not None:
        doc["max_walltime"] = walltime
    doc["cost_per_gpu_hour"] = 1.0
    state = part.state.upper()
    if state and state != "UP":
        notes.append(f"partition {part.name!r}: Slurm state is {part.state}")
    return doc


def discover(name: str | None = None, env: Mapping[str, str] | None = None) -> Discovery:
    """Read the live cluster (``scontrol show partition/node``) into a site document plus notes."""
    parts = show_partitions(env)
    nodes = show_nodes(env)
    notes: list[str] = []
    if name is None:
        try:
            name = show_config(env).get("ClusterName") or "discovered"
        except Exception:   # noqa: BLE001 - the name is cosmetic
            name = "discovered"
    gpu_types: dict[str, dict[str, Any]] = {}
    partitions = []
    owner: dict[str, str] = {}  # GPU node -> the partition that counts it
    for p in sorted(parts, key=lambda q: not q.default):  # the default partition first
        pnodes = [n for n in nodes if p.name in n.partitions]
        if not pnodes:
            notes.append(f"partition {p.name!r}: no nodes, left out")
            continue
        shared = sorted({owner[n.name] for n in pnodes if n.name in owner})
        if shared:  # the same GPUs twice would let the planner use GPUs the cluster does not have
            notes.append(f"partition {p.name!r} shares nodes with {', '.join(map(repr, shared))} (the same GPUs): "
                         "left out; replace that partition by this one if jobs should run here")
            continue
        doc = _partition_doc(p, pnodes, notes, gpu_types)
        if doc is not None:
            partitions.append(doc)
            owner.update({n.name: p.name for n in pnodes if _gpu_gres(n)})
    site: dict[str, Any] = {
        "schema_version": SITE_SCHEMA_VERSION,
        "name": name,
        "cost_unit": "GPU-hours",
        "slurm": {"account": "", "qos": "", "constraint": ""},
        "environment": {"prelude": []},
        "profiles": {"archive": ""},
        "gpu_types": gpu_types,
        "partitions": partitions,
    }
    guessed: dict[tuple[str, str], list[str]] = {}
    for part_doc in partitions:  # every known GPU type taken from a gres type: once per gres type, with its partitions
        gres_type = part_doc["gres"].partition(":")[2]
        if guess_gpu_type(gres_type) is not None:
            guessed.setdefault((gres_type, part_doc["gpu_type"]), []).append(part_doc["name"])
    for (gres_type, _name), names in guessed.items():
        known = guess_gpu_type(gres_type)
        assert known is not None
        notes.append(guess_note(gres_type, known, names))
    if partitions:
        notes.append("cost_per_gpu_hour = 1 on every partition and cost_unit = \"GPU-hours\" are placeholders "
                     "(Slurm knows no prices): plans are priced in GPU-hours, every partition's alike; set each "
                     "partition's cost_per_gpu_hour (and cost_unit, e.g. \"CHF\") to price them as your site does")
    else:
        notes.append("no partition with GPU nodes found: the site has no partitions and will not validate")
    return Discovery(site=site, notes=notes)


def refresh_site_doc(existing: Mapping[str, Any], found: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """An existing site document with what Slurm says now (:data:`SLURM_FACTS` of every partition it has, and the
    partitions it lacks, with their GPU types), keeping every choice of the site's author: its name, GPU types,
    costs, Slurm defaults, archive and network fits. Partitions Slurm no longer has are kept, with a note."""
    doc = {k: v for k, v in existing.items()}
    types = dict(existing.get("gpu_types", {}))
    parts = [dict(p) for p in existing.get("partitions", [])]
    by_name = {p["name"]: p for p in parts}
    notes: list[str] = []
    for new in found.get("partitions", []):
        old = by_name.get(new["name"])
        if old is None:
            parts.append(dict(new))
            if new["gpu_type"] not in types and not any(new["gpu_type"] in t.get("aliases", []) for t in types.values()):
                types[new["gpu_type"]] = found["gpu_types"][new["gpu_type"]]
            continue
        for key in SLURM_FACTS:
            if key in new:
                old[key] = new[key]
            else:
                old.pop(key, None)
        if old["max_nodes_per_job"] > old["nodes"]:
            old["max_nodes_per_job"] = old["nodes"]
    gone = [p["name"] for p in parts if p["name"] not in {n["name"] for n in found.get("partitions", [])}]
    if gone:
        notes.append(f"partition(s) {', '.join(map(repr, gone))} of the site are not GPU partitions of this Slurm "
                     "(kept: remove them if they are gone)")
    doc["gpu_types"], doc["partitions"] = types, parts
    return doc, notes


def discover_site(name: str | None = None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A site-config dict built from the live cluster; notes (unknown GPU types, ...) become warnings."""
    found = discover(name, env)
    for note in found.notes:
        warnings.warn(f"site discovery: {note}", DiscoveryWarning, stacklevel=2)
    return found.site


class DiscoveryWarning(UserWarning):
    """Something discovery had to guess or leave out."""


def dump_site_toml(d: Mapping[str, Any], comments: Sequence[str] = ()) -> str:
    """A site document as TOML text; ``comments`` (e.g. :attr:`Discovery.notes`) go on top as ``#`` lines."""
    header = [f"site config discovered from Slurm ({d.get('name', '?')}); review before use:"
              if comments else ""]
    header = [h for h in header if h] + [f"- {c}" for c in comments]
    return dump_toml(d, header_comments=header)


# ----------------------------------------------------------------------------------------- availability

def partition_states(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each partition's state as Slurm says it (``UP``, ``DOWN``, ``DRAIN``, ``INACTIVE``)."""
    return {p.name: (p.state or "UP").upper() for p in show_partitions(env)}


def live_availability(env: Mapping[str, str] | None = None,
                      partitions: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Idle GPUs and nodes per partition, now (``sinfo -N`` GRES and GRES in use).

    Per partition: ``state`` (Slurm's: UP, DOWN, DRAIN, INACTIVE), ``gres`` (most common GPU gres, e.g.
    ``gpu:a100``), ``nodes`` (all), ``nodes_usable`` (up and schedulable), ``nodes_idle`` (usable with no
    GPU in use), ``gpus`` (all), ``gpus_usable``, ``gpus_idle`` (free GPUs on usable nodes that still have
    a free CPU) and ``idle_gpus_by_node`` (node → free GPUs, usable nodes only). A partition that starts no
    job (not UP) has no usable node: its idle nodes would take a job that never starts.
    """
    states = partition_states(env)
    out: dict[str, dict[str, Any]] = {}
    for n in sinfo_nodes(env, partitions):
        p = out.setdefault(n.partition, {"state": states.get(n.partition, "UP"), "gres": None, "nodes": 0,
                                         "nodes_usable": 0, "nodes_idle": 0, "gpus": 0, "gpus_usable": 0,
                                         "gpus_idle": 0, "idle_gpus_by_node": {}, "_specs": Counter()})
        gpus, used = n.gpus, min(n.gpus_used, n.gpus)
        for g in n.gres:
            if g.name == "gpu":
                p["_specs"][g.spec] += g.count
        p["nodes"] += 1
        p["gpus"] += gpus
        if not n.usable or p["state"] not in STARTS_JOBS:
            continue
        p["nodes_usable"] += 1
        p["gpus_usable"] += gpus
        free = gpus - used if n.cpus_idle > 0 else 0
        p["gpus_idle"] += free
        p["idle_gpus_by_node"][n.name] = free
        if used == 0 and n.cpus_idle > 0:
            p["nodes_idle"] += 1
    for p in out.values():
        specs = p.pop("_specs")
        p["gres"] = specs.most_common(1)[0][0] if specs else None
    return out


# ------------------------------------------------------------------------------------- site vs. cluster

def check_reachable(env: Mapping[str, str] | None = None, *, submitit: bool = False) -> None:
    """``scontrol ping``: raises :class:`~sailor_hpc.slurm.commands.SlurmCommandMissing` (exit 2) without the
    Slurm client tools (``sbatch``; ``srun`` too for ``submitit``, which looks for it before it submits),
    :class:`SlurmUnavailable` (exit 3: try again later) when slurmctld does not answer."""
    path = slurm_env(env).get("PATH", os.defpath)
    for tool in ("sbatch", "srun") if submitit else ("sbatch",):
        if shutil.which(tool, path=path) is None:
            raise SlurmCommandMissing(f"Slurm command {tool!r} not found in PATH", field=tool,
                                      fix="run sailor-hpc where Slurm's client tools are on PATH (a login node)")
    proc = run_slurm(["scontrol", "ping"], env, timeout=PING_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        said = (proc.stdout.strip() or proc.stderr.strip() or "(no output)").splitlines()[-1]
        raise SlurmUnavailable(f"slurmctld does not answer: {said}", field="scontrol ping",
                               fix="check that slurmctld is up and SLURM_CONF names this cluster, then try again")


def missing_partitions(names: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """Those of ``names`` that Slurm has no partition of (``scontrol show partition``), in their order."""
    have = {p.name for p in show_partitions(env)}
    return [n for n in names if n not in have]
