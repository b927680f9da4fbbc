"""The root ``sailor-hpc`` command group; every command module registers itself on :data:`main` when the
command is named (:data:`COMMAND_MODULES`).

Every :class:`~sailor_hpc.core.errors.Problem` (and an ``OSError`` on a path the user gave) becomes
one message naming file, field and fix, and the exit code its type carries: 2 bad input
(:class:`~sailor_hpc.core.errors.SailorError`), 3 Slurm unavailable or timed out (try again later).
A reader that closes the pipe early (``sailor-hpc run status DIR | head``) ends the command quietly with
141, the status of a process killed by SIGPIPE, as any Unix tool's.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

import click

from sailor_hpc.core.errors import EXIT_SLURM_UNAVAILABLE, Problem, SailorError

EXIT_PIPE_CLOSED = 128 + 13  # 128 + SIGPIPE: what a shell reports for a tool whose reader went away


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Problem as exc:  # each error type carries its exit code (2 bad input, 3 Slurm unavailable, ...)
            _refuse(ctx, exc)
        except BrokenPipeError:  # the reader is gone: nothing to say, and nowhere to say it
            _quiet_stdout()
            ctx.exit(EXIT_PIPE_CLOSED)
        except OSError as exc:  # a path given on the command line cannot be read or written
            _refuse(ctx, SailorError(exc.strerror or str(exc), file=exc.filename,
                                     fix="check the path (a folder where a file is expected?) and its permissions"))


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of what is still buffered for the
    closed pipe does not fail again ("Exception ignored ... BrokenPipeError") on the way out."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _refuse(ctx: click.Context, exc: Problem) -> None:
    if "--json" in sys.argv:
        click.echo(json.dumps({**exc.to_dict(), "exit_code": exc.exit_code}), err=True)
    elif exc.exit_code == EXIT_SLURM_UNAVAILABLE:
        click.echo(f"error: Slurm is unavailable (exit {EXIT_SLURM_UNAVAILABLE}; nothing is wrong with the input, "
                   f"try again later): {exc}", err=True)
    else:
        click.echo(f"error: {exc}", err=True)
    ctx.exit(exc.exit_code)


#: each command of ``sailor-hpc`` and the module (of this package) that defines it. A call imports the module of
#: its command only: ``sailor-hpc run status`` or ``logs`` need neither the planner nor the simulator (numpy,
#: h5py), and every command in one process cost ~1 s of CPU per call (the suite makes ~130 such calls).
COMMAND_MODULES = {
    "checkpoint": "checkpoint_cmds", "sbatch": "job_cmds", "submit": "job_cmds", "status": "job_cmds",
    "cancel": "job_cmds", "logs": "job_cmds", "models": "model_cmds", "plan": "plan_cmds", "profile": "profile_cmds",
    "profiles": "profiles_cmds", "run": "run_cmds", "simulate": "simulate_cmds", "validate-sim": "simulate_cmds",
    "site": "site_cmds",
}


class _Root(_Group):
    """The root group: commands are imported when named (their modules register on it, as at import)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMAND_MODULES)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMAND_MODULES:
            importlib.import_module(f"{__package__}.{COMMAND_MODULES[cmd_name]}")
        return super().get_command(ctx, cmd_name)


@click.group(cls=_Root)
@click.version_option(package_name="sailor-hpc")
def main() -> None:
    """Plan and run LLM training on the mixed GPU partitions of a SLURM site."""
