"""``sailor-hpc sbatch | submit | status | cancel | logs``: training jobs of a plan on a Slurm site."""
from __future__ import annotations

import getpass
import hashlib
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import click

from sailor_hpc.cli.app import main
from sailor_hpc.cli.log_view import log_lines
from sailor_hpc.cli.output import echo_json, json_option, table
from sailor_hpc.cli.preflight import (
    RUNTIME_MODULES,
    USER_ENTRY_MODULES,
    JobNeeds,
    check_before_queue,
    check_checkpoints,
    skip_runtime_check_option,
    warn_interpreter,
)
from sailor_hpc.cli.run_cmds import status_cmd as run_status
from sailor_hpc.cli.training_options import (
    DATA_HELP,
    SKIP_PATH_CHECK,
    job_work,
    pop_training_args,
    skip_path_check_option,
    training_options,
)
from sailor_hpc.core.atomic import atomic_write_text, removed_on_error
from sailor_hpc.core.ds_config import ds_config, ds_config_text
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.site import load_site
from sailor_hpc.core.training import FLAGS
from sailor_hpc.jobs.options import DryRun, JobOptions, Limits, Training, UserEntry, WholePlan, check_user_entry
from sailor_hpc.jobs.render import (
    check_job_dir,
    placed_plan_file,
    render_job_script,
    write_job_script,
)
from sailor_hpc.slurm.status import job_status, list_jobs
from sailor_hpc.slurm.submit import cancel_job, check_script, log_path, read_log, submit_script

_PATH = click.Path(dir_okay=False, path_type=Path)


