"""The site file against the compute nodes (``sailor-hpc site doctor``): one short job per partition.

A new site's first question is whether its site file matches the nodes. For each partition, Slurm's nodes
(gres names and counts, CPUs, memory) are compared with the file, and one one-task job started as every
rank is (in the site's container, under the job's interpreter) reports what a rank sees:
:mod:`sailor_hpc.jobs.node_probe` (GPUs, driver/CUDA/torch/NCCL versions, the interfaces NCCL would use,
the token files the login side wrote into the folders that must be shared). Each difference that would
make a job fail or a plan wrong is a :class:`Finding` naming the site file's field and the fix, with the
measured value where one can be written into the file (``--write-site``).

The job asks for the GPUs Slurm's nodes have under the gres Slurm knows, not the site file's (which may be
what is wrong): so it still runs, and reports the rest, when the file's gres or GPU count is wrong.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sailor_hpc.core.site import GIB, Partition, Site
from sailor_hpc.jobs import node_probe
from sailor_hpc.slurm.container import rank_wrapper
from sailor_hpc.slurm.control import run_probe
from sailor_hpc.slurm.discover import guess_gpu_type
from sailor_hpc.slurm.partition_view import SlurmPartition

PROBE_SOURCE = Path(node_probe.__file__).read_text()
#: a GPU's memory in the site file may be below the card's (what a process can allocate), never above
MEMORY_SLACK = 1.01


@dataclass(frozen=True)
class Finding:
    """One way the site file and the nodes disagree: the field, what is wrong, the fix; ``value`` is what
    ``--write-site`` writes into the field (None: nothing it can measure and write, e.g. a folder)."""

    partition: str
    field: str
    message: str
    fix: str
    value: Any = None


@dataclass(frozen=True)
class Token:
    """A file the login side wrote into a folder every node must see; the job reads it at ``inside``."""

    field: str  # the site file's field or the option that names the folder
    folder: str
    path: str
    inside: str  # where a rank (in the container) finds it
    text: str


@dataclass
class PartitionCheck:
    """What the site file says, what Slurm and a rank on a node measured, and where they differ."""

    partition: str
    rows: list[tuple[str, str, str]] = field(default_factory=list)  # (what, the site file, measured)
    findings: list[Finding] = field(default_factory=list)
    facts: dict[str, Any] | None = None
    job_error: str | None = None

    def add(self, finding: Finding) -> None:
        """Record ``finding``, unless it is a measured value for a field that has one already (Slurm's GPU count
        and the rank's, which agree)."""
        if finding.value is None or all(f.field != finding.field for f in self.findings):
            self.findings.append(finding)

    def to_dict(self) -> dict[str, Any]:
        return {"partition": self.partition, "rows": [list(r) for r in self.rows],
                "findings": [f.__dict__ for f in self.findings], "facts": self.facts, "job_error": self.job_error}


def probe_options(slurm: SlurmPartition | None, gres: str) -> list[str]:
    """The node job's GPUs: all of one node's, under the gres Slurm has (the site's if Slurm knows it)."""
    if slurm is None or not slurm.gpu_gres:
        return ["--nodes=1"]
    spec = gres if gres in slurm.gpu_gres else slurm.main_gres
    assert spec is not None
    return ["--nodes=1", f"--gres={spec}:{slurm.gpu_gres[spec]}"]


def run_node_job(site: Site, part: Partition, slurm: SlurmPartition | None, python: str, tokens: Sequence[Token],
                 env: Mapping[str, str] | None) -> tuple[dict[str, Any] | None, str | None]:
    """Start :mod:`~sailor_hpc.jobs.node_probe` as a rank on a node of ``part``; its facts, or why none came."""
    wrapper = rank_wrapper(site.container)
    argv = wrapper.command([python, "-c", PROBE_SOURCE, *(t.inside for t in tokens)])
    proc = run_probe(part.name, argv, env, options=[*probe_options(slurm, part.gres), *wrapper.srun_options],
                     job_name="sailor-site-doctor")
    for line in proc.stdout.splitlines():
        if line.startswith(node_probe.MARKER):
            return json.loads(line[len(node_probe.MARKER):]), None
    said = (proc.stderr.strip() or proc.stdout.strip() or "(no output)").splitlines()[-3:]
    return None, f"exit {proc.returncode}: " + " | ".join(said)


def _gpu_type_of(name: str) -> str | None:
    """The GPU type name an nvidia-smi name stands for (``NVIDIA A100-SXM4-40GB`` -> ``A100-40``), if known."""
    return getattr(guess_gpu_type(name.strip().lower().replace(" ", "_")), "name", None)


def check_partition(site: Site, part: Partition, slurm: SlurmPartition | None, facts: dict[str, Any] | None,
                    job_error: str | None, tokens: Sequence[Token]) -> PartitionCheck:
    """The rows of the report for ``part`` and its findings."""
    c = PartitionCheck(part.name, facts=facts, job_error=job_error)
    key = f"partitions[{part.name}]"
    if slurm is None:
        c.add(Finding(part.name, f"{key}.name", f"Slurm has no node in partition {part.name!r}",
                      "correct the partition's name (sinfo -s lists Slurm's), or remove it"))
        return c
    _check_slurm(c, part, slurm, key)
    if facts is None:
        where = "environment.container" if site.container else "--python"
        fix = ("check the container on the nodes: the runtime on their PATH, the image readable there, each "
               "mount's target present in the image" if site.container else
               "pass --python with an interpreter the nodes have")
        c.add(Finding(part.name, where, f"the job on partition {part.name} gave no report ({job_error})",
                      fix))
        return c
    _check_gpus(c, site, part, facts, key)
    _versions(c, facts)
    _check_tokens(c, part, facts, tokens, site)
    return c


def _check_slurm(c: PartitionCheck, part: Partition, slurm: SlurmPartition, key: str) -> None:
    gres_text = ", ".join(f"{s} x {n}" for s, n in sorted(slurm.gpu_gres.items())) or "none"
    c.rows.append(("gres (GPUs per node)", f"{part.gres} x {part.gpus_per_node}", f"{gres_text} (Slurm)"))
    have = slurm.gpus_for(part.gres)
    if have is None:
        best = slurm.main_gres
        fix = f'set gres = "{best}"' if best else "move the partition's GPU nodes into it, or remove the partition"
        c.add(Finding(part.name, f"{key}.gres", f"Slurm's nodes of {part.name} have no gres {part.gres!r} "
                      f"(they have: {gres_text})", fix, best))
        have = slurm.gpu_gres.get(best) if best else None
    if have is not None and have != part.gpus_per_node:
        c.add(Finding(part.name, f"{key}.gpus_per_node", f"the site file says {part.gpus_per_node} GPUs "
                      f"per node, Slurm's nodes have {have}", f"set gpus_per_node = {have}", have))
    c.rows.append(("nodes", str(part.nodes), f"{len(slurm.nodes)} ({', '.join(slurm.nodes)})"))
    if part.nodes > len(slurm.nodes):
        c.add(Finding(part.name, f"{key}.nodes", f"the site file says {part.nodes} nodes, Slurm has "
                      f"{len(slurm.nodes)}", f"set nodes = {len(slurm.nodes)}", len(slurm.nodes)))
    for what, name, mine, theirs in (("CPUs per node", "cpus_per_node", part.cpus_per_node, slurm.cpus_per_node),
                                     ("memory per node (MB)", "memory_per_node_mb", part.memory_per_node_mb,
                                      slurm.memory_per_node_mb)):
        c.rows.append((what, str(mine), str(theirs)))
        if mine > theirs:  # a job asking for more would never start; less is a choice
            c.add(Finding(part.name, f"{key}.{name}", f"the site file says {mine}, Slurm's nodes have "
                          f"{theirs}", f"set {name} = {theirs}", theirs))


def _check_gpus(c: PartitionCheck, site: Site, part: Partition, facts: dict[str, Any], key: str) -> None:
    smi, torch, env = facts.get("nvidia_smi", {}), facts.get("torch", {}), facts.get("env", {})
    smi_gpus = smi.get("gpus") or []
    devices = torch.get("devices") or []
    assigned = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    if smi.get("found"):
        names = sorted({g["name"] for g in smi_gpus})
        smi_text = (f"{len(smi_gpus)} x {', '.join(names)}" if smi_gpus else smi.get("error", "no GPU"))
    else:
        smi_text = "no nvidia-smi"
    if not torch.get("found"):
        torch_text = "no torch in the job's interpreter"
    elif torch.get("error"):
        torch_text = f"torch does not import: {torch['error']}"
    else:
        torch_text = (f"{len(devices)} CUDA device(s)" if torch.get("cuda_available")
                      else f"no CUDA device (torch {torch.get('version')}, CUDA {torch.get('cuda') or 'none'})")
    c.rows.append(("GPUs a rank sees", f"{part.gpus_per_node} x {part.gpu_type}",
                   f"nvidia-smi: {smi_text}; torch: {torch_text}; Slurm: CUDA_VISIBLE_DEVICES="
                   f"{env.get('CUDA_VISIBLE_DEVICES', '(unset)')}"))
    if not facts.get("python", {}).get("sailor_hpc"):
        c.add(Finding(part.name, "environment.container.image" if site.container else "--python",
                      f"the job's interpreter {facts.get('python', {}).get('executable')} has no sailor-hpc, "
                      "which every rank starts through", "install sailor-hpc[runtime] into it (or the image)"))
    if not torch.get("found") or torch.get("error"):
        c.add(Finding(part.name, "environment.container.image" if site.container else "--python",
                      f"the job's interpreter cannot train: {torch_text}",
                      "install torch (sailor-hpc[runtime]) into the job's interpreter or the image"))
    if smi_gpus and torch.get("found") and not torch.get("cuda_available"):
        fix = ("pass the GPUs into the container (apptainer/singularity add --nv themselves; Charliecloud needs "
               "ch-fromhost --nvidia IMAGE) and use a CUDA build of torch" if site.container
               else "install a CUDA build of torch into the job's interpreter")
        c.add(Finding(part.name, "environment.container" if site.container else "--python",
                      f"nvidia-smi sees {len(smi_gpus)} GPU(s) but torch sees no CUDA device", fix))
    # how many GPUs a rank of a full node has: torch's count, else the driver's, else Slurm's assignment
    visible = (len(devices) if torch.get("cuda_available") else len(smi_gpus) if smi_gpus else len(assigned))
    if visible and visible < part.gpus_per_node:
        c.add(Finding(part.name, f"{key}.gpus_per_node", f"a job given a whole node sees {visible} GPU(s), "
                      f"the site file says {part.gpus_per_node}", f"set gpus_per_node = {visible}", visible))
    gpu = site.gpu(part.gpu_type)
    measured = [g["memory_mib"] for g in smi_gpus if g.get("memory_mib")] or [d["memory_mib"] for d in devices]
    if measured:
        have_gib = min(measured) / 1024
        c.rows.append(("memory per GPU (GiB)", f"{gpu.memory_bytes / GIB:.2f}", f"{have_gib:.2f}"))
        if gpu.memory_bytes / GIB > have_gib * MEMORY_SLACK:
            c.add(Finding(part.name, f"gpu_types.{gpu.name}.memory_gib", f"the site file says "
                          f"{gpu.memory_bytes / GIB:.2f} GiB, the GPUs have {have_gib:.2f} GiB",
                          f"set memory_gib = {have_gib:.2f}", round(have_gib, 2)))
    for name in sorted({g["name"] for g in smi_gpus} | {d["name"] for d in devices}):
        known = _gpu_type_of(name)
        if known is not None and known != gpu.name and known not in gpu.aliases:
            c.add(Finding(part.name, f"{key}.gpu_type", f"the site file says {gpu.name}, the nodes have "
                          f"{name} ({known})", f'set gpu_type = "{known}" (declared under [gpu_types])'))


def _versions(c: PartitionCheck, facts: dict[str, Any]) -> None:
    smi, torch, env = facts.get("nvidia_smi", {}), facts.get("torch", {}), facts.get("env", {})
    py = facts.get("python", {})
    container = next((f"{k}={v}" for k, v in env.items() if k in ("CH_RUNNING", "APPTAINER_CONTAINER",
                                                                  "SINGULARITY_CONTAINER", "ENROOT_ROOTFS",
                                                                  "PYXIS_VERSION")), "none seen")
    c.rows.append(("versions", "", f"driver {smi.get('driver') or '-'}, CUDA {smi.get('cuda') or '-'} (driver) / "
                   f"{torch.get('cuda') or '-'} (torch), torch {torch.get('version') or '-'}, "
                   f"NCCL {torch.get('nccl') or '-'}, Python {py.get('version')} ({py.get('executable')})"))
    c.rows.append(("container", "", container))
    addresses = {i["name"]: i.get("addresses", []) for i in facts.get("interfaces", [])}
    nccl = ", ".join(f"{n} ({', '.join(addresses.get(n, [])[:1]) or 'no address'})" for n in facts.get("nccl_interfaces", []))
    ifname = env.get("NCCL_SOCKET_IFNAME")
    c.rows.append(("NCCL interfaces", "", f"{nccl or 'none'} (NCCL_SOCKET_IFNAME={ifname or 'unset'}; all: "
                   f"{', '.join(addresses)})"))


def _check_tokens(c: PartitionCheck, part: Partition, facts: dict[str, Any], tokens: Sequence[Token], site: Site) -> None:
    seen = facts.get("tokens", {})
    for t in tokens:
        ok = seen.get(t.inside) == t.text
        c.rows.append((f"shared folder ({t.field})", t.folder, "seen by the node" if ok else "NOT seen by the node"))
        if not ok:
            fix = "put it on a filesystem every node mounts"
            if site.container:
                fix += " and mount it into the container (environment.container.mounts)"
            c.add(Finding(part.name, t.field, f"a rank on {facts.get('host')} does not see the file "
                          f"{t.path} written here: {t.folder} is not the same shared folder there", fix))


def measured_site(site: Site, checks: Sequence[PartitionCheck]) -> Site:
    """``site`` with every finding's measured value written into its field (what ``--write-site`` writes)."""
    parts = {p.name: p for p in site.partitions}
    gpu_types = dict(site.gpu_types)
    for check in checks:
        for f in check.findings:
            if f.value is None:
                continue
            name = f.field.rsplit(".", 1)[-1]
            if f.field.startswith("gpu_types."):
                g = site.gpu(f.field.split(".")[1])
                gpu_types[g.name] = replace(gpu_types[g.name], memory_bytes=int(f.value * GIB))
            else:
                p = replace(parts[f.partition], **{name: f.value})
                parts[f.partition] = replace(p, max_nodes_per_job=min(p.max_nodes_per_job, p.nodes))
    return replace(site, partitions=tuple(parts[p.name] for p in site.partitions), gpu_types=gpu_types)
