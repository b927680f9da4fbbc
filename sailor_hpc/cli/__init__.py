"""The ``sailor-hpc`` command line: a thin face over functions the tests call directly.

Each command group lives in its own module and registers itself on :data:`main`
(:mod:`sailor_hpc.cli.app`); importing this package registers them all.
"""
from sailor_hpc.cli import (  # noqa: F401  (registration)
    checkpoint_cmds,
    job_cmds,
    model_cmds,
    plan_cmds,
    profile_cmds,
    profiles_cmds,
    run_cmds,
    simulate_cmds,
    site_cmds,
    site_doctor,
)
from sailor_hpc.cli.app import main

__all__ = ["main"]