def _job_options(f: Any) -> Any:
    """Options shared by ``sbatch`` and ``submit`` (what the job script is rendered from)."""
    opts = [
        click.argument("plan_file", metavar="PLAN", type=_PATH),
        click.argument("entry_args", metavar="[-- ENTRY_ARGS...]", nargs=-1, type=click.UNPROCESSED),
        click.option("--site", "site_file", type=_PATH, required=True, help="Site config TOML."),
        click.option("--model", default=None, help="Model (required for a Sailor plan_config)."),
        click.option("--data", default=None, help=DATA_HELP),
        click.option("--save", default=None,
                     help="Checkpoint directory (default: <plan stem>-ckpt next to the plan, so a re-rendered job "
                          "resumes from it)."),
        click.option("--load", default=None, help="Checkpoint to start from (until the job has its own)."),
        click.option("--steps", type=click.IntRange(min=1), default=100, show_default=True,
                     help="Optimizer step to train to."),
        click.option("--time", "time_limit", default=None, help="Time limit (default 1 h, capped by the partitions)."),
        click.option("--time-min", default=None,
                     help="Shortest limit backfill may give the job (sbatch --time-min): it may start sooner; the "
                          "ranks checkpoint before whatever limit it gets and the job requeues itself."),
        click.option("--job-name", default=None, help="Slurm job name (default sailor-<model>)."),
        click.option("--extra-sbatch", multiple=True, help="Extra header option, e.g. --mail-type=END (repeatable)."),
        click.option("--train-arg", multiple=True, help="Extra argument of megatron_patch.launch (repeatable)."),
        click.option("--runtime", type=click.Choice(["megatron_patch", "deepspeed"]), default="megatron_patch",
                     show_default=True, help="Who trains the plan: megatron_patch, or stock DeepSpeed "
                                             "(megatron_patch.ds_runtime; only plans its engine runs)."),
        click.option("--entry", type=_PATH, default=None,
                     help="With --runtime deepspeed: your own DeepSpeed script, started on every rank of the plan as "
                          "`python SCRIPT --deepspeed_config DS_CONFIG ENTRY_ARGS...` with the plan's ds_config.json "
                          "(written next to the job from the training options) and torch.distributed's variables; "
                          "the script's own arguments go after --."),
        click.option("--python", default=sys.executable, show_default=True,
                     help="Interpreter on the compute nodes (default: this one, as `run` and `profile`)."),
        click.option("--signal-grace", type=int, default=None,
                     help="Seconds before the limit at which ranks checkpoint (default min(300, limit/10))."),
        click.option("--workdir", default=None,
                     help="Job working directory (default: the job directory, where the script and the placed "
                          "plan go: that of the script file, else the current directory)."),
        click.option("--log-dir", default=None, help="Directory of the job log (default: the work directory)."),
        click.option("--dry-run", is_flag=True, help="Ranks only print their role (no training)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return training_options(skip_runtime_check_option(skip_path_check_option("--data, --save and --load")(f)))


def _with_training_args(kw: dict[str, Any]) -> dict[str, Any]:
    """The command's arguments with the training options turned into launch arguments (before --train-arg's,
    which may override them), or, for a user's --entry, kept as values for its ds_config.json."""
    out = dict(kw)
    out["train_values"] = {f.dest: out.get(f.dest) for f in FLAGS}
    launch = pop_training_args(out)
    out["train_arg"] = tuple(kw["train_arg"]) if kw["entry"] is not None else (*launch, *kw["train_arg"])
    return out


def entry_script(entry: Path, skip: bool, **beside: object) -> Path:
    """A user's script, absolute (the job starts elsewhere) and checked to exist unless ``skip``; the options
    that belong to sailor-hpc's runtimes are refused beside it (``beside``: option -> value given). Shared with
    ``plan --sbatch``, which renders the same job."""
    for option, value in beside.items():
        if value:
            raise SailorError(f"--{option.replace('_', '-')} is an option of sailor-hpc's runtimes; your script "
                              "reads its own data and writes its own checkpoints", field=f"--{option.replace('_', '-')}",
                              fix="pass it to your script after --, e.g. -- --data PREFIX")
    script = entry.expanduser().absolute()
    if not skip and not script.is_file():
        raise SailorError("no script here", file=script, field="--entry",
                          fix=f"check the path, or pass {SKIP_PATH_CHECK} if only the compute nodes see it")
    return script


def ds_config_file(plan: Plan, train_values: dict[str, Any], steps: int, job_dir: Path, stem: str) -> tuple[Path, str]:
    """Where the plan's ds_config.json goes and its text: in the job directory, named by its content (a queued
    job's config is never replaced by a later render's); refused (engine, schedule, optimizer) here, before
    anything is written."""
    text = ds_config_text(ds_config(plan, train_values, steps))
    return job_dir.absolute() / f"{stem}.{hashlib.sha256(text.encode()).hexdigest()[:12]}.ds_config.json", text


def _job_dir(script: Path | None, option: str, workdir: str | None) -> Path:
    """The job directory, checked before anything is written: where the script, a placed copy of the plan,
    the default checkpoints and (by default) the job's working directory and log go. The script's
    directory, else ``--workdir``, else the current directory."""

    if script is None and workdir is not None:
        return check_job_dir(workdir, "--workdir")
    return check_job_dir(script.parent if script is not None else Path.cwd(), option)


def _render(plan_file: Path, site_file: Path, model: str | None, data: str | None, save: str | None,
            load: str | None, steps: int, time_limit: str | None, time_min: str | None, job_name: str | None,
            extra_sbatch: tuple[str, ...],
            train_arg: tuple[str, ...], python: str, signal_grace: int | None, workdir: str | None,
            log_dir: str | None, dry_run: bool, skip_path_check: bool, skip_runtime_check: bool, *, job_dir: Path,
            submitting: bool, runtime: str = "megatron_patch", entry: Path | None = None,
            entry_args: tuple[str, ...] = (), train_values: dict[str, Any] | None = None) -> tuple[str, Path]:
    """Render the job; a placed copy of the plan (if one is needed) and a user entry's ds_config.json go into
    ``job_dir`` (see :func:`_job_dir`), never next to the input plan, which may be read-only shared data.
    ``submitting``: the job is queued next, so what it needs is checked first (:mod:`.preflight`); a job only
    rendered gets a warning about its interpreter, and checkpoints of another model are refused either way."""

    site = load_site(site_file)
    job: Training | DryRun | UserEntry
    if entry is not None:
        check_user_entry(runtime, train_arg, WholePlan())
        script = entry_script(entry, skip_path_check, data=data, save=save, load=load, dry_run=dry_run)
    elif entry_args:
        raise SailorError(f"arguments after PLAN ({' '.join(entry_args)}) are a user script's, given with --entry",
                          field="--entry", fix="add --runtime deepspeed --entry SCRIPT, or pass runtime arguments "
                                               "with --train-arg")
    else:
        if save is None and not dry_run:  # next to the plan, whatever -o says: a re-rendered job resumes from it
            save = str(check_job_dir(plan_file.absolute().parent, "--save (default: next to the plan)")
                       / f"{plan_file.stem}-ckpt")
        job = job_work(data, save, load, steps, dry_run=dry_run, skip=skip_path_check, dry_run_option="--dry-run")
    work = check_job_dir(workdir, "--workdir") if workdir is not None else job_dir
    logs = check_job_dir(log_dir, "--log-dir") if log_dir is not None else work
    config: tuple[Path, str] | None = None
    with ExitStack() as undo:  # no script: no placed copy of the plan, no config left behind for it either
        plan, plan_path = placed_plan_file(plan_file, site, model, directory=job_dir, undo=undo)
        modules = USER_ENTRY_MODULES if entry is not None else RUNTIME_MODULES[runtime]
        checkpoints: dict[str, str | None] = {}
        if entry is None and isinstance(job, Training):  # a user's script keeps its own checkpoints
            checkpoints = {"--save": str(job.save), "--load": None if job.load is None else str(job.load)}
        if submitting:
            check_before_queue(JobNeeds(site=site, partitions=tuple(p.name for p in site.partitions), python=python,
                                        modules=modules, model=plan.model, checkpoints=checkpoints,
                                        skip_runtime_check=skip_runtime_check))
        else:
            check_checkpoints(plan.model, checkpoints)
            if not skip_runtime_check and site.container is None:  # a container's interpreter is not this machine's
                warn_interpreter(python, modules)
        copy = plan_path != plan_file.absolute()
        if entry is not None:
            config = ds_config_file(plan, train_values or {}, steps, job_dir, plan_file.stem)
            job = UserEntry(script, config[0], entry_args)
            undo.enter_context(removed_on_error(config[0]))
            atomic_write_text(*config)
        options = JobOptions(plan_path=plan_path, work=job, steps=steps, model=model, runtime=runtime,
                             train_args=train_arg, python=python, job_name=job_name,
                             limits=Limits(time_limit, time_min, signal_grace), extra_sbatch=extra_sbatch,
                             workdir=work, log_dir=logs)
        text = render_job_script(plan, site, options)
        for d in (work, logs):  # Slurm creates neither
            d.mkdir(parents=True, exist_ok=True)
    if copy:
        click.echo(f"placed plan written to {plan_path} (the job reads it: keep it until the job has ended)", err=True)
    if config is not None:
        click.echo(f"DeepSpeed config written to {config[0]} (the job reads it: keep it until the job has ended)",
                   err=True)
    return text, plan_path


@main.command("sbatch")
@_job_options
@click.option("-o", "--output", type=_PATH, default=None, help="Write the script here (default: print it).")
def sbatch_cmd(output: Path | None, **kw: Any) -> None:
    """Render the (het) sbatch script that trains PLAN on SITE; nothing is submitted."""

    text, _ = _render(**_with_training_args(kw), job_dir=_job_dir(output, "-o/--output", kw["workdir"]),
                      submitting=False)
    if output is None:
        click.echo(text, nl=False)
    else:
        write_job_script(output, text)
        click.echo(f"wrote {output}", err=True)


@main.command("submit")
@_job_options
@click.option("--script", "script_out", type=_PATH, default=None,
              help="Where to keep the rendered script (default: <plan>.sbatch next to the plan); its directory "
                   "is the job directory.")
@click.option("--test-only", is_flag=True, help="Only ask Slurm whether and when it would start (sbatch --test-only).")
@json_option
def submit_cmd(script_out: Path | None, test_only: bool, as_json: bool, **kw: Any) -> None:
    """Render and submit the job that trains PLAN on SITE; prints the job id."""

    script = script_out or kw["plan_file"].with_suffix(".sbatch")
    text, plan_path = _render(**_with_training_args(kw), job_dir=_job_dir(script, "--script", kw["workdir"]),
                              submitting=True)
    write_job_script(script, text)
    if test_only:
        answer = check_script(script)
        echo_json({"script": str(script), "test_only": answer}) if as_json else click.echo(answer)
        return
    rec = submit_script(script, plan=str(plan_path), site=str(kw["site_file"]))
    if as_json:
        echo_json({"job_id": rec.job_id, "script": rec.script, "log": rec.log, "plan": rec.plan})
    else:
        click.echo(f"submitted {script}; log: {rec.log}", err=True)
        click.echo(rec.job_id)


@main.command("status")
@click.argument("job_id", metavar="[JOBID|RUN_DIR]", required=False)
@json_option
@click.pass_context
def status_cmd(ctx: click.Context, job_id: str | None, as_json: bool) -> None:
    """State of a job (het components, nodes; squeue + sacct), of your queued jobs, or the history of a
    `sailor-hpc run` given its run directory."""

    if job_id is not None and Path(job_id).is_dir():
        ctx.invoke(run_status, run_dir=Path(job_id), events=True, as_json=as_json)
        return
    if job_id is not None:
        jobs = [job_status(job_id)]
    else:
        jobs = list_jobs(user=getpass.getuser())
    if as_json:
        echo_json(jobs[0].to_dict() if job_id is not None else [j.to_dict() for j in jobs])
        return
    rows = []
    for j in jobs:
        for c in j.components or []:
            rows.append((j.job_id, j.state, c.job_id, c.partition, c.state, c.nodes or "-",
                         c.exit_code or c.reason or "-"))
        if not j.components:
            rows.append((j.job_id, j.state, "-", "-", "-", "-", "unknown to squeue and sacct"))
    click.echo(table(("job", "job state", "component", "partition", "state", "nodes", "exit/reason"), rows))


@main.command("cancel")
@click.argument("job_ids", metavar="JOBID...", nargs=-1, required=True)
def cancel_cmd(job_ids: tuple[str, ...]) -> None:
    """Cancel jobs (every het component / array element of each)."""

    for job_id in job_ids:
        click.echo(f"cancelled {cancel_job(job_id)}")


@main.command("logs")
@click.argument("job_id", metavar="JOBID")
@click.option("--rank", type=click.IntRange(min=0), default=None,
              help="This rank's lines (default: rank 0's, which logs steps, losses, saves and loads).")
@click.option("--json", "as_json", is_flag=True, help="The runtime's JSON events instead (every rank's, or --rank's).")
@click.option("--all", "everything", is_flag=True, help="The whole log, every rank's lines and events.")
@click.option("--tail", type=click.IntRange(min=1), default=None, help="Only the last N lines.")
@click.option("--path", "path_only", is_flag=True, help="Only print where the log is.")
def logs_cmd(job_id: str, rank: int | None, as_json: bool, everything: bool, tail: int | None,
             path_only: bool) -> None:
    """Print a job's log (a job submitted with sailor-hpc): rank 0's lines for a person and the job's own
    messages; --json for the events, --rank N for another rank, --all for everything."""

    if path_only:
        click.echo(str(log_path(job_id)))
        return
    _, text = read_log(job_id)
    lines = text.splitlines() if everything else log_lines(text, rank=rank, events=as_json)
    shown = lines[-tail:] if tail is not None else lines
    if shown:
        click.echo("\n".join(shown))
