"""The work behind ``sailor-hpc plan --site ... --model ...`` (kept out of the option declarations)."""
from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import click

from planner import Constraints, PlanRequest
from planner.geo import gpus_per_cluster
from planner.on_queue import QueueState, plan_on_state
from planner.pareto import plot_pareto
from planner.time_goal import TimeGoal
from planner.time_pareto import plot_time_pareto
from sailor_hpc.cli.job_cmds import ds_config_file, entry_script
from sailor_hpc.cli.output import echo_json, table
from sailor_hpc.cli.plan_table import plan_table
from sailor_hpc.cli.preflight import RUNTIME_MODULES, USER_ENTRY_MODULES, check_checkpoints, warn_interpreter
from sailor_hpc.cli.time_planning import TimeOptions, echo_time, run_steps, time_json, time_terms, timed_job
from sailor_hpc.cli.training_options import job_work
from sailor_hpc.core.archive import open_archive
from sailor_hpc.core.atomic import atomic_write_text, removed_on_error
from sailor_hpc.core.deepspeed_plan import zero_stage_of
from sailor_hpc.core.ds_config import write_ds_config
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import get_model
from sailor_hpc.core.site import Site, load_site
from sailor_hpc.jobs.options import JobOptions, Training, UserEntry
from sailor_hpc.jobs.render import render_job_script, write_job_script
from sailor_hpc.slurm.discover import live_availability, missing_partitions

DEFAULT_GBS = 1024
DEFAULT_STEPS = 100  # of a --sbatch job


def parse_available(spec: str, site: Site) -> dict[str, int]:
    """GPUs per partition the planner may use."""
    if spec == "site":
        return {}
    if spec == "live":
        live = live_availability()
        missing = missing_partitions([p.name for p in site.partitions])
        if missing:  # planned without them, but not silently: a typo in the site would look like a busy queue
            click.echo(f"warning: --available live: Slurm has no partition {', '.join(map(repr, missing))} of the "
                       f"site {site.name} (planned without it; correct the site file {site.source})", err=True)
        stopped = [f"{p.name} ({live[p.name]['state']})" for p in site.partitions
                   if p.name in live and live[p.name]["state"] != "UP"]
        if stopped:  # its idle nodes would take a job that never starts
            click.echo(f"warning: --available live: partition {', '.join(stopped)} starts no job now (planned "
                       f"without it)", err=True)
        return {p.name: live.get(p.name, {}).get("nodes_idle", 0) * p.gpus_per_node for p in site.partitions}
    out: dict[str, int] = {}
    for item in spec.split(","):
        name, _, count = item.partition("=")
        if not count.strip().isdigit():
            raise SailorError(f"{item!r} is not PART=GPUS", field="--available",
                              fix="use 'site', 'live' or e.g. 'a100=64,v100=128'")
        with in_plan_terms(None, field="--available", drop_file=True):
            part = site.partition(name.strip())
        job_gpus = min(part.nodes, part.max_nodes_per_job) * part.gpus_per_node
        if int(count) > job_gpus:  # a silent cap would plan for GPUs the user believes were counted
            raise SailorError(f"{item.strip()!r} asks for more GPUs than one job can get of partition {part.name} "
                              f"({min(part.nodes, part.max_nodes_per_job)} nodes x {part.gpus_per_node} GPUs = "
                              f"{job_gpus})", field="--available",
                              fix=f"use at most {part.name}={job_gpus}, or correct the partition's nodes, "
                                  "gpus_per_node or max_nodes_per_job in the site file")
        out[part.name] = int(count)
    return out


@contextmanager
def in_plan_terms(only: str | None, *, field: str | None = None, fix: str | None = None,
                  drop_file: bool = False) -> Iterator[None]:
    """Re-label an error of a helper shared with other commands in this command's terms: the option the
    user gave and a fix naming options ``sailor-hpc plan`` has (the helpers name those of ``profile``,
    or a site field). ``only``: re-label only errors about that field (None: every error);
    ``drop_file``: the error is in a command-line value, not in the file the helper read."""
    try:
        yield
    except SailorError as exc:
        if only is None or exc.field == only:
            exc.field = field or exc.field
            exc.fix = fix or exc.fix
            exc.file = None if drop_file else exc.file
        raise


def check_options(model_name: str, seq_len: int | None) -> None:
    """Refuse what the search would only find out after minutes, or report in another command's terms."""
    with in_plan_terms(None, field="--model"):
        model = get_model(model_name)
    if seq_len is not None and seq_len != model.seq_len:
        raise SailorError(f"{model.name} is profiled (and planned) at sequence length {model.seq_len}, not {seq_len}",
                          field="--seq-len", fix=f"leave out --seq-len, or pass {model.seq_len}")


@dataclass(frozen=True)
class PlanSearch:
    """What ``sailor-hpc plan`` searches: the model on the site, the objective, the constraints and the GPUs."""

    site_file: Path
    model: str
    archive_path: Path | None = None
    gbs: int = DEFAULT_GBS
    seq_len: int | None = None
    dtype: str = "auto"
    objective: str = "throughput"
    constraints: Constraints = Constraints()
    available: str = "site"  # 'site', 'live' or 'PART=GPUS,...' (parse_available)
    space: str = "full"
    runtime: str = "megatron_patch"
    top_k: int = 5
    steps: int | None = None  # of the run (objective time) and of the --sbatch job
    time: TimeOptions = TimeOptions()


