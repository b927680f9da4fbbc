"""``sailor-hpc run``: train under a controller that re-plans and resumes when the allocation changes.

    sailor-hpc run --site SITE --model M --objective throughput|cost|time [constraints] --data PATH --save DIR [--steps N]
    sailor-hpc run --resume RUN_DIR          (continue a run that stopped, gave up or lost its controller)
    sailor-hpc run stop RUN_DIR              (every rank checkpoints, then every job ends)
    sailor-hpc run cancel RUN_DIR            (every job ends at once)
    sailor-hpc run status RUN_DIR            (the run's history: jobs, events, decisions)

The run directory (``--run-dir``, default ``SAVE/controller``) holds the spec, the journal, the plans,
the job scripts and the jobs' logs. Exit codes: 0 finished or stopped by its user, 1 gave up, 2 bad input,
130 interrupted (the job keeps running; ``--resume`` picks it up).
"""
from __future__ import annotations

import getpass
import signal
import sys
import time
from pathlib import Path
from typing import Any

import click

from sailor_hpc.cli.app import main
from sailor_hpc.cli.output import echo_json, json_option, table
from sailor_hpc.cli.preflight import RUNTIME_MODULES, JobNeeds, check_before_queue, skip_runtime_check_option
from sailor_hpc.cli.training_options import DATA_HELP, absolute_blend, pop_training_args, training_options
from sailor_hpc.controller import Controller, RunDir, RunSpec, RunState, new_run_id
from sailor_hpc.controller.groups import across_clusters
from sailor_hpc.controller.live import describe_live, live_view
from sailor_hpc.controller.planning import partitions_for_time
from sailor_hpc.controller.records import encode
from sailor_hpc.controller.spec import RUN_RUNTIMES
from sailor_hpc.controller.story import (
    ATTEMPT_HEADER,
    CHANGE_HEADER,
    attempt_rows,
    change_rows,
    describe,
)
from sailor_hpc.core.archive import open_archive
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import get_model
from sailor_hpc.core.precision import DTYPES
from sailor_hpc.core.site import load_site
from sailor_hpc.core.training import FLAGS

_FILE = click.Path(dir_okay=False, path_type=Path)
_DIR = click.Path(file_okay=False, path_type=Path)
#: options that describe a new run; --resume reads them from run.json instead
_RUN_OPTIONS = ("site_file", "model", "data", "save", "run_dir", "profiles", "gbs", "seq_len", "dtype", "steps", "objective",
                "max_cost_per_hour", "max_cost_per_iteration", "min_throughput", "max_gpus", "max_stages", "runtime", "min_gain",
                "restart_cost", "max_restarts", "backoff", "poll", "replan_interval", "grow_timeout", "save_interval",
                "time_limit", "time_min", "signal_grace", "python", "skip_runtime_check", "train_arg", "extra_sbatch",
                "resident_ranks",
                *(f.dest for f in FLAGS))


def parse_gain(text: str) -> float:
    """``10%`` or ``0.1`` -> 0.1."""
    t = text.strip()
    try:
        return float(t[:-1]) / 100.0 if t.endswith("%") else float(t)
    except ValueError:
        raise SailorError(f"{text!r} is not a fraction or a percentage", field="--min-gain",
                          fix="e.g. --min-gain 10% or --min-gain 0.1") from None


