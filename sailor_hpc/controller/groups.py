"""The controller's attempts across clusters: a *group* of one Slurm job per cluster, started and re-planned together.

A het job cannot span clusters, so on a site of several clusters the controller's attempt holds one job per
cluster (:func:`sailor_hpc.jobs.render.render_job_script` with a :class:`ClusterPart`), all joining one
rendezvous; they only train when every one of them runs. These are the policies of that attempt: the one
:class:`~sailor_hpc.controller.loop.Controller` loop calls :meth:`Groups.start` when the run has no
attempt and :meth:`Groups.watch` on each poll (its run directory, lock, journal and outage wait):

- every cluster's job is submitted (each with its cluster's ``SLURM_CONF``, a fresh rendezvous file) after
  the group's intent is journaled (``group_intent``: its jobs' names, unique to the run), so a group cut short
  while submitting, by a kill or a Slurm outage, is found by name;
- a cluster whose job still pends ``--grow-timeout`` after submission is dropped: the group is cancelled and
  the run re-planned without it (the ranks already running would only wait);
- a cluster whose job Slurm ends (cancelled, node failure, preemption, time limit) is lost like a node: the
  group is cancelled and re-planned on the remaining clusters, resuming from the newest complete checkpoint;
  a job that FAILED (the training's own error, or its ranks losing a peer cluster) retries the group on the
  same clusters;
- a cluster that left comes back once it has idle GPUs, ``--replan-interval`` after it left, after the
  running group saved a checkpoint of its own and when the plan across it gains ``--min-gain`` after the
  measured restart cost (:func:`~sailor_hpc.controller.policy.judge`; refused, it is asked again later): the
  group checkpoints and stops (SIGUSR1), then the run is re-planned across it;
- a Slurm outage anywhere is waited out with the controller's back-off, then the run goes on as a resumed
  one: the current group's jobs, journaled or found by name, are adopted when none of them ended badly, else
  stopped. As on one cluster, the run gives up after ``--max-restarts`` restarts in a row without a new
  checkpoint (a group regrown across a cluster that came back is a resize, not a restart).
"""
from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from sailor_hpc.controller import records
from sailor_hpc.controller.attempt_job import write_attempt_plan, write_attempt_script
from sailor_hpc.controller.context import RunContext
from sailor_hpc.controller.planning import plan_on
from sailor_hpc.controller.policy import Score, judge, restart_cost
from sailor_hpc.controller.slurm_ops import cancel_and_wait, canceller, find_job_by_name, request_checkpoint
from sailor_hpc.controller.spec import RunSpec
from sailor_hpc.controller.state import Attempt, job_name_prefix
from sailor_hpc.core.archive import ProfileArchive
from sailor_hpc.core.checkpoint import newest_step
from sailor_hpc.core.errors import JobFailed, NoPlanFits, SailorError, SlurmUnavailable
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.site import Site
from sailor_hpc.core.start_times import STARTS_JOBS
from sailor_hpc.jobs.options import ClusterPart
from sailor_hpc.jobs.render import plan_clusters
from sailor_hpc.slurm.discover import partition_states
from sailor_hpc.slurm.handle import SlurmCluster, SlurmJob
from sailor_hpc.slurm.hostlist import expand_hostlists
from sailor_hpc.slurm.status import JobStatus
from simulator import SimOptions, simulate

PlanFor = Callable[[tuple[str, ...]], Plan]
#: a job that ends in one of these lost its cluster (Slurm ended it: cancelled, node failure, preemption, ...);
#: a FAILED job is the training's own failure, or the echo of a peer cluster's loss: retried, not dropped
CLUSTER_LOSS = frozenset({"CANCELLED", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "TIMEOUT"})
STOP_TIMEOUT_S = 300.0  # a group asked to checkpoint (by its user, or to regrow) that has not ended by then is cancelled
SETTLE_S = 10.0  # after one job ends badly, how long the others get to end too (see _settle)


def across_clusters(site: Site) -> bool:
    """Whether the controller's attempts are groups (one job per cluster) on this site."""
    return len(site.clusters) > 1