@dataclass(frozen=True)
class PlanOutputs:
    """What ``sailor-hpc plan`` writes besides its report: the best plan, a Pareto plot, the job that trains the
    best plan and its DeepSpeed config. ``data``/``save``/``train_args``/``skip_path_check`` are the job's;
    ``entry``/``entry_args``: the job runs the user's DeepSpeed script instead, with the best plan's config."""

    plan: Path | None = None
    pareto: Path | None = None
    sbatch: Path | None = None
    ds_config: Path | None = None
    data: str | None = None
    save: str | None = None
    train_args: tuple[str, ...] = ()
    train_values: Mapping[str, Any] = field(default_factory=dict)  # the training options, for --ds-config
    skip_path_check: bool = False
    as_json: bool = False
    entry: Path | None = None
    entry_args: tuple[str, ...] = ()

    def plan_path(self) -> Path | None:
        """Where the best plan goes: -o, else <script>.plan.json next to the --sbatch script."""
        if self.plan is None and self.sbatch is not None:
            return self.sbatch.with_name(f"{self.sbatch.stem}.plan.json")
        return self.plan


def _sbatch_job(query: PlanSearch, out: PlanOutputs) -> JobOptions | None:
    """The --sbatch job's options, checked before the search, not after it (plan has no --dry-run)."""
    plan_path = out.plan_path()
    if out.entry is None and out.entry_args:
        raise SailorError(f"arguments after -- ({' '.join(out.entry_args)}) are a user script's, given with --entry",
                          field="--entry", fix="add --runtime deepspeed --sbatch FILE --entry SCRIPT")
    if out.entry is not None and out.sbatch is None:
        raise SailorError("--entry is the script of the --sbatch job", field="--entry", fix="add --sbatch FILE")
    if out.sbatch is None or plan_path is None:
        return None
    steps = query.steps or DEFAULT_STEPS
    runtime = "deepspeed" if query.runtime == "deepspeed" else "megatron_patch"
    if out.entry is not None:  # the config's path names its content, known once the best plan is: see run_planner
        script = entry_script(out.entry, out.skip_path_check, data=out.data, save=out.save)
        work = UserEntry(script, plan_path.absolute().with_suffix(".ds_config.json"), out.entry_args)
        warn_interpreter(sys.executable, USER_ENTRY_MODULES)
        return JobOptions(plan_path=plan_path.absolute(), work=work, steps=steps, runtime=runtime)
    job = job_work(out.data, out.save, None, steps, dry_run=False, skip=out.skip_path_check)
    if isinstance(job, Training):
        check_checkpoints(query.model, {"--save": str(job.save)})
    warn_interpreter(sys.executable, RUNTIME_MODULES[runtime])  # the job runs this interpreter (a script only)
    return JobOptions(plan_path=plan_path.absolute(), work=job, steps=steps, train_args=out.train_args,
                      runtime=runtime)


