"""One way to turn a run's spec into its jobs: the job options, plan file and script of an attempt, whatever
its scope (one job, one job of a bundle, or one cluster's part of a group).

Every job of a run trains the same way (its data, checkpoints, steps, runtime, interpreter, the site's extra
``sbatch`` options, time limits and signal grace); only the scope differs: :class:`InPlace` for the one job of a
run on one cluster (a loop of ``srun`` steps that re-plans on the surviving nodes), :class:`ClusterPart` for a
cluster's job of a group (joined by a rendezvous file; never requeued alone).
"""
from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from sailor_hpc.controller.spec import JobSpec, RunSpec
from sailor_hpc.controller.state import RunDir
from sailor_hpc.core.errors import SailorError, SlurmUnavailable
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.site import Site
from sailor_hpc.jobs.options import BundlePart, ClusterPart, InPlace, JobOptions, Limits, Training
from sailor_hpc.jobs.render import bundle_partitions, render_job_script, write_job_script
from sailor_hpc.slurm.handle import SlurmCluster, SlurmJob
from sailor_hpc.slurm.safety import BUNDLE_SEP


def attempt_options(job: JobSpec, plan_path: Path, rundir: RunDir, *, model: str, runtime: str, name: str,
                    scope: InPlace | ClusterPart, gate: Path | None = None, exclude: Sequence[str] = ()) -> JobOptions:
    """The options of one job of the run, from the spec's job part whole and the plan's model and runtime. With
    ``gate`` the ranks start at once but load the checkpoint only once that file exists (a job taking over from
    another). ``exclude``: nodes the job must not get (down, drained, reserved, or one a job could not release):
    the plan was made without them, and Slurm may otherwise hold the job for one of them."""
    extra = (*job.extra_sbatch, *((f"--exclude={','.join(exclude)}",) if exclude else ()))
    return JobOptions(plan_path=plan_path, work=Training(job.data, job.save), steps=job.steps, model=model,
                      runtime=runtime, job_name=name, extra_sbatch=extra,
                      train_args=("--save-interval", str(job.save_interval), *job.train_args,
                                  *(("--wait-for", str(gate)) if gate is not None else ())),
                      python=job.python, limits=Limits(job.time_limit, job.time_min, job.signal_grace_s),
                      workdir=rundir.path, log_dir=rundir.logs, scope=scope,
                      # the controller resubmits a group, or a bundle, whole
                      requeue=not isinstance(scope, ClusterPart) and scope.bundle is None)


def write_attempt_plan(rundir: RunDir, plan: Plan, attempt: int, try_: int = 1) -> Path:
    """The plan file of the attempt's ``try_``-th job (every cluster's job of a group reads the same plan)."""
    path = rundir.plan_file(attempt, try_)
    path.parent.mkdir(parents=True, exist_ok=True)
    plan.save(path)
    return path


def write_attempt_script(rundir: RunDir, spec: RunSpec, site: Site, plan: Plan, plan_path: Path, attempt: int, *,
                         name: str, scope: InPlace | ClusterPart, gate: Path | None = None,
                         exclude: Sequence[str] = (), try_: int = 1) -> Path:
    """Render and write the job script of the attempt (of one cluster's part for a :class:`ClusterPart`)."""
    options = attempt_options(spec.job, plan_path, rundir, model=spec.planning.model,
                              runtime=spec.planning.runtime_of(plan), name=name, scope=scope, gate=gate,
                              exclude=exclude)
    part = scope.bundle if isinstance(scope, InPlace) else None
    script = rundir.script_file(attempt, scope.cluster if isinstance(scope, ClusterPart)
                                else f"{part.index}-{part.partition}" if part is not None else None, try_)
    script.parent.mkdir(parents=True, exist_ok=True)
    write_job_script(script, render_job_script(plan, site, options))
    return script


def bundled(spec: RunSpec, site: Site, plan: Plan) -> bool:
    """Whether a one-job attempt runs ``plan`` as a bundle, one plain job per component of its job layout: a plan
    that would be a het job, whose ranks are resident (Slurm ends a whole het job that loses a node; a bundle
    keeps the other jobs' ranks)."""
    return (spec.job.resident_ranks and spec.planning.runtime_of(plan) == "megatron_patch" and not site.container
            and len(bundle_partitions(plan)) > 1)


def prepare_attempt(rundir: RunDir, spec: RunSpec, site: Site, plan: Plan, attempt: int, name: str,
                    gate: Path | None = None, exclude: Sequence[str] = ()) -> tuple[Path, list[Path]]:
    """The plan file and job scripts of a one-job attempt (the run's directory scope: in-place re-planning): one
    script, or a bundle's, one per component of the plan's job layout, in order, sharing a fresh folder."""
    try_ = rundir.next_try(attempt)
    plan_path = write_attempt_plan(rundir, plan, attempt, try_)
    base = InPlace(rundir.path, spec.job.resident_ranks)
    if not bundled(spec, site, plan):
        return plan_path, [write_attempt_script(rundir, spec, site, plan, plan_path, attempt, name=name, scope=base,
                                                gate=gate, exclude=exclude, try_=try_)]
    folder = rundir.path / "resident" / f"bundle-{attempt:03d}-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    parts = bundle_partitions(plan)
    return plan_path, [write_attempt_script(rundir, spec, site, plan, plan_path, attempt, name=name,
                                            scope=replace(base, bundle=BundlePart(p, i, len(parts), folder)),
                                            gate=gate, exclude=exclude, try_=try_)
                       for i, p in enumerate(parts)]


def submit_attempt(cluster: SlurmCluster, scripts: Sequence[Path], plan_path: Path, site: str) -> tuple[SlurmJob, str]:
    """Submit an attempt's job, every job of a bundle in order (its id: theirs joined by ``BUNDLE_SEP``); the job
    and the log the controller reads (the first job's: plan rank 0 and the agent that re-plans). A bundle that
    Slurm refuses half-way is cancelled: its jobs would wait for each other forever."""
    jobs: list[SlurmJob] = []
    log = ""
    try:
        for script in scripts:
            job, rec = cluster.submit(script, plan=str(plan_path), site=site)
            jobs.append(job)
            log = log or rec.log
    except SailorError:
        for job in jobs:
            try:
                job.cancel()
            except (SailorError, SlurmUnavailable):
                pass  # the controller's stray check cancels what is left of the run's jobs
        raise
    return cluster.job(BUNDLE_SEP.join(j.id for j in jobs)), log
