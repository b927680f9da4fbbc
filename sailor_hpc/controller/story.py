"""The run's history for people: one line per journal record, and one row per attempt (job).

Used by the controller as it goes (each record it writes is echoed) and by ``sailor-hpc run status``.
"""
from __future__ import annotations

from typing import Any

from sailor_hpc.controller.journal import Kind, Record
from sailor_hpc.controller.state import RunState


def _gpus(g: dict[str, int] | None) -> str:
    return "+".join(f"{n} {p}" for p, n in sorted((g or {}).items()) if n) or "-"


def describe(rec: Record) -> str:
    """One line saying what the record means."""
    k = rec["kind"]
    a = f"attempt {rec['attempt']}: " if "attempt" in rec else ""
    if k == Kind.RUN_STARTED:
        return f"run {rec.get('run_id')} started"
    if k == Kind.CONTROLLER_STARTED:
        return f"controller pid {rec.get('pid')} on {rec.get('host')}" + (" resumed the run" if rec.get("resumed") else "")
    if k == Kind.CONTROLLER_STOPPED:
        return f"controller stopped: {rec.get('reason')}"
    if k == Kind.PLAN:
        return (f"planned ({rec.get('reason')}) on free {_gpus(rec.get('available'))}: {_gpus(rec.get('gpus'))}, "
                f"{rec.get('throughput', 0):.2f} samples/s, {rec.get('cost_per_hour', 0):.2f}/h")
    if k == Kind.NO_PLAN:
        return f"no plan possible now: {rec.get('message')}"
    if k == Kind.SUBMIT_INTENT:
        return f"{a}submitting {rec.get('job_name')} ({rec.get('reason')})"
    if k == Kind.SUBMITTED:
        return f"{a}job {rec.get('job_id')} submitted, log {rec.get('log')}"
    if k == Kind.ADOPTED:
        return f"{a}found its job {rec.get('job_id')} in Slurm (submitted before the controller restarted)"
    if k == Kind.JOB_RUNNING:
        return f"{a}job running on {', '.join(rec.get('nodes', []))}"
    if k == Kind.FIRST_STEP:
        return f"{a}first step {rec.get('step')} (resumed from step {rec.get('loaded_step')})"
    if k == Kind.IN_PLACE:
        return (f"{a}re-planned in job {rec.get('job_id')} on its surviving nodes {', '.join(rec.get('nodes', []))}: "
                f"{_gpus(rec.get('was_gpus'))} -> {_gpus(rec.get('gpus'))}, released {', '.join(rec.get('released', [])) or '-'}"
                + (f" (Slurm refused: {'; '.join(rec['refused'])})" if rec.get("refused") else ""))
    if k == Kind.GROW_SUBMITTED:
        return (f"{a}bigger job {rec.get('job_id')} ({_gpus(rec.get('gpus'))}) submitted beside the running one, "
                f"which trains until it runs")
    if k == Kind.GROW_RUNNING:
        return (f"{a}bigger job {rec.get('job_id')} runs on {', '.join(rec.get('nodes', []))}: the old one trains "
                f"until its ranks are ready")
    if k == Kind.GATE_OPENED:
        return f"{a}its ranks are gone: bigger job {rec.get('job_id')} loads the checkpoint and trains"
    if k == Kind.GROW_CANCELLED:
        return f"{a}bigger job {rec.get('job_id')} cancelled ({rec.get('reason')}); training goes on where it is"
    if k == Kind.IN_PLACE_REFUSED:
        return f"{a}no in-place step in job {rec.get('job_id')} ({rec.get('reason')}): the job ends, a new one follows"
    if k == Kind.RECOVERY and rec.get("in_place"):
        return (f"{a}recovered from {rec.get('trigger')} inside the same job in {rec.get('recovery_s', 0):.1f} s "
                f"(ranks idle {rec.get('ranks_idle_s', 0):.1f} s, no queue)")
    if k == Kind.RECOVERY:
        return (f"{a}recovered from {rec.get('trigger')} in {rec.get('recovery_s', 0):.1f} s "
                f"(+ {rec.get('queue_wait_s') or 0:.1f} s queue wait)")
    if k in _GEO_DESCRIBE:
        return _GEO_DESCRIBE[k](rec)
    if k == Kind.CHECKPOINT:
        return f"checkpoint of step {rec.get('step')} complete ({rec.get('consumed_samples')} samples consumed)"
    if k == Kind.NODE_LOST:
        return f"{a}node(s) of the job lost: " + ", ".join(f"{n} {s}" for n, s in rec.get("nodes", {}).items())
    if k == Kind.IDLE_GPUS:
        ch = ", ".join(f"{p} {b}->{n}" for p, (b, n) in rec.get("change", {}).items())
        return f"{a}more GPUs free for the run: {ch}"
    if k == Kind.DECISION:
        return f"{a}{rec.get('action')}: {rec.get('reason')}"
    if k == Kind.BASELINE:
        return f"free GPUs for the run now {_gpus(rec.get('available'))}"
    if k == Kind.SIGNAL_SENT:
        return f"{a}asked job {rec.get('job_id')} to checkpoint and stop (SIG{rec.get('signal')}, {rec.get('reason')})"
    if k == Kind.JOB_STOPPED:
        return f"{a}job {rec.get('job_id')} stopped running ({rec.get('state')}, {rec.get('reason')}) at step {rec.get('step')}"
    if k == Kind.CANCEL:
        return f"cancelling job {rec.get('job_id')}: {rec.get('reason')}"
    if k == Kind.JOB_GONE:
        return f"{a}job {rec.get('job_id')} gone ({rec.get('state')})"
    if k == Kind.FAILURE:
        return f"{a}failed without training a step ({rec.get('reason')})"
    if k == Kind.BACKOFF:
        return f"backing off {rec.get('seconds', 0):.0f} s before the next job"
    if k == Kind.FINISHED:
        return f"finished: step {rec.get('step')} checkpointed at {rec.get('checkpoint')}"
    if k == Kind.GAVE_UP:
        return f"gave up: {rec.get('reason')}"
    if k == Kind.ERROR:
        return f"error ({rec.get('where')}): {rec.get('message')}"
    return k


