"""The attempt of a run on one cluster: one (het) Slurm job, watched, re-planned and resubmitted.

1. No job: plan on the GPUs free now (``sinfo``), write the plan and the job script, journal the
   intent, ``sbatch`` it, journal the job id. The job trains with ``--auto-resume`` on the run's one
   checkpoint directory, so it starts from the newest complete checkpoint, whatever plan wrote it.
2. The job runs: each poll reads the job's state and nodes, the nodes' states, the idle GPUs and the
   job's log (first step, checkpoints).
   - a node of the job is lost (down, drained, failing): the job, submitted with ``--no-kill``,
     re-plans on its surviving nodes by itself and goes on in a new ``srun`` step from the newest
     complete checkpoint (:mod:`~sailor_hpc.controller.inplace`); the controller journals it. A
     *draining* node still runs the job: the controller asks it to checkpoint first (SIGUSR1). When
     Slurm ends the job instead (its batch node, a het component's only node) or no plan fits the
     survivors, the controller cancels what is left of it and re-plans on what is free.
   - the job stops by itself (requeued after a preemption, saved on its time-limit signal, failed):
     the same, re-plan and resubmit; a job that failed without training a step counts as a failure
     (exponential back-off, also when sbatch fails; the run gives up after ``max_restarts`` restarts in a row
     without a new checkpoint, or at once on bad input).
   - more GPUs free for the run than when it last judged: re-plan; if the new plan gains at least
     ``min_gain`` after the restart cost (:mod:`~sailor_hpc.controller.policy`): when a plan on the
     idle GPUs alone gains that much too, submit it beside the running job
     (:mod:`~sailor_hpc.controller.grow`); else ask the job to checkpoint and stop (SIGUSR1), then resubmit.
     Else keep it.
3. The job completes at the requested step: the run is finished.

Never two jobs writing checkpoints: a new one is only submitted once the previous one is gone (every
het component final), except a bigger job grown beside it, whose ranks load nothing before the old
job's ranks are gone; any other job carrying the run's name prefix is cancelled first.
"""
from __future__ import annotations

from typing import Any

from sailor_hpc.controller import records, slurm_ops
from sailor_hpc.controller.attempt_job import prepare_attempt, submit_attempt
from sailor_hpc.controller.context import RunContext, user_name
from sailor_hpc.controller.events import (
    Observation,
    about_nodes,
    all_running,
    cpu_bound,
    draining_only,
    free_for_run,
    idle_increase,
    lost_nodes,
    never_now,
    node_states,
    own_gpus,
    stuck_reason,
    trains,
    without_ended_jobs,
)
from sailor_hpc.controller.grow import Grower
from sailor_hpc.controller.planning import Planned, judge_pending, plan_on, plan_on_queue
from sailor_hpc.controller.policy import Score, Verdict, judge, plan_shape, restart_cost
from sailor_hpc.controller.progress import LogTail, saved_on_signal
from sailor_hpc.controller.state import Attempt, Trigger, job_name
from sailor_hpc.core.errors import NoPlanFits, SailorError, SlurmUnavailable
from sailor_hpc.core.runtime_events import InPlace, InPlaceRefused, RuntimeEvent, event_fields
from sailor_hpc.jobs.render import cpus_per_task
from sailor_hpc.slurm.discover import live_availability
from sailor_hpc.slurm.handle import SlurmJob
from sailor_hpc.slurm.hostlist import expand_hostlist
from sailor_hpc.slurm.safety import BUNDLE_SEP, job_ids
from sailor_hpc.slurm.start_estimate import StartEstimator
from sailor_hpc.slurm.status import FINAL_STATES, JobStatus
from sailor_hpc.slurm.watch import JobWatcher

STOP_TIMEOUT_S = 300.0  # a job asked to checkpoint that has not stopped by then is cancelled ...
STOP_MARGIN = 3.0  # ... unless its measured step + save times, with this margin, need longer
JOB_LOST_AFTER_S = 120.0  # a job neither squeue nor sacct knows for this long is gone

DRAIN_REASON = "node draining"
USER_STOP = "the run's user stops it"


