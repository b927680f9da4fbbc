"""Rules for the values that reach ``#SBATCH`` lines: Slurm names, constraints and extra sbatch options.

They live in the data model because two layers apply them: the site loader checks a site's
``[slurm]`` section with them (``sailor-hpc site validate`` reports a bad value, not the first job
that renders it), and the job renderer (:mod:`sailor_hpc.slurm.safety` re-exports them) checks what a
user passes on the command line. One copy, so the two can never disagree.

``#SBATCH`` lines are split on white space by sbatch itself, without shell quoting, so values are
refused rather than escaped. sbatch reads them with ``getopt_long``, which takes any unique prefix of
a long option (``--parti=x`` is ``--partition=x``), so an option name is resolved against sbatch's own
option table before it is judged. Every refusal is a :class:`SailorError` naming the value, the field
it came from (a CLI flag or a site file field) and a fix.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from sailor_hpc.core.errors import SailorError

SLURM_WORD = re.compile(r"^[A-Za-z0-9_.-]+$")  # account, qos, partition
CONSTRAINT = re.compile(r"^[A-Za-z0-9_.,:&|!()\[\]*-]+$")
SBATCH_OPTION = re.compile(r"^--(?P<name>[a-z][a-z0-9-]*)(?:=(?P<value>[A-Za-z0-9_.,:/@%+=*-]+))?$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

#: every long option of sbatch 22.05 (its getopt table, hidden aliases such as --tasks-per-node and
#: --cluster included; read off sbatch's "ambiguous; possibilities" answers), plus the newer
#: --tres-per-task. Prefixes resolve against this table as sbatch resolves them.
SBATCH_LONG_OPTIONS = frozenset("""
account acctg-freq array batch bb bbf begin chdir cluster cluster-constraint clusters comment constraint
container context contiguous core-spec cores-per-socket cpu-freq cpus-per-gpu cpus-per-task deadline
delay-boot dependency distribution error exclude exclusive export export-file extra-node-info get-user-env
gid gpu-bind gpu-freq gpus gpus-per-node gpus-per-socket gpus-per-task gres gres-flags help hint hold
ignore-pbs input job-name kill-on-invalid-dep licenses mail-type mail-user mcs-label mem mem-bind
mem-per-cpu mem-per-gpu mincpus network nice no-kill no-requeue nodefile nodelist nodes ntasks
ntasks-per-core ntasks-per-gpu ntasks-per-node ntasks-per-socket ntasks-per-tres open-mode output
overcommit oversubscribe parsable partition power prefer priority profile propagate qos quiet reboot
requeue reservation signal sockets-per-node spread-job switches tasks-per-node test-only thread-spec
threads-per-core time time-min tmp tres-per-task uid usage use-min-nodes verbose version wait
wait-all-nodes wckey wrap
""".split())

#: sbatch's short options, so that ``-p x`` is refused as the ``--partition`` it is
SBATCH_SHORT_OPTIONS = {
    "A": "account", "B": "extra-node-info", "b": "begin", "C": "constraint", "c": "cpus-per-task", "D": "chdir",
    "d": "dependency", "e": "error", "F": "nodefile", "G": "gpus", "H": "hold", "h": "help", "i": "input",
    "J": "job-name", "k": "no-kill", "L": "licenses", "M": "clusters", "m": "distribution", "N": "nodes",
    "n": "ntasks", "O": "overcommit", "o": "output", "p": "partition", "Q": "quiet", "q": "qos", "S": "core-spec",
    "s": "oversubscribe", "t": "time", "V": "version", "v": "verbose", "W": "wait", "w": "nodelist", "x": "exclude",
}

_LAYOUT = ("sailor-hpc sets it from the plan (one task per GPU, one het component per partition)",
           "change the plan or the site's partitions instead")
_SITE = ("it comes from the site's [slurm] section", "set slurm.account / slurm.qos in the site file")
_JOB = ("sailor-hpc sets it for the job's output, time limit and checkpoint signal",
        "use the sbatch/submit options --job-name, --log-dir, --workdir, --time, --signal-grace "
        "(environment: the site's [environment].prelude)")
_SUBMIT = ("it changes what sbatch does or prints, which sailor-hpc reads to record the job",
           "leave it out (`sailor-hpc submit --test-only` asks Slurm without submitting)")
_CLUSTER = ("the job would go to another cluster, where status, cancel and logs do not look",
            "run sailor-hpc on that cluster with its own site file")

#: options a user may not add, with why and the fix: they would break the job's layout, its output
#: and signal handling, or the parsing of sbatch's answer
FORBIDDEN_REASONS: dict[str, tuple[str, str]] = {
    **dict.fromkeys(("partition", "nodes", "ntasks", "ntasks-per-node", "tasks-per-node", "ntasks-per-gpu",
                     "ntasks-per-tres", "gres", "gpus", "gpus-per-node", "gpus-per-task", "gpus-per-socket",
                     "cpus-per-task", "cpus-per-gpu", "tres-per-task", "distribution", "nodelist", "nodefile",
                     "array", "wrap"), _LAYOUT),
    **dict.fromkeys(("account", "qos"), _SITE),
    **dict.fromkeys(("output", "error", "open-mode", "job-name", "chdir", "signal", "requeue", "no-requeue", "time",
                     "export", "export-file"), _JOB),
    **dict.fromkeys(("wait", "test-only", "parsable", "quiet", "help", "usage", "version"), _SUBMIT),
    **dict.fromkeys(("clusters", "cluster"), _CLUSTER),
}
FORBIDDEN_SBATCH = frozenset(FORBIDDEN_REASONS)

#: options that describe the whole het job, written once before the first ``#SBATCH hetjob``: mail
#: and licences are the het leader's (sbatch does not copy --mail-*/--licenses/--bb to later
#: components, and the man page says licences only work on the first), and sbatch itself copies the
#: dependency, begin/deadline, comment, hold and priority options to every later component (checked
#: with ``sbatch -vv`` on 22.05). Every other option is per component and written in each one.
JOB_WIDE_SBATCH = frozenset({"mail-type", "mail-user", "licenses", "bb", "bbf", "dependency", "kill-on-invalid-dep",
                             "begin", "deadline", "comment", "hold", "nice", "priority"})


@dataclass(frozen=True)
class SbatchOption:
    """One extra ``--name[=value]`` with its name resolved to sbatch's full option name."""

    name: str
    value: str | None

    @property
    def text(self) -> str:
        return f"--{self.name}" if self.value is None else f"--{self.name}={self.value}"

    @property
    def job_wide(self) -> bool:
        return self.name in JOB_WIDE_SBATCH