def _clusters(rec: Record) -> str:
    return ", ".join(rec.get("clusters", [])) or "-"


#: a run across clusters (sailor_hpc.controller.geo_run): one line per co-scheduler record
_GEO_DESCRIBE: dict[str, Any] = {
    Kind.GROUP_SUBMITTED: lambda r: (f"group {r['group']}: jobs " + ", ".join(f"{c} {j}" for c, j in r.get("jobs", {}).items())
                                     + f" submitted (from step {r.get('start_step')})"),
    Kind.GROUP_ADOPTED: lambda r: f"group {r['group']}: found its jobs {r.get('states')} (before the co-scheduler restarted)",
    Kind.GROUP_RUNNING: lambda r: f"group {r['group']}: every cluster's job runs",
    Kind.GROUP_RECOVERED: lambda r: f"group {r['group']}: recovered from {r.get('trigger')} in {r.get('recovery_s', 0):.1f} s",
    Kind.GROUP_FAILED: lambda r: f"group {r['group']}: a job failed ({r.get('states')}): retried on the same clusters",
    Kind.GROUP_STOPPED: lambda r: f"group {r['group']}: stopped ({r.get('reason')})",
    Kind.CLUSTER_DROPPED: lambda r: f"group {r['group']}: {_clusters(r)} pending past the bound: dropped, re-planned without",
    Kind.CLUSTER_LOST: lambda r: f"group {r['group']}: cluster {_clusters(r)} lost ({r.get('states')}): re-planned on the rest",
    Kind.REGROW_DECISION: lambda r: (f"group {r['group']}: {'grow' if r.get('resize') else 'do not grow'} back across "
                                     f"{_clusters(r)}: {r.get('reason')}"),
    Kind.REGROWN: lambda r: f"group {r['group']}: {_clusters(r)} back: checkpoint, stop and re-plan across it",
}


def attempt_rows(state: RunState) -> list[tuple[Any, ...]]:
    """One row per job: attempt, job id, GPUs, predicted samples/s, why, start step, recovery, end."""
    rows = []
    for att in state.attempts:
        rec = att.recovery
        rows.append((att.number, att.job_id or "-", _gpus(att.gpus), f"{att.throughput:.2f}", att.reason,
                     "-" if att.start_step is None else att.start_step,
                     "-" if rec is None else f"{rec.recovery_s:.1f}",
                     "-" if rec is None or rec.queue_wait_s is None else f"{rec.queue_wait_s:.1f}",
                     _end(att)))
    return rows


def _end(att: Any) -> str:
    """How the job ended: why it stopped (the controller's words) and Slurm's final state."""
    if not att.gone:
        return "running" if att.running_t else "queued"
    why = (att.stopped or {}).get("reason")
    return f"{why} ({att.end_state})" if why and why != "completed" else str(att.end_state)


def group_rows(state: RunState) -> list[tuple[Any, ...]]:
    """One row per group of a run across clusters: group, each cluster's job, from step, how it ended."""
    return [(g.number, ", ".join(f"{c} {j}" for c, j in g.jobs.items()), g.start_step,
             g.end or ("completed" if state.finished else "running" if g.running_t else "queued"))
            for g in state.groups]


GROUP_HEADER = ("group", "jobs", "from step", "end")
ATTEMPT_HEADER = ("attempt", "job", "GPUs", "samples/s (sim)", "why", "from step", "recovery s", "queue s", "end")


def change_rows(state: RunState) -> list[tuple[Any, ...]]:
    """One row per allocation change the run recovered from: what happened, whether the run stayed in its
    allocation, the seconds its ranks trained nothing, the new job's queue wait, and the queue time an
    in-place change avoided (this run's mean measured queue wait of its new jobs; "-" before it has one)."""
    waits = [r.queue_wait_s for r in state.recoveries if not r.in_place and r.queue_wait_s is not None]
    avoided = f"{sum(waits) / len(waits):.1f}" if waits else "-"
    rows = []
    for i, att in enumerate(state.attempts):
        if att.recovery is not None:
            r = att.recovery
            before = state.attempts[i - 1].lost_nodes if i > 0 else {}
            rows.append((att.number, att.job_id or "-", change_label(r.trigger, before), "n", f"{r.idle_s:.1f}",
                         f"{r.queue_wait_s or 0:.1f}", "0"))
        for ch in att.in_place:
            rows.append((att.number, att.job_id or "-", change_label(ch.trigger[0] if ch.trigger else Kind.NODE_LOST,
                                                                     ch.lost), "y",
                         f"{ch.recovery.idle_s:.1f}" if ch.recovery else "-", "0", avoided))
    return rows


def change_label(trigger: str | None, lost: dict[str, str]) -> str:
    """What happened, in a person's words: a loss whose every node drains (or drained) is a ``drain``, not a
    node lost, though the controller handles both as losses."""
    if trigger == Kind.NODE_LOST and lost and all(str(s).lower().startswith(("drain", "drng")) for s in lost.values()):
        return "drain"
    return str(trigger)


CHANGE_HEADER = ("attempt", "job", "change", "same allocation", "ranks idle s", "queue s", "queue s avoided")
