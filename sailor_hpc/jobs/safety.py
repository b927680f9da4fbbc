"""Validation and quoting of every user-supplied string that ends up in a job script.

A job script is shell, and its ``#SBATCH`` lines are parsed by sbatch itself (split on white space,
no shell quoting), so two rules keep anything from being injected:

- values that go into ``#SBATCH`` lines (job name, log directory, work directory, account, QOS,
  constraint, extra options) must match a strict character set: no white space, no quotes, no ``$``,
  no newline. They are refused, not escaped, because sbatch has no quoting we could rely on;
- values that go into shell commands (plan, data, checkpoint paths, extra runtime arguments) are
  quoted with :func:`shlex.quote` and must not contain control characters (a newline would also
  break the comment lines that name them).

Every refusal is a :class:`SailorError` naming the field and a fix.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from sailor_hpc.errors import SailorError

JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")
SLURM_WORD = re.compile(r"^[A-Za-z0-9_.-]+$")  # account, qos, partition
CONSTRAINT = re.compile(r"^[A-Za-z0-9_.,:&|!()\[\]*-]+$")
SBATCH_PATH = re.compile(r"^[A-Za-z0-9_./+%-]+$")  # %j / %x patterns allowed in log paths
SBATCH_OPTION = re.compile(r"^--(?P<name>[a-z][a-z0-9-]*)(?:=(?P<value>[A-Za-z0-9_.,:/@%+=*-]+))?$")
PYTHON_EXE = re.compile(r"^[A-Za-z0-9_./+-]+$")
JOB_ID = re.compile(r"^\d+(?:_\d+|\+\d+)?$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

#: sbatch options a user may not add: they would break the job's layout (one task per GPU of the
#: plan, one het component per partition) or its output handling
FORBIDDEN_SBATCH = frozenset({
    "partition", "p", "nodes", "ntasks", "ntasks-per-node", "gres", "gpus", "gpus-per-node", "gpus-per-task",
    "cpus-per-task", "hetjob", "het-group", "array", "wrap", "output", "error", "open-mode", "job-name",
    "chdir", "signal", "requeue", "no-requeue", "time", "account", "qos", "distribution", "export",
})


def no_control_chars(value: str, field: str) -> str:
    if not isinstance(value, str):
        raise SailorError(f"must be a string, got {value!r}", field=field)
    if _CONTROL.search(value):
        raise SailorError(f"{value!r} contains control characters (newline, tab, ...)", field=field,
                          fix="use a value without control characters")
    if not value:
        raise SailorError("must not be empty", field=field)
    return value


def _matching(value: str, field: str, pattern: re.Pattern[str], what: str, fix: str) -> str:
    no_control_chars(value, field)
    if not pattern.match(value):
        raise SailorError(f"{value!r} is not {what}", field=field, fix=fix)
    return value


def job_name(value: str, field: str = "--job-name") -> str:
    return _matching(value, field, JOB_NAME, "a safe job name",
                     "use 1-64 letters, digits, '_', '.', '+', '-' (starting with a letter or digit)")


def slurm_word(value: str, field: str) -> str:
    return _matching(value, field, SLURM_WORD, "a valid Slurm name", "use letters, digits, '_', '.', '-'")


def constraint(value: str, field: str = "slurm.constraint") -> str:
    return _matching(value, field, CONSTRAINT, "a valid Slurm constraint expression",
                     "features joined with & | , and brackets, no spaces or quotes")


def sbatch_path(value: str | Path, field: str) -> str:
    """An absolute path for an ``#SBATCH`` line (``--output``, ``--chdir``): strict characters only."""
    no_control_chars(str(value), field)
    text = str(Path(value).expanduser().absolute())
    if not SBATCH_PATH.match(text):
        raise SailorError(f"{text!r} cannot be used in an #SBATCH line (sbatch does not quote)", field=field,
                          fix="use a directory whose path has only letters, digits and _ . / + - characters")
    return text


def shell_path(value: str | Path, field: str, *, absolute: bool = True) -> str:
    """A path for a shell command: made absolute, refused with control characters (quote it with :func:`q`)."""
    no_control_chars(str(value), field)
    return str(Path(value).expanduser().absolute()) if absolute else str(value)


def sbatch_option(value: str, field: str = "--extra-sbatch") -> str:
    """One extra ``--option[=value]`` for the job header, refused if unsafe or if it breaks the layout."""
    no_control_chars(value, field)
    m = SBATCH_OPTION.match(value.strip())
    if not m:
        raise SailorError(f"{value!r} is not an sbatch option of the form --name[=value] with a plain value",
                          field=field, fix="e.g. --mail-type=END; values may use letters, digits and _ . , : / @ % + = * -")
    if m.group("name") in FORBIDDEN_SBATCH or m.group("name").startswith("het"):
        raise SailorError(f"--{m.group('name')} is set by sailor-hpc from the plan and site", field=field,
                          fix="change the plan, the site config or the sbatch/submit options instead")
    return value.strip()


def python_exe(value: str, field: str = "--python") -> str:
    return _matching(value, field, PYTHON_EXE, "a plain interpreter name or path",
                     "e.g. python, python3 or /path/to/venv/bin/python")


def job_id(value: str | int, field: str = "JOBID") -> str:
    return _matching(str(value).strip(), field, JOB_ID, "a Slurm job id", "e.g. 1234, 1234_5 (array) or 1234+1 (het)")


def q(value: str) -> str:
    """Shell-quote one word (after :func:`no_control_chars`)."""
    return shlex.quote(value)
