"""A chaos soak on the real local cluster, shared by tests/controller/test_chaos_soak_cluster.py (a small one in
``make test``) and benchmarks/chaos_soak.py (a longer one).

A tiny model trains under ``sailor-hpc run`` (tests/controller/scenario.py) to a step it will not reach; a seeded
random sequence of faults is injected, each once the run handled the one before (it trained past a checkpoint
saved after it); then the user stops the run. The final checkpoint is compared with the uninterrupted
single-process reference run to the same step, and the job logs with each other: no step skipped, and a step
trained twice only where a job rolled back to an older checkpoint.

Faults (each a :class:`Fault`): ``drain`` and ``down`` (a node of the running job), ``operator_cancel`` (a Slurm
operator, another user, cancels the job), ``controller_kill`` (SIGKILL, then ``run --resume``), ``slurmctld``
(stopped for seconds, then started), ``corrupt`` (an operator cancels the job, then the newest checkpoint is truncated
before the next job loads it: that job must pass it over and roll back) and ``grow`` (GPUs held from the start are freed).
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sailor_hpc.core.checkpoint import latest_complete, read_manifest
from tests.controller.scenario import Scenario
from tests.slurm.cluster import OPERATOR
from tests.slurm.ranks import pause, rank_pids

FAULTS = ("drain", "down", "operator_cancel", "controller_kill", "slurmctld", "corrupt", "grow")


@dataclass
class FaultResult:
    name: str
    detail: str
    injected_t: float
    handled_t: float
    recovery_s: float | None  # the controller's own measure (journal ``recovery``), when the fault moved the run
    jobs_used: int  # jobs the run had submitted by the time it was handled


@dataclass
class Soak:
    sc: Scenario
    seed: int
    results: list[FaultResult] = field(default_factory=list)
    held: list[str] = field(default_factory=list)  # blockers the ``grow`` fault frees
    hold: tuple[str, ...] = ("a100-1", "a100-2")  # the A100 nodes held from the start

    # ------------------------------------------------------------------------------------------ set-up

    def faults(self, n: int) -> list[str]:
        """``n`` faults in a seeded random order (each kind at most once until all were used)."""
        rng = random.Random(self.seed)
        out: list[str] = []
        while len(out) < n:
            out += rng.sample(FAULTS, len(FAULTS))
        return out[:n]

    def hold_a100s(self) -> None:
        """Blockers on the A100s of ``hold`` before the run starts (all of them: the run begins on V100s; ``grow``
        frees them)."""
        self.held = [self.sc.blocker(node, 4) for node in self.hold]

    # ------------------------------------------------------------------------------------------- journal

    def records(self) -> list[dict[str, Any]]:
        return self.sc.records()

    def newest_checkpoint(self) -> int:
        steps = [r["step"] for r in self.records() if r["kind"] == "checkpoint"]
        return max(steps, default=0)

    def trains_past(self, step: int, timeout: float = 240.0) -> dict[str, Any]:
        """Wait for a journaled checkpoint past ``step`` (the run trains, whatever happened before)."""
        return self.sc.wait_for(f"a checkpoint past step {step}",
                                lambda r: r["kind"] == "checkpoint" and r["step"] > step, timeout)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The running job's ranks stopped (SIGSTOP) while a fault that leaves them alone (the controller's, Slurm's
        own) is injected and answered: the run's length then does not depend on how fast the machine trains
        meanwhile, and rounding differences, which grow with every step, stay small."""
        # resident ranks keep the command line of their job's plan through in-place changes
        plans = [r["plan_file"] for r in self.records()
                 if r["kind"] == "submit_intent" or (r["kind"] == "in_place" and not r.get("resident"))]
        pids = pause(plans[-1]) if plans and rank_pids(plans[-1]) else []
        try:
            yield
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    def current_job(self) -> tuple[str, list[str]]:
        """The run's job and its nodes, once it runs (the newest ``job_running`` record)."""
        running = self.sc.wait_for("a running job", lambda r: r["kind"] in ("job_running", "in_place"))
        recs = [r for r in self.records() if r["kind"] in ("job_running", "in_place")]
        last = recs[-1] if recs else running
        job = [r for r in self.records() if r["kind"] in ("submitted", "adopted")][-1]["job_id"]
        return job, list(last["nodes"])

    # ----------------------------------------------------------------------------------------- the faults

    def inject(self, name: str, rng: random.Random) -> FaultResult:
        """Inject one fault once the run trains, and wait until it was handled: the run trained past a
        checkpoint saved after the fault (for a fault that moved it, by a job that started after it)."""
        sc = self.sc
        self.trains_past(self.newest_checkpoint())
        t0 = time.time()
        detail = ""
        cleanup: Callable[[], None] = lambda: None  # noqa: E731 - the fault's own undo, once handled
        if name in ("drain", "down"):
            job, nodes = self.current_job()
            node = rng.choice(nodes)
            sc.set_node(node, name)
            detail = f"{node} of job {job}"
            cleanup = lambda: sc.set_node(node, "resume")  # noqa: E731
        elif name in ("operator_cancel", "corrupt"):
            job, _ = self.current_job()
            proc = sc.cluster.as_operator(["scancel", *job.split(",")])  # a bundle: every one of its jobs
            assert proc.returncode == 0, proc.stderr
            detail = f"job {job} cancelled by {OPERATOR}"
            if name == "corrupt":  # once the job is gone (its ranks save on the cancel's SIGTERM), before the next loads
                sc.wait_for(f"job {job} gone", lambda r: r["kind"] == "job_gone" and r.get("job_id") == job)
                newest = latest_complete(sc.save, deep=False)
                assert newest is not None
                layer = sorted(newest.glob("layer_*.pt"))[-1]
                layer.write_bytes(layer.read_bytes()[:64])
                detail += f", then {newest.name}/{layer.name} truncated"
        elif name == "controller_kill":
            with self.paused():
                sc.kill_controller()
                time.sleep(rng.uniform(1.0, 4.0))
                sc.start_controller(resume=True)
                self.answered(name, t0)
            detail = "SIGKILL, then run --resume (ranks paused)"
        elif name == "slurmctld":
            down_s = rng.uniform(12.0, 18.0)  # clients give up on a silent slurmctld after ~10 s
            with self.paused():
                with sc.cluster.slurmctld_stopped():
                    time.sleep(down_s)
                self.answered(name, t0)
            detail = f"slurmctld stopped {down_s:.1f} s (ranks paused)"
        elif name == "grow":
            for job in self.held:
                sc.slurm("scancel", job)
            detail = f"blockers {', '.join(self.held)} freed: {4 * len(self.held)} A100s idle"
            self.held = []
        else:
            raise ValueError(f"unknown fault {name!r}")
        after = self.answered(name, t0)
        handled = self.trains_past(self.newest_checkpoint(), timeout=300.0)
        while handled["t"] < after:
            handled = self.trains_past(handled["step"], timeout=300.0)
        cleanup()
        moved = [r for r in self.records() if r["kind"] == "recovery" and r["t"] >= t0]
        jobs = len([r for r in self.records() if r["kind"] == "submit_intent"])
        return FaultResult(name, detail, t0, handled["t"], moved[0]["recovery_s"] if moved else None, jobs)

    def answered(self, name: str, t0: float) -> float:
        """When the run answered the fault injected at ``t0``: the recovery (a new job's first step, or an in-place
        step's) of a fault that moved it, the resumed controller's start, Slurm answering again, or the decision
        on the freed GPUs (and the recovery of a resize)."""
        sc = self.sc
        if name in ("drain", "down", "operator_cancel", "corrupt"):
            return sc.wait_for("the run's recovery", lambda r: r["kind"] == "recovery" and r["t"] > t0, 300.0)["t"]
        if name == "controller_kill":
            return sc.wait_for("the resumed controller", lambda r: r["kind"] == "controller_started" and r["t"] > t0)["t"]
        if name == "slurmctld":
            return sc.wait_for("Slurm answering again", lambda r: r["kind"] == "error" and r["t"] > t0
                               and r["where"] == "slurm available", 300.0)["t"]
        decision = sc.wait_for("a decision on the freed GPUs", lambda r: r["kind"] == "decision" and r["t"] > t0, 300.0)
        if decision["action"] != "resize":
            return float(decision["t"])
        return sc.wait_for("the resize's recovery", lambda r: r["kind"] == "recovery" and r["t"] > t0, 300.0)["t"]

    def run(self, n: int) -> list[FaultResult]:
        """Start the run, inject ``n`` seeded faults one after the other, then stop the run (every rank saves)."""
        rng = random.Random(self.seed)
        names = self.faults(n)
        if "grow" in names:
            self.hold_a100s()
        self.sc.start_controller()
        for name in names:
            self.results.append(self.inject(name, rng))
        stop = subprocess.run(["sailor-hpc", "run", "stop", str(self.sc.run_dir)], cwd=self.sc.cluster.shared,
                              env=self.sc.env, capture_output=True, text=True, timeout=600)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert self.sc.wait_exit(timeout=120) == 0, self.sc.controller_output()
        return self.results