def idle_by_node(site: Site, clusters: Sequence[SlurmCluster],
                 whole: Mapping[str, set[str]] | None = None) -> dict[str, dict[str, int]]:
    """Idle GPUs per usable node of ``clusters``' partitions, partition -> node -> GPUs (``sinfo`` on each
    cluster; node names may repeat across clusters, partition names do not). Nodes in ``whole[cluster]`` count
    with every GPU (a running group's own, as if it had stopped)."""
    out: dict[str, dict[str, int]] = {}
    for cluster in clusters:
        starting = {name for name, state in partition_states(cluster.env).items() if state in STARTS_JOBS}
        parts = [p.name for p in site.partitions if p.cluster == cluster.name and p.name in starting]
        full = (whole or {}).get(cluster.name, set())
        for n in cluster.nodes(parts):
            if n.usable and n.partition in parts:
                out.setdefault(n.partition, {})[n.name] = n.gpus if n.name in full else max(0, n.gpus - n.gpus_used)
    return out


def planner_plan_for(spec: RunSpec, site: Site, archive: ProfileArchive,
                     cluster: Callable[[str], SlurmCluster]) -> PlanFor:
    """The run's best plan on the GPUs idle now in the given clusters (``cluster(name)``: its Slurm). A group is
    only re-planned after its jobs ended, so its own GPUs are idle by then."""
    return lambda clusters: plan_on(spec, site, archive, idle_by_node(site, [cluster(c) for c in clusters])).plan


