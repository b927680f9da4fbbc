"""``sailor-hpc simulate`` and ``sailor-hpc validate-sim``: the simulator's command-line face."""
from __future__ import annotations

from pathlib import Path

import click

from sailor_hpc.cli.app import main
from sailor_hpc.cli.output import echo_json, human_bytes, json_option, memory_by_gpu_type_table, table
from sailor_hpc.core.archive import open_archive
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.site import load_site
from simulator import SimOptions, plan_timeline, simulate
from simulator.runtimes import RUNTIMES, STAGING_BYTES
from simulator.validation import validate_runs

site_option = click.option("--site", "site_file", required=True, type=click.Path(dir_okay=False, path_type=Path),
                           help="Site config (site_configs/*.toml).")
runtime_option = click.option(
    "--runtime", type=click.Choice(list(RUNTIMES)), default="megatron_patch", show_default=True,
    help="The runtime that runs the plan, simulated as it runs it: megatron_patch (this project's), "
         "deepspeed-pipe (DeepSpeed's pipeline engine, which produced Sailor's measured runs) or deepspeed (stock "
         "DeepSpeed: only plans its engine runs, with the plan's ZeRO stage; docs/deepspeed.md).")
profiles_option = click.option("--profiles", "profiles", type=click.Path(dir_okay=False, path_type=Path), default=None,
                               help="Profile archive (default: $SAILOR_PROFILES, the site's, then the embedded one).")


def _archive(profiles: Path | None, site):
    return open_archive(profiles, site)


@main.command("simulate")
@click.argument("plan_file", metavar="PLAN", type=click.Path(dir_okay=False, path_type=Path))
@site_option
@profiles_option
@click.option("--model", default=None, help="Model of a Sailor plan_config (they do not name it).")
@click.option("--timeline", "timeline_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the per-rank schedule of one iteration: a Gantt chart (.png) or its events (.json).")
@runtime_option
@click.option("--backend", type=click.Choice(list(STAGING_BYTES)), default="nccl", show_default=True,
              help="How the ranks communicate: nccl on GPUs; gloo where the runtime runs without CUDA (a CPU "
                   "lab), whose sends wait for their receiver, so every stage-to-stage transfer blocks.")
@json_option
def simulate_cmd(plan_file: Path, site_file: Path, profiles: Path | None, model: str | None,
                 timeline_file: Path | None, runtime: str, backend: str, as_json: bool) -> None:
    """Iteration time, throughput, peak memory per GPU and cost of PLAN (ours or a Sailor plan_config)."""
    options = SimOptions(runtime=runtime, backend=backend)

    site = load_site(site_file)
    plan = load_plan(plan_file, model=model, site=site)
    archive = _archive(profiles, site)
    try:
        res = simulate(plan, site, archive, options=options)
    except SailorError as exc:  # what the simulator finds wrong with the plan (seq_len, layers) is in PLAN
        if exc.file is None:
            exc.file = str(plan_file)
        raise
    if timeline_file is not None:
        if timeline_file.suffix.lower() not in (".png", ".json"):
            raise SailorError(f"cannot write a timeline as {timeline_file.suffix or 'a file without suffix'}",
                              field="--timeline", fix="name it *.png (chart) or *.json (events)")
        tl = plan_timeline(plan, site, archive, options=options)
        if timeline_file.suffix.lower() == ".json":
            tl.write_json(timeline_file)
        else:
            tl.write_png(timeline_file, title=timeline_title(plan, site.name, plan_file.name, res.iteration_time_s))
    if as_json:
        out = {"file": str(plan_file), "site": site.name, "archive": archive.where, "runtime": runtime,
               "backend": backend, "optimizer_impl": options.optimizer_impl, **res.to_dict()}
        if timeline_file is not None:
            out["timeline"] = str(timeline_file)
        echo_json(out)
        return
    click.echo(describe_result(res, str(plan_file), site.name))
    if timeline_file is not None:
        click.echo(f"timeline written to {timeline_file}")


def timeline_title(plan: Plan, site_name: str, plan_name: str, iteration_time_s: float) -> str:
    """What the chart shows, said in its title: the model, the plan (file, GPUs, pipelines), the iteration time."""
    return (f"{plan.model} on {site_name}, plan {plan_name} ({plan.gpus_label()}, {len(plan.pipelines)} "
            f"pipeline{'s' if len(plan.pipelines) > 1 else ''}): {iteration_time_s:.4g} s per iteration")