def run_planner(query: PlanSearch, out: PlanOutputs) -> None:
    """Plan on the site's GPUs or the queue (:func:`planner.on_queue.plan_on_state`), write what ``out`` asks
    for, report."""
    site = load_site(query.site_file)
    check_options(query.model, query.seq_len)
    from_tokens = query.objective == "time" and query.steps is None and query.time.tokens is not None
    if from_tokens:  # the job trains the steps the plan's finish was computed for
        query = replace(query, steps=run_steps(None, query.time, query.model, query.gbs, query.seq_len))
    if out.ds_config is not None and query.runtime != "deepspeed":
        raise SailorError("--ds-config writes the config of a plan DeepSpeed's engine runs", field="--ds-config",
                          fix="add --runtime deepspeed")
    job = _sbatch_job(query, out)
    output = out.plan_path()
    with in_plan_terms("--archive", field="--profiles",
                       fix="pass --profiles FILE, set SAILOR_PROFILES, or reinstall to get the embedded default"):
        archive = open_archive(query.archive_path, site)
    objective, steps, top_k = query.objective, query.steps, query.top_k
    terms, snapshot, test_only = (time_terms(site, query.model, query.gbs, query.seq_len,
                                             None if from_tokens else steps, query.time)
                                  if objective == "time" else (None, None, None))
    state = QueueState(parse_available(query.available, site), snapshot, test_only)

    def request_for(available: dict[str, int], goal: TimeGoal | None) -> PlanRequest:
        return PlanRequest(model=query.model, global_batch_size=query.gbs, objective=objective,
                           constraints=query.constraints, available=available, seq_len=query.seq_len,
                           dtype=query.dtype, space=query.space, runtime=query.runtime, top_k=top_k, time_goal=goal)

    as_json, runtime, space = out.as_json, query.runtime, query.space
    sbatch_out, ds_config_out, pareto = out.sbatch, out.ds_config, out.pareto
    bar = _ProgressBar() if not as_json and sys.stderr.isatty() else None
    try:  # objective time: the plans shown ranked again on Slurm's own answers
        result = plan_on_state(site, archive, state, request_for, terms, top_k=top_k, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    request, goal = result.request, result.request.time_goal
    best = result.candidates[0]
    if ds_config_out is not None:  # refused (schedule, optimizer) before any file is written
        write_ds_config(ds_config_out, best.plan, out.train_values, steps or DEFAULT_STEPS)
    if job is not None and sbatch_out is not None:
        if goal is not None:
            job = timed_job(job, result, best)
        plan_file = Path(job.plan_path)
        config: tuple[Path, str] | None = None
        if isinstance(job.work, UserEntry):  # refused (engine, schedule, optimizer) before any file is written
            config = ds_config_file(best.plan, dict(out.train_values), job.steps, sbatch_out.parent, plan_file.stem)
            job = replace(job, work=replace(job.work, ds_config=config[0]))
        with ExitStack() as undo:  # no script: no plan file or config left behind for it either
            undo.enter_context(removed_on_error(plan_file))
            best.plan.save(plan_file)
            if config is not None:
                undo.enter_context(removed_on_error(config[0]))
                atomic_write_text(*config)
            script = render_job_script(best.plan, site, job)
        write_job_script(sbatch_out, script)
        if config is not None and not as_json:
            click.echo(f"its DeepSpeed config for --entry written to {config[0]} (the job reads it)")
    elif output is not None:
        best.plan.save(output)
    if pareto is not None:
        if goal is not None:
            plot_time_pareto(result, pareto)
        else:
            plot_pareto(result, pareto, site.cost_unit)
    shown = result.candidates[:top_k]
    if as_json:
        timing = time_json(result, shown) if goal is not None else {}
        echo_json({**timing, "plans": [_plan_json(c, site) for c in shown], "search_time_s": result.search_time_s,
                   "allocations_scored": result.allocations_scored, "plans_simulated": result.plans_simulated,
                   "output": str(output) if output else None, "sbatch": str(sbatch_out) if sbatch_out else None})
        return
    click.echo(f"{request.model} on {site.name}: global batch {request.global_batch_size}, objective "
               f"{objective}, space {space}; searched in {result.search_time_s:.2f} s "
               f"({result.allocations_scored} allocations scored, {result.plans_simulated} plans simulated)")
    click.echo(plan_table(shown, site.cost_unit))
    if site.clusters:
        click.echo(_clusters_table(shown, site))
    if goal is not None:
        echo_time(result, shown)
    if output is not None:
        click.echo(f"best plan written to {output}")
    if sbatch_out is not None and job is not None:
        given = ("--tokens" if from_tokens else "--steps" if query.steps
                 else f"the default of --steps, {DEFAULT_STEPS}")
        click.echo(f"its sbatch script written to {sbatch_out}; the job trains {job.steps} steps ({given})")
    if runtime == "deepspeed":
        click.echo(f"ZeRO stage of the best plan: {zero_stage_of(best.plan)}"
                   + (f"; its DeepSpeed config written to {ds_config_out}" if ds_config_out is not None else ""))


def _clusters_table(shown: list[Any], site: Site) -> str:
    """Per plan: GPUs taken in each cluster (one job each) and what crossing between them costs."""
    names = [c.name for c in site.clusters]
    rows = [(i + 1, *(gpus_per_cluster(c.plan, site).get(n, 0) for n in names),
             f"{c.result.egress_bytes / 1e9:.3g}", f"{c.result.egress_cost:.4g}",
             f"{c.result.cost_per_iteration:.4g}") for i, c in enumerate(shown)]
    return "\n" + table(("#", *(f"GPUs {n}" for n in names), "GB between clusters/iter",
                          f"egress {site.cost_unit}/iter", f"total {site.cost_unit}/iter"), rows)


def _plan_json(c: Any, site: Site) -> dict[str, Any]:
    r = c.result
    return {"gpus_per_cluster": gpus_per_cluster(c.plan, site) if site.clusters else {},
            "egress_bytes_per_iteration": r.egress_bytes, "egress_cost_per_iteration": r.egress_cost,
            "plan": c.plan.to_dict(), "iteration_time_s": r.iteration_time_s,
            "throughput_samples_per_s": r.throughput_samples_per_s, "tokens_per_s": r.tokens_per_s,
            "cost_per_hour": r.cost_per_hour, "cost_per_iteration": r.cost_per_iteration,
            "peak_memory_bytes": r.peak_memory_bytes, "memory_by_gpu_type": r.memory_by_gpu_type(),
            "gpus": c.plan.gpus_by_type()}


class _ProgressBar:
    """A click progress bar fed by the search's (done, total) callbacks."""

    def __init__(self) -> None:
        self._bar: Any = None
        self._shown = 0

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            self._bar = click.progressbar(length=total, label="searching", file=sys.stderr)
            self._bar.__enter__()
        step = min(done, total) - self._shown
        if step > 0:
            self._bar.update(step)
            self._shown += step

    def close(self) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
