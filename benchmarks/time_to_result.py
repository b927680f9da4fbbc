"""Time to result on a busy local Slurm cluster: the throughput plan against the time plan.

Each scenario scripts a queue state on the local cluster (tests/slurm/start.sh: a100 = 2 nodes x 4
GPUs, v100 = 2 x 8) with blocker jobs of known time limits, then:

1. plans tiny-gpt (global batch 64; profiles from measured OPT-350M layers, tests/data/tiny_archive.py)
   for STEPS steps twice on that state: ``--objective throughput`` and ``--objective time`` (queue read
   from Slurm, the shown plans checked with ``sbatch --test-only``);
2. runs each plan on a fresh copy of the state: the plan's exact (het) request is submitted, and each
   job holds its GPUs for the plan's predicted run time (``sleep``; the training itself is not executed:
   what is measured is the queue, the backfill and the restarts, with the run's length as predicted);
   a run longer than the time limit is a chain of jobs, each resubmitted when the previous one ends and
   paying RESTART_S, as ``sailor-hpc run`` would checkpoint and resume;
3. reports each plan's measured time to result (state ready -> last job ended), their ratio, and the
   start-estimate error (actual start of the first job - the planner's predicted start, taken from a
   snapshot just before that submission) with the estimate's source.

Scenarios: the best partition busy for a while; a backfill window (a100-1 held, a pending whole-
partition job planned after it, a100-2 idle until then); all idle; both partitions busy, the slower
one briefly; the best partition's time limit shorter than the run (restarts); and the site states: the
V100 partition DOWN while the A100s are busy; a maintenance reservation on the A100s ending in a minute;
a reservation on the A100s starting in 150 s; a job pending on a dependency (Slurm plans no start for
it) that takes the A100s next.

    python benchmarks/time_to_result.py [--only NAME] [--steps N]      (as root; ~15 min)

Times are wall seconds on this shared 2-core machine, scaled down: blockers hold minutes, runs last tens
of seconds (Slurm's time limits are whole minutes). The planner-speed line compares the 512-GPU search
(site_configs/a100-v100.toml) under both objectives, without Slurm calls.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from planner import Candidate, PlanRequest  # noqa: E402
from planner.on_queue import QueueState, plan_on_state  # noqa: E402
from planner.search import search  # noqa: E402
from planner.time_goal import TimeGoal, plan_shape  # noqa: E402
from planner.time_queue import TimeTerms  # noqa: E402
from sailor_hpc.core.archive import EMBEDDED_ARCHIVE, open_archive, read_archive  # noqa: E402
from sailor_hpc.core.site import Site, load_site, load_site_dict  # noqa: E402
from sailor_hpc.core.start_times import Hold, QueueSnapshot, shape_text  # noqa: E402
from sailor_hpc.slurm.commands import parse_kv_line  # noqa: E402
from sailor_hpc.slurm.start_estimate import StartEstimator, request_script  # noqa: E402
from tests.data.tiny_archive import write_tiny_archive  # noqa: E402
from tests.slurm.cluster import SlurmCluster, get_cluster  # noqa: E402

LAB = REPO / "site_configs" / "local-lab.toml"
MODEL, GBS = "tiny-gpt", 64
RESTART_S = 5.0  # a scaled-down checkpoint + relaunch
NAMES = ("ttr-blocker", "ttr")  # the benchmark's job names: only these are cancelled


@dataclass(frozen=True)
class Blocker:
    """A job holding GPUs: ``nodes`` of ``partition`` (whole), limit ``limit_min``, running ``run_s``;
    ``after``: the index of an earlier blocker it waits for (``afterok``: Slurm plans no start for it)."""

    partition: str
    nodes: int
    limit_min: int
    run_s: int
    node: str | None = None
    after: int | None = None


@dataclass(frozen=True)
class Resv:
    """A reservation of ``nodes`` from ``start_s`` from now for ``minutes`` (``maint``: a maintenance one)."""

    name: str
    nodes: str
    start_s: int
    minutes: int
    maint: bool = False


@dataclass(frozen=True)
class Scenario:
    name: str
    blockers: tuple[Blocker, ...]
    steps: int
    site_edit: Callable[[dict], None] | None = None
    down: tuple[str, ...] = ()  # partitions set DOWN (their nodes idle)
    reservations: tuple[Resv, ...] = ()


def _short_a100_limit(doc: dict) -> None:
    next(p for p in doc["partitions"] if p["name"] == "a100")["max_walltime"] = "00:01:00"


SCENARIOS = (
    Scenario("best partition busy", (Blocker("a100", 2, 2, 110),), 60),
    Scenario("backfill window", (Blocker("a100", 1, 2, 115, "a100-1"), Blocker("a100", 2, 1, 55)), 60),
    Scenario("all idle", (), 60),
    Scenario("both busy, v100 briefly", (Blocker("a100", 2, 2, 110), Blocker("v100", 2, 1, 30)), 60),
    Scenario("limit shorter than the run", (), 150, _short_a100_limit),
    Scenario("v100 down, a100 busy", (Blocker("a100", 2, 2, 110),), 60, down=("v100",)),
    Scenario("a100 maintenance, 1 min", (), 200, reservations=(Resv("ttr-maint", "a100-[1-2]", 0, 1, True),)),
    Scenario("a100 reserved in 150 s", (), 300, reservations=(Resv("ttr-soon", "a100-[1-2]", 150, 4),)),
    Scenario("job pending on a dependency", (Blocker("a100", 2, 1, 55), Blocker("v100", 1, 1, 55, "v100-1"),
                                             Blocker("a100", 2, 2, 110, after=0)), 100),
)


def lab_site(edit: Callable[[dict], None] | None) -> Site:
    import tomllib

    doc = tomllib.loads(LAB.read_text())
    if edit is not None:
        edit(doc)
    return load_site_dict(doc, source=str(LAB))


def epoch(text: str | None) -> float | None:
    return datetime.fromisoformat(text).timestamp() if text and text[:2].isdigit() else None


def job_info(cluster: SlurmCluster, job: str) -> dict[str, str]:
    out = cluster.run(["scontrol", "-o", "show", "job", job]).stdout.strip().splitlines()
    return parse_kv_line(out[0]) if out else {}


def clear(cluster: SlurmCluster) -> None:
    """Cancel the benchmark's jobs (blockers and runs), its reservations and DOWN partitions; wait until the
    jobs are gone."""
    for sc in SCENARIOS:
        for r in sc.reservations:
            cluster.run(["scontrol", "delete", f"ReservationName={r.name}"])
        for part in sc.down:
            cluster.run(["scontrol", "update", f"PartitionName={part}", "State=UP"])
    for name in NAMES:
        cluster.run(["scancel", f"--name={name}"])
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if not cluster.run(["squeue", "-h", "--name", ",".join(NAMES)]).stdout.strip():
            return
        time.sleep(0.5)
    raise RuntimeError("jobs did not leave the queue")


def make_state(cluster: SlurmCluster, sc: Scenario) -> float:
    """Set the partitions DOWN, create the reservations, submit the blockers in order; wait until the
    running ones run (the pending ones are planned)."""
    for part in sc.down:
        cluster.run(["scontrol", "update", f"PartitionName={part}", "State=DOWN"], check=True)
    for r in sc.reservations:
        cluster.run(["scontrol", "create", "reservation", f"ReservationName={r.name}", f"StartTime=now+{r.start_s}",
                     f"Duration={r.minutes}", f"Nodes={r.nodes}", "Users=nobody",
                     *(["Flags=MAINT"] if r.maint else [])], check=True)
    jobs: list[str] = []
    for b in sc.blockers:
        args = ["-p", b.partition, "-N", str(b.nodes), f"--gres=gpu:{b.partition}:{4 if b.partition == 'a100' else 8}",
                "-t", str(b.limit_min), "-o", "/dev/null", "-J", NAMES[0], "--wrap", f"sleep {b.run_s}"]
        if b.node:
            args[4:4] = ["-w", b.node]
        if b.after is not None:
            args[4:4] = ["-d", f"afterok:{jobs[b.after]}"]
        jobs.append(cluster.sbatch(args))
        time.sleep(1.5)  # the first blockers start before the next ones queue behind them
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = [cluster.job_states(j) for j in jobs]
        if all(s and s[0] in ("RUNNING", "PENDING") for s in states) and any(s == ["RUNNING"] for s in states) or not jobs:
            break
        time.sleep(0.3)
    time.sleep(2.0)  # the backfill pass plans the pending ones (bf_interval=1)
    return time.time()


def plans(site: Site, archive, snapshot: QueueSnapshot,
          estimator: StartEstimator, steps: int) -> tuple[Candidate, Candidate, TimeGoal]:
    """The time plan (as ``plan --objective time`` makes it: partitions that start no job left out, ranked on
    the queue, then on Slurm's --test-only answers) and the throughput plan."""
    def request_for(available: dict[str, int], goal: TimeGoal | None) -> PlanRequest:
        return PlanRequest(MODEL, GBS, objective="time", time_goal=goal, dtype="fp32", available=available)

    state = QueueState({}, snapshot, partial(estimator.test_only, site))
    timed = plan_on_state(site, archive, state, request_for, TimeTerms(steps, restart_cost_s=RESTART_S), top_k=3)
    fastest = search(site, archive, PlanRequest(MODEL, GBS, dtype="fp32")).candidates[0]
    assert timed.request.time_goal is not None
    return timed.candidates[0], fastest, timed.request.time_goal


def execute(cluster: SlurmCluster, site: Site, goal: TimeGoal, plan: Candidate, t_ready: float) -> dict:
    """Run the plan's request as a chain of jobs holding its GPUs for its predicted run; measured times."""
    shape = plan_shape(plan.plan)
    est = StartEstimator(cluster.env, history=False)
    snap = est.site_snapshot(site)
    fresh = replace(goal, snapshot=snap)
    key_limit = fresh.job_time_s(shape, goal.steps * plan.result.iteration_time_s)
    snap = est.test_only(site, snap, [(shape, round(key_limit))])
    predicted = replace(goal, snapshot=snap).plan_outlook(plan.plan, plan.result.iteration_time_s)
    remaining = goal.steps * plan.result.iteration_time_s
    first_start, end, jobs = None, None, 0
    while remaining > 1e-6:
        limit = goal.job_time_s(shape, remaining)
        train = min(remaining, goal.trains_s(limit))
        body = f"sleep {train + (RESTART_S if jobs else 0.0):.1f}"
        job = cluster.sbatch(["-o", "/dev/null"], request_script(site, shape, int(limit), body, name=NAMES[1]))
        cluster.wait_job(job, timeout=1200)
        info = job_info(cluster, job)
        first_start = first_start if first_start is not None else epoch(info.get("StartTime"))
        end = epoch(info.get("EndTime"))
        remaining -= train
        jobs += 1
    assert first_start is not None and end is not None
    return {"ttr": end - t_ready, "start": first_start - snap.taken_at, "predicted": predicted,
            "jobs": jobs, "shape": shape_text(shape)}


def run_scenario(cluster: SlurmCluster, archive, sc: Scenario) -> dict:
    site = lab_site(sc.site_edit)
    clear(cluster)
    make_state(cluster, sc)
    estimator = StartEstimator(cluster.env)
    timed, fastest, goal = plans(site, archive, estimator.site_snapshot(site), estimator, sc.steps)
    out = {}
    for label, plan in (("time", timed), ("throughput", fastest)):
        clear(cluster)
        t_ready = make_state(cluster, sc)
        out[label] = execute(cluster, site, goal, plan, t_ready)
        out[label]["predicted_finish"] = goal.plan_outlook(plan.plan, plan.result.iteration_time_s).finish_s
    clear(cluster)
    return out


def planner_speed() -> tuple[float, float]:
    """Seconds of the 512-GPU search (a100-v100.toml, OPT-350M, gbs 1024): throughput, then time (half the
    A100 nodes held for an hour, the rest idle)."""
    site = load_site(REPO / "site_configs" / "a100-v100.toml")
    archive = open_archive(site=site)
    nodes = {p.name: {f"{p.name}-{i}": p.gpus_per_node for i in range(p.nodes)} for p in site.partitions}
    holds = tuple(Hold("a100", f"a100-{i}", 4, 0.0, 3600.0) for i in range(32))
    goal = TimeGoal.for_site(site, 20000, QueueSnapshot(0.0, nodes, holds))
    t0 = time.perf_counter()
    search(site, archive, PlanRequest("OPT-350M", 1024))
    t1 = time.perf_counter()
    search(site, archive, PlanRequest("OPT-350M", 1024, objective="time", time_goal=goal))
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None, help="Run only the scenario whose name contains this.")
    ap.add_argument("--steps", type=int, default=None, help="Steps of every scenario (default: each its own).")
    ap.add_argument("--no-speed", action="store_true", help="Skip the 512-GPU planner-speed line.")
    args = ap.parse_args()
    if not args.no_speed:
        tp, tt = planner_speed()
        print(f"512-GPU search (a100-v100.toml): throughput {tp:.2f} s, time {tt:.2f} s (no Slurm calls)\n", flush=True)
    cluster = get_cluster()
    archive = read_archive(write_tiny_archive(Path(tempfile.mkdtemp()) / "tiny.h5"), EMBEDDED_ARCHIVE)
    head = (f"{'scenario':28} {'plan':10} {'request':18} {'jobs':>4} {'pred start':>10} {'start':>6} "
            f"{'error':>6} {'source':19} {'pred finish':>11} {'measured':>8}")
    print(head)
    print("-" * len(head), flush=True)
    ratios = []
    try:
        for sc in SCENARIOS:
            if args.only and args.only not in sc.name:
                continue
            if args.steps:
                sc = replace(sc, steps=args.steps)
            res = run_scenario(cluster, archive, sc)
            for label in ("throughput", "time"):
                r = res[label]
                p = r["predicted"]
                print(f"{sc.name:28} {label:10} {r['shape']:18} {r['jobs']:4d} {p.start.start_s:10.0f} {r['start']:6.0f} "
                      f"{r['start'] - p.start.start_s:6.0f} {p.start.source:19} {r['predicted_finish']:11.0f} "
                      f"{r['ttr']:8.0f}", flush=True)
            ratio = res["throughput"]["ttr"] / res["time"]["ttr"]
            ratios.append(ratio)
            print(f"{'':28} time to result, throughput plan / time plan: {ratio:.2f}", flush=True)
    finally:
        clear(cluster)
        cluster.stop()
    if ratios:
        print(f"\nratios: {', '.join(f'{r:.2f}' for r in ratios)}")


if __name__ == "__main__":
    main()
