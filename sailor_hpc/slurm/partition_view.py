"""Slurm's own account of a site's partitions, for the site check (``sailor-hpc site doctor``): the GPU gres
its nodes offer, their CPUs and memory (``scontrol show node``), and Slurm's version.

A partition's nodes may differ; each figure is the smallest over the nodes that have it, as a job that
may land on any of them can count on no more.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sailor_hpc.slurm.commands import NodeInfo, run_slurm, show_nodes


@dataclass(frozen=True)
class SlurmPartition:
    """One partition as Slurm's nodes describe it."""

    name: str
    nodes: tuple[str, ...]
    gpu_gres: dict[str, int]  # gres spec ("gpu:a100", or "gpu" untyped) -> GPUs per node (smallest node)
    cpus_per_node: int
    memory_per_node_mb: int

    def gpus_for(self, gres: str) -> int | None:
        """GPUs per node under the site's ``gres``: its spec exactly, or any GPU for an untyped ``gpu``."""
        if gres in self.gpu_gres:
            return self.gpu_gres[gres]
        if gres == "gpu" and self.gpu_gres:
            return max(self.gpu_gres.values())
        return None

    @property
    def main_gres(self) -> str | None:
        """The spec with the most GPUs per node (the partition's GPU type), None without GPUs."""
        return max(self.gpu_gres, key=lambda s: self.gpu_gres[s]) if self.gpu_gres else None


def partition_of(name: str, nodes: list[NodeInfo]) -> SlurmPartition | None:
    """Partition ``name`` from its nodes (``scontrol show node``); None when no node belongs to it."""
    members = [n for n in nodes if name in n.partitions]
    if not members:
        return None
    per_spec: dict[str, list[int]] = {}
    for n in members:
        for g in n.gres:
            if g.name == "gpu" and g.count > 0:
                per_spec.setdefault(g.spec, []).append(g.count)
    return SlurmPartition(name=name, nodes=tuple(n.name for n in members),
                          gpu_gres={spec: min(counts) for spec, counts in per_spec.items()},
                          cpus_per_node=min(n.cpus for n in members),
                          memory_per_node_mb=min(n.real_memory_mb for n in members))


def slurm_partitions(names: list[str], env: Mapping[str, str] | None = None) -> dict[str, SlurmPartition | None]:
    """Each named partition as Slurm's nodes describe it (None: Slurm has no node in it)."""
    nodes = show_nodes(env)
    return {name: partition_of(name, nodes) for name in names}


def slurm_version(env: Mapping[str, str] | None = None) -> str:
    """Slurm's version as its clients print it (``sinfo --version``: ``slurm 22.05.8`` -> ``22.05.8``)."""
    out = run_slurm(["sinfo", "--version"], env).stdout.strip()
    return out.split()[-1] if out else ""
