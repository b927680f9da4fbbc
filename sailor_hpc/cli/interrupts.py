"""Ctrl-C in a command that leaves Slurm jobs behind: say which keep running and the two ways on, and let a
second Ctrl-C cancel them.

click's own answer ("Aborted!") leaves a user not knowing that the jobs still run (and, for a sweep, still
write into the archive). The first Ctrl-C ends the wait and prints the jobs, the command that cancels them
and the one that finishes what was started; for ``GRACE_S`` seconds a second Ctrl-C cancels them instead.
"""
from __future__ import annotations

import contextlib
import shlex
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

import click

from sailor_hpc.slurm.commands import SlurmRefused
from sailor_hpc.slurm.submit import cancel_job

GRACE_S = 10.0
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended


def this_command_with(flag: str) -> str:
    """The command line this process was started with, ``flag`` added if it is not there already."""
    args = sys.argv[1:]
    return shlex.join(["sailor-hpc", *args, *([] if flag in args else [flag])])


def jobs_left_running(jobs: Sequence[str], *, finish: str, grace_s: float = GRACE_S) -> NoReturn:
    """After a first Ctrl-C: name ``jobs`` (still queued or running), ``sailor-hpc cancel`` for them and
    ``finish`` (the command that completes what they started); a second Ctrl-C within ``grace_s`` seconds
    cancels them. Exits 130 either way."""
    if not jobs:
        click.echo("interrupted; none of its jobs is queued or running", err=True)
        raise SystemExit(EXIT_INTERRUPTED)
    ids = " ".join(jobs)
    click.echo(f"interrupted: {len(jobs)} job(s) keep running: {ids}\n"
               f"  cancel them:  sailor-hpc cancel {ids}\n"
               f"  or finish:    {finish}\n"
               f"Ctrl-C again within {grace_s:.0f} s cancels them now.", err=True)
    try:
        time.sleep(grace_s)
    except KeyboardInterrupt:
        for job in jobs:
            with contextlib.suppress(SlurmRefused):  # it ended meanwhile
                cancel_job(job)
        click.echo(f"cancelled {ids}", err=True)
    raise SystemExit(EXIT_INTERRUPTED)
