"""One way to turn a run's spec into its jobs: the job options, plan file and script of an attempt, whatever
its scope (one job, or one cluster's part of a group).

Every job of a run trains the same way (its data, checkpoints, steps, runtime, interpreter, the site's extra
``sbatch`` options, time limits and signal grace); only the scope differs: :class:`InPlace` for the one job of a
run on one cluster (a loop of ``srun`` steps that re-plans on the surviving nodes), :class:`ClusterPart` for a
cluster's job of a group (joined by a rendezvous file; never requeued alone).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from sailor_hpc.controller.spec import JobSpec, RunSpec
from sailor_hpc.controller.state import RunDir
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.site import Site
from sailor_hpc.jobs.options import ClusterPart, InPlace, JobOptions, Limits, Training
from sailor_hpc.jobs.render import render_job_script, write_job_script


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
                      requeue=not isinstance(scope, ClusterPart))  # the controller resubmits a group whole


def write_attempt_plan(rundir: RunDir, plan: Plan, attempt: int) -> Path:
    """The attempt's plan file (one per attempt: every cluster's job of a group reads the same plan)."""
    path = rundir.plan_file(attempt)
    path.parent.mkdir(parents=True, exist_ok=True)
    plan.save(path)
    return path


def write_attempt_script(rundir: RunDir, spec: RunSpec, site: Site, plan: Plan, plan_path: Path, attempt: int, *,
                         name: str, scope: InPlace | ClusterPart, gate: Path | None = None,
                         exclude: Sequence[str] = ()) -> Path:
    """Render and write the job script of the attempt (of one cluster's part for a :class:`ClusterPart`)."""
    options = attempt_options(spec.job, plan_path, rundir, model=spec.planning.model,
                              runtime=spec.planning.runtime_of(plan), name=name, scope=scope, gate=gate,
                              exclude=exclude)
    script = rundir.script_file(attempt, scope.cluster if isinstance(scope, ClusterPart) else None)
    script.parent.mkdir(parents=True, exist_ok=True)
    write_job_script(script, render_job_script(plan, site, options))
    return script


def prepare_attempt(rundir: RunDir, spec: RunSpec, site: Site, plan: Plan, attempt: int, name: str,
                    gate: Path | None = None, exclude: Sequence[str] = ()) -> tuple[Path, Path]:
    """The plan file and job script of a one-job attempt (the run's directory scope: in-place re-planning)."""
    plan_path = write_attempt_plan(rundir, plan, attempt)
    return plan_path, write_attempt_script(rundir, spec, site, plan, plan_path, attempt, name=name,
                                           scope=InPlace(rundir.path, spec.job.resident_ranks), gate=gate,
                                           exclude=exclude)
