"""The job's agent: one ``srun`` step per node, and ranks that outlive an allocation change.

The batch script of a job that recovers in place (megatron_patch runtime) runs this module on the batch node
instead of one ``srun`` step for all ranks. It starts one step per node (``--kill-on-bad-exit=0``): Slurm ends
the step of a node that goes down, and releasing a drained node ends only that node's step, so the other
nodes' ranks keep their processes (checked on Slurm 22.05: a two-node ``--no-kill`` job's step on a100-1 ran on
through a100-2 going DOWN, and through ``scontrol update JobId=<id> NodeList=a100-1`` after a drain). The ranks
run with ``--resident DIR`` (:mod:`sailor_hpc.core.resident`): when training stops short they hold and wait
here for a directive. The agent then

1. waits until every rank still running holds (a node's step that ended counts as lost ranks); once a step
   ended badly or a rank failed, it tells the others to leave their communicators at once (``wake-<epoch>``:
   a lost node's processes may live on, their connections open, where it is cut off or hung);
2. asks :func:`sailor_hpc.controller.inplace.replan` which nodes were lost and plans on the survivors, with the
   run's objective and constraints, releasing drained nodes; none lost (a time-limit or stop signal, a failure):
   every rank leaves, the job ends with their exit code, as a job of one step would;
3. writes the next epoch's plan and :class:`~sailor_hpc.core.resident.Directive` (each seat's rank, a fresh
   rendezvous on the new rank 0's node) and prints the ``in_place`` record (``resident``: true) the controller
   journals. The ranks rejoin in their own processes: no new step, no import, no queue.

Mixed-GPU plans: Slurm 22.05 ends a whole het job when any of its nodes goes down, ``--no-kill`` or not, so the
controller runs such a plan as a *bundle*: one plain ``--no-kill`` job per component of its job layout (what
would be a het component), submitted together, meeting in one folder and one rendezvous
(:class:`sailor_hpc.jobs.options.BundlePart`). Each job has its agent (``--bundle-part``);
part 0's, beside plan rank 0, does the above for every job's ranks, the others start their steps, say when one
ends (``ended/<node>.json``) and follow its directives. A lost batch node ends its job (Slurm 22.05: FAILED,
``JobLaunchFailure``, its other nodes released): the lead takes every node of that job as lost and re-plans on
the other jobs, whose ranks go on in their processes. Only the loss of the lead's own batch node, where this
agent runs, ends the bundle (its followers then end their ranks) and falls back to a new attempt.
Exit code: the ranks' (0 done, 75 saved on a signal); 1 when no plan fits the survivors or the ranks failed.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen

from sailor_hpc.controller.events import ends_its_jobs, node_states
from sailor_hpc.controller.inplace import SurvivorPlanner, in_place_record, replan, step_port
from sailor_hpc.core.dist_env import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_SAVED_ON_SIGNAL
from sailor_hpc.core.errors import SailorError, SlurmUnavailable
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.resident import (
    Directive,
    Held,
    Part,
    Seat,
    read_directive,
    read_ended,
    read_held,
    read_parts,
    write_directive,
    write_ended,
    write_part,
    write_wake,
)
from sailor_hpc.core.runtime_events import InPlaceRefused, encode_event
from sailor_hpc.jobs.layout import component_layout, job_layout
from sailor_hpc.jobs.rank_env import JOB_TASKS_ENV, TASK_OFFSET_ENV
from sailor_hpc.slurm.commands import sinfo_nodes
from sailor_hpc.slurm.control import job_components, node_address, start_step
from sailor_hpc.slurm.safety import BUNDLE_SEP, job_ids
from sailor_hpc.slurm.status import poll_jobs

POLL_S = 0.02
#: how long the ranks still running may take to notice a change and hold (a rank computing a long step only
#: notices at its next collective); after it the job ends as a failed one
SETTLE_S = 120.0
#: a node's step that ended well while the others still train: lost after this (see :meth:`Agent.lost`)
ENDED_GRACE_S = 5.0
BUNDLE_WAIT_S = 600.0  # a bundle's jobs that have not all started by then: the job gives up
BUNDLE_POLL_S = 1.0  # how often a waiting agent asks Slurm whether a job of its bundle ended
BUNDLE_WATCH_S = 2.0  # how often the lead asks Slurm, while the ranks train, whether a job of its bundle ended
JOB_ENDED_RC = 137  # the ended marker the lead writes for each node of a job Slurm ended: its ranks were killed


@dataclass
class NodeStep:
    """One node's ``srun`` step and the seats (local indices) of its ranks."""

    node: str
    tasks: int
    proc: Popen[bytes]


