"""What an allocation change costs the run on the local Slurm cluster, per kind of change: the seconds its
ranks train nothing, whether a new job was needed, and the new job's Slurm queue time.

Two scenarios (tiny-gpt on CPU ranks, global batch 64, at most 2 GPUs):

* in place and without a gap (targets: node loss and drain <= 15 s of idle ranks with no new job, growth
  <= 5 s): local-lab with one GPU per A100 node, V100 blocked; the run trains on a100-1 + a100-2. Per
  cycle a100-2 drains (the job checkpoints, re-plans on a100-1 and goes on in the same job), comes back
  (a bigger job is submitted beside the running one, which checkpoints once it runs), goes down (Slurm
  kills the step there, the job survives with --no-kill and re-plans on a100-1) and comes back again.
  Mixed (``--plans mixed``): one GPU per node everywhere, a100-2 blocked, the run trains 1 A100 + a 2-stage
  V100 pipeline and v100-2 changes; with resident ranks the plan runs as a bundle (one plain job per partition:
  Slurm ends a whole het job that loses a node), without them as one het job (a node down: a new job). Last, the
  V100 job's batch node goes down ("het batch down": Slurm ends that job of the bundle; the A100 job goes on).
  Ranks idle: the last training step before the change to the first one after, by the runtime's own
  clock (its step records carry the wall time), in the same job or across the old and the new job.
* by a new job (today's path where one is needed; goal: recovery <= 60 s): blockers leave one idle A100;
  the run starts on 1 A100 + 1 V100 as a het job, whose one-node A100 component going down ends the job
  (Slurm cancels a het job that loses a node, --no-kill or not), then the node comes back
  (growth) and the job is preempted (SIGTERM: it checkpoints on the signal, the controller resubmits):

    detect   change -> the controller's first record about it (node lost, more idle GPUs, job stopped)
    submit   -> the new job submitted (checkpoint/stop of the old job, cancel, re-plan, render, sbatch)
    queue    -> the new job running (Slurm's queue wait; excluded from the recovery time)
    start    -> its first training step (srun, Python + torch + megatron import, rendezvous, checkpoint load)

Run: ``python benchmarks/resize_latency.py [--cycles 2] [--poll 0.5] [--only in-place|restart]
[--reuse both|yes|no] [--plans both|same|mixed]`` (as root;
it starts a local cluster, or uses the one named by SAILOR_SLURM_LAB). Times are wall seconds on this
shared 2-core machine; the controller observes at its poll interval, so each part is late by up to one poll.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sailor_hpc.slurm.hostlist import expand_hostlist  # noqa: E402
from tests.controller.scenario import Scenario, build_inputs, kind, one_gpu_a100_site, one_gpu_site  # noqa: E402
from tests.slurm.cluster import get_cluster  # noqa: E402

GOAL_S = 60.0
DETECT_KINDS = {"node lost": ("node_lost",), "more idle GPUs": ("idle_gpus",), "preempted": ("job_stopped",)}


def _parts(records: list[dict[str, Any]], event: str, t_change: float, attempt: int) -> dict[str, float]:
    after = [r for r in records if r["t"] >= t_change - 0.01]
    detect = next(r for r in after if r["kind"] in DETECT_KINDS[event])
    submitted = next(r for r in records if r["kind"] == "submitted" and r["attempt"] == attempt)
    running = next(r for r in records if r["kind"] == "job_running" and r["attempt"] == attempt)
    first = next(r for r in records if r["kind"] == "first_step" and r["attempt"] == attempt)
    rec = next(r for r in records if r["kind"] == "recovery" and r["attempt"] == attempt and not r.get("in_place"))
    queue = rec["queue_wait_s"] or 0.0  # a grown job's queue wait passes while the old job trains
    return {"detect": detect["t"] - t_change, "submit": submitted["t"] - detect["t"], "queue": queue,
            "start": first["t"] - running["t"], "recovery": first["t"] - t_change - queue,
            "loaded": first.get("loaded_step", 0), "idle": rec["ranks_idle_s"]}


def _change_row(records: list[dict[str, Any]], event: str, t_change: float) -> dict[str, Any]:
    """The recovery that answered the change at ``t_change``: in place (same job) or by a new job."""
    rec = next(r for r in records if r["kind"] == "recovery" and r["first_step_t"] >= t_change)
    job = next(r["job_id"] for r in records if r["kind"] in ("submitted", "adopted") and r["attempt"] == rec["attempt"])
    first = rec if rec.get("in_place") else next(r for r in records if r["kind"] == "first_step"
                                                  and r["attempt"] == rec["attempt"])
    return {"event": event, "job": job, "new_job": not rec.get("in_place"), "idle": rec.get("ranks_idle_s"),
            "first_step": rec["first_step_t"] - t_change, "queue": rec.get("queue_wait_s") or 0.0,
            "loaded": first.get("loaded_step", 0)}


def in_place_cycles(cluster: Any, root: Path, data: str, archive: Path, cycles: int, poll: float,
                    resident: bool = False, mixed: bool = False) -> list[dict[str, Any]]:
    """Shrink in place and grow without a gap: tiny-gpt on 2 A100 nodes of one GPU each (V100 blocked); per
    cycle a100-2 drains, comes back, goes down, comes back. ``resident``: the surviving ranks go on in their
    processes (``--resident-ranks``), else a new ``srun`` step starts them. ``mixed``: a mixed-GPU plan, one GPU
    per node everywhere, a100-2 blocked: 1 A100 + a 2-stage V100 pipeline on v100-1 + v100-2, whose v100-2
    changes (resident: a bundle of one job per partition; else one het job). Returns one row per change."""
    name = ("het-" if mixed else "") + ("resident" if resident else "in-place")
    sc = Scenario(cluster, root / name, data, archive, steps=1_000_000, poll_s=poll,
                  site=one_gpu_site(root) if mixed else one_gpu_a100_site(root),
                  extra_args=["--restart-cost", "0", "--resident-ranks" if resident else "--no-resident-ranks",
                              *(["--min-gain", "1%", "--max-gpus", "3"] if mixed else [])])
    sc.root.mkdir(parents=True, exist_ok=True)
    node = "v100-2" if mixed else "a100-2"
    rows: list[dict[str, Any]] = []
    try:
        if mixed:
            sc.blocker("a100-2", 4)
        else:
            sc.blocker("v100-1", 8)
            sc.blocker("v100-2", 8)
        sc.start_controller()
        sc.wait_for("the first step", kind("first_step", attempt=1), timeout=300)
        for _ in range(cycles):
            for event, state in (("node drains", "drain"), ("node back", "resume"), ("node down", "down"),
                                 ("node back", "resume")):
                last = sc.records()[-1]["seq"]
                sc.wait_for("a checkpoint since the last change",
                            lambda r, s=last: r["kind"] == "checkpoint" and r["seq"] > s, timeout=300)
                last = sc.records()[-1]["seq"]
                t = sc.set_node(node, state)
                sc.wait_for(f"the first step after: {event}",
                            lambda r, s=last: r["kind"] == "recovery" and r["seq"] > s, timeout=300)
                rows.append({**_change_row(sc.records(), ("het " if mixed else "") + event, t), "resident": resident})
                print(f"{event:15s}: ranks idle {rows[-1]['idle']:.1f} s, new job {rows[-1]['new_job']}", flush=True)
        if mixed:  # last, the V100 job's batch node (a bundle's: Slurm ends that job; a het job's: the whole job)
            last = sc.records()[-1]["seq"]
            sc.wait_for("a checkpoint since the last change",
                        lambda r, s=last: r["kind"] == "checkpoint" and r["seq"] > s, timeout=300)
            last = sc.records()[-1]["seq"]
            t = sc.set_node(_v100_batch_host(sc), "down")
            sc.wait_for("the first step after: batch node down",
                        lambda r, s=last: r["kind"] == "recovery" and r["seq"] > s, timeout=300)
            rows.append({**_change_row(sc.records(), "het batch down", t), "resident": resident})
            print(f"batch node down: ranks idle {rows[-1]['idle']:.1f} s, new job {rows[-1]['new_job']}", flush=True)
    finally:
        sc.cleanup()
    return rows


def _v100_batch_host(sc: Scenario) -> str:
    """The node running the batch script of the run's V100 job (a bundle's job, or a het job's component)."""
    for line in sc.slurm("scontrol", "-o", "show", "job").splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("Partition") == "v100" and fields.get("JobState") == "RUNNING" \
                and not fields.get("JobName", "").startswith("blocker"):
            nodes = expand_hostlist(fields["NodeList"])  # a het job's component: its batch script is the first's
            return fields["BatchHost"] if fields.get("BatchHost") in nodes else nodes[0]
    raise RuntimeError("no running V100 job of the run")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--poll", type=float, default=0.5, help="controller poll interval (s)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="keep the runs here (journals: WORKDIR/run, WORKDIR/in-place/run)")
    ap.add_argument("--only", choices=("restart", "in-place"), default=None, help="run one of the two scenarios")
    ap.add_argument("--reuse", choices=("both", "yes", "no"), default="both",
                    help="in place: with process reuse (--resident-ranks), without (a new srun step), or both")
    ap.add_argument("--plans", choices=("both", "same", "mixed"), default="both",
                    help="in place: a plan on one GPU type (2 A100), a mixed one (1 A100 + 2 V100), or both")
    args = ap.parse_args(argv)
    cluster = get_cluster()
    rows: list[tuple[str, int, dict[str, float]]] = []
    changes: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="resize-latency-") as tmp:
        root = args.workdir.absolute() if args.workdir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        data, archive = build_inputs(None, root)
        try:
            if args.only != "restart":
                for mixed in {"both": (False, True), "same": (False,), "mixed": (True,)}[args.plans]:
                    for resident in {"both": (False, True), "yes": (True,), "no": (False,)}[args.reuse]:
                        changes += in_place_cycles(cluster, root, data, archive, args.cycles, args.poll, resident,
                                                   mixed)
            if args.only != "in-place":
                rows = restart_cycles(cluster, root, data, archive, args.cycles, args.poll)
        finally:
            cluster.stop()
    if changes:
        _print_changes(changes, args.poll)
    if rows:
        _print_restarts(rows, args.poll)
    return 0