class OneJob:
    """The attempts of a run on one cluster (see the module doc): start, watch and reconcile one job at a time."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.spec, self.site, self.archive = ctx.spec, ctx.site, ctx.archive
        self.cluster = ctx.cluster()
        self.estimator = StartEstimator(ctx.env)  # objective time: the queue, read within its budget per plan
        self.grower = Grower(ctx, self.cluster, stop=self._stop)
        self._tails: dict[int, LogTail] = {}
        self._watchers: dict[int, JobWatcher] = {}
        self._hosts: dict[str, list[str]] = {}
        self._malformed: dict[int, list[str]] = {}  # log lines journaled as malformed, per attempt
        self._queue_judged_t = 0.0  # when a pending job was last judged against the queue

    def slurm_answers(self) -> bool:
        return self.cluster.answers()

    def job(self, cur: Attempt) -> SlurmJob:
        """The attempt's job (submitted: its id is journaled)."""
        if cur.job_id is None:
            raise SailorError(f"attempt {cur.number} has no job yet", field="journal")
        return self.cluster.job(cur.job_id)

    # ----------------------------------------------------------------------------------------- reconcile

    def reconcile(self) -> None:
        """After a (re)start: adopt a job submitted just before a kill, cancel jobs of the run that are not
        the current one (never two jobs writing the same checkpoints)."""
        cur = self.ctx.state.current
        if cur is not None and cur.job_id is None:
            self._adopt_or_drop(cur)
        if cur is not None and cur.handover_from is not None:
            self.grower.open_gate(cur.number)  # killed between journaling the handover and opening the gate
        self._cancel_strays()

    def _adopt_or_drop(self, cur: Attempt) -> bool:
        """The attempt's intent is journaled, its job id is not (a kill, or sbatch without an answer): adopt the
        job Slurm has under its name, else journal it gone (True: adopted)."""
        job = slurm_ops.find_job_by_name(self.spec.run_id, cur.job_name, self.cluster, cur.intent_t)
        if job is not None:
            self.ctx.note(records.Adopted(attempt=cur.number, job_id=job.id, log=str(job.log())))
            return True
        self.ctx.note(records.JobGone(attempt=cur.number, job_id=None, state="NOT_SUBMITTED"))
        return False

    def _cancel_strays(self) -> None:
        cur = self.ctx.state.current
        keep = set(job_ids(cur.job_id)) if cur is not None and cur.job_id is not None else set()
        if cur is not None and cur.successor is not None and cur.waits_for_successor:
            keep.update(job_ids(cur.successor.grown.job_id))  # the bigger job growing beside it
        for base, info in slurm_ops.owned_jobs(self.spec.run_id, self.cluster).items():
            if info["state"] in FINAL_STATES or base in keep:
                continue
            self.ctx.note(records.Cancel(job_id=base, reason=f"{info['name']} is not the run's current job"))
            self.ctx.note(records.JobGone(job_id=base, state=slurm_ops.cancel_and_wait(self.cluster.job(base))))

    # -------------------------------------------------------------------------------------- observation

    def observe(self, cur: Attempt | None) -> Observation:
        obs = Observation(t=self.ctx.clock())
        rows = self.cluster.nodes()
        obs.node_states, obs.unusable, obs.lost = node_states(rows)
        names = {p.name for p in self.site.partitions}
        idle = cpu_bound({p: dict(v["idle_gpus_by_node"]) for p, v in live_availability(self.cluster.env).items()
                          if p in names}, rows, {p.name: cpus_per_task(p) for p in self.site.partitions})
        own: dict[str, dict[str, int]] = {}
        if cur is not None and cur.job_id is not None:
            watcher = self._watcher(cur)
            watcher.poll()
            obs.job = watcher.status(cur.job_id)
            if obs.job is not None and trains(obs.job):
                hosts = {c.nodes: self._hosts_of(c.nodes) for c in obs.job.components if not c.final}
                obs.job_nodes = sorted({h for hs in hosts.values() for h in hs})
                own = own_gpus(self.ctx.plan(cur.plan_file), obs.job, hosts)  # what it holds
        obs.free = free_for_run(idle, own, obs.unusable, obs.lost)
        obs.idle = free_for_run(idle, {}, obs.unusable, obs.lost)
        for name in names:
            obs.free.setdefault(name, {})
        return obs

    def _watcher(self, cur: Attempt) -> JobWatcher:
        if cur.number not in self._watchers:
            w = self.cluster.watcher(poll_s=self.spec.control.poll_s, lost_after_s=JOB_LOST_AFTER_S)
            w.add([cur.job_id])  # type: ignore[list-item]
            self._watchers[cur.number] = w
        return self._watchers[cur.number]

    def _hosts_of(self, nodelist: str) -> list[str]:
        if nodelist not in self._hosts:
            self._hosts[nodelist] = expand_hostlist(nodelist)
        return self._hosts[nodelist]

    def _tail(self, cur: Attempt) -> LogTail | None:
        if cur.log is None:
            return None
        if cur.number not in self._tails:
            self._tails[cur.number] = LogTail(cur.log)
        return self._tails[cur.number]

    def start(self) -> None:
        """No current attempt: hand over to a bigger job that grew beside the last one, or plan on what is free
        now (objective time: on the queue) and submit the next job."""
        st, spec = self.ctx.state, self.spec
        prev = st.attempts[-1] if st.attempts else None
        if prev is not None and prev.successor is not None and prev.waits_for_successor:
            if prev.successor.running_t is not None:
                self.grower.handover(prev)
                return
            self.grower.drop_successor(prev, f"job {prev.job_id} ended before the bigger job started")
        if not self.ctx.next_attempt_due():
            return
        obs = self.observe(None)
        try:
            planned = (plan_on_queue(spec, self.site, self.archive, self.estimator)[0] if spec.planning.objective == "time"
                       else plan_on(spec, self.site, self.archive, obs.free))
        except NoPlanFits as exc:  # nothing free that fits (or the constraints exclude all): wait
            self.ctx.note_once(records.NoPlan(message=str(exc), available=obs.available))
            return
        self.ctx.said.pop(records.Kind.NO_PLAN, None)
        self._cancel_strays()
        self.submit(planned, obs)

    def submit(self, planned: Planned, obs: Observation) -> None:
        st, spec = self.ctx.state, self.spec
        trigger = st.trigger
        reason = st.next_reason
        number = len(st.attempts) + 1
        name = job_name(spec.run_id, number)
        try:
            plan_path, scripts = prepare_attempt(self.ctx.rundir, spec, self.site, planned.plan, number, name,
                                                 exclude=never_now(obs.unusable))
        except SailorError as exc:  # rendering is deterministic: the spec (time limit, options) must change
            self.ctx.note(records.GaveUp(reason=f"the job script cannot be rendered: {exc}"))
            return
        self.ctx.note(records.PlanChosen(reason=reason, available=obs.available, planner_available=planned.available,
                  plan_file=str(plan_path), **planned.summary()))
        self.ctx.note(records.SubmitIntent(attempt=number, job_name=name, plan_file=str(plan_path),
                  script=" ".join(map(str, scripts)), reason=reason, trigger=trigger.kind if trigger else None,
                  trigger_t=trigger.t if trigger else None,
                  gpus=planned.summary()["gpus"], throughput=planned.score.throughput,
                  cost_per_hour=planned.score.cost_per_hour))
        try:
            job, log = submit_attempt(self.cluster, scripts, plan_path, spec.planning.site)
        except SailorError as exc:  # sbatch refused the job: the attempt fails (back-off, then give up)
            self.ctx.note(records.ErrorSeen(message=str(exc), where="sbatch"))
            self.ctx.note(records.JobGone(attempt=number, job_id=None, state="NOT_SUBMITTED"))
            self._failed(self.ctx.state.attempt(number), "not submitted")
            return
        self.ctx.note(records.Submitted(attempt=number, job_id=job.id, log=log))

    # ------------------------------------------------------------------------------- watching the job

    def watch(self, cur: Attempt) -> None:
        if cur.job_id is None:  # killed, or sbatch did not answer, after the intent: Slurm may have the job
            if not self._adopt_or_drop(cur):
                self._failed(cur, "not submitted")
            return
        obs = self.observe(cur)
        tail = self._tail(cur)
        if tail is not None:
            self._in_place(cur, tail.poll())
            self.ctx.passed_over(cur, tail.skipped)
            for message in tail.malformed[len(self._malformed.get(cur.number, [])):]:
                self.ctx.note(records.ErrorSeen(message=message, where="job log"))
            self._malformed[cur.number] = list(tail.malformed)
        job = obs.job
        running = job is not None and all_running(job)
        if running and cur.running_t is None:
            self.ctx.note(records.JobRunning(attempt=cur.number, job_id=cur.job_id, nodes=obs.job_nodes))
        running = job is not None and trains(job)  # a bundle's job ended: its lead's agent answers (re-plans, or ends)
        self.first_step(cur, tail)
        self._in_place_recovered(cur, tail)
        if cur.waits_for_successor:
            self.grower.watch_successor(cur, obs.idle)
        self.ctx.checkpoint(cur)
        if job is None or not job.known and job.state != "LOST":
            return  # not visible yet (just submitted)
        lost = lost_nodes(sorted(set(cur.nodes) | set(obs.job_nodes)), obs.lost, {**cur.lost_nodes, **cur.released})
        if lost:
            rec = self.ctx.note(records.NodeLost(attempt=cur.number, job_id=cur.job_id, nodes=lost))
            if running and draining_only(lost) and cur.stop is None:
                self.ctx.note(records.Decision(attempt=cur.number, action="checkpoint", trigger=records.Kind.NODE_LOST,
                          trigger_t=rec.t, reason="a node of the job drains: checkpoint and move"))
                self._stop(cur, DRAIN_REASON)
                return
        if not job.final and any(c.state == "COMPLETING" for c in job.components):
            return  # ending (its GPUs may already show as idle): its final state will say how
        if running:
            if saved_on_signal(tail, self.ctx.checkpoint_step()) and not _answered_in_place(cur):  # ours, a preemption's or
                self._end(cur, job, tail)  # the time limit's: the checkpoint is committed, no need to wait for the exit
            elif cur.stop is not None and self.ctx.clock() - cur.stop.t > _stop_timeout(tail):
                self._end(cur, job, tail, why="did not stop after its checkpoint signal")
            elif cur.stop is None and cur.first_step_t is not None and not cur.lost_nodes and not cur.waits_for_successor:
                self._consider_resize(cur, obs, tail)
            return
        if cur.running_t is None and not job.final and job.state != "LOST" and not cur.lost_nodes:
            if job.state == "PENDING" and self._replan_stuck(cur, job, obs):
                return
            if self.spec.planning.objective == "time" and job.state == "PENDING":
                self._judge_pending(cur, obs.t)
            return  # queued: waiting is the queue's business (excluded from recovery time)
        self._end(cur, job, tail)

    def first_step(self, cur: Attempt, tail: LogTail | None) -> None:
        """Journal the job's first step and, for a job that answers a change, what the change cost; each once,
        also when a controller was killed between the two (the resumed one writes the recovery then)."""
        first = tail.progress.first_step if tail is not None else None
        if tail is None or first is None:
            return
        p = tail.progress
        if cur.first_step_t is None:
            self.ctx.note(records.FirstStep(attempt=cur.number, job_id=cur.job_id, step=first,
                                loaded_step=p.loaded_step or 0, consumed_samples=p.loaded_consumed or 0))
        if cur.trigger_t is None or cur.recovery is not None or cur.first_step_t is None:
            return
        queue = (cur.running_t - cur.submitted_t) if cur.running_t and cur.submitted_t else None
        down = cur.first_step_t - cur.trigger_t
        # ranks idle: from the change; for a job that took over from a running one (which trained while
        # this one queued), from that one's last step to this one's first, both by the runtime's clock
        # (the log's account is the job's first only before any in-place step)
        prev = self.ctx.state.attempt(cur.handover_from) if cur.handover_from is not None else None
        before = prev.stopped.last_step_t if prev is not None and prev.stopped is not None else None
        idle = p.first_step_t - before if before and p.first_step_t and not cur.in_place else down
        self.ctx.note(records.RecoveryMeasured(attempt=cur.number, trigger=cur.trigger, trigger_t=cur.trigger_t,
                                   submitted_t=cur.submitted_t, running_t=cur.running_t, first_step_t=cur.first_step_t,
                                   queue_wait_s=queue, downtime_s=down, recovery_s=down - (queue or 0.0),
                                   ranks_idle_s=idle, new_job=True, handover=prev is not None))

    def _in_place(self, cur: Attempt, events: list[RuntimeEvent]) -> None:
        """Journal the steps the job's batch script re-planned on its surviving nodes (once each: a resumed
        controller reads the log again from the start)."""
        for e in events:
            if isinstance(e, InPlace) and e.step_index > len(cur.in_place):
                self.ctx.note(records.InPlaceStep(attempt=cur.number, change=e))
            elif isinstance(e, InPlaceRefused) and e.step_index > len(cur.in_place):
                self.ctx.note(records.InPlaceRefusedStep(attempt=cur.number,
                          **{k: v for k, v in event_fields(e).items() if k != "t"}))

    def _in_place_recovered(self, cur: Attempt, tail: LogTail | None) -> None:
        """The first step after an in-place re-plan: how long the change cost, inside the same job."""
        if not cur.in_place or cur.in_place[-1].recovery is not None or tail is None or tail.progress.first_step is None:
            return
        change, p, t = cur.in_place[-1], tail.progress, self.ctx.clock()
        step_end = change.t_step_end if change.t_step_end is not None else t
        idle = p.first_step_t - p.before_t if p.first_step_t and p.before_t else t - step_end
        trigger = change.trigger or Trigger(records.Kind.NODE_LOST, step_end)  # seen by the job first
        self.ctx.note(records.RecoveryMeasured(attempt=cur.number, in_place=True, trigger=trigger.kind, trigger_t=trigger.t,
                  first_step_t=t, step=p.first_step, loaded_step=p.loaded_step or 0, queue_wait_s=0.0,
                  downtime_s=t - trigger.t, recovery_s=t - trigger.t,
                  ranks_idle_s=idle, new_job=False))

    def _judge_pending(self, cur: Attempt, now: float) -> None:
        """Objective time, the job pends: every ``replan_interval`` re-plan on the current queue; when another
        plan finishes first by more than ``min_gain``, cancel the pending job (the next poll submits the best
        plan). A wait that still pays is journaled once per job."""
        if now - self._queue_judged_t < self.spec.control.replan_interval_s or cur.job_id is None:
            return
        self._queue_judged_t = now
        try:
            v = judge_pending(self.spec, self.site, self.archive, self.estimator, cur.job_id,
                              self.ctx.plan(cur.plan_file), self.spec.planning.gbs / cur.throughput)
        except NoPlanFits as exc:
            self.ctx.note_once(records.NoPlan(message=str(exc), available={}))
            return
        if not v.move:
            if self.ctx.said.get(records.Kind.DECISION) != f"keep {cur.number}":
                self.ctx.note(records.Decision(attempt=cur.number, action="keep", trigger="queue", trigger_t=now, reason=v.reason,
                                   candidate=v.best.summary(), gain=v.gain, resize=False))
                self.ctx.said[records.Kind.DECISION] = f"keep {cur.number}"
            return
        self.ctx.note(records.Decision(attempt=cur.number, action="resize", trigger="queue", trigger_t=now, reason=v.reason,
                           candidate=v.best.summary(), gain=v.gain, resize=True))
        self.ctx.note(records.Cancel(job_id=cur.job_id, reason="a plan on the current queue finishes first"))
        self.ctx.note(records.JobGone(attempt=cur.number, job_id=cur.job_id, state=slurm_ops.cancel_and_wait(self.job(cur))))

    def _replan_stuck(self, cur: Attempt, job: JobStatus, obs: Observation) -> bool:
        """The job pends for a reason Slurm does not clear soon (a node down or drained, a partition down, a
        reservation): cancel it and re-plan on what is free (True: cancelled; the next poll submits anew). A
        reason about nodes always moves (the next job excludes them); another moves only when a plan on what
        is free differs from the pending one, which would otherwise wait for the same thing again."""
        reason = stuck_reason(job)
        if reason is None or cur.job_id is None:
            return False
        if not about_nodes(reason):
            try:
                planned = plan_on(self.spec, self.site, self.archive, obs.free)
            except NoPlanFits:
                return False
            if plan_shape(planned.plan) == plan_shape(self.ctx.plan(cur.plan_file)):
                if self.ctx.said.get(records.Kind.DECISION) != f"stuck {cur.number} {reason}":  # once per reason
                    self.ctx.note(records.Decision(attempt=cur.number, action="keep", trigger="pending", trigger_t=obs.t,
                                                   reason=f"pends ({reason}); the best plan on what is free is the same"))
                    self.ctx.said[records.Kind.DECISION] = f"stuck {cur.number} {reason}"
                return False
        why = f"pends ({reason}), which Slurm does not clear soon: re-plan on what is free"
        self.ctx.note(records.Decision(attempt=cur.number, action="replan", trigger="pending", trigger_t=obs.t, reason=why))
        self.ctx.note(records.Cancel(job_id=cur.job_id, reason=why))
        self.ctx.note(records.JobGone(attempt=cur.number, job_id=cur.job_id, state=slurm_ops.cancel_and_wait(self.job(cur))))
        return True

    def _stop(self, cur: Attempt, reason: str) -> None:
        try:
            if reason in ("resize", USER_STOP):  # the run moves to another job, or ends: no requeue
                self.job(cur).keep_from_requeue()
            slurm_ops.request_checkpoint(self.job(cur))
        except SailorError as exc:  # gone meanwhile: the next poll sees it stopped
            self.ctx.note_once(records.ErrorSeen(message=str(exc), where="checkpoint signal"))
            return
        self.ctx.note(records.SignalSent(attempt=cur.number, job_id=cur.job_id, signal="USR1", reason=reason))

    def _consider_resize(self, cur: Attempt, obs: Observation, tail: LogTail | None) -> None:
        st, spec = self.ctx.state, self.spec
        more = idle_increase(st.baseline, obs.available)
        if not more:
            if any(obs.available.get(p, 0) < n for p, n in st.baseline.items()):
                self.ctx.note(records.Baseline(available=obs.available))  # fewer free now: a later return counts
            return
        if st.last_replan_t is not None and obs.t - st.last_replan_t < spec.control.replan_interval_s:
            return
        if st.grow_blocked is not None and st.grow_blocked == obs.idle:
            self.ctx.note(records.Baseline(available=obs.available, note="a bigger job timed out pending on this "
                                           "queue: none is tried again until the queue changes"))
            return
        rec = self.ctx.note(records.IdleGpus(attempt=cur.number, change={p: list(v) for p, v in more.items()},
                        available=obs.available))
        try:
            planned = plan_on(spec, self.site, self.archive, obs.free)
        except NoPlanFits as exc:
            self.ctx.note(records.Baseline(available=obs.available, note=str(exc)))
            return
        step = (tail.progress.last_step if tail is not None else None) or self.ctx.checkpoint_step()
        remaining = max(0, spec.job.steps - step) * spec.planning.gbs
        restart_s = restart_cost(spec.control.restart_cost_s, st.restart_costs)
        if plan_shape(planned.plan) == plan_shape(self.ctx.plan(cur.plan_file)):
            verdict = Verdict(False, 0.0, 0.0, 0.0, "the best plan on the new availability is the current one")
        else:
            verdict = judge(spec.planning.objective, Score(cur.throughput, cur.cost_per_hour), planned.score, remaining,
                            restart_s, spec.control.min_gain)
        self.ctx.note(records.Decision(attempt=cur.number, action="resize" if verdict.resize else "keep",
                  trigger=records.Kind.IDLE_GPUS, trigger_t=rec.t, candidate=planned.summary(),
                  current={"gpus": cur.gpus, "throughput": cur.throughput, "cost_per_hour": cur.cost_per_hour},
                  restart_cost_s=restart_s, remaining_samples=remaining, step=step, **verdict.to_dict()))
        if verdict.resize:
            if not self.grower.grow(cur, obs, rec.t, remaining, restart_s):
                self._stop(cur, "resize")
        else:
            self.ctx.note(records.Baseline(available=obs.available))

    # --------------------------------------------------------------------------------- the job ended

    def _end(self, cur: Attempt, job: JobStatus, tail: LogTail | None, why: str | None = None) -> None:
        """The job stopped training (or must): make sure it is gone, then decide what comes next."""
        prog = tail.progress if tail is not None else None
        job = without_ended_jobs(job, {**cur.lost_nodes, **cur.released})
        if job.state == "FAILED" and not any(c.exit_code for c in job.components):
            job = self._with_exit_codes(cur, job)
        by, by_user = self._canceller(cur, job)
        if cur.stopped is None:
            cancelled = (f"cancelled by {by_user}, the run's user" if by_user else
                         f"cancelled by {by}, not the run's user: a fault" if by else None)
            self.ctx.note(records.JobStopped(attempt=cur.number, job_id=cur.job_id, state=job.state,
                      reason=why or cancelled or _classify(cur, job, prog),
                      step=prog.last_step if prog else None, last_step_t=prog.last_step_t if prog else None,
                      exit_codes=[c.exit_code for c in job.components if c.exit_code]))
        early = self.grower.open_gate_early(cur, tail)
        final = job.state if job.final else None
        if final is None and cur.job_id is not None:
            self.ctx.note(records.Cancel(job_id=cur.job_id, reason="what is left of the stopped job"))
            # ranks that saved on the signal have left their step: end the rest (the batch script) at once,
            # which matters when a bigger job waits for this one to be gone before it loads
            grace = 0.0 if saved_on_signal(tail, self.ctx.checkpoint_step()) else 10.0
            final = slurm_ops.cancel_and_wait(self.job(cur), grace_s=grace, lost={**cur.lost_nodes, **cur.released})
        if tail is not None:
            tail.poll()  # its last words: saved, done, error
        if not early:  # else newer checkpoints are the bigger job's: journaled once it is the run's job
            self.ctx.checkpoint(cur)
        self.ctx.note(records.JobGone(attempt=cur.number, job_id=cur.job_id, state=final))
        if self.ctx.checkpoint_step() >= self.spec.job.steps:
            if cur.waits_for_successor:
                self.grower.drop_successor(cur, "the run is finished")
            ck = self.ctx.state.checkpoint
            self.ctx.note(records.Finished(step=self.ctx.checkpoint_step(), checkpoint=ck.path if ck else None))
            return
        if by_user is not None:  # the user's decision: the run stops, nothing is resubmitted
            if cur.waits_for_successor:
                self.grower.drop_successor(cur, "the run's user cancelled its job")
            self.ctx.note(records.RunStopped(how="cancelled", by=by_user, step=self.ctx.checkpoint_step(),
                                             jobs={cur.job_id or "": final or job.state}))
            return
        bad_input = any(c.exit_code.startswith("2:") for c in job.components if c.exit_code)
        if bad_input and prog is not None and prog.errors:
            if cur.waits_for_successor:
                self.grower.drop_successor(cur, "the run gave up")
            self.ctx.note(records.GaveUp(reason="the training refused its input: " + " | ".join(prog.errors[-3:])))
            return
        if cur.first_step_t is None and cur.stop is None and not cur.lost_nodes:
            self._failed(cur, cur.stopped.reason if cur.stopped is not None else str(final))

    def _canceller(self, cur: Attempt, job: JobStatus) -> tuple[str | None, str | None]:
        """Who cancelled the job outside sailor-hpc (``scancel``), and their name again when it is the run's own
        user: their decision, not a fault; anyone else's cancel is a fault the run recovers from. A bundle's job
        cancelled alone counts (its other jobs then fail: the aggregate state says FAILED)."""
        cancelled = any(c.state == "CANCELLED" for c in job.components) or job.state == "CANCELLED"
        if not cancelled or cur.stop is not None or cur.lost_nodes or cur.job_id is None:
            return None, None
        uid = slurm_ops.canceller(self.job(cur), job, self.ctx.clock, self.ctx.sleep)
        return (user_name(uid) if uid is not None else None), self.ctx.users_own(uid)

    def end_all(self, how: str) -> dict[str, str]:
        """End the run's jobs as its user asked (``stop``: the running job saves a complete checkpoint first);
        returns each job's final state. Strays of the run are cancelled too."""
        out: dict[str, str] = {}
        cur = self.ctx.state.current
        if cur is not None and cur.waits_for_successor and cur.successor is not None:
            out[cur.successor.grown.job_id] = self.grower.drop_successor(cur, f"the run's user asked it to {how}")
        if cur is not None and cur.job_id is not None:
            job = self.job(cur)
            if how == "stop":
                self._checkpoint_and_wait(cur, job)
            out[job.id] = slurm_ops.cancel_and_wait(job, grace_s=0.0 if how == "cancel" else 10.0)
            self.ctx.checkpoint(cur)
            if cur.stopped is None:
                prog = tail.progress if (tail := self._tail(cur)) is not None else None
                self.ctx.note(records.JobStopped(attempt=cur.number, job_id=job.id, state=out[job.id],
                                                 reason=f"the run's user asked it to {how}",
                                                 step=prog.last_step if prog else None,
                                                 last_step_t=prog.last_step_t if prog else None))
            self.ctx.note(records.JobGone(attempt=cur.number, job_id=job.id, state=out[job.id]))
        elif cur is not None:  # an intent Slurm has no job for (reconcile looked): nothing to end
            self.ctx.note(records.JobGone(attempt=cur.number, job_id=None, state="NOT_SUBMITTED"))
        self._cancel_strays()
        return out

    def _checkpoint_and_wait(self, cur: Attempt, job: SlurmJob) -> None:
        """Ask a running job to save a complete checkpoint and end; wait until it did (or its stop timeout)."""
        if not trains(job.status()):
            return  # pending or ending: nothing of it to save
        self._stop(cur, USER_STOP)
        tail = self._tail(cur)
        deadline = self.ctx.clock() + _stop_timeout(tail)
        while self.ctx.clock() < deadline:
            if tail is not None:
                tail.poll()
            self.ctx.checkpoint(cur)
            if job.status().final or saved_on_signal(tail, self.ctx.checkpoint_step()):
                return
            self.ctx.sleep(self.spec.control.poll_s)

    def _failed(self, cur: Attempt, reason: str) -> None:
        """A job that never trained a step: wait longer after each such failure in a row before the next."""
        self.ctx.note(records.Failure(attempt=cur.number, reason=reason))
        k = self.ctx.state.failures_in_a_row
        wait = min(self.spec.control.backoff_max_s, self.spec.control.backoff_s * 2 ** (k - 1)) if k > 0 else 0.0
        if wait > 0:
            self.ctx.note(records.Backoff(seconds=wait, until=self.ctx.clock() + wait))

    def _with_exit_codes(self, cur: Attempt, job: JobStatus, tries: int = 10, poll_s: float = 0.5) -> JobStatus:
        """Slurm can show a job FAILED before its accounting holds the exit codes, which tell a training
        that refused its input (exit 2: give up) from one that crashed (retry): ask again, briefly."""
        for _ in range(tries):
            self.ctx.sleep(poll_s)
            try:
                later = self.job(cur).status()
            except SlurmUnavailable:
                break
            if any(c.exit_code for c in later.components):
                return later
        return job


