"""The controller's hands on Slurm: find the run's own jobs, request a checkpoint, cancel and wait.

Every job is a :class:`~sailor_hpc.slurm.handle.SlurmJob` bound to its cluster; this module only adds what
the controller needs on top: jobs found by the run's name prefix (``squeue -t all``, then
``sacct --name``), a checkpoint request (``scancel --signal=USR1``: the runtime finishes its step,
saves a complete checkpoint and exits 75), and a cancel that returns only once every het component
is gone, so two jobs of a run never write the same checkpoint directory.
"""
from __future__ import annotations

import getpass
import time
from collections.abc import Callable, Collection

from sailor_hpc.controller.events import without_ended_jobs
from sailor_hpc.controller.state import job_name_prefix
from sailor_hpc.core.errors import SailorError, SlurmUnavailable
from sailor_hpc.slurm.commands import QueueJob, squeue
from sailor_hpc.slurm.handle import SlurmCluster, SlurmJob
from sailor_hpc.slurm.safety import BUNDLE_SEP
from sailor_hpc.slurm.status import FINAL_STATES, RUNNING_STATES, JobRef, JobStatus


def owned_queue_rows(run_id: str, cluster: SlurmCluster) -> list[QueueJob]:
    """Rows of ``squeue -t all`` (this user) of jobs named after this run, any state."""
    prefix = job_name_prefix(run_id)
    return [r for r in squeue(cluster.env, all_states=True, user=getpass.getuser()) if r.name.startswith(prefix)]


def owned_jobs(run_id: str, cluster: SlurmCluster) -> dict[str, dict[str, str]]:
    """Jobs of this run that Slurm still shows: base job id -> {"name", "state"} (het components merged;
    a job is active while any component is not final)."""
    out: dict[str, dict[str, str]] = {}
    for row in owned_queue_rows(run_id, cluster):
        ref = JobRef.parse(row.job_id)
        base = ref.base if ref is not None else row.job_id
        state = row.state.split()[0] if row.state else ""
        entry = out.setdefault(base, {"name": row.name, "state": state})
        if state not in FINAL_STATES:
            entry["state"] = state
    return out


def find_job_by_name(run_id: str, name: str, cluster: SlurmCluster, since: float) -> SlurmJob | None:
    """The job called ``name`` (squeue first; sacct for one already forgotten by slurmctld); the jobs of a bundle,
    which share their name, as one (in submission order)."""
    ids = [base for base, info in owned_jobs(run_id, cluster).items() if info["name"] == name]
    ids = ids or [j.id for j in cluster.named(name, since)]
    return cluster.job(BUNDLE_SEP.join(sorted(set(ids), key=int))) if ids else None


def canceller(job: SlurmJob, status: JobStatus, clock: Callable[[], float], sleep: Callable[[float], None],
              wait_s: float = 10.0) -> int | None:
    """The uid that cancelled the job (``status`` is CANCELLED), waiting up to ``wait_s`` for accounting to say it
    (slurmctld sends it to slurmdbd in the background); None when accounting cannot tell."""
    deadline = clock() + wait_s
    while status.cancelled_by is None and clock() < deadline:
        sleep(0.5)
        try:
            status = job.status()
        except SlurmUnavailable:
            return None
    return status.cancelled_by


def training_steps_gone(job: SlurmJob, timeout_s: float = 30.0, poll_s: float = 0.2) -> bool:
    """Whether no ``srun`` step of the job runs any more (waits up to ``timeout_s``). Ranks only run in
    steps, so from then on nothing of the job writes checkpoints, even while its batch script still ends
    (which, cancelled, takes Slurm's KillWait: 11 s measured here)."""
    deadline = time.monotonic() + timeout_s
    while True:
        steps = job.steps()
        if not any(s.rpartition(".")[2].isdigit() for s in steps):  # 31.0, 31+1.0; not 31.batch, 31.extern
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)


def request_checkpoint(job: SlurmJob, signal: str = "USR1") -> None:
    """Ask every rank of the (running) job to finish its step, save a complete checkpoint and exit."""
    job.signal(signal)


def cancel_and_wait(job: SlurmJob, timeout_s: float = 120.0, poll_s: float = 0.5,
                    grace_s: float = 10.0, lost: Collection[str] = ()) -> str:
    """End the job and return its final state once every component is final (or forgotten); a bundle's without
    the jobs it went on without, whose nodes are all among ``lost`` (:func:`events.without_ended_jobs`).

    How, measured on the local cluster: the ranks take SIGTERM as "checkpoint and stop", so a plain
    ``scancel`` leaves them running until Slurm's KillWait (30 s by default) runs out; ``scancel``
    with SIGKILL is a cancellation that kills ``srun`` before its tasks, and the steps then spend
    7-10 s failing to report to it. SIGHUP, which the runtime does not handle, ends every rank at
    once; ``srun`` and the job script then finish by themselves (3 s). So: SIGHUP to the job's steps,
    then ``scancel`` what is left as soon as nothing of the job runs any more (a requeued, pending
    component), or after ``grace_s``. Ending ranks at any moment is safe: a checkpoint becomes
    visible only by an atomic rename, so a save cut short leaves a temporary directory never loaded.
    """
    watcher = job.cluster.watcher(poll_s=poll_s, lost_after_s=10.0)
    watcher.add([job.id])
    t0 = time.monotonic()
    cancelled = hung_up = False
    while True:
        watcher.poll()
        st = watcher.status(job.id)
        if st is not None and st.final:
            return without_ended_jobs(st, lost).state
        running = st is not None and any(c.state in RUNNING_STATES for c in st.components)
        if running and not hung_up:
            # only to running steps: scancel --signal on a requeued (pending) job blocks until it times out
            hung_up = True
            try:
                job.signal("HUP", check=False)
            except SlurmUnavailable:
                pass  # scancel below ends it anyway
        if not cancelled and (not running or time.monotonic() - t0 > grace_s):
            try:
                job.cancel()
            except SailorError:
                pass  # already gone: the watcher will say so
            cancelled = True
        if time.monotonic() - t0 > timeout_s:
            raise SlurmUnavailable(f"job {job.id} is still not gone {timeout_s:.0f} s after it was cancelled",
                              field="scancel", fix="check slurmctld and the job's nodes; the controller will not "
                                                   "submit another job while this one may still write checkpoints")
        time.sleep(poll_s)
