"""The job's agent: one ``srun`` step per node, and ranks that outlive an allocation change.

The batch script of a job that recovers in place (megatron_patch runtime) runs this module on the batch node
instead of one ``srun`` step for all ranks. It starts one step per node (``--kill-on-bad-exit=0``): Slurm ends
the step of a node that goes down, and releasing a drained node ends only that node's step, so the other
nodes' ranks keep their processes (checked on Slurm 22.05: a two-node ``--no-kill`` job's step on a100-1 ran on
through a100-2 going DOWN, and through ``scontrol update JobId=<id> NodeList=a100-1`` after a drain). The ranks
run with ``--resident DIR`` (:mod:`sailor_hpc.core.resident`): when training stops short they hold and wait
here for a directive. The agent then

1. waits until every rank still running holds (a node's step that ended counts as lost ranks);
2. asks :func:`sailor_hpc.controller.inplace.replan` which nodes were lost and plans on the survivors, with the
   run's objective and constraints, releasing drained nodes; none lost (a time-limit or stop signal, a failure):
   every rank leaves, the job ends with their exit code, as a job of one step would;
3. writes the next epoch's plan and :class:`~sailor_hpc.core.resident.Directive` (each seat's rank, a fresh
   rendezvous on the new rank 0's node) and prints the ``in_place`` record (``resident``: true) the controller
   journals. The ranks rejoin in their own processes: no new step, no import, no queue.

Het jobs: Slurm 22.05 ends a whole het job when any of its nodes goes down; a drain is recovered here.
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

from sailor_hpc.controller.inplace import SurvivorPlanner, in_place_record, replan, step_port
from sailor_hpc.core.dist_env import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_SAVED_ON_SIGNAL
from sailor_hpc.core.errors import SailorError, SlurmUnavailable
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.resident import Directive, Held, Seat, read_held, write_directive
from sailor_hpc.core.runtime_events import InPlaceRefused, encode_event
from sailor_hpc.jobs.layout import job_layout
from sailor_hpc.jobs.rank_env import JOB_TASKS_ENV, TASK_OFFSET_ENV
from sailor_hpc.slurm.control import Component, job_components, node_address, start_step

POLL_S = 0.02
#: how long the ranks still running may take to notice a change and hold (a rank computing a long step only
#: notices at its next collective); after it the job ends as a failed one
SETTLE_S = 120.0


@dataclass
class NodeStep:
    """One node's ``srun`` step and the seats (local indices) of its ranks."""

    node: str
    tasks: int
    proc: Popen[bytes]

    def seats(self) -> list[Seat]:
        return [Seat(self.node, i) for i in range(self.tasks)]


