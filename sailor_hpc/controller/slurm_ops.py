"""The controller's hands on Slurm: render and submit an attempt, find its own jobs, signal, cancel.

Everything goes through sailor_hpc's job side (``render_job_script``, ``submit_script``,
``cancel_job``, ``poll_jobs``/``JobWatcher``) and Slurm command wrappers; this module only adds what
the controller needs on top: jobs found by the run's name prefix (``squeue -t all``, then
``sacct --name``), a checkpoint request (``scancel --signal=USR1``: the runtime finishes its step,
saves a complete checkpoint and exits 75), and a cancel that returns only once every het component
is gone, so two jobs of a run never write the same checkpoint directory.
"""
from __future__ import annotations

import getpass
import time
from collections.abc import Mapping
from pathlib import Path

from sailor_hpc.controller.spec import RunSpec
from sailor_hpc.controller.state import RunDir, job_name_prefix
from sailor_hpc.core.errors import SailorError, SlurmUnavailable
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.site import Site
from sailor_hpc.jobs.options import InPlace, JobOptions, Limits, Training
from sailor_hpc.jobs.render import render_job_script, write_job_script
from sailor_hpc.slurm.commands import QueueJob, squeue
from sailor_hpc.slurm.control import jobs_named, signal_job, step_ids
from sailor_hpc.slurm.status import FINAL_STATES, RUNNING_STATES, JobRef
from sailor_hpc.slurm.submit import JobRecord, cancel_job, submit_script
from sailor_hpc.slurm.watch import JobWatcher

Env = Mapping[str, str] | None


def owned_queue_rows(run_id: str, env: Env) -> list[QueueJob]:
    """Rows of ``squeue -t all`` (this user) of jobs named after this run, any state."""
    prefix = job_name_prefix(run_id)
    return [r for r in squeue(env, all_states=True, user=getpass.getuser()) if r.name.startswith(prefix)]


def owned_jobs(run_id: str, env: Env) -> dict[str, dict[str, str]]:
    """Jobs of this run that Slurm still shows: base job id -> {"name", "state"} (het components merged;
    a job is active while any component is not final)."""
    out: dict[str, dict[str, str]] = {}
    for row in owned_queue_rows(run_id, env):
        ref = JobRef.parse(row.job_id)
        base = ref.base if ref is not None else row.job_id
        state = row.state.split()[0] if row.state else ""
        entry = out.setdefault(base, {"name": row.name, "state": state})
        if state not in FINAL_STATES:
            entry["state"] = state
    return out


def find_job_by_name(run_id: str, name: str, env: Env, since: float) -> str | None:
    """The id of the job called ``name`` (squeue first; sacct for one already forgotten by slurmctld)."""
    for base, info in owned_jobs(run_id, env).items():
        if info["name"] == name:
            return base
    return next(iter(jobs_named(name, env, since)), None)


def prepare_attempt(rundir: RunDir, spec: RunSpec, site: Site, plan: Plan, attempt: int,
                    name: str, gate: Path | None = None) -> tuple[Path, Path]:
    """Write the attempt's placed plan and its job script; returns both paths. With ``gate`` the ranks
    start at once but load the checkpoint only once that file exists (a job taking over from another)."""
    plan_path = rundir.plan_file(attempt)
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan.save(plan_path)
    options = JobOptions(plan_path=plan_path, work=Training(spec.data, spec.save), steps=spec.steps,
                         model=spec.model, runtime=spec.runtime_of(plan), job_name=name, extra_sbatch=spec.extra_sbatch,
                         train_args=("--save-interval", str(spec.save_interval), *spec.train_args,
                                     *(("--wait-for", str(gate)) if gate is not None else ())),
                         python=spec.python, limits=Limits(spec.time_limit, spec.time_min, spec.signal_grace_s),
                         workdir=rundir.path, log_dir=rundir.logs, scope=InPlace(rundir.path))
    text = render_job_script(plan, site, options)
    script = rundir.script_file(attempt)
    script.parent.mkdir(parents=True, exist_ok=True)
    write_job_script(script, text)
    return plan_path, script


def submit(script: Path, plan_path: Path, spec: RunSpec, env: Env) -> JobRecord:
    return submit_script(script, env, plan=str(plan_path), site=spec.site)


def training_steps_gone(job_id: str, env: Env, timeout_s: float = 30.0, poll_s: float = 0.2) -> bool:
    """Whether no ``srun`` step of the job runs any more (waits up to ``timeout_s``). Ranks only run in
    steps, so from then on nothing of the job writes checkpoints, even while its batch script still ends
    (which, cancelled, takes Slurm's KillWait: 11 s measured here)."""
    deadline = time.monotonic() + timeout_s
    while True:
        steps = step_ids(job_id, env)
        if not any(s.rpartition(".")[2].isdigit() for s in steps):  # 31.0, 31+1.0; not 31.batch, 31.extern
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)


def request_checkpoint(job_id: str, env: Env, signal: str = "USR1") -> None:
    """Ask every rank of the (running) job to finish its step, save a complete checkpoint and exit."""
    signal_job(job_id, signal, env)


def cancel_and_wait(job_id: str, env: Env, timeout_s: float = 120.0, poll_s: float = 0.5,
                    grace_s: float = 10.0) -> str:
    """End the job and return its final state once every component is final (or forgotten).

    How, measured on the local cluster: the ranks take SIGTERM as "checkpoint and stop", so a plain
    ``scancel`` leaves them running until Slurm's KillWait (30 s by default) runs out; ``scancel``
    with SIGKILL is a cancellation that kills ``srun`` before its tasks, and the steps then spend
    7-10 s failing to report to it. SIGHUP, which the runtime does not handle, ends every rank at
    once; ``srun`` and the job script then finish by themselves (3 s). So: SIGHUP to the job's steps,
    then ``scancel`` what is left as soon as nothing of the job runs any more (a requeued, pending
    component), or after ``grace_s``. Ending ranks at any moment is safe: a checkpoint becomes
    visible only by an atomic rename, so a save cut short leaves a temporary directory never loaded.
    """
    watcher = JobWatcher(env, poll_s=poll_s, lost_after_s=10.0)
    watcher.add([job_id])
    t0 = time.monotonic()
    cancelled = hung_up = False
    while True:
        watcher.poll()
        st = watcher.status(job_id)
        if st is not None and st.final:
            return st.state
        running = st is not None and any(c.state in RUNNING_STATES for c in st.components)
        if running and not hung_up:
            # only to running steps: scancel --signal on a requeued (pending) job blocks until it times out
            hung_up = True
            try:
                signal_job(job_id, "HUP", env, check=False)
            except SlurmUnavailable:
                pass  # scancel below ends it anyway
        if not cancelled and (not running or time.monotonic() - t0 > grace_s):
            try:
                cancel_job(job_id, env)
            except SailorError:
                pass  # already gone: the watcher will say so
            cancelled = True
        if time.monotonic() - t0 > timeout_s:
            raise SlurmUnavailable(f"job {job_id} is still not gone {timeout_s:.0f} s after it was cancelled",
                              field="scancel", fix="check slurmctld and the job's nodes; the controller will not "
                                                   "submit another job while this one may still write checkpoints")
        time.sleep(poll_s)
