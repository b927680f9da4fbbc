"""Thin, typed wrappers around the Slurm client commands (``sinfo``, ``scontrol``, ``squeue``, ``sacct``).

Every function takes an optional ``env``: extra environment variables laid over ``os.environ``
(typically ``{"SLURM_CONF": ...}`` for a non-default cluster; a complete environment such as
the test fixture's ``slurm_cluster.env`` works as well). A missing command (:class:`SlurmCommandMissing`) or a
refusal (:class:`SlurmRefused`) is a :class:`sailor_hpc.core.errors.SailorError` naming the command and Slurm's
message; a
timeout, or a failure while slurmctld does not answer, raises :class:`~sailor_hpc.core.errors.SlurmUnavailable`.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from sailor_hpc.core.errors import SailorError, SlurmUnavailable

DEFAULT_TIMEOUT_S = 60.0
PING_TIMEOUT_S = 20.0
_INSTALL_FIX = ("run sailor-hpc on a machine with the Slurm client tools (a login node) and SLURM_CONF "
                "pointing at the cluster; for the local test cluster: tests/slurm/install.sh + start.sh")
_UNAVAILABLE_FIX = "check that slurmctld is up (scontrol ping) and SLURM_CONF is right, then try again"


class SlurmCommandMissing(SailorError):
    """The Slurm client command is not installed (not in PATH): the machine, not the request, must change."""


class SlurmRefused(SailorError):
    """Slurm ran the command and refused it while slurmctld answers; ``output`` is what Slurm said, for the
    callers that tell one of Slurm's own refusals from another (e.g. accounting that is switched off)."""

    def __init__(self, message: str, *, output: str, field: str, fix: str) -> None:
        super().__init__(message, field=field, fix=fix)
        self.output = output