@dataclass
class Agent:
    """One job's agent. A bundle (one job per component of a mixed-GPU plan's layout) has one per job, sharing ``root``:
    part 0's, beside plan rank 0, answers every change for all (the *lead*); the others start their job's steps,
    say when one ends and follow the lead's directives."""

    run_dir: Path
    job_plan: Path
    root: Path  # the ranks' --resident folder
    job_id: str
    srun_options: list[str]  # every node's step: --wait, the container's options
    task: list[str]  # what each task runs (rank_env, then the runtime)
    part: int = 0  # this job's index in its bundle
    parts: int = 1
    steps: dict[str, NodeStep] = field(default_factory=dict)
    retired: list[NodeStep] = field(default_factory=list)  # steps of nodes the plan no longer uses
    epoch: int = 0
    plan: Path | None = None
    planner: SurvivorPlanner | None = None
    addresses: dict[str, str] = field(default_factory=dict)
    members: dict[str, int] = field(default_factory=dict)  # lead: every node of the current plan -> its ranks
    _marked: set[str] = field(default_factory=set)
    _woken: int = -1  # the epoch whose ranks were told to leave their communicators
    _ended_seen: dict[str, float] = field(default_factory=dict)  # node -> when its ended marker was first read
    _parts: dict[int, Part] = field(default_factory=dict)  # the bundle's jobs, once every one registered
    dropped: set[str] = field(default_factory=set)  # lead: jobs of the bundle Slurm ended with their batch node

    @property
    def lead(self) -> bool:
        return self.part == 0

    def start(self) -> None:
        """One step per node of the job's plan, tasks numbered as one step over the whole job would number them."""
        plan = load_plan(self.job_plan, validate=False)
        layout = job_layout(plan) if self.parts == 1 else component_layout(job_layout(plan), self.part)
        comps = job_components(self.job_id)
        het = len(comps) > 1
        offset = 0
        for lay, comp in zip(layout.components, comps):
            cpus = os.environ.get(f"SLURM_CPUS_PER_TASK_HET_GROUP_{lay.index}") or os.environ.get("SLURM_CPUS_PER_TASK")
            for node in comp.nodes[:lay.nodes]:
                opts = [*([f"--het-group={lay.index}"] if het else []), "-N", "1", "-n", str(lay.tasks_per_node),
                        f"--ntasks-per-node={lay.tasks_per_node}", f"--nodelist={node}",
                        *([f"--cpus-per-task={cpus}"] if cpus else []), "--kill-on-bad-exit=0", "--distribution=block",
                        *self.srun_options]
                env = {**os.environ, TASK_OFFSET_ENV: str(offset), JOB_TASKS_ENV: str(layout.num_tasks)}
                self.steps[node] = NodeStep(node, lay.tasks_per_node, start_step(opts, self.task, env))
                offset += lay.tasks_per_node
        write_part(self.root, Part(self.part, self.job_id, {n: s.tasks for n, s in self.steps.items()},
                                   batch_node=os.environ.get("SLURMD_NODENAME", "")))
        self.plan = self.job_plan
        if self.lead:
            threading.Thread(target=self._prepare, daemon=True).start()

    def _bundle(self) -> dict[int, Part]:
        """Every job of the bundle, once all registered (the ranks only train once every job runs); read once."""
        deadline = time.monotonic() + BUNDLE_WAIT_S
        while not self._parts:
            if len(parts := read_parts(self.root)) == self.parts:
                self._parts = parts
            elif time.monotonic() > deadline:
                raise SailorError(f"{len(parts)} of the bundle's {self.parts} jobs started within {BUNDLE_WAIT_S:.0f} s",
                                  file=self.root, fix="the run's controller re-plans on what is free")
            else:
                time.sleep(POLL_S)
        return self._parts

    def bundle_id(self) -> str:
        return BUNDLE_SEP.join(p.job_id for _, p in sorted(self._bundle().items()))

    def running_jobs(self) -> list[str]:
        """The bundle's jobs the lead has not re-planned without."""
        return [j for j in job_ids(self.bundle_id()) if j not in self.dropped]

    def drop_ended(self, ask_jobs: bool = True) -> bool:
        """Lead: whether every job of the bundle that Slurm ended lost its batch node (then its nodes are marked
        ended, and a change re-plans without them); False when one ended otherwise (cancelled, failed), which
        ends the bundle. A job whose batch node is down counts at once: Slurm kills its batch script then, and its
        steps once it ends (3-10 s later, measured). Other ends are asked of Slurm (``ask_jobs``). While Slurm does
        not answer: True, as if none ended (asked again later)."""
        parts = {p.job_id: p for p in self._bundle().values()}
        others = [j for j in self.running_jobs() if j != self.job_id]
        if not others:
            return True
        said = read_ended(self.root)  # a job whose agent said every node's step ended ended by itself
        try:
            _, _, lost = node_states(sinfo_nodes(None))
            ended = [j for j in others if ends_its_jobs(lost.get(parts[j].batch_node, ""))]
            rest = [j for j in others if j not in ended and not all(n in said for n in parts[j].nodes)]
            if ask_jobs and rest:
                ended += [j for j, s in poll_jobs(rest).items() if s.final]
        except (SailorError, SlurmUnavailable):
            return True
        if any(not set(parts[j].nodes) & set(lost) for j in ended):
            return False
        for j in ended:
            for node in parts[j].nodes:
                write_ended(self.root, node, JOB_ENDED_RC)
            self.dropped.add(j)
        return True

    def _prepare(self) -> None:
        """While the ranks start: what a change will need (the planner's inputs, the nodes' addresses, the plan
        for the loss of each node)."""
        try:
            parts = self._bundle()
            planner = SurvivorPlanner.of(self.run_dir, self.job_plan)
            self.addresses = {n: node_address(n) or n for p in parts.values() for n in p.nodes}
            planner.plan_ahead(job_components(self.bundle_id()))
        except (SailorError, SlurmUnavailable, OSError):
            return  # a change then reads and plans everything itself
        self.planner = planner

    def mark_ended(self) -> None:
        """Say which of this job's node steps ended, and how (the lead reads them for every job)."""
        for node, s in self.steps.items():
            if node not in self._marked and (rc := s.proc.poll()) is not None:
                write_ended(self.root, node, rc)
                self._marked.add(node)

    def live(self, ended: dict[str, int]) -> dict[str, int]:
        """Lead: the current plan's nodes whose step has not ``ended``, and their ranks (at first: every node of
        every job of the bundle)."""
        if not self.members:
            self.members = {n: t for p in self._bundle().values() for n, t in p.nodes.items()}
        return {n: t for n, t in self.members.items() if n not in ended}

    def settled(self) -> tuple[dict[str, Held], bool]:
        """Wait until every rank still running holds; (the markers, whether it settled in time). A job of the
        bundle that Slurm ended says nothing: asked of Slurm, it counts as lost nodes if its batch node was lost
        (:meth:`drop_ended`), else the bundle cannot settle."""
        deadline = time.monotonic() + SETTLE_S
        next_poll = 0.0
        while True:
            self.mark_ended()
            held = read_held(self.root, self.epoch)
            ended = read_ended(self.root)
            if all(Seat(n, i).key in held for n, t in self.live(ended).items() for i in range(t)):
                return held, True
            self.wake_on_failure(held, ended)
            if time.monotonic() > deadline:
                return held, False
            if self.parts > 1 and time.monotonic() > next_poll:
                next_poll = time.monotonic() + BUNDLE_POLL_S
                if not self.drop_ended():
                    return held, False
            time.sleep(POLL_S)

    def lost(self, ended: dict[str, int]) -> list[str]:
        """The plan's nodes whose step ended mid-epoch: badly, or well but with the others still at work after
        :data:`ENDED_GRACE_S` (Slurm's step of a node set DOWN may end with 0; at the end of training every
        node's step ends well within a moment of the others')."""
        now = time.monotonic()
        for n in ended:
            self._ended_seen.setdefault(n, now)
        return sorted(n for n in self.members if n in ended
                      and (ended[n] != 0 or now - self._ended_seen[n] > ENDED_GRACE_S))

    def wake_on_failure(self, held: dict[str, Held], ended: dict[str, int]) -> None:
        """A node's step ended badly (the node lost) or a rank's collective failed: no rank can finish this epoch.
        Tell those still training to leave their communicators now: a lost node's processes may live on (a
        network cut, a hung node), their connections open, and their peers would wait for the timeout."""
        if self._woken == self.epoch:
            return
        lost = self.lost(ended)
        failed = sorted(k for k, h in held.items() if not h.saved)
        if lost or failed:
            write_wake(self.root, self.epoch, f"step ended on {', '.join(lost)}" if lost
                       else f"rank {failed[0]} failed: {held[failed[0]].reason}")
            self._woken = self.epoch

    @staticmethod
    def _a_job_ended(jobs: list[str]) -> bool:
        """Whether Slurm ended one of ``jobs`` (not known while Slurm does not answer: asked again later)."""
        try:
            return any(s.final for s in poll_jobs(jobs).values())
        except (SailorError, SlurmUnavailable):
            return False

    def wait_own(self) -> list[int]:
        """Wait for every step of this job; the codes of the steps of nodes the plan still used."""
        for s in self.retired:
            s.proc.wait()
        codes = [s.proc.wait() for s in self.steps.values()]
        self.mark_ended()
        return codes

    def leave_all(self, code: int) -> int:
        """Every rank leaves with ``code``; the job's exit code once every step ended."""
        write_directive(self.root, Directive(self.epoch + 1, None, "", 0, 0, {}, exit_code=code))
        self.wait_own()
        return code

    def kill_own(self) -> None:
        for s in self.steps.values():
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGKILL)

    def change(self) -> int | None:
        """Lead: answer a change for every job of the bundle: the next epoch's directive (None), or the exit code."""
        t_end = time.time()
        held, in_time = self.settled()
        if not in_time:
            self.kill_own()
            return self.leave_all(EXIT_FAILED)
        ended = read_ended(self.root)
        if not held and not self.live(ended):  # every rank finished after all (a slow last one): no change
            return self.finished(ended)
        if self.parts > 1 and not self.drop_ended():  # a job of the bundle ended, not with its batch node
            self.kill_own()
            return self.leave_all(EXIT_FAILED)
        try:
            planner = self.planner or SurvivorPlanner.of(self.run_dir, self.job_plan)
            r = replan(planner, list(self.members), self.bundle_id(), self.addresses, ended=self.dropped)
        except (SailorError, SlurmUnavailable) as exc:  # no plan fits the survivors, or Slurm does not answer
            print(encode_event(InPlaceRefused(job_id=self.job_id, step_index=self.epoch + 1, rc=EXIT_FAILED,
                                              reason=str(exc), t=round(time.time(), 3))), flush=True)
            return self.leave_all(EXIT_FAILED)
        if r is None:  # no node lost: a signal every rank saved on (time limit, stop), or a failure
            ended = read_ended(self.root)
            codes = [ended[n] for n in self.members if n in ended]
            saved = bool(held) and all(h.saved for h in held.values())
            return self.leave_all(job_code(codes) if any(c not in (0, EXIT_SAVED_ON_SIGNAL) for c in codes)
                                  else EXIT_SAVED_ON_SIGNAL if saved else EXIT_FAILED)
        nxt = self.epoch + 1
        plan_path = self.job_plan.with_name(f"{self.job_plan.stem}.epoch-{nxt}.json")
        r.planned.plan.save(plan_path)
        assert self.plan is not None
        was = load_plan(self.plan, validate=False)
        ranks = _seat_ranks(r.planned.plan, r.nodes)
        directive = Directive(nxt, str(plan_path), r.address, step_port(self.job_id, nxt), r.planned.plan.num_gpus,
                              ranks)
        write_directive(self.root, directive)
        print(encode_event(in_place_record(r, self.job_id, nxt, EXIT_FAILED, t_end, plan_path, was, resident=True)),
              flush=True)
        self.members = {n: sum(p is not None for p in places) for n, places in ranks.items()}
        self.follow(directive)
        self.plan = plan_path
        return None

    def finished(self, ended: dict[str, int]) -> int:
        """Lead, every step of the plan ended: the job's exit code once this job's steps are reaped."""
        self.wait_own()
        return job_code([ended[n] for n in self.members if n in ended])

    def follow(self, d: Directive) -> None:
        """The steps of nodes ``d`` gives no rank are retired: their ranks leave, and their codes no longer
        count (a lost node's step failed; an unused one's ranks leave with 0)."""
        self.retired += [s for n, s in self.steps.items() if n not in d.ranks]
        self.steps = {n: s for n, s in self.steps.items() if n in d.ranks}
        self.epoch = d.epoch

    def run(self) -> int:
        self.start()
        if not self.lead:
            return self._follower()
        try:
            return self._lead()
        except SailorError as exc:  # the bundle's other jobs never all started: nothing to answer for
            print(f"sailor-hpc job agent: {exc}", file=sys.stderr, flush=True)
            self.kill_own()
            return self.leave_all(EXIT_FAILED)

    def _lead(self) -> int:
        next_poll = time.monotonic() + BUNDLE_WATCH_S
        while True:
            time.sleep(POLL_S)
            self.mark_ended()
            if self.parts > 1 and time.monotonic() > next_poll:  # a job Slurm ends leaves no agent to say so
                next_poll = time.monotonic() + BUNDLE_WATCH_S
                self.drop_ended(ask_jobs=False)
            ended = read_ended(self.root)
            if not self.live(ended):
                return self.finished(ended)
            if self.lost(ended) or read_held(self.root, self.epoch):
                code = self.change()
                if code is not None:
                    return code

    def _follower(self) -> int:
        """A bundle's other jobs: their steps, their ends said, the lead's directives followed; a lead whose job
        Slurm ended (its node lost) leaves no one to answer: the ranks are ended and so is this job."""
        next_poll = 0.0
        while True:
            time.sleep(POLL_S)
            self.mark_ended()
            d = read_directive(self.root, self.epoch + 1)
            if d is not None and d.plan is None:
                self.wait_own()
                return d.exit_code
            if d is not None:
                self.follow(d)
                continue
            if all(s.proc.poll() is not None for s in self.steps.values()):
                return job_code(self.wait_own())
            if read_held(self.root, self.epoch) and time.monotonic() > next_poll:
                next_poll = time.monotonic() + BUNDLE_POLL_S
                if self._a_job_ended([self._bundle()[0].job_id]) and read_directive(self.root, self.epoch + 1) is None:
                    self.kill_own()
                    self.wait_own()
                    return EXIT_FAILED