def describe_result(res, name: str, site_name: str) -> str:
    plan = res.plan
    lines = [f"{name} on {site_name}: {plan.model}, global batch {plan.global_batch_size}, {plan.num_gpus} GPUs, "
             f"{len(plan.pipelines)} pipeline(s), {plan.dtype}",
             f"iteration time   {res.iteration_time_s:.4f} s  (pipeline flush {res.breakdown['flush_s']:.4f} s, "
             f"gradient sync after flush {max(res.breakdown['sync_s'], 0.0):.4f} s, "
             f"optimizer {res.breakdown['optimizer_s']:.4f} s)",
             f"throughput       {res.throughput_samples_per_s:.2f} samples/s, {res.tokens_per_s:,.0f} tokens/s",
             f"peak memory      {human_bytes(res.peak_memory_bytes)} per GPU (max, device memory in use)  -> "
             + ("fits" if res.fits else "DOES NOT FIT"),
             f"peak allocated   {human_bytes(res.peak_allocated_bytes)} per GPU (max, torch's max_memory_allocated)",
             f"cost             {res.cost_per_iteration:.6g} {res.cost_unit} per iteration"
             + (f" (of which egress {res.egress_cost:.6g} {res.cost_unit}: {human_bytes(res.egress_bytes)} between "
                "clusters)" if res.egress_bytes else "")
             + f", {res.cost_per_hour:.6g} {res.cost_unit} per hour of GPUs", ""]
    rows = [(s.pipeline, s.stage, f"{s.first_layer}-{s.last_layer}", s.gpu_type, s.tp, f"{s.fwd_s * 1e3:.2f}",
             f"{s.bwd_s * 1e3:.2f}", f"{s.act_send_s * 1e3:.2f}", human_bytes(s.memory.total),
             human_bytes(float(s.memory.peak_allocated)), human_bytes(s.capacity_bytes), "yes" if s.fits else "NO")
            for s in res.stages]
    lines.append(table(("pipe", "stage", "layers", "gpu", "tp", "fwd ms", "bwd ms", "send ms", "memory", "allocated",
                        "capacity", "fits"), rows))
    lines.append("")
    lines.append(memory_by_gpu_type_table(res))
    return "\n".join(lines)


@main.command("validate-sim")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@site_option
@click.option("--model", required=True, help="Model the runs trained (e.g. OPT-350M).")
@profiles_option
@json_option
def validate_sim_cmd(paths: tuple[Path, ...], site_file: Path, model: str, profiles: Path | None,
                     as_json: bool) -> None:
    """Measured vs simulated time and memory of Sailor-format runs (files or folders), simulated as
    DeepSpeed's pipeline engine (the runtime that produced them)."""

    site = load_site(site_file)
    report = validate_runs(paths, site, model, _archive(profiles, site))
    if as_json:
        echo_json(report.to_dict())
        return
    click.echo(describe_report(report))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _num(x: float | None, scale: float = 1.0, fmt: str = "{:.4g}") -> str:
    return "-" if x is None else fmt.format(x / scale)


def describe_report(report) -> str:
    rows, notes = [], []
    for n, r in enumerate(report.rows, 1):
        mark = ""
        for what, why in (("time", r.time_excluded), ("memory", r.mem_excluded)):
            if why:
                mark += "t" if what == "time" else "m"
                notes.append(f"[{n}] {what} excluded: {why}")
        rows.append((n, r.file, _num(r.real_s), _num(r.est_s), _pct(r.time_err_pct), _num(r.real_mem_bytes, 2**30, "{:.2f}"),
                     _num(r.est_mem_bytes, 2**30, "{:.2f}"), _pct(r.mem_err_pct), mark or ""))
    out = [table(("#", "file", "real s", "est s", "err %", "real GiB", "est GiB", "err %", "excl"), rows), ""]
    s = report.summary()
    out.append(f"time error   mean {_pct(s['time_mape_pct'])} %  median {_pct(s['time_median_pct'])} %  "
               f"max {_pct(s['time_max_pct'])} %  over {s['time_files']} of {s['files']} files")
    out.append(f"memory error mean {_pct(s['mem_mape_pct'])} %  median {_pct(s['mem_median_pct'])} %  "
               f"max {_pct(s['mem_max_pct'])} %  over {s['mem_files']} of {s['files']} files")
    if notes:
        out.append("")
        out.extend(notes)
    return "\n".join(out)
