"""``sailor-hpc plan --objective time``: the queue read from Slurm, the plans ranked by expected finish.

The search ranks plans on the queue timeline (``squeue``/``scontrol``); then Slurm itself is asked when
the shown plans' exact requests would start (``sbatch --test-only``, within the same time budget), and
they are ranked again on those answers. Every start says where it came from.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from functools import partial
from typing import Any

import click

from planner import Candidate, SearchResult
from planner.time_goal import Outlook, TimeGoal, plan_shape
from planner.time_queue import TestOnly, TimeTerms
from planner.time_strategy import Strategy, choose
from sailor_hpc.cli.output import table
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import get_model
from sailor_hpc.core.site import Site
from sailor_hpc.core.start_times import IDLE_NOW, QueueSnapshot, shape_text
from sailor_hpc.jobs.options import JobOptions
from sailor_hpc.jobs.render import parse_time_limit
from sailor_hpc.slurm.start_estimate import StartEstimator


@dataclass(frozen=True)
class TimeOptions:
    """The options of the time objective (besides --steps)."""

    tokens: int | None = None
    deadline: str | None = None
    max_gpu_hours: float | None = None
    time_limit: str | None = None
    time_min: str | None = None
    restart_cost: float = 60.0
    queue: str = "live"


_NAMES = ("tokens", "deadline", "max_gpu_hours", "time_limit", "time_min", "restart_cost", "queue")


def time_options(f: Any) -> Any:
    """Add the time objective's options to a command."""
    opts = [
        click.option("--tokens", type=click.IntRange(min=1), default=None,
                     help="Objective time: tokens to train (steps = tokens / (global batch x sequence length))."),
        click.option("--deadline", default=None,
                     help="Objective time: finish by then: a Slurm duration from now (D-HH:MM:SS, HH:MM:SS, "
                          "minutes) or a local date and time (2026-12-01T08:00)."),
        click.option("--max-gpu-hours", type=float, default=None, help="Objective time: GPU-hours the run may use."),
        click.option("--time", "time_limit", default=None,
                     help="Objective time: each job's time limit (default: the partitions' max_walltime); a longer "
                          "run is cut into jobs, each restart paying --restart-cost and a new wait."),
        click.option("--time-min", default=None,
                     help="Objective time: the shortest time limit backfill may give the first job, so it can "
                          "start in a shorter window (sbatch --time-min)."),
        click.option("--restart-cost", type=float, default=60.0, show_default=True,
                     help="Objective time: seconds a checkpoint-and-restart costs."),
        click.option("--queue", type=click.Choice(["live", "idle"]), default="live", show_default=True,
                     help="Objective time: read the queue from Slurm, or plan as if every GPU were idle now."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def pop_time_options(kw: dict[str, Any]) -> TimeOptions:
    return TimeOptions(**{n: kw.pop(n) for n in _NAMES if n in kw})


def parse_deadline(text: str, now: float) -> float:
    """Seconds from ``now`` to the deadline (a duration, or a date and time)."""
    if re.match(r"^\d{4}-\d\d-\d\d", text.strip()):
        try:
            return datetime.fromisoformat(text.strip()).timestamp() - now
        except ValueError:
            raise SailorError(f"{text!r} is not a date and time", field="--deadline",
                              fix="e.g. 2026-12-01T08:00, or a duration such as 12:00:00") from None
    try:
        return float(parse_time_limit(text)[1])
    except SailorError:
        raise SailorError(f"{text!r} is neither a duration nor a date and time", field="--deadline",
                          fix="e.g. 12:00:00 (12 h from now), 1-00:00:00, or 2026-12-01T08:00") from None


def run_steps(steps: int | None, opts: TimeOptions, model: str, gbs: int, seq_len: int | None) -> int:
    """Steps to train, from --steps or --tokens (exactly one)."""
    if (steps is None) == (opts.tokens is None):
        raise SailorError("objective time needs how long to train: exactly one of --steps and --tokens",
                          field="--steps/--tokens", fix="e.g. --steps 5000 or --tokens 2e9")
    if steps is not None:
        return steps
    assert opts.tokens is not None
    per_step = gbs * (seq_len or get_model(model).seq_len)
    return max(1, math.ceil(opts.tokens / per_step))


def queue_now(site: Site, opts: TimeOptions) -> tuple[QueueSnapshot, TestOnly | None]:
    """The queue of every partition now and Slurm's ``sbatch --test-only`` for the shown plans (--queue live);
    with --queue idle, every GPU of the site idle and no Slurm call."""
    if opts.queue != "live":
        return QueueSnapshot.all_idle({p.name: {f"{p.name}-{i}": p.gpus_per_node for i in range(p.nodes)}
                                       for p in site.partitions}, time.time()), None
    estimator = StartEstimator()
    return estimator.site_snapshot(site), partial(estimator.test_only, site)


def time_terms(site: Site, model: str, gbs: int, seq_len: int | None, steps: int | None,
               opts: TimeOptions) -> tuple[TimeTerms, QueueSnapshot, TestOnly | None]:
    """What ``plan --objective time`` plans on: the run's terms from the options, and the queue they are read
    against (:func:`queue_now`); :func:`planner.on_queue.plan_on_state` builds the goal from them."""
    if len(site.clusters) > 1:  # one queue per cluster, and a job per cluster: not modelled
        raise SailorError(f"objective time reads one Slurm cluster's queue; site {site.name!r} spans "
                          f"{len(site.clusters)}", file=site.source, field="--objective",
                          fix="plan each cluster's site file on its own, or use --objective throughput")
    n = run_steps(steps, opts, model, gbs, seq_len)
    snapshot, test_only = queue_now(site, opts)
    for name, text in (("--time", opts.time_limit), ("--time-min", opts.time_min)):
        if text:
            parse_time_limit(text, name)  # a malformed time is bad input, said with its option
    deadline = parse_deadline(opts.deadline, snapshot.taken_at) if opts.deadline else None
    if deadline is not None and deadline <= 0:
        raise SailorError(f"--deadline {opts.deadline} has passed", field="--deadline", fix="give a later one")
    terms = TimeTerms(n, time_limit=opts.time_limit, time_min=opts.time_min, restart_cost_s=opts.restart_cost,
                      deadline_s=deadline, max_gpu_hours=opts.max_gpu_hours)
    return terms, snapshot, test_only


def timed_job(job: JobOptions, result: SearchResult, best: Candidate) -> JobOptions:
    """The plan's job asks for the time limit its expected finish was computed with (and ``--time-min``):
    with the default hour instead, its start, restarts and finish would not be the ones the plan shows."""
    goal = result.request.time_goal
    assert goal is not None
    minutes = math.ceil(goal.plan_outlook(best.plan, best.result.iteration_time_s).job_time_s / 60)
    least = None if goal.time_min_s is None else math.ceil(goal.time_min_s / 60)
    time_min = str(least) if least is not None and least < minutes else None  # a shorter job needs no minimum
    return replace(job, limits=replace(job.limits, time=str(minutes), time_min=time_min))


def _hms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "never"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _timeline(goal: TimeGoal, c: Candidate) -> Outlook:
    """The outlook from the queue timeline alone (without Slurm's --test-only answers)."""
    return replace(goal, snapshot=replace(goal.snapshot, tested={})).plan_outlook(c.plan, c.result.iteration_time_s)


def _history(goal: TimeGoal, c: Candidate) -> float | None:
    waits = [goal.snapshot.history_wait(p, len(g)) for p, g in plan_shape(c.plan)]
    return None if any(w is None for w in waits) else max(w.median_wait_s for w in waits if w is not None)


def finite(value: float | None) -> float | None:
    """A number JSON can hold: None for no value, math.inf (never) or NaN."""
    return value if value is not None and math.isfinite(value) else None


def plan_time_json(goal: TimeGoal, c: Candidate) -> dict[str, Any]:
    """One plan's time to result; a start, finish or GPU-hours that does not exist is null, with the reason."""
    o = goal.plan_outlook(c.plan, c.result.iteration_time_s)
    start = o.start
    return {"request": shape_text(plan_shape(c.plan)), "shape": [[p, list(g)] for p, g in plan_shape(c.plan)],
            "expected_start_s": finite(start.start_s), "start_source": start.source,
            "start_reason": start.detail or None, "start_considered": list(start.considered),
            "timeline_start_s": finite(_timeline(goal, c).start.start_s),
            "history_wait_s": finite(_history(goal, c)), "run_s": o.run_s, "restarts": o.restarts,
            "restart_s": finite(o.restart_s), "job_time_s": finite(o.job_time_s),
            "expected_finish_s": finite(o.finish_s), "gpu_hours": finite(o.gpu_hours)}


def strategy_json(s: Strategy) -> dict[str, Any]:
    return {"chosen": s.chosen, "why": s.why, "wait_finish_s": finite(s.wait.finish_s),
            "grow_finish_s": finite(s.grow_finish_s), "grow_at_s": finite(s.grow_at_s),
            "grow_from": s.grow_from.plan.gpus_by_type() if s.grow_from else None,
            "grow_to": s.grow_to.plan.gpus_by_type() if s.grow_to else None}


def queue_json(snapshot: QueueSnapshot, left_out: dict[str, str]) -> dict[str, Any]:
    """The queue's sources: notes, the site states read, the partitions left out and why, the history."""
    return {"taken_at": snapshot.taken_at, "slurm_seconds": snapshot.slurm_seconds, "notes": list(snapshot.notes),
            "partitions": {name: {"state": st.state, "max_time_s": finite(st.max_time_s), "max_nodes": st.max_nodes}
                           for name, st in snapshot.partitions.items()},
            "unknown_partitions": list(snapshot.unknown_partitions), "left_out": left_out,
            "nodes_left_out": {p: dict(n) for p, n in snapshot.nodes_left_out.items()},
            "reservations": [{"name": r.name, "start_s": finite(r.start_s), "end_s": finite(r.end_s),
                              "nodes": list(r.nodes), "ours": r.ours} for r in snapshot.reservations],
            "unplanned_pending_jobs": [j.job for j in snapshot.unplanned],
            "history": [asdict(h) for h in snapshot.history],
            "history_error": asdict(snapshot.history_error) if snapshot.history_error else None}


def echo_time(result: SearchResult, shown: list[Candidate]) -> None:
    """The plans' expected start (and its source), run time, restarts and finish; the strategy; the sources."""
    goal = result.request.time_goal
    assert goal is not None
    rows = []
    for i, c in enumerate(shown):
        o = goal.plan_outlook(c.plan, c.result.iteration_time_s)
        hist = _history(goal, c)
        rows.append((i + 1, shape_text(plan_shape(c.plan)), f"{c.result.iteration_time_s:.3f}", _hms(o.start.start_s),
                     o.start.source, _hms(_timeline(goal, c).start.start_s), "-" if hist is None else _hms(hist),
                     _hms(o.run_s), o.restarts, _hms(o.finish_s), f"{o.gpu_hours:.3g}"))
    click.echo(f"\ntime to result of {goal.steps} steps (h:mm:ss from now):")
    click.echo(table(("#", "request", "iteration s", "start", "start source", "timeline start", "history wait",
                      "run", "restarts", "finish", "GPU-hours"), rows))
    for i, c in enumerate(shown):
        start = goal.plan_outlook(c.plan, c.result.iteration_time_s).start
        if start.detail and start.source != IDLE_NOW:
            click.echo(f"  #{i + 1} starts {start.detail}" if math.isfinite(start.start_s)
                       else f"  #{i + 1} never starts: {start.detail}")
    strategy = choose(result, goal)
    click.echo(f"strategy: {strategy.chosen}: {strategy.why}")
    snap = goal.snapshot
    for name, why in result.left_out.items():
        click.echo(f"left out: {name}: {why}")
    states = site_states(snap)
    if states:
        click.echo(f"site states taken into account: {states}")
    err = snap.history_error
    note = (f"sacct history of {sum(h.jobs for h in snap.history)} jobs; its error on them (each predicted from "
            f"the others): mean {err.mean_abs_error_s:.0f} s, {100 * err.within_60s:.0f} % within a minute"
            if err else "no measured history error (no sacct history, or too few jobs)")
    click.echo(f"start estimates: {snap.slurm_seconds:.2f} s of Slurm calls; {note}"
               + "".join(f"; {n}" for n in snap.notes))


def time_json(result: SearchResult, shown: list[Candidate]) -> dict[str, Any]:
    """The time objective's part of ``plan --json``: per plan, the strategy, the queue's sources."""
    goal = result.request.time_goal
    assert goal is not None
    return {"steps": goal.steps, "time": [plan_time_json(goal, c) for c in shown],
            "strategy": strategy_json(choose(result, goal)), "queue": queue_json(goal.snapshot, result.left_out)}


def site_states(snap: QueueSnapshot) -> str:
    """The site states a snapshot read, in a line: partitions not UP, nodes left out, reservations, pending
    jobs Slurm has not planned ("" when it read none of them)."""
    parts = [f"{name} {st.state}" for name, st in snap.partitions.items() if not st.starts_jobs]
    parts += [f"{len(n)} node(s) of {p} {'/'.join(sorted(set(n.values())))}" for p, n in snap.nodes_left_out.items()]
    parts += [r.text() for r in snap.reservations]
    if snap.unplanned:
        parts.append(f"{len(snap.unplanned)} pending job(s) Slurm has not planned (counted ahead)")
    return "; ".join(parts)
