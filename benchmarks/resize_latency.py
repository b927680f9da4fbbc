"""Recovery time of the resize controller on the local Slurm cluster: allocation change -> first step under
the new plan, queue wait excluded (goal: <= 60 s).

The scenario of tests/controller (tiny-gpt on CPU ranks, global batch 64, at most 2 GPUs; blockers leave one
idle A100): per cycle, a node of the job goes down (``scontrol update state=down``: re-plan onto 2 V100),
comes back (``state=resume``: grow back to 2 A100, the job checkpoints on SIGUSR1), and the job is
preempted (SIGTERM to its ranks: it checkpoints on the signal, the controller resubmits). The clock starts
at the ``scontrol``/``scancel`` call; the parts come from the controller's journal:

    detect   change -> the controller's first record about it (node lost, more idle GPUs, job stopped)
    submit   -> the new job submitted (checkpoint/stop of the old job, cancel, re-plan, render, sbatch)
    queue    -> the new job running (Slurm's queue wait; excluded from the recovery time)
    start    -> its first training step (srun, Python + torch + megatron import, rendezvous, checkpoint load)

Run: ``python benchmarks/resize_latency.py [--cycles 2] [--poll 0.5]`` (as root; it starts a local cluster,
or uses the one named by SAILOR_SLURM_LAB). Times are wall seconds on this shared 2-core machine; the
controller observes at its poll interval, so each part is late by up to one poll.
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

from tests.controller.scenario import Scenario, build_inputs, kind  # noqa: E402
from tests.slurm.cluster import get_cluster  # noqa: E402

GOAL_S = 60.0
DETECT_KINDS = {"node lost": ("node_lost",), "more idle GPUs": ("idle_gpus",), "preempted": ("job_stopped",)}


def _parts(records: list[dict[str, Any]], event: str, t_change: float, attempt: int) -> dict[str, float]:
    after = [r for r in records if r["t"] >= t_change - 0.01]
    detect = next(r for r in after if r["kind"] in DETECT_KINDS[event])
    submitted = next(r for r in records if r["kind"] == "submitted" and r["attempt"] == attempt)
    running = next(r for r in records if r["kind"] == "job_running" and r["attempt"] == attempt)
    first = next(r for r in records if r["kind"] == "first_step" and r["attempt"] == attempt)
    queue = running["t"] - submitted["t"]
    return {"detect": detect["t"] - t_change, "submit": submitted["t"] - detect["t"], "queue": queue,
            "start": first["t"] - running["t"], "recovery": first["t"] - t_change - queue,
            "loaded": first.get("loaded_step", 0)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--poll", type=float, default=0.5, help="controller poll interval (s)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="keep the run here (journal: WORKDIR/run; `sailor-hpc run status WORKDIR/run`)")
    args = ap.parse_args(argv)
    cluster = get_cluster()
    rows: list[tuple[str, int, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="resize-latency-") as tmp:
        root = args.workdir.absolute() if args.workdir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        data, archive = build_inputs(root)
        sc = Scenario(cluster, root, data, archive, steps=1_000_000, poll_s=args.poll)
        try:
            sc.blocker("a100-1", 3)
            sc.blocker("a100-2", 4)
            sc.start_controller()
            attempt = 1
            sc.wait_for("the first step", kind("first_step", attempt=1), timeout=300)
            for _ in range(args.cycles):
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
            cluster.stop()
    head = f"{'allocation change':17s} {'job':>3s} {'detect':>7s} {'submit':>7s} {'queue*':>7s} {'start':>7s} " \
           f"{'recovery':>9s} {'resumed at':>10s}"
    print(f"\nResize recovery on the local Slurm cluster (tiny-gpt, 2 CPU ranks, poll {args.poll} s); seconds, "
          f"recovery = change -> first step under the new plan, queue wait (*) excluded")
    print(head)
    print("-" * len(head))
    for event, att, p in rows:
        print(f"{event:17s} {att:3d} {p['detect']:7.1f} {p['submit']:7.1f} {p['queue']:7.1f} {p['start']:7.1f} "
              f"{p['recovery']:9.1f} {'step ' + str(p['loaded']):>10s}")
    rec = [p["recovery"] for _, _, p in rows]
    print(f"\nrecovery: mean {statistics.mean(rec):.1f} s, max {max(rec):.1f} s over {len(rec)} changes "
          f"(goal <= {GOAL_S:.0f} s: {'met' if max(rec) <= GOAL_S else 'NOT met'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
