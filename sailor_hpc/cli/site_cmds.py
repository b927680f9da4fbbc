"""``sailor-hpc site ...``: validate, show and discover site configs."""
from __future__ import annotations

from pathlib import Path

import click

from sailor_hpc.cli.app import main
from sailor_hpc.cli.output import echo_json, human_bytes, json_option, table
from sailor_hpc.core.atomic import atomic_write_text
from sailor_hpc.core.site import Site, load_site, load_site_dict
from sailor_hpc.slurm.discover import discover


@main.group()
def site() -> None:
    """Site configs (site_configs/*.toml)."""


@site.command("validate")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@json_option
def validate_cmd(file: Path, as_json: bool) -> None:
    """Check a site TOML; exit 2 with the offending field if it is wrong."""
    s = load_site(file)
    if as_json:
        echo_json({"file": str(file), "valid": True, "name": s.name, "partitions": [p.name for p in s.partitions]})
    else:
        click.echo(f"{file}: valid site {s.name!r} with {len(s.partitions)} partition(s), "
                   f"{sum(p.total_gpus for p in s.partitions)} GPUs")


def describe(s: Site) -> str:
    rows = [(p.name, p.gpu_type, p.gres, p.nodes, p.gpus_per_node, p.total_gpus,
             human_bytes(s.gpu(p.gpu_type).memory_bytes), p.max_nodes_per_job, p.max_walltime or "-",
             f"{p.cost_per_gpu_hour:g} {s.cost_unit}",
             "yes" if p.inter_node else "no")
            for p in s.partitions]
    head = f"site {s.name} ({s.source or 'discovered'}); profiles: {s.archive or 'embedded default'}"
    return head + "\n" + table(("partition", "gpu", "gres", "nodes", "gpus/node", "gpus", "memory/gpu",
                                "max nodes/job", "max time", "cost per GPU-hour", "network fits"), rows)


@site.command("show")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@json_option
def show_cmd(file: Path, as_json: bool) -> None:
    """Print a site's partitions, GPUs, limits and costs."""
    s = load_site(file)
    if as_json:
        echo_json(s.to_dict())
    else:
        click.echo(describe(s))


@site.command("discover")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Write the TOML here.")
@click.option("--name", default=None, help="Site name (default: Slurm's ClusterName).")
@json_option
def discover_cmd(output: Path | None, name: str | None, as_json: bool) -> None:
    """Build a site config from sinfo/scontrol of the cluster this runs on."""

    found = discover(name)
    doc = found.site
    for note in found.notes:
        click.echo(f"note: {note}", err=True)
    load_site_dict(doc, source="<discovered>")  # the discovered site must validate
    text = found.toml()  # the notes also as comments on top of the file
    if output is not None:
        atomic_write_text(output, text)
    if as_json:
        echo_json(doc)
    elif output is None:
        click.echo(text, nl=False)
    else:
        click.echo(f"wrote {output}")
