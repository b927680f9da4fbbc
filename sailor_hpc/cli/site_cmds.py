"""``sailor-hpc site ...``: validate, show and discover site configs."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from sailor_hpc.cli.app import main
from sailor_hpc.cli.output import echo_json, human_bytes, json_option, table
from sailor_hpc.cli.site_files import write_site_file, written_json, written_lines
from sailor_hpc.core.atomic import atomic_write_text
from sailor_hpc.core.sailor_compat import SAILOR_DATA
from sailor_hpc.core.sailor_compat.multizone import HEADER, multizone_site
from sailor_hpc.core.site import Site, load_site, load_site_dict
from sailor_hpc.core.toml_writer import dump_toml
from sailor_hpc.slurm.discover import discover, refresh_site_doc


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
             f"{p.cost_per_gpu_hour:g}", "yes" if p.inter_node else "no")
            for p in s.partitions]
    head = f"site {s.name} ({s.source or 'discovered'}); profiles: {s.archive or 'embedded default'}"
    text = head + "\n" + table(("partition", "gpu", "gres", "nodes", "gpus/node", "gpus", "memory/gpu",
                                "max nodes/job", "max time", f"cost/GPU-h ({s.cost_unit})", "network fits"), rows)
    return text + _describe_clusters(s)


def _describe_clusters(s: Site) -> str:
    """Clusters, islands and the links between them (nothing on a one-cluster site without islands)."""
    out = ""
    if s.clusters:
        cluster_rows = [(c.name, f"-M {c.slurm_cluster}" if c.slurm_cluster else (f"SLURM_CONF={c.slurm_conf}"
                                                                                 if c.slurm_conf else "default Slurm"),
                         ", ".join(p.name for p in s.partitions if p.cluster == c.name),
                         sum(p.total_gpus for p in s.partitions if p.cluster == c.name)) for c in s.clusters]
        out += "\n\n" + table(("cluster", "reached by", "partitions", "gpus"), cluster_rows)
    islands = sorted({(p.cluster, p.island) for p in s.partitions if p.island})
    if islands:
        island_rows = [(i, c or "-", ", ".join(p.name for p in s.partitions if p.island == i)) for c, i in islands]
        out += "\n\n" + table(("island", "cluster", "partitions"), island_rows)
    links = [(kind, " - ".join(sorted(pair)), t, s.links.cost_per_gb.get(pair) if kind == "clusters" else None)
             for kind, tables in (("islands", s.links.islands), ("clusters", s.links.clusters))
             for pair, t in sorted(tables.items(), key=lambda kv: sorted(kv[0]))]
    if links:
        link_rows = [(kind, pair, f"{max(f.peak_bytes_per_s for f in t.fits.values()) / 1e9:.3g}",
                      f"{t.latency_s * 1e6:g}", "-" if price is None else f"{price:g}")
                     for kind, pair, t, price in links]
        out += "\n\n" + table(("link", "between", "peak GB/s", "latency µs", f"cost/GB ({s.cost_unit})"), link_rows)
    return out


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
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the TOML here. An existing site file is updated with what Slurm says of its partitions "
                   "(nodes, GPUs, CPUs, memory, limits) and the partitions it lacks; its comments and everything "
                   "else its author chose (names, GPU types, costs, archive, network) are kept.")
@click.option("--name", default=None, help="Site name (default: Slurm's ClusterName).")
@json_option
def discover_cmd(output: Path | None, name: str | None, as_json: bool) -> None:
    """Build a site config from sinfo/scontrol of the cluster this runs on. What it had to guess (GPU types
    from gres names, costs) is printed as notes, with the field to edit, and written as comments on top."""

    found = discover(name)
    doc = found.site
    for note in found.notes:
        click.echo(f"note: {note}", err=True)
    load_site_dict(doc, source="<discovered>")  # the discovered site must validate
    if output is not None and output.exists():
        _refresh(output, doc, name, as_json)
        return
    text = found.toml()  # the notes also as comments on top of the file
    if output is not None:
        atomic_write_text(output, text)
    if as_json:
        echo_json(doc)
    elif output is None:
        click.echo(text, nl=False)
    else:
        parts = ", ".join(f"{p['name']} ({p['nodes']} x {p['gpus_per_node']} {p['gpu_type']})" for p in doc["partitions"])
        click.echo(f"wrote {output}: site {doc['name']!r}, partitions {parts}"
                   + (f"; review the {len(found.notes)} note(s) above (also on top of the file)" if found.notes else ""))


def _refresh(output: Path, found: dict[str, Any], name: str | None, as_json: bool) -> None:
    """Update the existing site ``output`` with what discovery found (an edit that keeps its text)."""
    old = load_site(output)
    doc, notes = refresh_site_doc(old.to_dict(), found)
    if name is not None:
        doc["name"] = name
    for note in notes:
        click.echo(f"note: {note}", err=True)
    new = load_site_dict(doc, source=output)
    changes = write_site_file(output, output, new)
    if as_json:
        echo_json({**written_json(output, output, changes), "notes": notes})
    else:
        click.echo("\n".join(written_lines(output, None, changes)))


@site.command("import-sailor-multizone")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Write the site TOML here.")
@click.option("--gpus-per-zone", type=click.IntRange(min=4), default=128, show_default=True,
              help="A100-40 GPUs in each zone (a multiple of 4; Sailor's traces use 32, 80 and 128).")
def import_multizone_cmd(output: Path, gpus_per_zone: int) -> None:
    """Write Sailor's multi-zone setting (5 GCP zones, measured links, egress prices) as a site."""
    if gpus_per_zone % 4:
        raise click.BadParameter(f"{gpus_per_zone} is not a multiple of 4 (GPUs per VM)", param_hint="--gpus-per-zone")
    doc = multizone_site(SAILOR_DATA, gpus_per_zone)
    load_site_dict(doc, source="<sailor multizone>")  # what we write must validate
    atomic_write_text(output, dump_toml(doc, HEADER))
    click.echo(f"wrote {output}")


from sailor_hpc.cli import site_doctor  # noqa: E402,F401  (registers "site doctor" on the group above)