def slurm_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``os.environ`` with ``env`` laid over it (the environment Slurm commands are run with)."""
    out = dict(os.environ)
    if env:
        out.update({k: str(v) for k, v in env.items()})
    return out


def run_slurm(args: Sequence[str], env: Mapping[str, str] | None = None, *, timeout: float = DEFAULT_TIMEOUT_S,
              check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run one Slurm client command (``stdin``: what it reads, e.g. the batch script of ``sbatch --test-only``).

    Raises :class:`SailorError` when the command is missing or refuses its input (exit 2 material),
    :class:`SlurmUnavailable` when it hangs past ``timeout`` or fails while slurmctld does not answer
    (``scontrol ping``): the same failure means "fix the request" or "try again later", and only Slurm
    itself can tell which, never the wording of a message."""
    if not args:
        raise ValueError("empty command")
    full_env = slurm_env(env)
    exe = shutil.which(args[0], path=full_env.get("PATH", os.defpath))
    cmd_text = " ".join(args)
    if exe is None:
        raise SlurmCommandMissing(f"Slurm command {args[0]!r} not found in PATH", field=cmd_text, fix=_INSTALL_FIX)
    try:
        proc = subprocess.run([exe, *args[1:]], input=stdin, env=full_env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(f"{cmd_text!r} did not answer within {timeout:.0f} s", field=cmd_text,
                               fix=_UNAVAILABLE_FIX) from None
    except OSError as exc:
        raise SailorError(f"cannot run {cmd_text!r}: {exc}", field=cmd_text, fix=_INSTALL_FIX) from None
    if check and proc.returncode != 0:
        msg = (proc.stderr.strip() or proc.stdout.strip() or "(no output)").splitlines()
        text = f"{cmd_text!r} failed (exit {proc.returncode}): {' / '.join(msg[-5:])}"
        if args[0] != "scontrol" or args[1:2] != ["ping"]:
            if not controller_answers(env):
                raise SlurmUnavailable(text + " while slurmctld does not answer", field=cmd_text,
                                       fix=_UNAVAILABLE_FIX)
        raise SlurmRefused(text, output=proc.stderr + proc.stdout, field=cmd_text,
                           fix="Slurm refused the request: check the command's values (job id, partition, "
                               "options) and SLURM_CONF")
    return proc


def run_for_jobs(args: Sequence[str], ids: Sequence[str], env: Mapping[str, str] | None = None, *,
                 timeout: float = DEFAULT_TIMEOUT_S, check: bool = True) -> None:
    """``args`` with every id of ``ids`` (``scancel`` ...); a bundle's (several plain jobs) one job at a time, refused
    only when every job refuses: a bundle goes on without a job Slurm ended (a lost batch node), and ``scancel``
    exits 1 for an ended job after acting on the others."""
    if len(ids) <= 1:
        run_slurm([*args, *ids], env, timeout=timeout, check=check)
        return
    refused: list[SailorError] = []
    for job in ids:
        try:
            run_slurm([*args, job], env, timeout=timeout, check=check)
        except SailorError as exc:  # that job ended
            refused.append(exc)
    if len(refused) == len(ids):
        raise refused[0]


def controller_answers(env: Mapping[str, str] | None = None, timeout: float = PING_TIMEOUT_S) -> bool:
    """Whether slurmctld answers ``scontrol ping`` (exit 0) within ``timeout``."""
    full_env = slurm_env(env)
    exe = shutil.which("scontrol", path=full_env.get("PATH", os.defpath))
    if exe is None:
        return False
    try:
        return subprocess.run([exe, "ping"], env=full_env, capture_output=True, text=True,
                              timeout=timeout).returncode == 0
    except (subprocess.TimeoutExpired, OSError):
        return False


# ----------------------------------------------------------------------------------------- parsing helpers

_KV_KEY = re.compile(r"(?:(?<=\s)|^)([A-Za-z][A-Za-z0-9_/:.\-]*)=")


def parse_kv_line(line: str) -> dict[str, str]:
    """``scontrol -o`` output (``Key=value Key2=value with spaces ...``) as a dict."""
    matches = list(_KV_KEY.finditer(line))
    out: dict[str, str] = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        out[m.group(1)] = line[m.end():end].strip()
    return out


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside parentheses (``gpu:a100:2(IDX:0-1),gpu:v100:1(IDX:3)``)."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(0, depth - 1)
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


@dataclass(frozen=True)
class GresEntry:
    """One GRES of a node: ``gpu:a100:4(S:0-1)`` → name ``gpu``, type ``a100``, count 4."""

    name: str
    type: str | None
    count: int

    @property
    def spec(self) -> str:
        """``gpu:a100`` (or ``gpu`` without type): what site configs call ``gres``."""
        return f"{self.name}:{self.type}" if self.type else self.name


def parse_gres(text: str | None) -> list[GresEntry]:
    """Parse a Slurm GRES string (``gpu:a100:4``, ``gpu:2(IDX:0-1)``, ``gpu:a100:4(S:0),shard:8``, ``(null)``)."""
    if not text or text.strip() in ("(null)", "N/A", "none", ""):
        return []
    out = []
    for item in split_top_level(text.strip()):
        item = re.sub(r"\(.*\)$", "", item).strip()       # (IDX:0-1), (S:0-1)
        if item.startswith("gres:"):
            item = item[5:]
        if item.startswith("gres/"):
            item = item[5:]
        fields = item.split(":")
        name = fields[0]
        gtype: str | None = None
        count = 1
        if len(fields) == 2:
            if re.fullmatch(r"\d+[KMGT]?", fields[1]):
                count = _count(fields[1])
            else:
                gtype = fields[1]
        elif len(fields) >= 3:
            gtype = ":".join(fields[1:-1])
            if re.fullmatch(r"\d+[KMGT]?", fields[-1]):
                count = _count(fields[-1])
            else:
                gtype, count = ":".join(fields[1:]), 1
        out.append(GresEntry(name=name, type=gtype or None, count=count))
    return out


def _count(text: str) -> int:
    mult = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
    if text[-1] in mult:
        return int(text[:-1]) * mult[text[-1]]
    return int(text)


def gpu_count(gres: Iterable[GresEntry]) -> int:
    return sum(g.count for g in gres if g.name == "gpu")


def _int(text: str | None, default: int = 0) -> int:
    try:
        return int(str(text).strip())
    except (TypeError, ValueError):
        return default


# -------------------------------------------------------------------------------------------- scontrol

@dataclass(frozen=True)
class PartitionInfo:
    """``scontrol -o show partition`` (one partition)."""

    name: str
    nodes: str                 # hostlist expression, e.g. "a100-[1-2]"
    total_nodes: int
    total_cpus: int
    max_nodes: int | None      # None = UNLIMITED
    max_time: str | None       # None = UNLIMITED/INFINITE; else Slurm time text, e.g. "1-00:00:00"
    default: bool
    state: str
    raw: dict[str, str]


@dataclass(frozen=True)
class NodeInfo:
    """``scontrol -o show node`` (one node)."""

    name: str
    partitions: tuple[str, ...]
    gres: tuple[GresEntry, ...]
    cpus: int
    real_memory_mb: int
    state: str                 # e.g. "IDLE", "MIXED", "DOWN+DRAIN", "IDLE*"
    raw: dict[str, str]

    @property
    def gpus(self) -> int:
        return gpu_count(self.gres)


@dataclass(frozen=True)
class ReservationInfo:
    """``scontrol -o show reservation`` (one reservation); times as Slurm prints them (local time)."""

    name: str
    start: str
    end: str
    nodes: str                 # hostlist expression ("" for a reservation of licences only)
    partition: str             # "" when none is named
    users: tuple[str, ...]     # a leading '-' excludes that user
    accounts: tuple[str, ...]
    groups: tuple[str, ...]
    flags: tuple[str, ...]
    state: str                 # ACTIVE or INACTIVE (not started yet)


_UNLIMITED = {"UNLIMITED", "INFINITE", "NONE", "N/A", ""}


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(x for x in (text or "").split(",") if x and x != "(null)")


def _scontrol_records(entity: str, key: str, env: Mapping[str, str] | None,
                      names: Sequence[str] = ()) -> list[dict[str, str]]:
    """``scontrol -o show ENTITY [names]``: one key=value dict per line that names its ``key``."""
    args = ["scontrol", "-o", "show", entity] + ([",".join(names)] if names else [])
    records = (parse_kv_line(line.strip()) for line in run_slurm(args, env).stdout.splitlines())
    return [kv for kv in records if key in kv]


def show_partitions(env: Mapping[str, str] | None = None) -> list[PartitionInfo]:
    parts = []
    for kv in _scontrol_records("partition", "PartitionName", env):
        max_nodes = kv.get("MaxNodes", "UNLIMITED")
        max_time = kv.get("MaxTime", "UNLIMITED")
        parts.append(PartitionInfo(
            name=kv["PartitionName"], nodes=kv.get("Nodes", ""), total_nodes=_int(kv.get("TotalNodes")),
            total_cpus=_int(kv.get("TotalCPUs")),
            max_nodes=None if max_nodes.upper() in _UNLIMITED else _int(max_nodes),
            max_time=None if max_time.upper() in _UNLIMITED else max_time,
            default=kv.get("Default", "NO").upper() == "YES", state=kv.get("State", ""), raw=kv))
    return parts


def show_reservations(env: Mapping[str, str] | None = None) -> list[ReservationInfo]:
    """Every reservation Slurm holds ("No reservations in the system" gives none)."""
    return [ReservationInfo(
        name=kv["ReservationName"], start=kv.get("StartTime", ""), end=kv.get("EndTime", ""),
        nodes="" if kv.get("Nodes", "(null)") == "(null)" else kv.get("Nodes", ""),
        partition="" if kv.get("PartitionName", "(null)") == "(null)" else kv.get("PartitionName", ""),
        users=_names(kv.get("Users")), accounts=_names(kv.get("Accounts")), groups=_names(kv.get("Groups")),
        flags=_names(kv.get("Flags")), state=kv.get("State", ""))
        for kv in _scontrol_records("reservation", "ReservationName", env)]


def show_nodes(env: Mapping[str, str] | None = None, names: Sequence[str] = ()) -> list[NodeInfo]:
    nodes = []
    for kv in _scontrol_records("node", "NodeName", env, names):
        parts = kv.get("Partitions", "")
        nodes.append(NodeInfo(
            name=kv["NodeName"], partitions=tuple(p for p in parts.split(",") if p),
            gres=tuple(parse_gres(kv.get("Gres"))), cpus=_int(kv.get("CPUTot")),
            real_memory_mb=_int(kv.get("RealMemory")), state=kv.get("State", ""), raw=kv))
    return nodes


def show_config(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``scontrol show config`` as a dict (``ClusterName``, ``SlurmctldPort``, ...)."""
    out = run_slurm(["scontrol", "show", "config"], env).stdout
    conf = {}
    for line in out.splitlines():
        m = re.match(r"^(\S+)\s*=\s?(.*)$", line)
        if m:
            conf[m.group(1)] = m.group(2).strip()
    return conf


# ----------------------------------------------------------------------------------------------- sinfo

@dataclass(frozen=True)
class SinfoNode:
    """One line of ``sinfo -N`` (a node in one partition; a node in two partitions gives two lines)."""

    name: str
    partition: str             # without the '*' that marks the default partition
    default_partition: bool
    state: str                 # long state: "idle", "mixed", "allocated", "down*", "drained", ...
    gres: tuple[GresEntry, ...]
    gres_used: tuple[GresEntry, ...]
    cpus: int
    cpus_idle: int
    memory_mb: int

    @property
    def gpus(self) -> int:
        return gpu_count(self.gres)

    @property
    def gpus_used(self) -> int:
        return gpu_count(self.gres_used)

    @property
    def usable(self) -> bool:
        """Up and schedulable: not down, drained/draining, failing, in maintenance or not responding."""
        s = self.state.lower()
        if s.endswith(("*", "~", "#", "!", "%", "$", "@", "^", "-")):
            return False
        bad = ("down", "drain", "fail", "maint", "unknown", "inval", "reboot", "power", "future", "reserved",
               "boot", "not_responding", "planned", "blocked")
        return not any(b in s for b in bad)


_SINFO_FIELDS = ["NodeList", "Partition", "StateLong", "Gres", "GresUsed", "CPUs", "CPUsState", "Memory"]


def sinfo_nodes(env: Mapping[str, str] | None = None, partitions: Sequence[str] = ()) -> list[SinfoNode]:
    """``sinfo -N`` with GRES and GRES in use, one entry per (node, partition)."""
    fmt = ",".join(f"{f}:|" for f in _SINFO_FIELDS)   # no width: full values, '|' after each field
    args = ["sinfo", "-h", "-N", "-O", fmt]
    if partitions:
        args += ["-p", ",".join(partitions)]
    out = run_slurm(args, env).stdout
    nodes = []
    for line in out.splitlines():
        if not line.strip():
            continue
        f = line.split("|")
        if len(f) < len(_SINFO_FIELDS):
            raise SailorError(f"cannot parse sinfo output line {line!r}", field="sinfo -N -O ...",
                              fix="this sailor-hpc expects Slurm >= 20.11")
        name, part, state, gres, used, cpus, cpus_state, mem = (x.strip() for x in f[:len(_SINFO_FIELDS)])
        cs = cpus_state.split("/")       # allocated/idle/other/total
        nodes.append(SinfoNode(
            name=name, partition=part.rstrip("*"), default_partition=part.endswith("*"), state=state,
            gres=tuple(parse_gres(gres)), gres_used=tuple(parse_gres(used)), cpus=_int(cpus),
            cpus_idle=_int(cs[1]) if len(cs) == 4 else _int(cpus), memory_mb=_int(mem)))
    return nodes


# ---------------------------------------------------------------------------------------------- squeue

@dataclass(frozen=True)
class QueueJob:
    """One line of ``squeue`` (a het job gives one line per component, ``12+0``, ``12+1``)."""

    job_id: str
    partition: str
    state: str
    num_nodes: int
    nodelist: str
    reason: str
    tres_per_node: str
    name: str


def squeue(env: Mapping[str, str] | None = None, *, jobs: Sequence[str | int] = (), all_states: bool = False,
           user: str | None = None) -> list[QueueJob]:
    """Jobs in the queue; ``all_states`` also lists finished jobs still known to slurmctld (MinJobAge)."""
    args = ["squeue", "-h", "-o", "%i|%P|%T|%D|%N|%r|%b|%j"]
    if jobs:
        args += ["-j", ",".join(str(j) for j in jobs)]
    if all_states:
        args += ["-t", "all"]
    if user:
        args += ["-u", user]
    proc = run_slurm(args, env, check=False)
    if proc.returncode != 0:
        if jobs and controller_answers(env):
            return []  # slurmctld answers but refuses the ids: it knows none of them (any more)
        run_slurm(args, env)   # raise with the message
    out = []
    for line in proc.stdout.splitlines():
        f = line.split("|", 7)
        if len(f) < 8:
            continue
        out.append(QueueJob(job_id=f[0], partition=f[1], state=f[2], num_nodes=_int(f[3]), nodelist=f[4],
                            reason=f[5], tres_per_node=f[6], name=f[7]))
    return out


# ----------------------------------------------------------------------------------------------- sacct

@dataclass(frozen=True)
class AcctJob:
    """One line of ``sacct -P`` (jobs, het components ``12+0`` and steps ``12.batch``, ``12+1.0``)."""

    job_id: str
    name: str
    partition: str
    state: str                 # e.g. "COMPLETED", "FAILED", "CANCELLED by 0"
    exit_code: str             # "rc:signal"
    nodelist: str
    alloc_tres: str
    elapsed: str

    @property
    def base_state(self) -> str:
        return self.state.split()[0] if self.state else ""

    @property
    def cancelled_by(self) -> int | None:
        """The uid that cancelled the job (``CANCELLED by 1000``), None for any other state."""
        words = self.state.split()
        return int(words[2]) if len(words) == 3 and words[0] == "CANCELLED" and words[1] == "by" \
            and words[2].isdigit() else None

    @property
    def is_step(self) -> bool:
        return "." in self.job_id


_SACCT_FIELDS = ["JobID", "Partition", "State", "ExitCode", "NodeList", "AllocTRES", "Elapsed", "JobName"]


def sacct(env: Mapping[str, str] | None = None, *, jobs: Sequence[str | int], allocations_only: bool = False,
          ) -> list[AcctJob]:
    """Accounting records of ``jobs`` (query by id: plain ``sacct`` windows can miss fresh jobs)."""
    if not jobs:
        return []
    args = ["sacct", "-n", "-P", "-o", ",".join(_SACCT_FIELDS), "-j", ",".join(str(j) for j in jobs)]
    if allocations_only:
        args.append("-X")
    out = []
    for line in run_slurm(args, env).stdout.splitlines():
        f = line.split("|", len(_SACCT_FIELDS) - 1)   # JobName last: it may contain '|'
        if len(f) < len(_SACCT_FIELDS):
            continue
        out.append(AcctJob(job_id=f[0], partition=f[1], state=f[2], exit_code=f[3], nodelist=f[4],
                           alloc_tres=f[5], elapsed=f[6], name=f[7]))
    return out