def _print_changes(changes: list[dict[str, Any]], poll: float) -> None:
    head = f"{'allocation change':17s} {'reuse':>5s} {'job':>7s} {'new job':>7s} {'ranks idle':>10s} " \
           f"{'-> 1st step':>11s} {'queue':>6s} {'resumed at':>10s}"
    print(f"\nIn place and without a gap (tiny-gpt, 2 A100 nodes of 1 GPU; het: 1 A100 + 2 V100 nodes of 1 GPU, v100-2 "
          f"changing; poll {poll} s); seconds. Ranks idle: "
          "the runtime's last step before the change to its first step under the new plan; -> 1st step: from the "
          "scontrol call (growth: the bigger job's ranks start while the old job trains)")
    print(head)
    print("-" * len(head))
    for c in changes:
        print(f"{c['event']:17s} {'yes' if c['resident'] else 'no':>5s} {c['job']:>7s} "
              f"{'yes' if c['new_job'] else 'no':>7s} {c['idle']:10.2f} "
              f"{c['first_step']:11.1f} {c['queue']:6.1f} {'step ' + str(c['loaded']):>10s}")
    for event in ("node drains", "node down", "node back", "het node drains", "het node down", "het node back",
                  "het batch down"):
        for reuse in (False, True):
            idle = [c["idle"] for c in changes if c["event"] == event and c["resident"] == reuse]
            if idle:
                goal = 1.0 if reuse and not event.endswith("node back") else None
                verdict = f" (target <= {goal:.0f} s: {'met' if max(idle) <= goal else 'NOT met'})" if goal else ""
                print(f"{event:15s} {'with' if reuse else 'without':7s} process reuse: ranks idle mean "
                      f"{statistics.mean(idle):.2f} s, max {max(idle):.2f} s over {len(idle)}{verdict}")
    print(f"new jobs for node loss or drain: {sum(c['new_job'] for c in changes if c['event'] != 'node back')}")


