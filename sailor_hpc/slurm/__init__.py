"""Talking to a live Slurm cluster: command wrappers (:mod:`.commands`) and site discovery (:mod:`.discover`)."""
from __future__ import annotations

from sailor_hpc.slurm.commands import (
                                       AcctJob,
                                       GresEntry,
                                       NodeInfo,
                                       PartitionInfo,
                                       QueueJob,
                                       SinfoNode,
                                       parse_gres,
                                       run_slurm,
                                       sacct,
                                       show_config,
                                       show_nodes,
                                       show_partitions,
                                       sinfo_nodes,
                                       squeue,
)
from sailor_hpc.slurm.discover import (
                                       Discovery,
                                       discover,
                                       discover_site,
                                       dump_site_toml,
                                       guess_gpu_type,
                                       live_availability,
)

__all__ = [
    "AcctJob", "Discovery", "GresEntry", "NodeInfo", "PartitionInfo", "QueueJob", "SinfoNode", "discover",
    "discover_site", "dump_site_toml", "guess_gpu_type", "live_availability", "parse_gres", "run_slurm", "sacct",
    "show_config", "show_nodes", "show_partitions", "sinfo_nodes", "squeue",
]
