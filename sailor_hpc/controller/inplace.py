"""Shrink in place: after a training step that lost nodes, re-plan on the job's survivors and go on.

The controller's jobs run training as a loop of ``srun`` steps in one allocation submitted with
``--no-kill`` (``sbatch_templates/train.sbatch.j2``). When a step ends without finishing, the batch
script runs ``python -m sailor_hpc.controller.inplace``, here, on the compute node (torch-free):

1. the job's nodes now (``scontrol show job``, per het component) and their states (``sinfo``);
   nodes that are down, drained, draining or failing are lost; none lost: the job ends as today
   (finished, saved on its time-limit or preemption signal, failed, or asked to resize);
2. the planner on the survivors (the GPUs the job holds on each surviving node), with the run's
   objective and constraints; each component of the new plan must run in the job's het component of
   the same partition, in the same order (Slurm cannot give a running job a new component);
3. drained nodes are released (``scontrol update JobId=<component> NodeList=<survivors>``); where Slurm
   refuses (the node runs the batch script: ``Invalid node name specified``) the job ends instead, and the
   controller's next job excludes the node;
4. the next step's plan file and ``<job plan>.step-K.env`` (PLAN, MASTER_ADDR/PORT, per-component
   ``srun`` options with ``--nodelist``) are written atomically, and one JSON line
   ``{"event": "in_place", ...}`` goes to the job's log, which the controller journals. The step
   starts with ``--auto-resume``: from the newest complete checkpoint, in the same job, no queue.

Exit 0: the next step is ready; 1: end the job (the controller then resubmits, today's fallback).
This works whether or not the controller is up: the batch script carries on by itself.

Slurm 22.05 facts this relies on, checked on the local cluster (tests/slurm):

- ``sbatch --no-kill``: ``scontrol update NodeName=X State=DOWN`` kills the step on X (srun exits 137)
  and Slurm drops X from the job, which keeps RUNNING on the rest (NodeList and NumNodes shrink);
- ``State=DRAIN`` keeps running jobs; ``scontrol update JobId=<id> NodeList=<subset>`` on a running
  job releases the other nodes at once (rc 0; no ``slurm_job_<id>_resize.sh`` is written where
  scontrol runs, so the script passes every count to ``srun`` explicitly instead of sourcing it);
- a step in a shrunk allocation needs explicit ``-N``/``-n``/``--nodelist``: the batch environment
  (``SLURM_NTASKS``, ``SLURM_JOB_NUM_NODES``) keeps the old counts and ``srun`` refuses the step;
- het jobs: ``JobId=<id>+<k>`` is refused (``scontrol: error: Invalid job ID 4+1``); the
  component's own job id works (``JobId=5 NumNodes=1`` shrank component 1 from 2 nodes to 1; after a
  drain, ``JobId=128 NodeList=v100-1`` released v100-2 and the next ``srun --het-group=1 -N 1
  --nodelist=v100-1`` step ran). Releasing a node under a running step kills that step (rc 137), so
  nodes are released only here, after the step ended.
  ``NumNodes=0`` is refused (``Node count specification invalid for job 7``). A het job survives a
  *drain* (the component's drained node is released as above) but not a node going *down*: losing any
  node, even one of a two-node component, ends the whole het job despite ``--no-kill`` (``CANCELLED ...
  DUE TO NODE FAILURE``, the component FAILED with ``JobLaunchFailure``): that falls back to a new job;
- ``--time-min`` is accepted next to ``--time``; a job started by backfill may get a limit as
  short as the minimum (a 10-minute job with ``--time-min=2`` started with ``TimeLimit=00:02:00``).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from sailor_hpc.controller.events import node_states
from sailor_hpc.controller.planning import Planned, plan_on
from sailor_hpc.controller.spec import RunSpec
from sailor_hpc.controller.state import RunDir
from sailor_hpc.core.archive import ProfileArchive, open_archive
from sailor_hpc.core.atomic import atomic_write_text
from sailor_hpc.core.dist_env import job_port
from sailor_hpc.core.errors import SailorError, SlurmUnavailable
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.runtime_events import InPlace, InPlaceRefused, encode_event
from sailor_hpc.core.site import Site, load_site
from sailor_hpc.jobs.layout import job_layout
from sailor_hpc.jobs.render import components_for
from sailor_hpc.slurm.commands import show_nodes, sinfo_nodes
from sailor_hpc.slurm.control import Component, job_components, shrink_component
from sailor_hpc.slurm.hostlist import expand_hostlists
from sailor_hpc.slurm.safety import BUNDLE_SEP, job_ids

EXIT_NEXT_STEP, EXIT_END_JOB = 0, 1
STEP_PORT_STRIDE = 9973


def survivors(comps: list[Component], job_plan: Plan, lost: dict[str, str]) -> dict[str, dict[str, int]]:
    """GPUs the job holds on each surviving node, per partition: the allocation was rendered from the
    job's first plan, so component i holds that plan's ranks per node on each of its nodes."""
    layout = job_layout(job_plan).components
    free: dict[str, dict[str, int]] = {}
    for comp, lay in zip(comps, layout):
        for node in comp.nodes:
            if node not in lost:
                free.setdefault(lay.partition, {})[node] = lay.tasks_per_node
    return free


def step_components(plan: Plan, comps: list[Component], free: dict[str, dict[str, int]],
                    heterogeneous: bool, cpus: list[int]) -> tuple[list[str], list[str]]:
    """The next step's ``srun`` options per component, and its nodes in rank order. A component without nodes
    is a bundle's job that Slurm ended (:func:`bundle_components`): the plan runs on the others.

    Raises SailorError when the plan's components are not the job's (a partition left out or added):
    Slurm keeps at least one node per component, so such a plan needs a new job."""
    layout = job_layout(plan).components
    kept = [(c, n) for c, n in zip(comps, cpus, strict=True) if c.nodes]
    comps, cpus = [c for c, _ in kept], [n for _, n in kept]
    if [c.partition for c in layout] != [c.partition for c in comps]:
        raise SailorError(f"the plan on the survivors uses partitions {[c.partition for c in layout]}, the job has "
                          f"{[c.partition for c in comps]}", field="in-place plan",
                          fix="a new job is submitted instead")
    opts, nodes = [], []
    for i, (lay, comp) in enumerate(zip(layout, comps)):
        fit = [n for n in comp.nodes if free.get(lay.partition, {}).get(n, 0) >= lay.tasks_per_node][:lay.nodes]
        if len(fit) < lay.nodes:
            raise SailorError(f"component {i} needs {lay.nodes} node(s) of {lay.tasks_per_node} GPUs, the job has "
                              f"{len(fit)}", field="in-place plan", fix="a new job is submitted instead")
        het = f"--het-group={i} " if heterogeneous else ""
        opts.append(f"{het}-N {lay.nodes} -n {lay.nodes * lay.tasks_per_node} --ntasks-per-node={lay.tasks_per_node} "
                    f"--nodelist={','.join(fit)} --cpus-per-task={cpus[i]}")
        nodes.extend(fit)
    return opts, nodes


def release(comps: list[Component], keep: set[str], lost: dict[str, str]) -> tuple[list[str], list[str]]:
    """Give the lost nodes still in the allocation back to Slurm; (released nodes, what Slurm refused)."""
    released, refused = [], []
    for comp in comps:
        gone = [n for n in comp.nodes if n in lost]
        if not gone:
            continue
        stay = [n for n in comp.nodes if n in keep]
        if not stay:  # Slurm keeps one node per component (NumNodes=0 is refused)
            refused.append(f"component {comp.job_id} keeps {','.join(gone)}: no node of it is used any more")
            continue
        answer = shrink_component(comp.job_id, stay)
        if answer is None:
            released.extend(gone)
        else:
            refused.append(answer)
    return released, refused


@dataclass(frozen=True)
class Replanned:
    """The plan on the job's survivors, and where each of its components runs (Slurm's nodes, in rank order)."""

    planned: Planned
    lost: dict[str, str]
    options: list[str]  # per component: the srun options of a step running it
    nodes: list[str]
    released: list[str]
    refused: list[str]
    address: str  # where the new plan's rank 0 runs


@dataclass
class SurvivorPlanner:
    """What every re-plan of one job reads (the run's spec and site, the profiles, the job's plan), read once; and
    the plans it made, by the GPUs they were made on: the job agent plans each single-node loss ahead, while
    the ranks train, so a change costs only the Slurm calls that say what was lost."""

    spec: RunSpec
    site: Site
    archive: ProfileArchive
    job_plan: Plan
    made: dict[str, Planned] = field(default_factory=dict)

    @classmethod
    def of(cls, run_dir: Path, job_plan_file: Path) -> SurvivorPlanner:
        spec = RunDir(run_dir).spec()
        site = load_site(spec.planning.site)
        return cls(spec, site, open_archive(spec.planning.profiles, site), load_plan(job_plan_file, validate=False))

    def plan(self, free: dict[str, dict[str, int]]) -> Planned:
        key = json.dumps(free, sort_keys=True)
        if key not in self.made:
            self.made[key] = plan_on(self.spec, self.site, self.archive, free)
        return self.made[key]

    def plan_ahead(self, comps: list[Component]) -> None:
        """The plan for the loss of each one node of ``comps`` (where one fits)."""
        for node in (n for c in comps for n in c.nodes):
            try:
                self.plan(survivors(comps, self.job_plan, {node: "ahead"}))
            except SailorError:
                continue  # nothing fits without it: the job would end then anyway

    @property
    def cpus(self) -> list[int]:
        return [c.cpus_per_task for c in components_for(job_layout(self.job_plan), self.site)]


def bundle_components(job_id: str, ended: Collection[str] = ()) -> list[Component]:
    """The job's components now (:func:`~sailor_hpc.slurm.control.job_components`); a bundle's job in ``ended``
    (Slurm ended it with its batch node: its nodes are no longer the run's) as a component without nodes, so
    that the others keep their places in the job's layout."""
    if not ended:
        return job_components(job_id)
    ids = job_ids(job_id)
    running = iter(job_components(BUNDLE_SEP.join(j for j in ids if j not in ended)))
    return [Component(j, "", []) if j in ended else next(running) for j in ids]


def replan(planner: SurvivorPlanner, step_nodes: Collection[str], job_id: str,
           addresses: dict[str, str] | None = None, ended: Collection[str] = ()) -> Replanned | None:
    """Which of ``step_nodes`` were lost and the plan on the job's survivors, with the lost nodes released;
    None when no node was lost. Raises SailorError when no plan fits the survivors or Slurm keeps a lost node.
    ``addresses``: the nodes' addresses, read ahead (else asked of Slurm); ``ended``: a bundle's jobs that Slurm
    ended, whose nodes are all lost."""
    comps = bundle_components(job_id, ended)
    _, _, lost_states = node_states(sinfo_nodes(None))
    lost = {n: lost_states.get(n, "gone from the job") for n in step_nodes
            if n in lost_states or all(n not in c.nodes for c in comps)}
    if not lost:
        return None
    free = survivors(comps, planner.job_plan, lost)
    planned = planner.plan(free)
    opts, nodes = step_components(planned.plan, comps, free, len(comps) > 1, planner.cpus)
    released, refused = release(comps, set(nodes), lost)
    if refused:  # the job would hold a drained node for as long as it drains: a new job without it instead
        raise SailorError(f"Slurm refused to release {', '.join(sorted(set(lost) - set(released)))}: "
                          f"{'; '.join(refused)}", field="in-place release",
                          fix="the job ends; the controller submits a new job without the node")
    address = (addresses or {}).get(nodes[0]) or next(
        (n.raw.get("NodeAddr") for n in show_nodes(None, names=[nodes[0]])), None) or nodes[0]
    return Replanned(planned, lost, opts, nodes, released, refused, address)


def step_port(job_id: str, step: int) -> int:
    """A fresh rendezvous port per step, far from the ports of the jobs submitted next (base + job id)."""
    return job_port(int(job_id) + step * STEP_PORT_STRIDE)


def in_place_record(r: Replanned, job_id: str, step: int, rc: int, t_end: float, plan_path: Path, was: Plan,
                    resident: bool = False) -> InPlace:
    return InPlace(job_id=job_id, step_index=step, rc=rc, t_step_end=round(t_end, 3), t_ready=round(time.time(), 3),
                   lost=r.lost, released=r.released, refused=r.refused, plan_file=str(plan_path), nodes=r.nodes,
                   gpus=r.planned.plan.gpus_by_partition(), throughput=r.planned.score.throughput,
                   cost_per_hour=r.planned.score.cost_per_hour, was_gpus=was.gpus_by_partition(), resident=resident)


def next_step(run_dir: Path, job_plan_file: Path, step_plan_file: Path, step: int, rc: int,
              job_id: str) -> InPlace | None:
    """Plan and prepare the next step; returns the ``in_place`` record, or None when the step lost no node
    (raises SailorError when it did but no plan fits the survivors: the job ends, a new one follows)."""
    t_end = time.time()
    r = replan(SurvivorPlanner.of(run_dir, job_plan_file), _step_nodes(job_plan_file, step - 1), job_id)
    if r is None:
        return None  # finished, saved on a signal, asked to resize, or failed: the job ends as it always did
    plan_path = job_plan_file.with_name(f"{job_plan_file.stem}.step-{step}.json")
    r.planned.plan.save(plan_path)
    env = "\n".join([f"PLAN={shlex.quote(str(plan_path))}", f"export MASTER_ADDR={shlex.quote(r.address)}",
                     f"export MASTER_PORT={step_port(job_id, step)}", f"STEP_NODES={shlex.quote(','.join(r.nodes))}",
                     "STEP_COMPONENTS=(" + " ".join(shlex.quote(o) for o in r.options) + ")"]) + "\n"
    atomic_write_text(_env_file(job_plan_file, step), env)
    return in_place_record(r, job_id, step, rc, t_end, plan_path, load_plan(step_plan_file, validate=False))


def _env_file(job_plan_file: Path, step: int) -> Path:
    return job_plan_file.with_name(f"{job_plan_file.stem}.step-{step}.env")


def _step_nodes(job_plan_file: Path, step: int) -> list[str]:
    """The nodes step ``step`` ran on. The first step ran on the whole allocation as it started, which the
    batch environment still holds (Slurm has already dropped a DOWN node from the job itself)."""
    if step <= 0:
        return expand_hostlists(v for k, v in os.environ.items()
                                if k == "SLURM_JOB_NODELIST" or k.startswith("SLURM_JOB_NODELIST_HET_GROUP_"))
    for line in _env_file(job_plan_file, step).read_text().splitlines():
        if line.startswith("STEP_NODES="):
            return shlex.split(line.partition("=")[2])[0].split(",")
    return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sailor_hpc.controller.inplace", description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--job-plan", type=Path, required=True, help="the plan the job was submitted with")
    ap.add_argument("--step-plan", type=Path, required=True, help="the plan of the step that ended")
    ap.add_argument("--step", type=int, required=True, help="the index of the next step (1, 2, ...)")
    ap.add_argument("--rc", type=int, required=True, help="the exit code of the step that ended")
    args = ap.parse_args(argv)
    job_id = os.environ.get("SLURM_JOB_ID", "")
    try:
        rec = next_step(args.run_dir, args.job_plan, args.step_plan, args.step, args.rc, job_id)
    except (SailorError, SlurmUnavailable) as exc:  # no plan fits the survivors, or Slurm does not answer
        print(encode_event(InPlaceRefused(job_id=job_id, step_index=args.step, rc=args.rc, reason=str(exc),
                                          t=round(time.time(), 3))), flush=True)
        return EXIT_END_JOB
    if rec is None:
        return EXIT_END_JOB
    print(encode_event(rec), flush=True)
    return EXIT_NEXT_STEP


if __name__ == "__main__":
    sys.exit(main())