def restart_cycles(cluster: Any, root: Path, data: str, archive: Path, cycles: int,
                   poll: float) -> list[tuple[str, int, dict[str, float]]]:
    """The path where a new job is needed: a het job that loses a node is ended by Slurm."""
    rows: list[tuple[str, int, dict[str, float]]] = []
    sc = Scenario(cluster, root, data, archive, steps=1_000_000, poll_s=poll)
    try:
        sc.blocker("a100-1", 3)
        sc.blocker("a100-2", 4)
        sc.start_controller()
        attempt = 1
        sc.wait_for("the first step", kind("first_step", attempt=1), timeout=300)
        for _ in range(cycles):
            for event in ("node lost", "more idle GPUs", "preempted"):
                first = sc.wait_for("the current job's first step", kind("first_step", attempt=attempt))
                sc.wait_for("a checkpoint of this job",
                            lambda r, a=attempt: r["kind"] == "checkpoint" and r.get("attempt") == a, timeout=300)
                if event == "node lost":
                    t = sc.set_node("a100-1", "down")
                elif event == "more idle GPUs":
                    t = sc.set_node("a100-1", "resume")
                else:
                    t = time.time()
                    sc.slurm("scancel", "--signal=TERM", first["job_id"])
                attempt += 1
                sc.wait_for(f"the first step after: {event}", kind("first_step", attempt=attempt), timeout=300)
                rows.append((event, attempt, _parts(sc.records(), event, t, attempt)))
                print(f"{event:15s} -> attempt {attempt}: recovery {rows[-1][2]['recovery']:.1f} s", flush=True)
    finally:
        sc.cleanup()
    return rows


def _print_restarts(rows: list[tuple[str, int, dict[str, float]]], poll: float) -> None:
    head = f"{'allocation change':17s} {'job':>3s} {'detect':>7s} {'submit':>7s} {'queue*':>7s} {'start':>7s} " \
           f"{'recovery':>9s} {'ranks idle':>10s} {'resumed at':>10s}"
    print(f"\nResize recovery by a new job (tiny-gpt, 2 CPU ranks, poll {poll} s); seconds, "
          f"recovery = change -> first step under the new plan, queue wait (*) excluded; for growth the old job "
          f"trains until the new one's ranks are ready, so ranks idle is what the change cost")
    print(head)
    print("-" * len(head))
    for event, att, p in rows:
        print(f"{event:17s} {att:3d} {p['detect']:7.1f} {p['submit']:7.1f} {p['queue']:7.1f} {p['start']:7.1f} "
              f"{p['recovery']:9.1f} {p['idle']:10.1f} {'step ' + str(p['loaded']):>10s}")
    rec = [p["recovery"] for _, _, p in rows]
    print(f"\nrecovery: mean {statistics.mean(rec):.1f} s, max {max(rec):.1f} s over {len(rec)} changes "
          f"(goal <= {GOAL_S:.0f} s: {'met' if max(rec) <= GOAL_S else 'NOT met'})")


if __name__ == "__main__":
    raise SystemExit(main())
