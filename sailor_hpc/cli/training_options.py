"""The training-run options of ``sailor-hpc run``, ``sbatch``, ``submit`` and ``plan --sbatch``.

They are ``sailor_hpc.core.training``'s table (the one ``megatron_patch.launch`` parses), so every
command documents and checks them alike and hands the ones a user gave to the job as launch arguments;
what was not given is left to the runtime's default.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.training import FLAGS, DataBlend, check_dataset_prefix, launch_args
from sailor_hpc.jobs.options import DryRun, Training
from sailor_hpc.jobs.render import check_job_dir, check_training_args

DATA_HELP = ("Dataset prefix (PREFIX.bin/.idx) the ranks train on, or a blend of prefixes with weights as one "
             "argument: '0.7 PREFIX_A 0.3 PREFIX_B' (as Megatron's data path).")


def training_options(f: Any) -> Any:
    """Add every option of the table (default None: not given, the runtime's default applies)."""
    for flag in reversed(FLAGS):
        kind = click.Choice(flag.choices) if flag.choices else flag.type
        default = "" if flag.default is None else f" [runtime default: {flag.default}]"
        f = click.option(flag.flag, flag.dest, type=kind, default=None, help=f"{flag.help[0].upper()}{flag.help[1:]}."
                         + default)(f)
    return f


def pop_training_args(kw: dict[str, Any]) -> list[str]:
    """Take the table's options out of a command's keyword arguments; the launch arguments they make."""
    return launch_args({f.dest: kw.pop(f.dest, None) for f in FLAGS})


def absolute_blend(data: str) -> str:
    """``--data`` with absolute prefixes (a job runs elsewhere); missing files are refused now, not in the job."""
    blend = DataBlend.parse(data)
    prefixes = [str(Path(p).expanduser().absolute()) for p in blend.prefixes]
    for prefix in prefixes:
        check_dataset_prefix(prefix)
    return blend.with_prefixes(prefixes).text()


SKIP_PATH_CHECK = "--skip-path-check"


def skip_path_check_option(paths: str) -> Any:
    """The flag, its help naming the command's own path options (``paths``)."""
    return click.option("--skip-path-check", "skip_path_check", is_flag=True,
                        help=f"Do not check {paths} on this machine: they are paths only the compute nodes see "
                             "(the job then finds out).")


def job_paths(data: str | None, save: str | None, load: str | None, *,
              skip: bool) -> tuple[str | None, str | None, str | None]:
    """``--data``, ``--save`` and ``--load`` of a job rendered or submitted here, as the job will read them:
    absolute (the job starts in another directory, on another machine) and checked now (dataset files
    exist, the checkpoint directory can be created and written, the checkpoint to load exists), so a typo
    is refused before the job waits in the queue. ``skip``: as given, for paths only compute nodes see."""
    if skip:
        return data, save, load
    try:
        data = absolute_blend(data) if data is not None else None
        save = str(check_job_dir(save, "--save")) if save is not None else None
        if load is not None:
            target = Path(load).expanduser().absolute()
            if not target.exists():
                raise SailorError("no checkpoint (or checkpoint root) here", file=target, field="--load",
                                  fix="check the path")
            load = str(target)
    except SailorError as exc:
        exc.fix = f"{exc.fix + '; ' if exc.fix else ''}or pass {SKIP_PATH_CHECK} if only the compute nodes see it"
        raise
    return data, save, load


def job_work(data: str | None, save: str | None, load: str | None, steps: int, *, dry_run: bool, skip: bool,
             dry_run_option: str | None = None) -> Training | DryRun:
    """What the job's ranks do, checked before anything is searched or written: a dry run, or training on
    ``data`` into ``save`` with the paths as the job reads them (:func:`job_paths`)."""
    check_training_args(data, save, steps, dry_run=dry_run, dry_run_option=dry_run_option)
    if dry_run:  # ranks that only print their role read none of the paths
        return DryRun()
    data, save, load = job_paths(data, save, load, skip=skip)
    assert data is not None and save is not None  # refused above when missing
    return Training(data, save, load)