@dataclass
class Agent:
    run_dir: Path
    job_plan: Path
    root: Path  # the ranks' --resident folder
    job_id: str
    srun_options: list[str]  # every node's step: --wait, the container's options
    task: list[str]  # what each task runs (rank_env, then the runtime)
    steps: dict[str, NodeStep] = field(default_factory=dict)
    epoch: int = 0
    plan: Path | None = None
    planner: SurvivorPlanner | None = None
    addresses: dict[str, str] = field(default_factory=dict)

    def start(self) -> None:
        """One step per node of the job's plan, tasks numbered as one step over the whole job would number them."""
        plan = load_plan(self.job_plan, validate=False)
        layout = job_layout(plan)
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
        self.plan = self.job_plan
        threading.Thread(target=self._prepare, args=(comps,), daemon=True).start()

    def _prepare(self, comps: list[Component]) -> None:
        """While the ranks start: what a change will need (the planner's inputs, the nodes' addresses, the plan
        for the loss of each node)."""
        try:
            planner = SurvivorPlanner.of(self.run_dir, self.job_plan)
            self.addresses = {n: node_address(n) or n for n in self.steps}
            planner.plan_ahead(comps)
        except (SailorError, SlurmUnavailable, OSError):
            return  # a change then reads and plans everything itself
        self.planner = planner

    def running(self) -> dict[str, NodeStep]:
        return {n: s for n, s in self.steps.items() if s.proc.poll() is None}

    def settled(self) -> tuple[dict[str, Held], bool]:
        """Wait until every rank still running holds; (the markers, whether it settled in time)."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            held = read_held(self.root, self.epoch)
            if all(seat.key in held for s in self.running().values() for seat in s.seats()):
                return held, True
            if time.monotonic() > deadline:
                return held, False
            time.sleep(POLL_S)

    def leave_all(self, code: int) -> int:
        """Every rank leaves with ``code``; the job's exit code once every step ended."""
        write_directive(self.root, Directive(self.epoch + 1, None, "", 0, 0, {}, exit_code=code))
        for s in self.steps.values():
            s.proc.wait()
        return code

    def change(self) -> int | None:
        """Answer a change: the next epoch's directive (None), or the job's exit code."""
        t_end = time.time()
        held, in_time = self.settled()
        if not in_time:
            for s in self.running().values():
                s.proc.send_signal(signal.SIGKILL)
            return self.leave_all(EXIT_FAILED)
        try:
            planner = self.planner or SurvivorPlanner.of(self.run_dir, self.job_plan)
            r = replan(planner, list(self.steps), self.job_id, self.addresses)
        except (SailorError, SlurmUnavailable) as exc:  # no plan fits the survivors, or Slurm does not answer
            print(encode_event(InPlaceRefused(job_id=self.job_id, step_index=self.epoch + 1, rc=EXIT_FAILED,
                                              reason=str(exc), t=round(time.time(), 3))), flush=True)
            return self.leave_all(EXIT_FAILED)
        if r is None:  # no node lost: a signal every rank saved on (time limit, stop), or a failure
            ended = [s.proc.returncode for s in self.steps.values() if s.proc.returncode is not None]
            saved = bool(held) and all(h.saved for h in held.values())
            return self.leave_all(job_code(ended) if any(c not in (0, EXIT_SAVED_ON_SIGNAL) for c in ended)
                                  else EXIT_SAVED_ON_SIGNAL if saved else EXIT_FAILED)
        nxt = self.epoch + 1
        plan_path = self.job_plan.with_name(f"{self.job_plan.stem}.epoch-{nxt}.json")
        r.planned.plan.save(plan_path)
        assert self.plan is not None
        was = load_plan(self.plan, validate=False)
        ranks = _seat_ranks(r.planned.plan, r.nodes)
        write_directive(self.root, Directive(nxt, str(plan_path), r.address, step_port(self.job_id, nxt),
                                             r.planned.plan.num_gpus, ranks))
        print(encode_event(in_place_record(r, self.job_id, nxt, EXIT_FAILED, t_end, plan_path, was, resident=True)),
              flush=True)
        self.steps = {n: s for n, s in self.steps.items() if n not in r.lost}
        self.epoch, self.plan = nxt, plan_path
        return None

    def run(self) -> int:
        self.start()
        while True:
            time.sleep(POLL_S)
            running = self.running()
            if not running:
                return job_code([s.proc.returncode for s in self.steps.values()])
            lost_step = any(s.proc.returncode not in (None, 0) for s in self.steps.values())
            if lost_step or read_held(self.root, self.epoch):
                code = self.change()
                if code is not None:
                    return code


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
    args = ap.parse_args(argv[:cut])
    # the ranks' to act on (the time limit's USR1, a preemption's TERM reach the whole job): the agent stays to
    # answer their holds; Slurm's KILL after the grace ends it with them
    for signum in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    args.resident_dir.mkdir(parents=True, exist_ok=True)
    agent = Agent(args.run_dir, args.job_plan, args.resident_dir, os.environ.get("SLURM_JOB_ID", ""),
                  args.srun_option, argv[cut + 1:])
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