def _stop_timeout(tail: LogTail | None) -> float:
    """How long a job asked to checkpoint may take to stop: cancelling it mid-save would lose every step
    since its last periodic checkpoint, so a model that saves slowly gets the time its own saves took."""
    needs = tail.progress.stop_needs_s if tail is not None else 0.0
    return max(STOP_TIMEOUT_S, STOP_MARGIN * needs)


def _answered_in_place(cur: Attempt) -> bool:
    """The job's batch script answers the stop itself: it re-plans on its other nodes (or ends, if no plan fits
    them), so the controller waits for the job instead of ending it on the saved checkpoint. Asked to checkpoint
    because a node drains; or a bundle that lost nodes without our signal: Slurm ended one of its jobs with its
    batch node, whose ranks' SIGTERM made every rank save, and the lead job's agent re-plans without that job."""
    if cur.stop is not None:
        return cur.stop.reason == DRAIN_REASON
    return bool(cur.lost_nodes) and BUNDLE_SEP in (cur.job_id or "")


def _classify(cur: Attempt, job: JobStatus, prog: Any) -> str:
    """Why a job stopped running, in the issue's terms."""
    if cur.stop is not None:
        return cur.stop.reason
    if cur.lost_nodes:
        return records.Kind.NODE_LOST
    if job.state == "COMPLETED":
        return "completed"
    if prog is not None and prog.signal_step is not None:
        return "signal_saved"  # time limit or preemption: the job checkpointed on its signal
    if job.state in ("PENDING", "REQUEUED", "REQUEUE_HOLD"):
        return "requeued"
    if job.state == "NODE_FAIL":
        return records.Kind.NODE_LOST
    if job.state in ("TIMEOUT", "PREEMPTED"):
        return job.state.lower()
    return f"failed ({job.state})"
