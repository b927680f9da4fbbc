"""Validation and quoting of every user-supplied string that ends up in a job script.

A job script is shell, and its ``#SBATCH`` lines are parsed by sbatch itself (split on white space,
no shell quoting), so two rules keep anything from being injected:

- values that go into ``#SBATCH`` lines (job name, log directory, work directory, account, QOS,
  constraint, extra options) must match a strict character set: no white space, no quotes, no ``$``,
  no newline. They are refused, not escaped, because sbatch has no quoting we could rely on. The
  rules for the values a site's ``[slurm]`` section shares with the command line (Slurm names,
  constraints, extra sbatch options) live in :mod:`sailor_hpc.core.sbatch_values`, which the site loader
  applies too, and are re-exported here;
- values that go into shell commands (plan, data, checkpoint paths, extra runtime arguments) are
  quoted with :func:`shlex.quote` and must not contain control characters (a newline would also
  break the comment lines that name them).

Every refusal is a :class:`SailorError` naming the field and a fix.
"""
from __future__ import annotations

import os
import re
import shlex
from collections.abc import Sequence
from pathlib import Path

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.sbatch_values import (
    CONSTRAINT,
    FORBIDDEN_SBATCH,
    JOB_WIDE_SBATCH,
    SBATCH_OPTION,
    SLURM_WORD,
    SbatchOption,
    constraint,
    matching,
    no_control_chars,
    parse_sbatch_option,
    slurm_word,
)
from sailor_hpc.core.site import Site

__all__ = ["CONSTRAINT", "FORBIDDEN_SBATCH", "JOB_WIDE_SBATCH", "SBATCH_OPTION", "SLURM_WORD", "SbatchOption",
           "constraint", "job_id", "job_name", "no_control_chars", "parse_sbatch_option", "python_exe", "q",
           "quoted_python_exe", "sbatch_path", "shell_path", "site_sbatch_options", "slurm_word"]

JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")
SBATCH_PATH = re.compile(r"^[A-Za-z0-9_./+%-]+$")  # %j / %x patterns allowed in log paths
PYTHON_EXE = re.compile(r"^[A-Za-z0-9_./+-]+$")
JOB_ID = re.compile(r"^\d+(?:_\d+|\+\d+)?$")


def job_name(value: str, field: str = "--job-name") -> str:
    return matching(value, field, JOB_NAME, "a safe job name",
                    "use 1-64 letters, digits, '_', '.', '+', '-' (starting with a letter or digit)")


def sbatch_path(value: str | os.PathLike[str], field: str) -> str:
    """An absolute path for an ``#SBATCH`` line (``--output``, ``--chdir``): strict characters only."""
    no_control_chars(str(value), field)
    text = str(Path(value).expanduser().absolute())
    if not SBATCH_PATH.match(text):
        raise SailorError(f"{text!r} cannot be used in an #SBATCH line (sbatch does not quote)", field=field,
                          fix="use a directory whose path has only letters, digits and _ . / + - characters")
    return text


def shell_path(value: str | os.PathLike[str], field: str, *, absolute: bool = True) -> str:
    """A path for a shell command: made absolute, refused with control characters (quote it with :func:`q`)."""
    no_control_chars(str(value), field)
    return str(Path(value).expanduser().absolute()) if absolute else str(value)


def python_exe(value: str, field: str = "--python") -> str:
    return matching(value, field, PYTHON_EXE, "a plain interpreter name or path",
                    "e.g. python, python3 or /path/to/venv/bin/python")


def quoted_python_exe(value: str, field: str = "--python") -> str:
    """An interpreter path for a script that shell-quotes it: any path (a virtualenv under a folder with a
    space, as ``sys.executable`` may be) but no control characters and no leading ``-`` (an option)."""
    no_control_chars(value, field)
    if value.startswith("-"):
        raise SailorError(f"{value!r} is not an interpreter name or path", field=field,
                          fix="e.g. python3 or /path/to/venv/bin/python")
    return value


def job_id(value: str | int, field: str = "JOBID") -> str:
    return matching(str(value).strip(), field, JOB_ID, "a Slurm job id", "e.g. 1234, 1234_5 (array) or 1234+1 (het)")


#: joins the ids of a *bundle*: plain jobs, one per het component it would have, that run one mixed-GPU plan, so that
#: Slurm can end one of them (a node lost) without the others, as it ends a whole het job (sailor_hpc.jobs.options.BundlePart)
BUNDLE_SEP = ","


def job_ids(value: str | int, field: str = "JOBID") -> list[str]:
    """The jobs an id names: itself, or each job of a bundle (``1234,1235``), every one checked."""
    return [job_id(part, field) for part in str(value).split(BUNDLE_SEP)]


def q(value: str) -> str:
    """Shell-quote one word (after :func:`no_control_chars`)."""
    return shlex.quote(value)


def site_sbatch_options(site: Site, extra_sbatch: Sequence[str] = ()) -> list[SbatchOption]:
    """Every option the site and the caller add to a job's header, checked and under sbatch's full names:
    the site's ``[slurm]`` account, QOS and constraint, its ``extra_sbatch``, then the caller's options.
    A refusal names the site file's field or the ``--extra-sbatch`` flag. Training jobs and profiling
    jobs both read them here and split them into job-wide and per-component options
    (:attr:`SbatchOption.job_wide`)."""
    s = site.slurm
    named = (("account", s.account, slurm_word), ("qos", s.qos, slurm_word), ("constraint", s.constraint, constraint))
    out = [SbatchOption(name, check(value, f"slurm.{name}", file=site.source)) for name, value, check in named if value]
    out += [parse_sbatch_option(o, f"slurm.extra_sbatch[{i}]", file=site.source)
            for i, o in enumerate(s.extra_sbatch)]
    return out + [parse_sbatch_option(o) for o in extra_sbatch]
