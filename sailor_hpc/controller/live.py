"""What a run's jobs and checkpoints are *now*, from Slurm and the checkpoint directory, beside what its journal
says: ``sailor-hpc run status`` shows both, and says where they disagree (a job cancelled while no controller
watched, a checkpoint saved since the journal last looked).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from sailor_hpc.controller.slurm_ops import owned_jobs
from sailor_hpc.controller.state import RunDir, RunState
from sailor_hpc.core.checkpoint import latest_complete, read_manifest
from sailor_hpc.core.errors import SailorError, SlurmUnavailable
from sailor_hpc.core.site import load_site
from sailor_hpc.jobs.render import site_cluster
from sailor_hpc.slurm.status import FINAL_STATES


@dataclass(frozen=True)
class LiveJob:
    """One job of the run's current attempt as Slurm sees it now."""

    cluster: str  # "" on a site of one cluster
    job_id: str
    state: str
    nodes: list[str]
    reason: str = ""  # why it pends, as squeue says


@dataclass(frozen=True)
class LiveView:
    jobs: list[LiveJob] = field(default_factory=list)
    strays: list[str] = field(default_factory=list)  # other jobs named after the run that Slurm still runs
    slurm_error: str | None = None  # Slurm could not be asked
    checkpoint_step: int | None = None  # the newest complete checkpoint on disk
    checkpoint_path: str | None = None
    notes: list[str] = field(default_factory=list)  # where Slurm or the disk and the journal disagree

    def to_dict(self) -> dict[str, object]:
        return {"jobs": [vars(j) for j in self.jobs], "strays": self.strays, "slurm_error": self.slurm_error,
                "checkpoint_on_disk": None if self.checkpoint_step is None else
                {"step": self.checkpoint_step, "path": self.checkpoint_path}, "notes": self.notes}


def live_view(rd: RunDir, state: RunState, controller_alive: bool) -> LiveView:
    """Ask Slurm about the run's current jobs (not for a run that finished or stopped: none of its jobs is left)
    and look at its checkpoint directory (see the module doc)."""
    spec = rd.spec()
    jobs: list[LiveJob] = []
    strays: list[str] = []
    notes: list[str] = []
    error: str | None = None
    if state.finished is None and state.stopped is None:
        try:
            jobs, strays, notes = _ask_slurm(rd, state, controller_alive)
        except (SailorError, SlurmUnavailable) as exc:
            error = str(exc)
    newest = latest_complete(spec.job.save, deep=False)
    step = read_manifest(newest)["step"] if newest is not None else None
    journaled = state.checkpoint.step if state.checkpoint else None
    if step is not None and (journaled is None or step > journaled):
        notes.append(f"the newest complete checkpoint on disk is step {step}; the journal last saw "
                     f"{journaled if journaled is not None else 'none'}")
    return LiveView(jobs, strays, error, step, str(newest) if newest is not None else None, notes)


def _ask_slurm(rd: RunDir, state: RunState, controller_alive: bool) -> tuple[list[LiveJob], list[str], list[str]]:
    """The current attempt's jobs as Slurm sees them, the run's other jobs Slurm still runs, and where Slurm
    disagrees with the journal."""
    spec = rd.spec()
    site = load_site(spec.planning.site)
    names = [c.name for c in site.clusters] if len(site.clusters) > 1 else [""]
    clusters = {c: site_cluster(site, c or None) for c in names}
    cur = state.current
    ours = dict(cur.jobs) if cur is not None else {}
    jobs, strays, notes = [], [], []
    for cluster, job_id in ours.items():
        st = clusters[cluster].job(job_id).status()
        jobs.append(LiveJob(cluster, job_id, st.state, st.nodes, next((c.reason for c in st.components if c.reason), "")))
        if st.final:
            watcher = "the controller sees it at its next poll" if controller_alive else \
                "no controller watches the run: sailor-hpc run --resume"
            notes.append(f"job {job_id} ended ({st.state}) and the journal does not say so yet ({watcher})")
    for handle in clusters.values():
        strays += [base for base, info in owned_jobs(spec.run_id, handle).items()
                   if info["state"] not in FINAL_STATES and base not in ours.values()]
    if strays:
        notes.append(f"jobs named after the run that are not its current attempt's: {', '.join(strays)} "
                     f"(a resumed controller cancels them)")
    return jobs, strays, notes


def describe_live(view: LiveView) -> list[str]:
    """The live view for people, a line each."""
    if view.slurm_error is not None:
        lines = [f"now: Slurm cannot be asked ({view.slurm_error})"]
    elif not view.jobs:
        lines = ["now: no job of the run in Slurm"]
    else:
        lines = ["now: " + "; ".join(
            f"{(j.cluster + ' ') if j.cluster else ''}job {j.job_id} {j.state}"
            + (f" on {','.join(j.nodes)}" if j.nodes else "") + (f" ({j.reason})" if j.reason else "")
            for j in view.jobs)]
    ck = f"step {view.checkpoint_step} ({Path(view.checkpoint_path or '').name})" if view.checkpoint_step is not None \
        else "none yet"
    lines.append(f"newest complete checkpoint on disk: {ck}")
    lines += [f"note: {n}" for n in view.notes]
    return lines
