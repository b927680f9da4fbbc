"""The root ``sailor-hpc`` command group; every command module registers itself on :data:`main`.

Every :class:`~sailor_hpc.core.errors.SailorError` (and an ``OSError`` on a path the user gave) becomes
one message naming file, field and fix, and exit code 2.
"""
from __future__ import annotations

import json
import sys
from typing import Any

import click

from sailor_hpc.core.errors import EXIT_BAD_INPUT, SailorError


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SailorError as exc:
            _refuse(ctx, exc)
        except OSError as exc:  # a path given on the command line cannot be read or written
            _refuse(ctx, SailorError(exc.strerror or str(exc), file=exc.filename,
                                     fix="check the path (a folder where a file is expected?) and its permissions"))


def _refuse(ctx: click.Context, exc: SailorError) -> None:
    if "--json" in sys.argv:
        click.echo(json.dumps(exc.to_dict()), err=True)
    else:
        click.echo(f"error: {exc}", err=True)
    ctx.exit(EXIT_BAD_INPUT)


@click.group(cls=_Group)
@click.version_option(package_name="sailor-hpc")
def main() -> None:
    """Plan and run LLM training on the mixed GPU partitions of a SLURM site."""