def no_control_chars(value: str, field: str, *, file: object | None = None) -> str:
    if not isinstance(value, str):
        raise SailorError(f"must be a string, got {value!r}", file=file, field=field)
    if _CONTROL.search(value):
        raise SailorError(f"{value!r} contains control characters (newline, tab, ...)", file=file, field=field,
                          fix="use a value without control characters")
    if not value:
        raise SailorError("must not be empty", file=file, field=field)
    return value


def matching(value: str, field: str, pattern: re.Pattern[str], what: str, fix: str, *,
             file: object | None = None) -> str:
    no_control_chars(value, field, file=file)
    if not pattern.match(value):
        raise SailorError(f"{value!r} is not {what}", file=file, field=field, fix=fix)
    return value


def slurm_word(value: str, field: str, *, file: object | None = None) -> str:
    return matching(value, field, SLURM_WORD, "a valid Slurm name", "use letters, digits, '_', '.', '-'", file=file)


def constraint(value: str, field: str = "slurm.constraint", *, file: object | None = None) -> str:
    return matching(value, field, CONSTRAINT, "a valid Slurm constraint expression",
                    "features joined with & | , and brackets, no spaces or quotes", file=file)


def _forbidden(shown: str, name: str, field: str, file: object | None) -> SailorError:
    why, fix = FORBIDDEN_REASONS.get(name, _LAYOUT)
    return SailorError(f"{shown} cannot be added: {why}", file=file, field=field, fix=fix)


def _short_option(text: str, field: str, file: object | None) -> SailorError:
    """The error for ``-X ...``: sbatch's short options are refused, the forbidden ones as what they are."""
    long = SBATCH_SHORT_OPTIONS.get(text[1:2])
    if long in FORBIDDEN_REASONS:
        return _forbidden(f"{text!r} (-{text[1]} is --{long})", long, field, file)
    example = f"--{long}=VALUE" if long else "--name=value"
    return SailorError(f"{text!r} is a short option; only long options are accepted", file=file, field=field,
                       fix=f"write it as {example}")


def resolve_option_name(name: str, field: str, *, file: object | None = None) -> str:
    """sbatch's full option name for ``name`` or a unique prefix of one, as getopt_long reads it.

    A name no sbatch 22.05 option starts with is returned as it is (an option of a newer Slurm; the
    sbatch that reads it refuses it if it does not know it). An ambiguous prefix is refused: sbatch
    would refuse it too, and one of its readings may be an option sailor-hpc sets.
    """
    if name in SBATCH_LONG_OPTIONS:
        return name
    readings = sorted(o for o in SBATCH_LONG_OPTIONS if o.startswith(name))
    if len(readings) == 1:
        return readings[0]
    if readings:
        raise SailorError(f"--{name} is ambiguous: sbatch could read it as " + ", ".join(f"--{o}" for o in readings),
                          file=file, field=field, fix="write the option's full name")
    return name


def parse_sbatch_option(value: str, field: str = "--extra-sbatch", *, file: object | None = None) -> SbatchOption:
    """One extra ``--option[=value]`` for the job header, refused if unsafe or if it breaks the job."""
    no_control_chars(value, field, file=file)
    text = value.strip()
    if text.startswith("-") and not text.startswith("--"):
        raise _short_option(text, field, file)
    m = SBATCH_OPTION.match(text)
    if not m:
        raise SailorError(f"{value!r} is not an sbatch option of the form --name[=value] with a plain value",
                          file=file, field=field,
                          fix="e.g. --mail-type=END; values may use letters, digits and _ . , : / @ % + = * -")
    name = resolve_option_name(m.group("name"), field, file=file)
    if name in FORBIDDEN_REASONS or name.startswith("het"):
        shown = f"--{m.group('name')}" + ("" if name == m.group("name") else f" (sbatch reads it as --{name})")
        raise _forbidden(shown, name, field, file)
    return SbatchOption(name=name, value=m.group("value"))
