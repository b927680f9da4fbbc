"""The ``sailor-hpc`` command line: a thin face over functions the tests call directly.

Each command group lives in its own module and registers itself on :data:`main`
(:mod:`sailor_hpc.cli.app`), which imports a command's module when a call names it.
"""
from sailor_hpc.cli.app import main

__all__ = ["main"]