def new_run(opts: dict[str, Any]) -> Path:
    """Check a new run's options, write its run directory and return it."""

    for name, flag in (("site_file", "--site"), ("model", "--model"), ("data", "--data"), ("save", "--save")):
        if opts.get(name) is None:
            raise click.UsageError(f"a new run needs {flag} (or --resume RUN_DIR)")
    site_path = opts["site_file"].absolute()
    site = load_site(site_path)
    partitions_for_time(opts.get("time_limit"), site)  # a --time no partition admits: refused now
    if opts["runtime"] != "megatron_patch" and across_clusters(site):  # a group's jobs launch megatron_patch
        raise SailorError(f"--runtime {opts['runtime']} is for a site of one cluster; {site_path} has several",
                          field="--runtime", fix="leave out --runtime (megatron_patch), or give a site of one cluster")
    profiles = str(Path(opts["profiles"]).absolute()) if opts.get("profiles") else None
    open_archive(profiles, site)  # a missing archive is an error now, not in the loop
    data = absolute_blend(opts["data"])
    train_args = (*pop_training_args(opts), *(opts.get("train_arg") or ()))
    save = Path(opts["save"]).absolute()
    spec = RunSpec.of(run_id=new_run_id(), site=str(site_path), model=get_model(opts["model"]).name,
                   objective=opts["objective"], data=data, save=str(save), steps=opts["steps"], gbs=opts["gbs"],
                   profiles=profiles, seq_len=opts.get("seq_len"), dtype=opts.get("dtype") or "auto",
                   max_cost_per_hour=opts.get("max_cost_per_hour"),
                   max_cost_per_iteration=opts.get("max_cost_per_iteration"),
                   min_throughput=opts.get("min_throughput"), max_gpus=opts.get("max_gpus"),
                   max_stages=opts.get("max_stages"), runtime=opts["runtime"], min_gain=parse_gain(opts["min_gain"]),
                   restart_cost_s=opts.get("restart_cost"), max_restarts=opts["max_restarts"],
                   backoff_s=opts["backoff"], poll_s=opts["poll"], replan_interval_s=opts["replan_interval"],
                   grow_timeout_s=opts["grow_timeout"],
                   save_interval=opts["save_interval"], time_limit=opts.get("time_limit"),
                   time_min=opts.get("time_min"),
                   signal_grace_s=opts.get("signal_grace"), python=opts["python"],
                   train_args=train_args, extra_sbatch=tuple(opts.get("extra_sbatch") or ()),
                   resident_ranks=bool(opts.get("resident_ranks")))
    check_before_queue(JobNeeds(site=site, partitions=tuple(p.name for p in site.partitions), python=opts["python"],
                                modules=RUNTIME_MODULES[opts["runtime"]], model=spec.planning.model,
                                checkpoints={"--save": str(save)}, skip_runtime_check=opts["skip_runtime_check"]))
    save.mkdir(parents=True, exist_ok=True)
    run_dir = Path(opts["run_dir"]).absolute() if opts.get("run_dir") else save / "controller"
    return RunDir.create(run_dir, spec).path