class Groups:
    """The attempts of a run across clusters (see the module doc): start, watch and reconcile a group of jobs.
    ``plan_for`` replaces the planner (tests give fixed plans per set of clusters)."""

    def __init__(self, ctx: RunContext, plan_for: PlanFor | None = None) -> None:
        self.ctx = ctx
        self.spec, self.site, self.archive = ctx.spec, ctx.site, ctx.archive
        self.fixed_plans = plan_for
        self.plan_for = plan_for or planner_plan_for(self.spec, self.site, self.archive, ctx.cluster)
        self._regrow_refused: dict[str, float] = {}  # cluster that left -> when growing back was last judged not worth it
        self._next_clusters: tuple[str, ...] | None = None  # where the next group is planned, once the current one decided

    def slurm_answers(self) -> bool:
        """Whether the slurmctld of every cluster the run may use (not left) answers."""
        return all(self.ctx.cluster(c.name).answers() for c in self.site.clusters if c.name not in self.ctx.state.left)

    def _job(self, cluster: str, job_id: str) -> SlurmJob:
        return self.ctx.cluster(cluster).job(job_id)

    # --------------------------------------------------------------------------------------- a new group

    def start(self) -> None:
        """Plan on the clusters the last group left the run with (at a start: every cluster that has not
        left) and submit one job per cluster the plan uses."""
        if not self.ctx.next_attempt_due():  # finished, or out of restarts: the same rules as one job's
            return
        gone = set(self.ctx.state.left)
        clusters = self._next_clusters or tuple(c.name for c in self.site.clusters if c.name not in gone) or tuple(gone)
        try:
            self._submit_group(clusters, len(self.ctx.state.attempts) + 1)
        except NoPlanFits as exc:  # nothing free that fits the clusters: wait for GPUs
            self.ctx.note_once(records.NoPlan(message=str(exc), available={}))

    def _submit_group(self, clusters: tuple[str, ...], attempt: int) -> None:
        s, directory = self.spec, self.ctx.rundir.path
        plan = self.plan_for(clusters)
        used = plan_clusters(plan, self.site)
        if not set(used) <= set(clusters):
            raise SailorError(f"the plan for clusters {', '.join(clusters)} uses {', '.join(used)}",
                              field="plan_for", fix="plan only on the clusters given")
        try_ = self.ctx.rundir.next_try(attempt)
        plan_path = write_attempt_plan(self.ctx.rundir, plan, attempt, try_)
        rdzv = directory / f"rendezvous.{attempt}.{uuid.uuid4().hex}"  # fresh: an old one holds an old address
        start = self.ctx.checkpoint_step()  # journaled by next_attempt_due just before
        names = {c: f"{job_name_prefix(s.run_id)}{attempt:03d}-{c}" for c in used}
        score = self._score(plan)
        # journaled before the first sbatch: a group cut short by a kill or an outage is found by these names
        self.ctx.note(records.GroupIntent(group=attempt, job_names=names, start_step=start, plan_file=str(plan_path),
                                      gpus=plan.gpus_by_partition(), throughput=score.throughput,
                                      cost_per_hour=score.cost_per_hour))
        jobs = {}
        for cluster in used:
            script = write_attempt_script(self.ctx.rundir, s, self.site, plan, plan_path, attempt, name=names[cluster],
                                          scope=ClusterPart(cluster, rdzv), try_=try_)
            jobs[cluster] = self.ctx.cluster(cluster).submit(script, plan=str(plan_path), site=s.planning.site)[0].id
        self.ctx.note(records.GroupSubmitted(group=attempt, jobs=jobs, clusters=list(used), start_step=start,
                                         plan_file=str(plan_path)))
        self._next_clusters = None

    def reconcile(self) -> None:
        """After a restart or an outage: the current group, adopted if every cluster's job of it (journaled, or
        found by its name when the group was cut short while submitting) pends, runs or completed; else stopped."""
        cur = self.ctx.state.current
        if cur is None:
            return
        jobs = dict(cur.jobs)
        for c, name in cur.job_names.items():
            if c not in jobs and (found := find_job_by_name(self.spec.run_id, name, self.ctx.cluster(c), cur.intent_t)):
                jobs[c] = found.id
        polled = self._poll(jobs)
        states = {c: s.state for c, s in polled.items()}
        whole = set(jobs) == set(cur.clusters)
        if whole and all(st == "COMPLETED" for st in states.values()):
            self.ctx.note(records.Finished(group=cur.number, step=newest_step(Path(self.spec.job.save)), states=states))
        elif whole and not any(s.final and s.state != "COMPLETED" for s in polled.values()):
            # pending, running or (some) completed: the group goes on; watching it decides the rest
            self.ctx.note(records.GroupAdopted(group=cur.number, jobs=dict(jobs), states=states))
        else:
            missing = sorted(set(cur.clusters) - set(jobs))
            self._stop_group(cur, f"resumed: not every job runs ({states}"
                             + (f"; never submitted on {', '.join(missing)})" if missing else ")"), jobs)

    # ------------------------------------------------------------------------------------ watching a group

    def watch(self, cur: Attempt) -> None:
        """One poll of the current group: finished, or a cluster pending too long, lost or failed (stop the
        group; the next one is planned on the clusters left), or all running (maybe regrow across one that left)."""
        if set(cur.jobs) != set(cur.clusters):  # cut short while submitting: its jobs are found by name
            self.reconcile()
            return
        states = self._poll(cur.jobs)  # a Slurm outage here is the loop's to wait out, then the group is adopted
        self.ctx.checkpoint(cur)  # a newer complete checkpoint: the group made progress (restarts count from 0)
        if all(s.state == "COMPLETED" for s in states.values()):
            self.ctx.note(records.Finished(group=cur.number, step=self.ctx.checkpoint_step()))
            return
        ended = {c: s.state for c, s in states.items() if s.final and s.state != "COMPLETED"}
        pending = [c for c, s in states.items() if s.state == "PENDING"]
        submitted = cur.submitted_t if cur.submitted_t is not None else cur.intent_t
        if not ended and pending and self.ctx.clock() - submitted > self.spec.control.grow_timeout_s:
            self.ctx.note(records.ClusterDropped(group=cur.number, clusters=pending, reason="pending"))
            self._replan_without(cur, pending, "pending")
            return
        if ended:  # states read before our own cancel turns the others CANCELLED
            if (by := self._cancelled_by_user(cur, ended, states)) is not None:
                self._stop_group(cur, f"cancelled by {by}, the run's user")
                self.ctx.note(records.RunStopped(how="cancelled", by=by, step=self.ctx.checkpoint_step(),
                                                 jobs={cur.jobs[c]: st for c, st in ended.items()}))
                return
            ended = self._settle(cur, ended)
            lost = [c for c, st in ended.items() if st in CLUSTER_LOSS]
            if lost:
                self.ctx.note(records.ClusterLost(group=cur.number, clusters=lost, states=ended))
            else:
                self.ctx.note(records.GroupFailed(group=cur.number, states=ended))  # no cluster lost
            self._replan_without(cur, lost, "cluster lost" if lost else "job failed")
            return
        if cur.running_t is None and all(s.state == "RUNNING" for s in states.values()):
            self.ctx.note(records.GroupRunning(group=cur.number))
            if cur.trigger is not None and cur.trigger_t is not None:  # the change this group answers cost this long
                self.ctx.note(records.GroupRecovered(group=cur.number, trigger=cur.trigger, trigger_t=cur.trigger_t,
                                                 recovery_s=round(self.ctx.clock() - cur.trigger_t, 3)))
            return
        back = self._rejoining(cur) if cur.running_t is not None else []
        if back:
            self.ctx.note(records.Regrown(group=cur.number, clusters=back, step=self.ctx.checkpoint_step()))
            for c, j in cur.jobs.items():
                request_checkpoint(self._job(c, j))
            self._wait_group_final(cur)
            self._next_clusters = tuple(dict.fromkeys([*cur.jobs, *back]))

    def _poll(self, jobs: Mapping[str, str]) -> dict[str, JobStatus]:
        return {c: self._job(c, j).status() for c, j in jobs.items()}

    def _cancelled_by_user(self, cur: Attempt, ended: Mapping[str, str], states: Mapping[str, JobStatus]) -> str | None:
        """The run's user's name when they cancelled a cluster's job of the group outside sailor-hpc (their
        decision: the run stops), else None (a fault: the cluster is lost, the run goes on without it)."""
        for c, st in ended.items():
            if st == "CANCELLED":
                uid = canceller(self._job(c, cur.jobs[c]), states[c], self.ctx.clock, self.ctx.sleep)
                if (by := self.ctx.users_own(uid)) is not None:
                    return by
        return None

    def end_all(self, how: str) -> dict[str, str]:
        """End the group's jobs as the run's user asked (``stop``: a running group saves a complete checkpoint
        first); returns each job's final state (``cluster:job id``)."""
        cur = self.ctx.state.current
        if cur is not None and set(cur.jobs) != set(cur.clusters):
            self.reconcile()  # cut short while submitting: find its jobs by name, or stop it
            cur = self.ctx.state.current
        if cur is None:
            return {}
        if how == "stop" and all(s.state == "RUNNING" for s in self._poll(cur.jobs).values()):
            for c, j in cur.jobs.items():
                request_checkpoint(self._job(c, j))
            self._ended_within(cur, STOP_TIMEOUT_S)  # cancelled below if not
        states = {c: cancel_and_wait(self._job(c, j)) for c, j in cur.jobs.items()}
        self.ctx.note(records.GroupStopped(group=cur.number, reason=f"the run's user asked it to {how}", states=states))
        return {f"{c}:{cur.jobs[c]}": st for c, st in states.items()}

    def _settle(self, cur: Attempt, ended: dict[str, str]) -> dict[str, str]:
        """The end states of every job that ends within ``SETTLE_S`` of the first: a cancelled cluster's job
        may show up final after its peers' ranks already failed on the lost connection."""
        deadline = self.ctx.clock() + SETTLE_S
        while len(ended) < len(cur.jobs) and self.ctx.clock() < deadline:
            self.ctx.sleep(self.spec.control.poll_s)
            ended |= {c: s.state for c, s in self._poll(cur.jobs).items()
                      if s.final and s.state != "COMPLETED" and c not in ended}
        return ended

    def _stop_group(self, cur: Attempt, reason: str, jobs: Mapping[str, str] | None = None) -> None:
        """Cancel every cluster's job of the group and wait until all are gone."""
        states = {c: cancel_and_wait(self._job(c, j)) for c, j in (jobs or cur.jobs).items()}
        self.ctx.note(records.GroupStopped(group=cur.number, reason=reason, states=states))

    def _replan_without(self, cur: Attempt, gone: list[str], reason: str) -> None:
        self._stop_group(cur, reason)
        rest = tuple(c for c in cur.jobs if c not in gone)
        if not rest:
            raise JobFailed(f"every cluster of the run left ({reason}: {', '.join(gone)})", field="clusters",
                            fix="check the clusters' queues and nodes, then start the run again")
        self._next_clusters = rest

    def _ended_within(self, cur: Attempt, timeout_s: float) -> bool:
        """After a checkpoint request: whether every job of the group ended by itself (exit 75) within
        ``timeout_s``."""
        deadline = self.ctx.clock() + timeout_s
        while self.ctx.clock() < deadline:
            if all(s.final for s in self._poll(cur.jobs).values()):
                return True
            self.ctx.sleep(self.spec.control.poll_s)
        return False

    def _wait_group_final(self, cur: Attempt) -> None:
        """After a checkpoint request: wait for every job to end by itself, else cancel it."""
        if self._ended_within(cur, STOP_TIMEOUT_S):
            self.ctx.note(records.GroupStopped(group=cur.number, reason="rejoin"))
        else:
            self._stop_group(cur, "rejoin: checkpoint request timed out")

    # -------------------------------------------------------------------------------------------- regrow

    def _has_idle_gpus(self, cluster: str) -> bool:
        try:
            idle = idle_by_node(self.site, [self.ctx.cluster(cluster)])
        except SlurmUnavailable:
            return False  # its controller does not answer: not back yet
        return any(g > 0 for nodes in idle.values() for g in nodes.values())

    def _rejoining(self, cur: Attempt) -> list[str]:
        """Clusters that left (``state.left``: the clusters dropped or lost, with when) and may come back now (see
        the module doc)."""
        now = self.ctx.clock()
        if self.ctx.checkpoint_step() <= (cur.start_step or 0):
            return []  # the group has not saved anything yet: moving now would recompute its steps
        back = [c for c, t in self.ctx.state.left.items()
                if now - max(t, self._regrow_refused.get(c, t)) >= self.spec.control.replan_interval_s
                and self._has_idle_gpus(c)]
        if back and not self._worth_regrowing(cur, tuple(back)):
            self._regrow_refused.update({c: now for c in back})  # not worth it now: asked again a replan interval later
            return []
        return back

    def _score(self, plan: Plan) -> Score:
        """The plan scored as the planner scores it: simulated as the runtime that will run it runs it."""
        r = simulate(plan, self.site, self.archive, options=SimOptions(runtime=self.spec.planning.runtime_of(plan)))
        return Score(r.throughput_samples_per_s, r.cost_per_hour)

    def _worth_regrowing(self, cur: Attempt, back: tuple[str, ...]) -> bool:
        """The resize policy for growing back across ``back``: the plan on the grown clusters must gain
        ``min_gain`` over the running group's after the (measured) restart cost."""
        grown = tuple(dict.fromkeys([*cur.jobs, *back]))
        try:
            new = (self.fixed_plans(grown) if self.fixed_plans is not None
                   else plan_on(self.spec, self.site, self.archive, self._free_with_group(grown, cur)).plan)
            current, candidate = self._score(self.ctx.plan(cur.plan_file)), self._score(new)
        except (SailorError, SlurmUnavailable) as exc:  # no plan fits the grown clusters, or one does not answer
            self.ctx.note(records.RegrowDecision(group=cur.number, clusters=list(back), resize=False, reason=str(exc)))
            return False
        remaining = max(0, self.spec.job.steps - self.ctx.checkpoint_step()) * self.spec.planning.gbs
        verdict = judge(self.spec.planning.objective, current, candidate, remaining,
                        restart_cost(self.spec.control.restart_cost_s, self.ctx.state.restart_costs), self.spec.control.min_gain)
        self.ctx.note(records.RegrowDecision(group=cur.number, clusters=list(back), **verdict.to_dict()))
        return verdict.resize

    def _free_with_group(self, clusters: tuple[str, ...], cur: Attempt) -> dict[str, dict[str, int]]:
        """GPUs free per node of ``clusters`` if the group stopped: idle ones, and every GPU of the group's nodes
        (it may not hold them all; the plan made once it stopped is checked against what is really free)."""
        states = self._poll({c: j for c, j in cur.jobs.items() if c in clusters})
        ours = {c: set(expand_hostlists(p.nodes for p in s.components)) for c, s in states.items()}
        return idle_by_node(self.site, [self.ctx.cluster(c) for c in clusters], ours)
