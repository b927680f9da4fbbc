"""Per-task wrapper of the training step: Slurm task -> plan rank, then exec the runtime.

    python -m sailor_hpc.jobs.rank_env --plan plan.json [--partitions a,b] -- python -m megatron_patch.launch ...

``srun`` numbers the tasks of a het job component by component (see :mod:`sailor_hpc.jobs.layout`);
the plan numbers ranks pipeline by pipeline. This wrapper reads ``SLURM_PROCID`` / ``SLURM_NTASKS`` /
``SLURM_LOCALID``, looks the task up in the plan's job layout, checks that Slurm placed it where the
layout expects (task count, local index), exports ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` /
``LOCAL_WORLD_SIZE`` (the torchrun variables, which ``sailor_hpc.core.dist_env`` prefers over Slurm's),
``OMP_NUM_THREADS`` (this component's CPUs per task, unless set) and ``SAILOR_LABEL_RANKS`` (the runtime labels
each rank's lines in the job's one log), then replaces itself with the command. Where the task's
environment names a fork server (``SAILOR_FORK_SERVER``: the test cluster's), the command is forked from a
zygote there instead, and this process stands in for it in the step (:mod:`megatron_patch.fork_server`).
It imports no torch, so it costs a few tens of milliseconds per rank.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

from megatron_patch.fork_server import FORK_SERVER_ENV, exit_as, run_forked
from sailor_hpc.core.errors import EXIT_BAD_INPUT, SailorError
from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.runtime_events import LABEL_ENV
from sailor_hpc.jobs.layout import JobLayout, component_layout, job_layout


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except KeyError:
        raise SailorError(f"{key} is not set: not started by srun", field=key,
                          fix="run the job script with sbatch (its srun step starts this wrapper)") from None
    except ValueError:
        raise SailorError(f"{key}={env[key]!r} is not an integer", field=key) from None


#: set by the job agent, which starts one step per node: the job task of the step's task 0, and the job's tasks
TASK_OFFSET_ENV, JOB_TASKS_ENV = "SAILOR_TASK_OFFSET", "SAILOR_JOB_TASKS"


def rank_environment(layout: JobLayout, env: Mapping[str, str]) -> dict[str, str]:
    """The variables to export for the task described by ``env`` (Slurm's task variables; under the job agent's
    one step per node, offset to the job's task numbering)."""
    procid, ntasks = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    if TASK_OFFSET_ENV in env:
        procid, ntasks = procid + _int(env, TASK_OFFSET_ENV), _int(env, JOB_TASKS_ENV)
    if ntasks != layout.num_tasks:
        raise SailorError(f"srun started {ntasks} tasks but the plan has {layout.num_tasks} ranks in this job",
                          field="SLURM_NTASKS", fix="the job script and the plan file disagree: re-render the script")
    place = layout.place(procid)
    comp = layout.components[place.component]
    if "SLURM_LOCALID" in env and _int(env, "SLURM_LOCALID") != place.local:
        raise SailorError(f"task {procid} has SLURM_LOCALID={env['SLURM_LOCALID']}, the layout expects {place.local}",
                          field="SLURM_LOCALID", fix="use block task distribution (the rendered script does)")
    out = {"RANK": str(place.rank), "WORLD_SIZE": str(layout.world_size), "LOCAL_RANK": str(place.local),
           "LOCAL_WORLD_SIZE": str(comp.tasks_per_node), "SAILOR_HET_GROUP": str(place.component),
           LABEL_ENV: "1"}  # srun merges the ranks' output into one log: each rank labels its lines
    if "OMP_NUM_THREADS" not in env:
        cpus = env.get(f"SLURM_CPUS_PER_TASK_HET_GROUP_{place.component}") or env.get("SLURM_CPUS_PER_TASK")
        if cpus and cpus.isdigit():
            out["OMP_NUM_THREADS"] = cpus
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m sailor_hpc.jobs.rank_env --plan PLAN -- COMMAND...", file=sys.stderr)
        return EXIT_BAD_INPUT
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="python -m sailor_hpc.jobs.rank_env")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--partitions", default=None,
                    help="comma-separated: this job runs only the plan's ranks on these (one cluster of several)")
    ap.add_argument("--component", type=int, default=None,
                    help="this job runs only this component of the plan's job layout (one job of a bundle)")
    args = ap.parse_args(argv[:cut])
    command = argv[cut + 1:]
    if not command:
        print("error: no command after --", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        parts = None if args.partitions is None else set(args.partitions.split(","))
        layout = job_layout(load_plan(args.plan), parts)
        if args.component is not None:
            layout = component_layout(layout, args.component)
        os.environ.update(rank_environment(layout, os.environ))
    except SailorError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    sys.stdout.flush()
    if server := os.environ.get(FORK_SERVER_ENV):
        code = run_forked(command, server)
        if code is not None:
            return exit_as(code)
    os.execvp(command[0], command)
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
