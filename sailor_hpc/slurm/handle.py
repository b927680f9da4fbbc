"""A Slurm cluster as this process reaches it, and a job bound to it: the caller never passes an environment
beside a job id.

A site of several clusters reaches each through its own ``SLURM_CONF``; job ids are per cluster, so an id alone
names no job. :class:`SlurmCluster` carries the environment its commands run with, and :class:`SlurmJob` the
cluster that gave it its id (submitit's ``Job(job_id, folder)`` binds a job to its cluster the same way). Every
command still runs through this package's wrappers (:mod:`~sailor_hpc.slurm.commands`,
:mod:`~sailor_hpc.slurm.control`, :mod:`~sailor_hpc.slurm.submit`).
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sailor_hpc.slurm.commands import SinfoNode, controller_answers, sinfo_nodes
from sailor_hpc.slurm.control import jobs_named, keep_from_requeue, signal_job, step_ids
from sailor_hpc.slurm.safety import job_ids
from sailor_hpc.slurm.status import JobStatus, poll_jobs
from sailor_hpc.slurm.submit import JobRecord, cancel_job, log_path, submit_script
from sailor_hpc.slurm.watch import JobWatcher


@dataclass(frozen=True)
class SlurmCluster:
    """One cluster: ``env`` is the environment its commands run with (None: this process's own)."""

    name: str = ""
    env: Mapping[str, str] | None = field(default=None, compare=False, repr=False)

    def job(self, job_id: str) -> SlurmJob:
        return SlurmJob(str(job_id), self)

    def submit(self, script: str | os.PathLike[str], *, plan: str = "", site: str = "") -> tuple[SlurmJob, JobRecord]:
        """``sbatch`` the script here: the job, and the submission's record (its log among others)."""
        rec = submit_script(script, self.env, plan=plan, site=site)
        return self.job(rec.job_id), rec

    def answers(self) -> bool:
        """Whether this cluster's slurmctld answers now."""
        return controller_answers(self.env)

    def nodes(self, partitions: Sequence[str] = ()) -> list[SinfoNode]:
        return sinfo_nodes(self.env, partitions)

    def named(self, name: str, since: float) -> list[SlurmJob]:
        """The jobs accounting knows by ``name``, submitted after ``since`` (unix seconds)."""
        return [self.job(j) for j in jobs_named(name, self.env, since)]

    def watcher(self, *, poll_s: float, lost_after_s: float) -> JobWatcher:
        """A watcher of this cluster's jobs (one ``squeue`` and one ``sacct`` for all it tracks)."""
        return JobWatcher(self.env, poll_s=poll_s, lost_after_s=lost_after_s)


@dataclass(frozen=True)
class SlurmJob:
    """A job id and the cluster it is an id of."""

    id: str
    cluster: SlurmCluster

    def status(self) -> JobStatus:
        """Every het component's state, from ``squeue`` and ``sacct`` (a job either forgot is LOST)."""
        return poll_jobs([self.id], self.cluster.env)[self.id]

    def signal(self, signal: str, *, check: bool = True) -> None:
        """Send ``signal`` to every running step of the job (not its batch script)."""
        signal_job(self.id, signal, self.cluster.env, check=check)

    def cancel(self) -> None:
        cancel_job(self.id, self.cluster.env)

    def keep_from_requeue(self) -> None:
        """The job ends instead of requeueing itself after its checkpoint."""
        keep_from_requeue(self.id, self.cluster.env)

    def steps(self) -> list[str]:
        """The job's steps that run now (``31.0``, ``31+1.0``, ``31.batch``, ...)."""
        return step_ids(self.id, self.cluster.env)

    def log(self) -> Path:
        """Where the job writes its output (a bundle: its first job, plan rank 0's)."""
        return log_path(self.id, self.cluster.env)

    def logs(self) -> list[Path]:
        """Where each job of a bundle writes its output (a job alone: its log)."""
        return [log_path(j, self.cluster.env) for j in job_ids(self.id)]