def final_step(sc: Scenario) -> int:
    final = latest_complete(sc.save)
    assert final is not None
    return int(read_manifest(final)["step"])


def step_account(save: Path) -> tuple[set[int], list[int]]:
    """Every step the run trained, from rank 0's metrics file in the checkpoint directory (written by every job,
    straight to the shared filesystem: a node failure loses the end of a job's log, not this): (the steps, the
    steps trained twice). Asserts that each job (each ``srun`` step of an in-place job) trains on from the step
    after the checkpoint it resumed from, a step some job trained before, and that a step is trained twice only
    after a rollback: a resume from an older checkpoint than the newest step trained."""
    seen: set[int] = set()
    twice: list[int] = []
    loaded, newest, nxt = 0, 0, 1
    for line in (save / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "resumed":
            loaded, newest, nxt = rec["step"], max(seen, default=0), rec["step"] + 1
            assert loaded in seen, f"resumed from step {loaded}, which no job trained"
        elif rec["kind"] == "train":
            step = rec["step"]
            if step == 1 and nxt != 1:  # a job that found no checkpoint starts over
                loaded, newest = 0, max(seen, default=0)
            else:
                assert step == nxt, f"step {step} after step {nxt - 1}: a step skipped"
            if step in seen:
                assert loaded < step <= newest, f"step {step} trained twice without a rollback"
                twice.append(step)
            seen.add(step)
            nxt = step + 1
    return seen, twice


def describe(results: list[FaultResult], seed: int) -> str:
    """The soak's table, for a person (the benchmark prints it, docs/controller.md keeps one)."""
    rows = [f"chaos soak, seed {seed}: {len(results)} faults injected, {len(results)} survived",
            f"{'#':>2}  {'fault':<16} {'handled after':>13}  {'recovery s':>10}  {'jobs':>4}  detail"]
    for i, r in enumerate(results, 1):
        rec = f"{r.recovery_s:.1f}" if r.recovery_s is not None else "-"
        rows.append(f"{i:>2}  {r.name:<16} {r.handled_t - r.injected_t:>11.1f} s  {rec:>10}  {r.jobs_used:>4}  {r.detail}")
    return "\n".join(rows)
