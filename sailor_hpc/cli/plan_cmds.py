"""``sailor-hpc plan validate``: check a plan (ours or Sailor's plan_config)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from planner import Constraints
from sailor_hpc.cli.app import main
from sailor_hpc.cli.output import echo_json, json_option, table
from sailor_hpc.cli.planning import DEFAULT_GBS, PlanOutputs, PlanSearch, run_planner
from sailor_hpc.cli.simulate_cmds import runtime_option
from sailor_hpc.cli.time_planning import pop_time_options, time_options
from sailor_hpc.cli.training_options import DATA_HELP, pop_training_args, skip_path_check_option, training_options
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.precision import DTYPES
from sailor_hpc.core.site import load_site
from sailor_hpc.core.training import FLAGS


def plan_rows(plan: Plan) -> list[tuple]:
    return [(i, p.micro_batch_size, p.num_micro_batches, j, f"{s.first_layer}-{s.last_layer}", s.tp, s.gpu_type,
             s.partition or "-", "-" if s.placement is None else f"node {s.placement.node} gpus {list(s.placement.gpus)}")
            for i, p in enumerate(plan.pipelines) for j, s in enumerate(p.stages)]


def describe_plan(plan: Plan) -> str:
    head = (f"{plan.model}: global batch {plan.global_batch_size}, {len(plan.pipelines)} pipeline(s), "
            f"{plan.num_gpus} GPUs {plan.gpus_by_type()}, {plan.dtype}")
    return head + "\n" + table(("pipe", "mbs", "micro-batches", "stage", "layers", "tp", "gpu", "partition",
                                "placement"), plan_rows(plan))


class _PlanGroup(click.Group):
    """``plan`` takes the arguments of the --sbatch job's --entry script after ``--``, as ``sbatch`` does; a group
    would read the first of them as a subcommand's name, so they are set aside before click parses the rest."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if "--" in args:
            cut = args.index("--")
            args, ctx.meta["entry_args"] = args[:cut], tuple(args[cut + 1:])
        return super().parse_args(ctx, args)


@main.group(name="plan", cls=_PlanGroup, invoke_without_command=True)
@click.option("--site", "site_file", type=click.Path(dir_okay=False, path_type=Path), help="Site TOML.")
@click.option("--model", "model_name", help="Model (catalog name or Sailor alias; `sailor-hpc models` lists them).")
@click.option("--profiles", "archive_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Profile archive (default: $SAILOR_PROFILES, the site's, then the embedded one).")
@click.option("--gbs", type=int, default=None, help="Global batch size (default: 1024).")
@click.option("--seq-len", type=int, default=None,
              help="Sequence length (default and only value: the model's, at which it is profiled).")
@click.option("--dtype", type=click.Choice(["auto", *DTYPES]), default="auto", show_default=True,
              help="Training precision; auto: the best the GPU types train in (bf16, then fp16, then fp32) among "
                   "those the archive has profiles of.")
@click.option("--objective", type=click.Choice(["throughput", "cost", "time"]), default="throughput", show_default=True,
              help="Rank plans by samples per second, by cost per sample, or by expected finish (queue wait + "
                   "--steps/--tokens of training + restarts; see docs/time-to-result.md).")
@click.option("--max-cost-per-hour", type=float, default=None, help="In the site's cost unit.")
@click.option("--max-cost-per-iteration", type=float, default=None, help="In the site's cost unit.")
@click.option("--min-throughput", type=float, default=None, help="Samples per second.")
@click.option("--max-gpus", type=click.IntRange(min=1), default=None, help="GPUs a plan may use at most.")
@click.option("--available", default="site", show_default=True,
              help="'site' (every GPU of the site), 'live' (whole idle nodes from sinfo) or "
                   "'PART=GPUS,PART=GPUS'.")
@click.option("--space", type=click.Choice(["full", "sailor", "homogeneous"]), default="full", show_default=True,
              help="Search space: everything, Sailor's plan shape, or one partition.")
@runtime_option
@click.option("--ds-config", "ds_config_out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --runtime deepspeed: also write the best plan's DeepSpeed config (ds_config.json: batch, "
                   "precision, ZeRO stage, clipping, optimizer and LR schedule from the training options).")
@click.option("--top", "top_k", type=click.IntRange(min=1), default=5, show_default=True, help="Plans to show.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the best plan here.")
@click.option("--pareto", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Plot the cost-throughput front of the simulated plans (PNG).")
@click.option("--sbatch", "sbatch_out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the sbatch script that trains the best plan (the plan goes to -o, "
                   "default <script>.plan.json next to it).")
@click.option("--entry", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --runtime deepspeed --sbatch: the job runs your own DeepSpeed script on every rank as "
                   "`python SCRIPT --deepspeed_config DS_CONFIG ARGS...` (ARGS: what follows --) with the best plan's "
                   "ds_config.json, written next to the script from the training options (as `sbatch --entry`).")
@click.option("--data", default=None, help="For the --sbatch job: " + DATA_HELP)
@click.option("--save", default=None, help="Checkpoint directory for the --sbatch job.")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="Training steps: of the run (objective time), of the --sbatch job (default 100).")
@time_options
@skip_path_check_option("--data and --save")
@training_options
@json_option
@click.pass_context
def plan_group(ctx: click.Context, site_file: Path | None, model_name: str | None, **opts: Any) -> None:
    """Search the best plans (sailor-hpc plan --site S --model M ...), or `plan validate`."""
    if ctx.invoked_subcommand is not None:
        return
    if site_file is None or model_name is None:
        if site_file is None and model_name is None:
            click.echo(ctx.get_help())
            return
        raise click.UsageError("plan needs both --site and --model")
    train_values = {f.dest: opts.get(f.dest) for f in FLAGS}  # for --ds-config
    train_args = tuple(pop_training_args(opts))  # checked before the search
    query = PlanSearch(site_file=site_file, model=model_name, archive_path=opts["archive_path"],
                       gbs=DEFAULT_GBS if opts["gbs"] is None else opts["gbs"], seq_len=opts["seq_len"],
                       dtype=opts["dtype"], objective=opts["objective"],
                       constraints=Constraints(opts["max_cost_per_hour"], opts["max_cost_per_iteration"],
                                               opts["min_throughput"], opts["max_gpus"]),
                       available=opts["available"], space=opts["space"], runtime=opts["runtime"],
                       top_k=opts["top_k"], steps=opts["steps"], time=pop_time_options(opts))
    out = PlanOutputs(plan=opts["output"], pareto=opts["pareto"], sbatch=opts["sbatch_out"],
                      ds_config=opts["ds_config_out"], data=opts["data"], save=opts["save"], train_args=train_args,
                      train_values=train_values, skip_path_check=opts["skip_path_check"], as_json=opts["as_json"],
                      entry=opts["entry"], entry_args=ctx.meta.get("entry_args", ()))
    run_planner(query, out)


@plan_group.command("validate")
@click.argument("plan_file", metavar="PLAN", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--model", default=None, help="Model of a Sailor plan_config (they do not name it).")
@click.option("--site", "site_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also check GPU types, partitions and placement against this site.")
@json_option
def validate_cmd(plan_file: Path, model: str | None, site_file: Path | None, as_json: bool) -> None:
    """Check PLAN's invariants (layers, samples, TP, GPUs); Sailor plan_configs are converted."""

    site = load_site(site_file) if site_file else None
    plan = load_plan(plan_file, model=model, site=site)
    if as_json:
        echo_json({"file": str(plan_file), "valid": True, "plan": plan.to_dict()})
    else:
        click.echo(f"{plan_file}: valid plan")
        click.echo(describe_plan(plan))
