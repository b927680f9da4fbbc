"""``sailor-hpc profile``: measure a model and the network of a site with profiling jobs (submitit), or with
processes on this machine (``--local``)."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import click

from profiler.keys import device_key
from profiler.sites import measured_site
from profiler.sweep import SweepConfig, SweepInterrupted, checked, run_sweep
from sailor_hpc.cli.app import main
from sailor_hpc.cli.interrupts import jobs_left_running, this_command_with
from sailor_hpc.cli.output import echo_json, json_option, table
from sailor_hpc.cli.preflight import RUNTIME_MODULES, JobNeeds, check_before_queue, skip_runtime_check_option
from sailor_hpc.cli.site_files import write_site_file, written_json, written_lines
from sailor_hpc.core.archive import read_archive
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import get_model
from sailor_hpc.core.site import load_site


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SailorError(f"{text!r} is not a comma-separated list of integers", field=flag, fix="e.g. 1,2,4") from None
    if not values or any(v <= 0 for v in values):
        raise SailorError(f"{text!r} must list positive integers", field=flag, fix="e.g. 1,2,4")
    return values


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip()) if text else ()


@main.command("profile")
@click.option("--site", "site_file", type=click.Path(dir_okay=False, path_type=Path), required=True)
@click.option("--model", required=True, help="Model to profile (catalog name; `sailor-hpc models` lists them).")
@click.option("--partitions", default=None, help="Comma-separated partitions (default: all of the site).")
@click.option("--mbs", default="1,2,4,8", show_default=True, help="Micro-batch sizes.")
@click.option("--tp", default="1,2,4", show_default=True, help="TP degrees (those that fit a node).")
@click.option("--archive", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Archive to merge into (default: the site's shared archive; required with --cpu).")
@click.option("--cpu", is_flag=True, help="Measure on CPU (test clusters): recorded under cpu-<GPU type>.")
@click.option("--local", is_flag=True,
              help="No Slurm: measure on this machine, one point at a time, as local processes (links between "
                   "nodes are skipped).")
@click.option("--network", default="intra,inter,between", show_default=True,
              help="Network measurements: any of intra,inter,between, or none.")
@click.option("--no-compute", is_flag=True, help="Only the network jobs.")
@click.option("--net-senders", default="1,2,4", show_default=True, help="GPUs sending at once (k).")
@click.option("--net-sizes", default=None, help="Message sizes as log2 bytes, e.g. 16,20,24 (default by device).")
@click.option("--dtype", default="fp32", show_default=True)
@click.option("--blocks", type=int, default=None, help="Transformer blocks measured (default 2; the rest copy the last).")
@click.option("--iters", type=int, default=20, show_default=True, help="Timed repetitions per point, at least.")
@click.option("--min-time", "min_time_s", type=click.FloatRange(min=0.0), default=1.0, show_default=True,
              help="Seconds of timed work per point, at least (more repetitions where one is short).")
@click.option("--warmup", type=int, default=3, show_default=True,
              help="Untimed repetitions, at least (a GPU runs them until its repetition time is steady).")
@click.option("--points-per-job", type=int, default=1, show_default=True,
              help="Micro-batch sizes measured by one array element (more: fewer start-ups, coarser failures).")
@click.option("--time", "time_min", type=int, default=30, show_default=True, help="Time limit per job (minutes).")
@click.option("--begin", default=None, help="Start the jobs later (sbatch --begin, e.g. now+1hour).")
@click.option("--folder", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Job files and sweep state, on a filesystem the nodes see (default ./sailor-profile/<site>-<model>).")
@click.option("--python", default=sys.executable, show_default=True, help="Interpreter on the compute nodes.")
@click.option("--timeout", "timeout_s", type=float, default=None, help="Give up (cancel open jobs) after this many s.")
@click.option("--lost-after", type=float, default=120.0, show_default=True,
              help="Seconds a job may be unknown to squeue and sacct before it counts as lost.")
@click.option("--poll", "poll_s", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Seconds between looks at Slurm while the jobs run.")
@click.option("--resume", is_flag=True, help="Complete a partial sweep: skip what the archive has, re-attach to jobs.")
@click.option("--runtime", type=click.Choice(["megatron_patch", "deepspeed"]), default="megatron_patch",
              show_default=True, help="deepspeed: also measure DeepSpeed's engine costs per step and micro-batch at "
                                      "TP 1 (ZeRO 0-3, its pipeline engine), which `plan/simulate --runtime "
                                      "deepspeed` add to the layers.")
@click.option("--write-site", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the site with the measured network fits, the archive (and cpu- GPU types with --cpu): "
                   "an edit of --site that keeps its comments; prints every field it changed. May be --site itself.")
@skip_runtime_check_option
@json_option
def profile_cmd(site_file: Path, model: str, partitions: str | None, mbs: str, tp: str, archive: Path | None,
                cpu: bool, local: bool, network: str, no_compute: bool, net_senders: str, net_sizes: str | None, dtype: str,
                blocks: int | None, iters: int, min_time_s: float, warmup: int, points_per_job: int, time_min: int,
                begin: str | None,
                folder: Path | None, python: str, timeout_s: float | None, lost_after: float, poll_s: float,
                resume: bool, runtime: str, write_site: Path | None, skip_runtime_check: bool, as_json: bool) -> None:
    """Profile MODEL on the site's partitions with Slurm jobs (or, with --local, processes on this machine)
    and merge the results into the archive.

    Exit code 0 when every point and link was measured, 1 when some failed (each is reported and
    recorded; run again with --resume to complete the sweep), 2 for bad input or a compute side that cannot
    measure (no srun, no torch: the sweep stops at the first such job), 130 after Ctrl-C (the jobs keep
    running unless a second Ctrl-C cancels them).
    """

    site = load_site(site_file)
    name = get_model(model).name
    if archive is None:
        if cpu:
            raise SailorError("a CPU sweep needs an archive of its own", field="--archive",
                              fix="pass --archive PATH (not the site's shared archive)")
        if not site.archive:
            raise SailorError("the site has no shared archive to write into", file=site.source,
                              field="profiles.archive", fix="set [profiles].archive in the site or pass --archive")
        archive = Path(site.archive)
    kinds = () if network.strip().lower() == "none" else _names(network)
    sizes = tuple(2 ** e for e in _ints(net_sizes, "--net-sizes")) if net_sizes else ()
    cfg = SweepConfig(site=site, model=name, archive=archive, partitions=_names(partitions), mbs=_ints(mbs, "--mbs"),
                      tp=_ints(tp, "--tp"), cpu=cpu, compute=not no_compute, network=kinds,
                      senders=_ints(net_senders, "--net-senders"), sizes=sizes, dtype=dtype, blocks=blocks,
                      warmup=warmup, iters=iters, min_time_s=min_time_s, time_min=time_min, begin=begin,
                      folder=folder or Path("sailor-profile") / f"{site.name}-{name}", python=python,
                      points_per_job=points_per_job, timeout_s=timeout_s, lost_after_s=lost_after, poll_s=poll_s,
                      resume=resume, local=local, deepspeed=runtime == "deepspeed")
    if not local:  # jobs need the runtime extra (submitit starts them), a network-only sweep torch alone
        checked(cfg)  # the input first, then the environment
        modules = ("submitit", *(("torch",) if no_compute else RUNTIME_MODULES[runtime]))
        check_before_queue(JobNeeds(site=site, partitions=cfg.part_names, python=python, modules=modules,
                                    archive=archive, skip_runtime_check=skip_runtime_check,
                                    submitit=True))
    try:
        report = run_sweep(cfg)
    except SweepInterrupted as stop:
        jobs_left_running(stop.jobs, finish=this_command_with("--resume"))
    written: list[str] = []
    doc = report.to_dict()
    if write_site is not None:  # the site as measured, with the archive its profiles are in
        measured = replace(measured_site(site, read_archive(report.archive), cpu=cpu), archive=str(report.archive))
        renamed = {n: device_key(n, cpu) for n in site.gpu_types}
        changes = write_site_file(write_site, site_file, measured, renamed_gpu_types=renamed)
        written = written_lines(write_site, site_file, changes)
        doc["site_written"] = written_json(write_site, site_file, changes)
    if as_json:
        echo_json(doc)
    else:
        rows = [(u.key, u.status, u.job_id or "-", u.reason or "-") for u in report.units]
        click.echo(table(("unit", "status", "job", "note"), rows))
        counts = report.to_dict()["counts"]
        click.echo(f"{report.archive}: {', '.join(f'{v} {k}' for k, v in sorted(counts.items()))} "
                   f"in {report.seconds:.0f} s" + ("" if report.complete else "; run again with --resume to complete"))
        for line in written:
            click.echo(line)
    if not report.complete:
        raise SystemExit(1)
