"""``sailor-hpc site doctor SITE``: check the site file against the compute nodes, one short job per partition
(:mod:`sailor_hpc.jobs.site_check`), list every mismatch with its fix (exit 2), and optionally write a site
file with the measured values (``--write-site``)."""
from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from sailor_hpc.cli.output import echo_json, json_option, table
from sailor_hpc.cli.site_cmds import site
from sailor_hpc.cli.site_files import write_site_file, written_json, written_lines
from sailor_hpc.core.atomic import atomic_write_text
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.site import Site, load_site
from sailor_hpc.jobs.render import cluster_submit_env
from sailor_hpc.jobs.site_check import Finding, PartitionCheck, Token, check_partition, measured_site, run_node_job
from sailor_hpc.slurm import safety
from sailor_hpc.slurm.container import path_inside
from sailor_hpc.slurm.discover import check_reachable
from sailor_hpc.slurm.partition_view import slurm_partitions, slurm_version

TOKEN_PREFIX = ".sailor-doctor-"


@site.command("doctor")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--partitions", default=None, help="Comma-separated partitions to check (default: all of the site's).")
@click.option("--python", default=None,
              help="The jobs' interpreter (default: this one's path; with a container, the image's at that path).")
@click.option("--checkpoints", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The folder runs save checkpoints to, checked to be shared with the nodes (default: this folder).")
@click.option("--write-site", "write_site", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the site file with the measured values here (an edit of FILE; FILE itself is allowed).")
@json_option
def doctor_cmd(file: Path, partitions: str | None, python: str | None, checkpoints: Path | None,
               write_site: Path | None, as_json: bool) -> None:
    """Check a site file against its compute nodes: one job of seconds per partition reports the GPUs a rank
    sees, driver/CUDA/torch/NCCL versions, the network interfaces NCCL would use and whether the archive's and
    the checkpoints' folders are shared, beside Slurm's gres, CPUs and memory. Exit 2 on any mismatch."""
    s = load_site(file)
    names = [p.strip() for p in partitions.split(",") if p.strip()] if partitions else [p.name for p in s.partitions]
    parts = [s.partition(n) for n in names]  # an unknown name is refused with the site's partitions
    python = safety.quoted_python_exe(python or sys.executable)
    folders = [("--checkpoints", (checkpoints or Path.cwd()).expanduser().absolute())]
    if s.archive:
        folders.insert(0, ("profiles.archive", Path(s.archive).parent))
    clusters: list[dict[str, Any]] = []  # per cluster: Slurm's version and the GPU gres its nodes offer
    checks: list[PartitionCheck] = []
    tokens, site_findings = _write_tokens(s, folders)
    try:
        for cluster in dict.fromkeys(p.cluster for p in parts):
            env = cluster_submit_env(s, cluster, os.environ) if cluster else None
            check_reachable(env)
            version = slurm_version(env)
            mine = [p for p in parts if p.cluster == cluster]
            slurm = slurm_partitions([p.name for p in mine], env)
            for p in mine:
                facts, error = (run_node_job(s, p, slurm[p.name], python, tokens, env)
                                if slurm[p.name] is not None else (None, None))
                checks.append(check_partition(s, p, slurm[p.name], facts, error, tokens))
            gres = {spec for sp in slurm.values() if sp is not None for spec in sp.gpu_gres}
            clusters.append({"cluster": cluster or None, "slurm_version": version, "gpu_gres": sorted(gres)})
    finally:
        for t in tokens:
            Path(t.path).unlink(missing_ok=True)
    findings = site_findings + [f for c in checks for f in c.findings]
    written = None
    if write_site is not None:
        written = write_site_file(write_site, file, measured_site(s, checks))
    if as_json:
        echo_json({"site": str(file), "slurm": clusters, "container": s.container.to_dict() if s.container else None,
                   "partitions": [c.to_dict() for c in checks], "findings": [f.__dict__ for f in findings],
                   "written": written_json(write_site, file, written) if write_site and written is not None else None})
    else:
        click.echo(_report(s, clusters, checks, findings))
        if write_site is not None and written is not None:
            click.echo("\n".join(written_lines(write_site, file, written)))
    _verdict(s, findings, write_site)


def _write_tokens(s: Site, folders: Sequence[tuple[str, Path]]) -> tuple[list[Token], list[Finding]]:
    """A token file in each folder the nodes must share (its name and text unique to this check)."""
    tokens, findings = [], []
    for field, folder in folders:
        text = uuid.uuid4().hex
        path = folder / f"{TOKEN_PREFIX}{text}"
        try:
            atomic_write_text(path, text + "\n")
        except OSError as exc:
            findings.append(Finding("", field, f"cannot write a file into {folder} here: {exc.strerror or exc}",
                                    "give a folder that exists and that you can write"))
            continue
        tokens.append(Token(field, str(folder), str(path), path_inside(s.container, str(path)), text))
    return tokens, findings


def _report(s: Site, clusters: Sequence[dict[str, Any]], checks: Sequence[PartitionCheck],
            findings: Sequence[Finding]) -> str:
    container = f"{s.container.runtime} {s.container.image}" if s.container else "none"
    slurm = "; ".join((f"cluster {c['cluster']}: " if c["cluster"] else "") + f"Slurm {c['slurm_version']}, GPU gres "
                      f"{', '.join(c['gpu_gres']) or 'none'}" for c in clusters)
    out = [f"site {s.name} ({s.source}); container: {container}; {slurm}"]
    for c in checks:
        facts = c.facts or {}
        host = facts.get("env", {}).get("SLURMD_NODENAME") or facts.get("host")
        out += ["", f"partition {c.partition}" + (f" (a rank on {host})" if host else ""),
                table(("", "site file", "measured"), c.rows) if c.rows else "  (not measured)"]
    out.append("")
    if not findings:
        out.append(f"ok: the site file matches the nodes of {', '.join(c.partition for c in checks)}")
    for f in findings:
        where = f" (partition {f.partition})" if f.partition and f"[{f.partition}]" not in f.field else ""
        out.append(f"mismatch: {f.field}{where}: {f.message} (fix: {f.fix})")
    return "\n".join(out)


def _verdict(s: Site, findings: Sequence[Finding], write_site: Path | None) -> None:
    """Exit 2 on a mismatch; with --write-site, only on one the written file could not take (a folder, a
    broken interpreter)."""
    left = [f for f in findings if write_site is None or f.value is None]
    if left:
        first = left[0]
        more = f" (and {len(left) - 1} more, listed above)" if len(left) > 1 else ""
        hint = "" if write_site is not None or first.value is None else "; or write the measured values with --write-site FILE"
        raise SailorError(f"the site file does not match the nodes: {first.message}{more}", file=s.source,
                          field=first.field, fix=first.fix + hint)