def drive(run_dir: Path, *, resume: bool = False) -> int:
    """Run the controller in the foreground, echoing the journal; SIGTERM stops it like Ctrl-C."""

    t0 = time.time()

    def echo(line: str) -> None:
        click.echo(f"[{time.time() - t0:7.1f}s] {line}")

    def on_term(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        return Controller(RunDir.existing(run_dir), echo=echo).run(resume=resume)
    finally:
        signal.signal(signal.SIGTERM, previous)


@main.group(name="run", invoke_without_command=True)
@click.option("--site", "site_file", type=_FILE, help="Site config TOML.")
@click.option("--model", help="Model (catalog name or Sailor alias).")
@click.option("--objective", type=click.Choice(["throughput", "cost", "time"]), default="throughput", show_default=True,
              help="time: each plan on the free GPUs ranked by expected finish of --steps (restarts at --time "
                   "included); the run starts now and grows as GPUs free (docs/time-to-result.md).")
@click.option("--data", help=DATA_HELP)
@click.option("--save", help="Checkpoint directory of the run (every job resumes from its newest complete one).")
@click.option("--steps", type=click.IntRange(min=1), default=1000, show_default=True, help="Optimizer step to reach.")
@click.option("--gbs", type=click.IntRange(min=1), default=1024, show_default=True, help="Global batch size.")
@click.option("--profiles", type=_FILE, default=None,
              help="Profile archive (default: $SAILOR_PROFILES, the site's, then the embedded one).")
@click.option("--seq-len", type=int, default=None, help="Sequence length (default: the model's).")
@click.option("--dtype", type=click.Choice(["auto", *DTYPES]), default="auto", show_default=True,
              help="Training precision; auto: the best the GPU types train in (bf16, then fp16, then fp32) among "
                   "those the archive has profiles of.")
@click.option("--max-cost-per-hour", type=float, default=None)
@click.option("--max-cost-per-iteration", type=float, default=None)
@click.option("--min-throughput", type=float, default=None, help="Samples per second.")
@click.option("--max-gpus", type=int, default=None)
@click.option("--max-stages", type=int, default=None, help="Most pipeline stages per pipeline.")
@click.option("--runtime", type=click.Choice(RUN_RUNTIMES), default="megatron_patch",
              show_default=True, help="Who trains the jobs: deepspeed plans only what DeepSpeed's engine runs; auto "
                                      "takes DeepSpeed's best plan at each re-plan while it is within --min-gain of "
                                      "megatron_patch's (docs/deepspeed.md).")
@click.option("--min-gain", default="10%", show_default=True,
              help="Resize a running job only if the new plan gains this much after the restart cost.")
@click.option("--restart-cost", type=float, default=None,
              help="Seconds one restart costs (default: measured from the run's restarts, 60 s before the first).")
@click.option("--max-restarts", type=click.IntRange(min=0), default=10, show_default=True,
              help="Restarts in a row without a new checkpoint (node lost, preempted, failed, not submitted; "
                   "resizes for more GPUs do not count), then it gives up.")
@click.option("--backoff", type=float, default=30.0, show_default=True,
              help="Seconds to wait after a job that failed without a step (doubles each time).")
@click.option("--poll", type=float, default=2.0, show_default=True, help="Seconds between looks at Slurm.")
@click.option("--replan-interval", type=float, default=30.0, show_default=True,
              help="At most one re-plan for more idle GPUs per this many seconds.")
@click.option("--grow-timeout", type=float, default=300.0, show_default=True,
              help="Seconds a bigger job submitted beside the running one may wait in the queue before it is "
                   "cancelled (the run keeps training meanwhile).")
@click.option("--resident-ranks/--no-resident-ranks", default=True, show_default=True,
              help="Recover in place without new processes: one srun step per node, and on a node lost or drained "
                   "the surviving ranks take the new plan in their own processes (megatron_patch runtime outside "
                   "a container; else each change starts a new srun step). A mixed-GPU plan then runs as a bundle "
                   "of plain jobs, one per het component, so that a node lost is recovered in place (Slurm ends a "
                   "whole het job); --no-resident-ranks keeps one het job, whose components Slurm starts together.")
@click.option("--save-interval", type=click.IntRange(min=1), default=50, show_default=True,
              help="The job checkpoints every K steps (a lost node costs at most K steps).")
@click.option("--time", "time_limit", default=None, help="Time limit of each job (it checkpoints before it).")
@click.option("--time-min", "time_min", default=None,
              help="Shortest time limit backfill may give a job (sbatch --time-min): it starts sooner, and "
                   "checkpoints before whatever limit it got.")
@click.option("--signal-grace", type=int, default=None, help="Seconds before the limit at which ranks checkpoint.")
@click.option("--python", default=sys.executable, show_default=True, help="Interpreter on the compute nodes.")
@skip_runtime_check_option
@training_options
@click.option("--train-arg", multiple=True, help="Extra argument of megatron_patch.launch (repeatable).")
@click.option("--extra-sbatch", multiple=True, help="Extra #SBATCH option, e.g. --mail-type=END (repeatable).")
@click.option("--run-dir", type=_DIR, default=None, help="Where the run's journal lives (default: SAVE/controller).")
@click.option("--resume", "resume_dir", type=_DIR, default=None,
              help="Continue the run in this run directory: one that stopped, gave up or lost its controller.")
@click.pass_context
def run_group(ctx: click.Context, resume_dir: Path | None, **opts: Any) -> None:
    """Plan from live availability, submit, watch; re-plan and resume from checkpoints when the allocation changes."""
    if ctx.invoked_subcommand is not None:
        return
    if resume_dir is not None:
        given = [n for n in _RUN_OPTIONS if ctx.get_parameter_source(n) == click.core.ParameterSource.COMMANDLINE]
        if given:
            raise click.UsageError(f"--resume takes no run options ({', '.join(given)}): they are in RUN_DIR/run.json")
        run_dir = resume_dir
        said, done = resume_note(RunDir.existing(run_dir))
        click.echo(said)
        if done:
            ctx.exit(0)
        ctx.exit(drive(run_dir, resume=True))
    else:
        if opts.get("site_file") is None and opts.get("model") is None:
            click.echo(ctx.get_help())
            return
        run_dir = new_run(opts)
        click.echo(f"run directory {run_dir} (resume with: sailor-hpc run --resume {run_dir})")
    ctx.exit(drive(run_dir))


def run_phase(state: RunState, controller_alive: bool) -> str:
    """Where the run stands, in a line: what ended it (and whose decision that was), or who drives it now."""
    if state.finished:
        return "finished"
    if state.stopped is not None:
        return (f"stopped by {state.stopped.by} ({state.stopped.how}) at checkpoint step {state.stopped.step}; "
                f"continue with --resume")
    if state.gave_up:
        return f"gave up: {state.gave_up}; continue with --resume once the cause is fixed"
    if state.stop_requested is not None:
        return f"{state.stop_requested.by} asked it to {state.stop_requested.how}; its jobs are ending"
    return "running" if controller_alive else "its controller is not running (interrupted or killed): --resume"


def resume_note(rd: RunDir) -> tuple[str, bool]:
    """What ``run --resume`` finds and will do, for people; True when there is nothing to do (finished)."""
    st = rd.state()
    ck = st.checkpoint.step if st.checkpoint else 0
    if st.finished is not None:
        return f"run {rd.path}: finished at step {st.finished.step}; nothing to resume", True
    if rd.controller_alive():
        raise SailorError("another controller is running this run", file=rd.path / "controller.lock",
                          fix="stop it first (sailor-hpc run stop), or watch it with sailor-hpc run status --watch")
    if st.stopped is not None:
        why = f"was stopped by {st.stopped.by} ({st.stopped.how}) at checkpoint step {st.stopped.step}"
    elif st.gave_up is not None:
        why = f"gave up: {st.gave_up}"
    elif st.stop_requested is not None:
        return (f"run {rd.path}: {st.stop_requested.by} asked it to {st.stop_requested.how}; finishing that "
                f"(the run's jobs end, then it stops)"), False
    else:
        cur = st.current
        jobs = f"adopting its current job(s) {', '.join(cur.jobs.values()) or '(being submitted)'}" if cur else \
            "planning on the GPUs free now and submitting"
        return f"run {rd.path}: its controller had stopped (interrupted or killed); {jobs}", False
    return (f"run {rd.path} {why}; resuming: planning on the GPUs free now and submitting from checkpoint step "
            f"{ck} (restarts count afresh)"), False


def end_run(run_dir: Path, how: str, timeout_s: float) -> int:
    """Ask the run to end (``stop``: every rank checkpoints first; ``cancel``: at once) and wait until every job of
    it is gone. A running controller does it (it holds the run's lock); without one, this process does."""
    rd = RunDir.existing(run_dir, "RUN_DIR")
    st = rd.state()
    if st.finished is not None:
        click.echo(f"run {rd.path}: finished at step {st.finished.step}; nothing to {how}")
        return 0
    if st.stopped is not None and rd.stop_request() is None:
        click.echo(f"run {rd.path}: already stopped by {st.stopped.by} ({st.stopped.how}) at checkpoint step "
                   f"{st.stopped.step}; continue it with sailor-hpc run --resume {rd.path}")
        return 0
    rd.request_stop(how, getpass.getuser())
    t0 = time.time()

    def echo(line: str) -> None:
        click.echo(f"[{time.time() - t0:7.1f}s] {line}")

    if not rd.controller_alive():
        echo(f"no controller runs this run: ending its jobs here ({how})")
        return Controller(rd, echo=echo).run()
    echo(f"asked the run's controller to {how}" + (" (every rank saves a checkpoint first)" if how == "stop" else ""))
    seen = len(rd.records())
    while time.time() - t0 < timeout_s:
        recs = rd.records()
        for rec in recs[seen:]:
            echo(describe(rec))
        seen = len(recs)
        st = rd.state()
        if st.stopped is not None:
            return 0
        if not rd.controller_alive():  # it died (or exited) before it ended the run: finish the stop here
            echo("the controller is gone before the run stopped: ending its jobs here")
            return Controller(rd, echo=echo).run()
        time.sleep(0.5)
    raise SailorError(f"the run has not stopped {timeout_s:.0f} s after it was asked to", file=rd.stop_request_file,
                      fix="the request stays: the controller ends the run when it can; check sailor-hpc run status, "
                          "or end the jobs at once with sailor-hpc run cancel")


def _end_command(how: str, timeout_s: float, doc: str) -> None:
    """``sailor-hpc run stop|cancel RUN_DIR``: the two ways a user ends a run, one command each."""

    @click.argument("run_dir", metavar="RUN_DIR", type=_DIR)
    @click.option("--timeout", type=float, default=timeout_s, show_default=True,
                  help="Seconds to wait for every job of the run to be gone.")
    @click.pass_context
    def command(ctx: click.Context, run_dir: Path, timeout: float) -> None:
        ctx.exit(end_run(run_dir, how, timeout))

    command.__doc__ = doc
    run_group.command(how)(command)


_end_command("stop", 900.0, "Stop the run: every rank saves a complete checkpoint, then every job of it ends "
                            "(continue with --resume).")
_end_command("cancel", 300.0, "Cancel the run at once, without a checkpoint (it continues from its newest one with "
                              "--resume).")


@run_group.command("status")
@click.argument("run_dir", metavar="RUN_DIR", type=_DIR)
@click.option("--events/--no-events", default=True, show_default=True, help="Also list every journal record.")
@click.option("--watch", "watch_s", type=click.FloatRange(min=0.5), default=None,
              help="Redraw every this many seconds until Ctrl-C (or until the run ended).")
@json_option
def status_cmd(run_dir: Path, events: bool, watch_s: float | None, as_json: bool) -> None:
    """The run's history (its jobs: plans, why, recovery times; every event and decision) and what Slurm and the
    checkpoint directory say now."""
    rd = RunDir.existing(run_dir, "RUN_DIR")
    if watch_s is None or as_json:
        _status(rd, events, as_json)
        return
    try:
        while True:
            click.clear()
            _status(rd, events=False, as_json=False)
            state = rd.state()
            if state.finished or state.stopped or state.gave_up:
                return
            time.sleep(watch_s)
    except KeyboardInterrupt:
        return


def _status(rd: RunDir, events: bool, as_json: bool) -> None:
    spec = rd.spec()
    records = rd.records()
    state = rd.state()  # an inconsistent journal is refused naming its line (exit 2)
    alive = rd.controller_alive()
    ck = state.checkpoint
    phase = run_phase(state, alive)
    live = live_view(rd, state, alive)
    if as_json:
        echo_json({"run_dir": str(rd.path), "spec": spec.to_dict(), "phase": phase, "controller_alive": alive,
                   "checkpoint": None if ck is None else {"step": ck.step, "consumed_samples": ck.consumed_samples,
                                                          "path": ck.path},
                   "live": live.to_dict(), "restarts": state.restarts,
                   "attempts": [dict(zip(ATTEMPT_HEADER, row)) for row in attempt_rows(state)],
                   "changes": [dict(zip(CHANGE_HEADER, row)) for row in change_rows(state)],
                   "passed_over": [encode(r) for r in state.passed_over],
                   "records": [encode(r) for r in records]})
        return
    plan_req, job = spec.planning, spec.job
    click.echo(f"run {spec.run_id}: {plan_req.model} to step {job.steps} ({plan_req.objective}, gbs {plan_req.gbs}) "
               f"- {phase}; checkpoint {ck.step if ck else '-'}; {state.restarts} restart(s)")
    for line in describe_live(live):
        click.echo(line)
    for passed in state.passed_over:  # checkpoints a job could not use: said here, not only in its log
        click.echo(describe(passed))
    click.echo(table(ATTEMPT_HEADER, attempt_rows(state)))
    changes = change_rows(state)
    if changes:
        click.echo("\nallocation changes:")
        click.echo(table(CHANGE_HEADER, changes))
    if events and records:
        t0 = records[0].t
        click.echo("")
        for rec in records:
            click.echo(f"[{rec.t - t0:7.1f}s] {describe(rec)}")
