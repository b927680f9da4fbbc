"""Checks before a job is queued, shared by every command that submits (``profile``, ``submit``, ``run``).

A mistake found inside a job costs a queue wait and, for a sweep, GPUs that measured for nothing: an
archive the user cannot write, an interpreter without torch on the compute side, a checkpoint of another
model in ``--save``, a partition Slurm does not have. Each is looked at here, before anything is written or
queued, and refused as a :class:`SailorError` naming the thing and the fix (exit 2); a Slurm that does not
answer is :class:`~sailor_hpc.core.errors.SlurmUnavailable` (exit 3, try again later).

The compute side's interpreter is asked directly, where this machine sees it (a shared filesystem, as
Slurm sites have): it is started with a probe that looks the modules up with ``importlib.util.find_spec``,
which finds an install without importing it. Importing torch and megatron-core would take seconds of
every command, and a login node without the compute nodes' drivers is no judge of whether they import.
An interpreter only the compute nodes see is passed over with ``--skip-runtime-check`` (the job then
finds out). Commands that only render a job (``sbatch``, ``plan --sbatch``) get a warning instead, since
the script may be meant for another machine.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from sailor_hpc.core.checkpoint import MANIFEST, newest_usable, read_manifest
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import get_model
from sailor_hpc.core.paths import writable_dir
from sailor_hpc.core.site import Site
from sailor_hpc.jobs.render import cluster_submit_env
from sailor_hpc.slurm.container import rank_wrapper
from sailor_hpc.slurm.control import PROBE_WAIT_S, run_probe
from sailor_hpc.slurm.discover import check_reachable, missing_partitions

SKIP_RUNTIME_CHECK = "--skip-runtime-check"
PROBE_TIMEOUT_S = 60.0
#: what each way of training needs in the compute side's interpreter
RUNTIME_MODULES = {"megatron_patch": ("torch", "megatron.core"),
                   "deepspeed": ("torch", "megatron.core", "deepspeed"),
                   "auto": ("torch", "megatron.core", "deepspeed")}  # `run` may choose either
USER_ENTRY_MODULES = ("torch", "deepspeed")  # a user's DeepSpeed script beside the plan's ds_config.json
# prints the modules it cannot find; a parent package that is missing is a missing module too
_PROBE = """import importlib.util, sys
def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False
print(" ".join(m for m in sys.argv[1:] if not found(m)))"""


def skip_runtime_check_option(f: Any) -> Any:
    """The escape for an interpreter only the compute nodes see."""
    return click.option(SKIP_RUNTIME_CHECK, "skip_runtime_check", is_flag=True,
                        help="Do not check that --python has what the job needs (torch, megatron-core, DeepSpeed) "
                             "on this machine: for an interpreter only the compute nodes see.")(f)


@dataclass(frozen=True)
class JobNeeds:
    """What the jobs a command is about to queue need: partitions in Slurm, an interpreter with ``modules`` on
    the compute side, checkpoint directories that hold ``model``'s checkpoints or none, a writable archive."""

    site: Site
    partitions: tuple[str, ...]
    python: str
    modules: tuple[str, ...]
    model: str | None = None
    checkpoints: Mapping[str, str | None] = field(default_factory=dict)  # option -> directory
    archive: Path | None = None
    skip_runtime_check: bool = False
    submitit: bool = False  # the jobs are submitted through submitit (profile), which needs srun here


def check_before_queue(needs: JobNeeds) -> None:
    """Refuse (exit 2, or 3 for a Slurm that does not answer) what would fail only once the job runs.
    What this machine can tell is looked at first, Slurm last (an interpreter only the compute nodes see is
    asked of one of them, by a one-task job, once Slurm answers)."""
    if needs.archive is not None:
        check_archive(needs.archive)
    if needs.model is not None:
        check_checkpoints(needs.model, needs.checkpoints)
    # in a container, the interpreter at that path is the image's: this machine's file of that name is no judge
    not_here = needs.skip_runtime_check or needs.site.container is not None
    missing = None if not_here else missing_modules(needs.python, needs.modules)
    refuse_missing(needs.python, missing)
    check_slurm(needs.site, needs.partitions, submitit=needs.submitit)
    if not needs.skip_runtime_check and missing is None:
        refuse_missing(needs.python, missing_modules_on(needs.site, needs.partitions[0], needs.python, needs.modules))


def check_archive(archive: Path) -> None:
    """The archive's folder takes a real file of this user's (a read-only mount or another user's folder
    refuse it), named as the archive, not as the lock or shard file the sweep would fail on later."""
    path = archive.expanduser().absolute()
    try:
        writable_dir(path.parent, "--archive")
    except SailorError as exc:
        raise SailorError(f"the profile archive cannot be written: {exc.message}", file=path, field="--archive",
                          fix="pass --archive with a file in a folder you can write, or get write access to "
                              f"{path.parent}") from None


