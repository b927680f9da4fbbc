"""The run's history for people: one line per journal record, and one row per attempt (job).

Used by the controller as it goes (each record it writes is echoed) and by ``sailor-hpc run status``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from sailor_hpc.controller import records
from sailor_hpc.controller.state import RunState


def _gpus(g: dict[str, int] | None) -> str:
    return "+".join(f"{n} {p}" for p, n in sorted((g or {}).items()) if n) or "-"


def describe(rec: records.Record) -> str:
    """One line saying what the record means."""
    attempt = getattr(rec, "attempt", None)  # the records of one job name its attempt
    a = f"attempt {attempt}: " if attempt is not None else ""
    match rec:
        case records.RunStarted():
            return f"run {rec.run_id} started"
        case records.ControllerStarted():
            return f"controller pid {rec.pid} on {rec.host}" + (" resumed the run" if rec.resumed else "")
        case records.ControllerStopped():
            return f"controller stopped: {rec.reason}"
        case records.PlanChosen():
            return (f"planned ({rec.reason}) on free {_gpus(rec.available)}: {_gpus(rec.gpus)}, "
                    f"{rec.throughput:.2f} samples/s, {rec.cost_per_hour:.2f}/h")
        case records.NoPlan():
            return f"no plan possible now: {rec.message}"
        case records.SubmitIntent():
            return f"{a}submitting {rec.job_name} ({rec.reason})"
        case records.Submitted():
            return f"{a}job {rec.job_id} submitted, log {rec.log}"
        case records.Adopted():
            return f"{a}found its job {rec.job_id} in Slurm (submitted before the controller restarted)"
        case records.JobRunning():
            return f"{a}job running on {', '.join(rec.nodes)}"
        case records.FirstStep():
            return f"{a}first step {rec.step} (resumed from step {rec.loaded_step})"
        case records.InPlaceStep(change=step):
            return (f"{a}re-planned in job {step.job_id} on its surviving nodes {', '.join(step.nodes)}: "
                    f"{_gpus(step.was_gpus)} -> {_gpus(step.gpus)}, released {', '.join(step.released) or '-'}"
                    + (f" (Slurm refused: {'; '.join(step.refused)})" if step.refused else ""))
        case records.GrowSubmitted():
            return (f"{a}bigger job {rec.job_id} ({_gpus(rec.gpus)}) submitted beside the running one, "
                    f"which trains until it runs")
        case records.GrowRunning():
            return (f"{a}bigger job {rec.job_id} runs on {', '.join(rec.nodes)}: the old one trains "
                    f"until its ranks are ready")
        case records.GateOpened():
            return f"{a}its ranks are gone: bigger job {rec.job_id} loads the checkpoint and trains"
        case records.GrowCancelled():
            return (f"{a}bigger job {rec.job_id} cancelled ({rec.reason}); training goes on where it is"
                    + ("; no bigger job on this queue again until it changes" if rec.queue is not None else ""))
        case records.InPlaceRefusedStep():
            return f"{a}no in-place step in job {rec.job_id} ({rec.reason}): the job ends, a new one follows"
        case records.RecoveryMeasured(in_place=True):
            return (f"{a}recovered from {rec.trigger} inside the same job in {rec.recovery_s:.1f} s "
                    f"(ranks idle {rec.ranks_idle_s or 0:.1f} s, no queue)")
        case records.RecoveryMeasured():
            return (f"{a}recovered from {rec.trigger} in {rec.recovery_s:.1f} s "
                    f"(+ {rec.queue_wait_s or 0:.1f} s queue wait)")
        case records.CheckpointSeen():
            return f"checkpoint of step {rec.step} complete ({rec.consumed_samples} samples consumed)"
        case records.CheckpointPassedOver():
            instead = f"loaded {Path(rec.using).name}" if rec.using else "no older checkpoint verifies"
            which = rec.step if rec.step is not None else Path(rec.path).name
            return f"{a}checkpoint step {which} passed over: {rec.reason} ({instead})"
        case records.NodeLost():
            return f"{a}node(s) of the job lost: " + ", ".join(f"{n} {s}" for n, s in rec.nodes.items())
        case records.IdleGpus():
            ch = ", ".join(f"{p} {b}->{n}" for p, (b, n) in rec.change.items())
            return f"{a}more GPUs free for the run: {ch}"
        case records.Decision():
            return f"{a}{rec.action}: {rec.reason}"
        case records.Baseline():
            return f"free GPUs for the run now {_gpus(rec.available)}"
        case records.SignalSent():
            return f"{a}asked job {rec.job_id} to checkpoint and stop (SIG{rec.signal}, {rec.reason})"
        case records.JobStopped():
            return f"{a}job {rec.job_id} stopped running ({rec.state}, {rec.reason}) at step {rec.step}"
        case records.Cancel():
            return f"cancelling job {rec.job_id}: {rec.reason}"
        case records.JobGone():
            return f"{a}job {rec.job_id} gone ({rec.state})"
        case records.Failure():
            return f"{a}failed without training a step ({rec.reason})"
        case records.Backoff():
            return f"backing off {rec.seconds:.0f} s before the next job"
        case records.Finished():
            return f"finished: step {rec.step} checkpointed at {rec.checkpoint}"
        case records.GaveUp():
            return f"gave up: {rec.reason}"
        case records.StopRequested():
            return f"{rec.by} asked the run to {rec.how}" + (" (every rank checkpoints first)" if rec.how == "stop" else "")
        case records.RunStopped():
            jobs = ", ".join(f"{j} {s}" for j, s in rec.jobs.items()) or "none left"
            return (f"stopped by {rec.by} ({rec.how}) at checkpoint step {rec.step}; jobs: {jobs} "
                    f"(continue with sailor-hpc run --resume)")
        case records.RunResumed():
            return f"resumed a run that {rec.was}, from checkpoint step {rec.step}"
        case records.ErrorSeen():
            return f"error ({rec.where}): {rec.message}"
        # a run across clusters (sailor_hpc.controller.groups): attempts that are groups of jobs
        case records.GroupIntent():
            planned = f"{_gpus(rec.gpus)}, {rec.throughput:.2f} samples/s (sim), " if rec.gpus else ""
            return (f"group {rec.group}: submitting " + ", ".join(rec.job_names.values())
                    + f" ({planned}from step {rec.start_step})")
        case records.GroupSubmitted():
            return (f"group {rec.group}: jobs " + ", ".join(f"{c} {j}" for c, j in rec.jobs.items())
                    + f" submitted (from step {rec.start_step})")
        case records.GroupAdopted():
            return f"group {rec.group}: found its jobs {rec.states} (after a controller restart or a Slurm outage)"
        case records.GroupRunning():
            return f"group {rec.group}: every cluster's job runs"
        case records.GroupRecovered():
            return f"group {rec.group}: recovered from {rec.trigger} in {rec.recovery_s:.1f} s"
        case records.GroupFailed():
            return f"group {rec.group}: a job failed ({rec.states}): retried on the same clusters"
        case records.GroupStopped():
            return f"group {rec.group}: stopped ({rec.reason})"
        case records.ClusterDropped():
            return f"group {rec.group}: {_clusters(rec.clusters)} pending past the bound: dropped, re-planned without"
        case records.ClusterLost():
            return f"group {rec.group}: cluster {_clusters(rec.clusters)} lost ({rec.states}): re-planned on the rest"
        case records.RegrowDecision():
            return (f"group {rec.group}: {'grow' if rec.resize else 'do not grow'} back across "
                    f"{_clusters(rec.clusters)}: {rec.reason}")
        case records.Regrown():
            return f"group {rec.group}: {_clusters(rec.clusters)} back: checkpoint, stop and re-plan across it"
    return rec.kind.value


def _clusters(clusters: list[str]) -> str:
    return ", ".join(clusters) or "-"


def attempt_rows(state: RunState) -> list[tuple[Any, ...]]:
    """One row per attempt: attempt, its job (across clusters: each cluster's), GPUs, predicted samples/s, why,
    start step, recovery, the new job's queue wait, end."""
    rows = []
    for att in state.attempts:
        rec = att.recovery
        rows.append((att.number, _jobs(att), _gpus(att.gpus),
                     "-" if att.across and not att.gpus else f"{att.throughput:.2f}",
                     att.reason, "-" if att.start_step is None else att.start_step,
                     "-" if rec is None else f"{rec.recovery_s:.1f}",
                     "-" if rec is None or rec.queue_wait_s is None else f"{rec.queue_wait_s:.1f}",
                     _end(att, state)))
    return rows


def _jobs(att: Any) -> str:
    if att.across:
        return ", ".join(f"{c} {j}" for c, j in att.jobs.items()) or "-"
    return att.job_id or "-"


def _end(att: Any, state: RunState) -> str:
    """How the attempt ended: why it stopped (the controller's words) and Slurm's final state."""
    if att.across:  # a group's jobs end together, for the reason the controller journaled
        return att.end or ("completed" if state.finished else "running" if att.running_t else "queued")
    if not att.gone:
        return "running" if att.running_t else "queued"
    why = att.stopped.reason if att.stopped is not None else None
    return f"{why} ({att.end_state})" if why and why != "completed" else str(att.end_state)


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
            rows.append((att.number, _jobs(att), change_label(r.trigger, before), "n", f"{r.idle_s:.1f}",
                         "-" if r.queue_wait_s is None else f"{r.queue_wait_s:.1f}", "0"))
        for ch in att.in_place:
            rows.append((att.number, att.job_id or "-", change_label(ch.trigger.kind if ch.trigger else records.Kind.NODE_LOST,
                                                                     ch.lost), "y",
                         f"{ch.recovery.idle_s:.1f}" if ch.recovery else "-", "0", avoided))
    return rows


def change_label(trigger: str | None, lost: dict[str, str]) -> str:
    """What happened, in a person's words: a loss whose every node drains (or drained) is a ``drain``, not a
    node lost, though the controller handles both as losses."""
    if trigger == records.Kind.NODE_LOST and lost and all(str(s).lower().startswith(("drain", "drng")) for s in lost.values()):
        return "drain"
    return str(trigger)


CHANGE_HEADER = ("attempt", "job", "change", "same allocation", "ranks idle s", "queue s", "queue s avoided")
