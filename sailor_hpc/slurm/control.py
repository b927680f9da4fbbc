"""Acting on jobs: signal, keep from requeueing, shrink, list steps, find by name, show components, run a step.

The controller and a job's own batch script (after a step lost nodes) use these; every command line is
here, in the Slurm layer, so a caller never spells ``scancel`` or ``scontrol update`` itself. Failures
carry their meaning by type (:func:`~sailor_hpc.slurm.commands.run_slurm`): Slurm refusing is a
SailorError, Slurm not answering SlurmUnavailable.
"""
from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sailor_hpc.core.errors import SailorError
from sailor_hpc.slurm.commands import parse_kv_line, run_for_jobs, run_slurm
from sailor_hpc.slurm.hostlist import expand_hostlist
from sailor_hpc.slurm.safety import job_ids
from sailor_hpc.slurm.status import JobRef

Env = Mapping[str, str] | None
SIGNAL_TIMEOUT_S = 10.0  # scancel --signal waits on a job in transition (requeue): do not hang the caller


def signal_job(job_id: str, signal: str, env: Env, *, check: bool = True) -> None:
    """``scancel --signal=SIGNAL``: to every running step of the job (not its batch script); of every job of a
    bundle that still runs."""
    run_for_jobs(["scancel", f"--signal={signal}"], job_ids(job_id), env, check=check, timeout=SIGNAL_TIMEOUT_S)


def keep_from_requeue(job_id: str, env: Env) -> None:
    """``scontrol update JobId=X Requeue=0``: the job's own ``scontrol requeue`` is then refused and it ends."""
    for jid in job_ids(job_id):
        run_slurm(["scontrol", "update", f"JobId={jid}", "Requeue=0"], env, check=False, timeout=SIGNAL_TIMEOUT_S)


def step_ids(job_id: str, env: Env) -> list[str]:
    """The job's steps that run now (``squeue -s``): ``31.0``, ``31+1.0``, ``31.batch``, ``31.extern``."""
    return run_slurm(["squeue", "-h", "-s", "-j", job_id, "-o", "%i"], env, check=False).stdout.split()


def jobs_named(name: str, env: Env, since: float) -> list[str]:
    """Ids of the jobs called ``name`` that accounting knows, submitted after ``since`` (unix seconds, less a
    minute); none where accounting is off (squeue is then the only source)."""
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(since - 60))
    proc = run_slurm(["sacct", "-n", "-P", "-X", "-o", "JobID,JobName", f"--name={name}", "-S", start], env,
                     check=False)
    if proc.returncode != 0:
        return []
    out = []
    for line in proc.stdout.splitlines():
        jid, _, jname = line.partition("|")
        ref = JobRef.parse(jid)
        if jname == name and ref is not None:
            out.append(ref.base)
    return out


@dataclass(frozen=True)
class Component:
    """One het component of a running job (a plain job has one)."""

    job_id: str  # its own numeric id: what ``scontrol update JobId=`` accepts
    partition: str
    nodes: list[str]


def job_components(job_id: str, env: Env = None) -> list[Component]:
    """The job's components now, in het offset order (``scontrol -o show job``: one line per component); a
    bundle's, its jobs' in the bundle's order (one each)."""
    comps = []
    for jid in job_ids(job_id):
        out = run_slurm(["scontrol", "-o", "show", "job", jid], env).stdout
        rows = [parse_kv_line(line) for line in out.splitlines() if line.strip()]
        rows.sort(key=lambda r: int(r.get("HetJobOffset", "0") or 0))
        comps += [Component(r["JobId"], r.get("Partition", ""), expand_hostlist(r.get("NodeList", ""))) for r in rows]
    return comps


def shrink_component(component_id: str, keep: list[str], env: Env = None) -> str | None:
    """Release every node of the (running) component but ``keep`` (``scontrol update JobId=C NodeList=...``);
    None when Slurm did it, else what it answered."""
    try:
        run_slurm(["scontrol", "update", f"JobId={component_id}", f"NodeList={','.join(keep)}"], env)
    except SailorError as exc:
        return f"scontrol update JobId={component_id} NodeList={','.join(keep)}: {exc.message}"
    return None


def node_address(node: str, env: Env = None) -> str | None:
    """The address slurmd of ``node`` listens on (``NodeAddr``), which ranks on other nodes can reach; None
    when Slurm does not say (an unknown node)."""
    proc = run_slurm(["scontrol", "-o", "show", "node", node], env, check=False)
    for line in proc.stdout.splitlines():
        addr = parse_kv_line(line).get("NodeAddr")
        if addr:
            return addr
    return None


PROBE_WAIT_S = 60  # a one-task probe job that cannot start within this is given up (srun --immediate)


def run_probe(partition: str, argv: Sequence[str], env: Env = None, timeout: float = PROBE_WAIT_S + 60.0, *,
              options: Sequence[str] = (), job_name: str = "sailor-preflight") -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as a one-task job of a few seconds on a node of ``partition`` (``srun``: its output comes back
    here), for what only the compute nodes can answer (their interpreter's modules, GPUs, folders). The job
    waits at most ``PROBE_WAIT_S`` for a node (``--immediate``); its exit code is the caller's to judge.
    ``options``: more ``srun`` options (the GPUs to ask for, the container of pyxis)."""
    return run_slurm(["srun", f"--partition={partition}", "--ntasks=1", "--cpus-per-task=1", "--time=1",
                      f"--immediate={PROBE_WAIT_S}", f"--job-name={job_name}", "--quiet", *options, *argv], env,
                     check=False, timeout=timeout)


def run_step(options: Sequence[str], env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    """Run one job step, ``srun OPTIONS``, from inside an allocation, with exactly ``env`` (the caller shapes
    the step: what it leaves out of the batch environment matters); its output captured, its exit code kept
    (a step's failure is the caller's to judge)."""
    return subprocess.run(["srun", *options], env=dict(env), capture_output=True, text=True)


def start_step(options: Sequence[str], argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """Start one job step, ``srun OPTIONS ARGV``, from inside an allocation, running on beside the caller: its
    output goes where the caller's goes (the job's log); the caller polls it."""
    return subprocess.Popen(["srun", *options, *argv], env=dict(env))