def job_code(codes: list[int]) -> int:
    """The job's exit code from its steps', as one step over all ranks would give it: bad input (2) wins, so the
    controller gives up instead of retrying; then any other failure; else saved on a signal (75) or done (0)."""
    failed = [c for c in codes if c not in (0, EXIT_SAVED_ON_SIGNAL)]
    if failed:
        return EXIT_BAD_INPUT if EXIT_BAD_INPUT in failed else failed[0]
    return max(codes, default=0)


def _seat_ranks(plan: Plan, nodes: list[str]) -> dict[str, list[int | None]]:
    """Each node's ranks of ``plan`` in local order: ``nodes`` lists the plan's job layout's nodes, component by
    component, as :func:`sailor_hpc.controller.inplace.step_components` chose them."""
    slots = [slot for comp in job_layout(plan).components for slot in comp.slots]
    return {node: list(slot.ranks) for node, slot in zip(nodes, slots)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m sailor_hpc.controller.job_agent OPTIONS -- TASK...", file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="python -m sailor_hpc.controller.job_agent", description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--job-plan", type=Path, required=True, help="the plan the job was submitted with")
    ap.add_argument("--resident-dir", type=Path, required=True, help="where the ranks hold (their --resident)")
    ap.add_argument("--srun-option", action="append", default=[], help="an option of every node's step")
    ap.add_argument("--bundle-part", default=None, metavar="PARTITION:I/N",
                    help="a bundle's job I of N, running component I of the plan's job layout, on PARTITION (0: the lead)")
    args = ap.parse_args(argv[:cut])
    part, parts = 0, 1
    if args.bundle_part:  # PARTITION:I/N; the partition is for a person reading the job's command line
        index, _, count = args.bundle_part.rpartition(":")[2].partition("/")
        part, parts = int(index), int(count)
    # the ranks' to act on (the time limit's USR1, a preemption's TERM reach the whole job): the agent stays to
    # answer their holds; Slurm's KILL after the grace ends it with them
    for signum in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    args.resident_dir.mkdir(parents=True, exist_ok=True)
    agent = Agent(args.run_dir, args.job_plan, args.resident_dir, os.environ.get("SLURM_JOB_ID", ""),
                  args.srun_option, argv[cut + 1:], part=part, parts=parts)
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