def check_checkpoints(model: str, directories: Mapping[str, str | None]) -> None:
    """Each directory (or checkpoint) holds checkpoints of ``model`` or none: the job would otherwise find a
    checkpoint of another model only after its queue wait."""
    name = get_model(model).name
    for option, directory in directories.items():
        if directory is None or not Path(directory).expanduser().is_dir():
            continue
        root = Path(directory).expanduser()
        newest = root if (root / MANIFEST).is_file() else newest_usable(root, deep=False).path
        if newest is None:
            continue
        found = read_manifest(newest).get("model")
        if found is not None and found != name:
            raise SailorError(f"holds a checkpoint of {found} ({newest.name}), not of {name}",
                              file=newest, field=option,
                              fix=f"give {option} a directory of {name}'s checkpoints or an empty one")


def missing_modules(python: str, modules: tuple[str, ...]) -> list[str] | None:
    """The modules ``python`` cannot find, or None when this machine does not see that interpreter."""
    exe = shutil.which(python)
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, "-c", _PROBE, *modules], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        raise SailorError(f"the interpreter did not answer within {PROBE_TIMEOUT_S:.0f} s", file=exe,
                          field="--python", fix=f"check it, or pass {SKIP_RUNTIME_CHECK}") from None
    except OSError as exc:
        raise SailorError(f"the interpreter cannot be started: {exc.strerror}", file=exe, field="--python",
                          fix="pass a Python interpreter with --python") from None
    return _probe_answer(proc, exe)


def missing_modules_on(site: Site, partition: str, python: str, modules: tuple[str, ...]) -> list[str]:
    """The modules ``python`` cannot find on a compute node of ``partition``, asked by a one-task job of a few
    seconds: for an interpreter this machine does not see."""
    cluster = site.partition(partition).cluster
    env = cluster_submit_env(site, cluster, os.environ) if cluster else None
    wrapper = rank_wrapper(site.container)
    proc = run_probe(partition, wrapper.command([python, "-c", _PROBE, *modules]), env, options=wrapper.srun_options)
    if "Unable to allocate resources" in proc.stderr or "Immediate execution impossible" in proc.stderr:
        raise SailorError(f"a one-task job on partition {partition} could not start within {PROBE_WAIT_S} s to check "
                          "the compute side's interpreter", file=python, field="--python",
                          fix=f"try again when a node is free, or pass {SKIP_RUNTIME_CHECK}")
    return _probe_answer(proc, python, where=f" on a node of partition {partition}")


def _probe_answer(proc: subprocess.CompletedProcess[str], exe: str, where: str = "") -> list[str]:
    if proc.returncode != 0:
        said = (proc.stderr.strip() or proc.stdout.strip() or "(no output)").splitlines()[-1]
        raise SailorError(f"is not a Python interpreter that runs{where} (exit {proc.returncode}: {said})",
                          file=exe, field="--python", fix="pass a Python interpreter with --python")
    return proc.stdout.split()


def _install_fix(python: str, missing: list[str]) -> str:
    what = "the runtime extra (pip install 'sailor-hpc[runtime]'" + (
        ", and deepspeed" if "deepspeed" in missing else "") + ")"
    return f"install {what} into {python}, or pass --python with an interpreter that has them"


def refuse_missing(python: str, missing: list[str] | None) -> None:
    """Refuse a job whose interpreter lacks modules it needs (None, unknown yet: nothing to refuse)."""
    if missing:
        raise SailorError(f"the job's interpreter has no {', '.join(missing)}: the job would fail at its start",
                          file=python, field="--python", fix=_install_fix(python, missing))


def warn_interpreter(python: str, modules: tuple[str, ...]) -> None:
    """For a job only rendered here: one warning when its interpreter lacks a module (it may be meant for
    another machine, so nothing is refused)."""
    missing = missing_modules(python, modules)
    if missing:
        click.echo(f"warning: the job script runs {python}, which has no {', '.join(missing)}: the job would "
                   f"fail at its start ({_install_fix(python, missing)})", err=True)


def check_slurm(site: Site, partitions: tuple[str, ...], *, submitit: bool = False) -> None:
    """Each cluster the partitions are on answers ``scontrol ping`` and has those partitions; the client tools
    are on PATH (:func:`~sailor_hpc.slurm.discover.check_reachable`)."""
    by_cluster: dict[str, list[str]] = {}
    for name in partitions:
        by_cluster.setdefault(site.partition(name).cluster, []).append(name)
    for cluster, names in by_cluster.items():
        env = cluster_submit_env(site, cluster, os.environ) if cluster else None
        check_reachable(env, submitit=submitit)
        if cluster and site.cluster(cluster).slurm_cluster and not site.cluster(cluster).slurm_conf:
            continue  # reached with sbatch -M: this scontrol shows another cluster's partitions
        missing = missing_partitions(names, env)
        if missing:
            where = f" (cluster {cluster})" if cluster else ""
            raise SailorError(f"Slurm{where} has no partition {', '.join(repr(n) for n in missing)}, which the site "
                              "names", file=site.source, field="partitions",
                              fix="correct the partition's name in the site file (sinfo -s lists Slurm's), or "
                                  "remove it; `sailor-hpc site discover` writes a site from Slurm")
