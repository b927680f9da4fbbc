"""Rank and rendezvous from the launcher's environment, and the runtime's exit codes (torch-free).

Slurm (``srun``) sets SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID; torchrun sets RANK / WORLD_SIZE /
LOCAL_RANK. Torchrun's variables win when both are present (torchrun inside an allocation).
MASTER_ADDR / MASTER_PORT must be exported by the job script; under Slurm without MASTER_ADDR the
first host of SLURM_JOB_NODELIST (or SLURM_JOB_NODELIST_HET_GROUP_0 for het jobs) is used when it is
a plain host name, and port 29500 by default.
"""
from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from sailor_hpc.core.errors import SailorError

EXIT_DONE = 0  # all requested steps trained (and saved when --save was given)
EXIT_FAILED = 1  # an unexpected error
EXIT_BAD_INPUT = 2  # bad plan / arguments (SailorError), as the sailor-hpc CLI
EXIT_SAVED_ON_SIGNAL = 75  # EX_TEMPFAIL: got SIGUSR1/SIGTERM, saved a complete checkpoint, resume later
DEFAULT_PORT = 29500
#: a job's rendezvous port is JOB_PORT_BASE + job id % JOB_PORT_SPAN (training, profiling and in-place steps
#: alike): concurrent jobs on a node get different ones, and all stay below Linux's ephemeral range (32768 up by
#: default), where any outgoing connection (gloo's own among them) may hold the port a job is about to bind
JOB_PORT_BASE, JOB_PORT_SPAN = 20000, 12000


def job_port(job_id: int) -> int:
    """The rendezvous port of Slurm job ``job_id`` (see :data:`JOB_PORT_BASE`)."""
    return JOB_PORT_BASE + job_id % JOB_PORT_SPAN


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "single"
    host: str


#: what the launcher sets, the smallest and largest value each may take (ranks count from 0; a port is 1..65535)
ENV_BOUNDS: dict[str, tuple[int, int | None]] = {
    "RANK": (0, None), "WORLD_SIZE": (1, None), "LOCAL_RANK": (0, None), "SLURM_PROCID": (0, None),
    "SLURM_NTASKS": (1, None), "SLURM_LOCALID": (0, None), "MASTER_PORT": (1, 65535)}


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    """The integer variable ``key`` (``default`` when unset), within its :data:`ENV_BOUNDS`."""
    if key not in env and default is not None:
        return default
    low, high = ENV_BOUNDS[key]
    fix = f"the launcher sets {key}; export an integer from {low}" + (f" to {high}" if high is not None else "")
    try:
        value = int(env[key])
    except ValueError:
        raise SailorError(f"environment variable {key}={env[key]!r} is not an integer", field=key, fix=fix) from None
    if value < low or (high is not None and value > high):
        raise SailorError(f"environment variable {key}={value} is out of range", field=key, fix=fix)
    return value


def _first_host(nodelist: str) -> str | None:
    """First host of a Slurm node list: 'a100-[1-3],v100-1' -> 'a100-1' (no scontrol needed)."""
    m = re.match(r"([^,\[]+)(?:\[(\d+)[^\]]*\])?", nodelist)
    if not m:
        return None
    return m.group(1) + (m.group(2) or "")


def read_env(env: Mapping[str, str] | None = None) -> DistEnv:
    """Rank, world size, local rank and rendezvous address of this process."""
    env = os.environ if env is None else env
    host = env.get("SLURMD_NODENAME") or socket.gethostname()
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world, local = _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK", 0)
        source = "torchrun"
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local = _int(env, "SLURM_LOCALID", 0)
        source = "slurm"
    else:
        rank, world, local, source = 0, 1, 0, "single"
    addr = env.get("MASTER_ADDR")
    if addr is None and source == "slurm":
        nodelist = env.get("SLURM_JOB_NODELIST_HET_GROUP_0") or env.get("SLURM_JOB_NODELIST", "")
        addr = _first_host(nodelist)
    port = _int(env, "MASTER_PORT", DEFAULT_PORT)
    if not 0 <= rank < world:
        raise SailorError(f"rank {rank} is not in [0, {world})", field="RANK/SLURM_PROCID",
                          fix="start as many processes as WORLD_SIZE / SLURM_NTASKS says")
    return DistEnv(rank=rank, world_size=world, local_rank=local, master_addr=addr or "127.0.0.1",
                   master_port=port, source=source, host=host)
