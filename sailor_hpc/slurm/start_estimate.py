"""Read what start-time estimates need from Slurm, within a time bound: the queue, Slurm's own answers, history.

* the queue (:func:`StartEstimator.snapshot`): every usable node's GPUs (``sinfo``), what running jobs
  hold on each node until their end time, and what pending jobs Slurm has planned hold from their
  expected start (``scontrol -d show job``: the per-node GRES, ``SchedNodeList``, ``StartTime``/``EndTime``);
* the site's states that decide when a request can start at all: partition states and limits
  (``scontrol show partition``), the nodes left out (down, drained, draining), reservations (``scontrol
  show reservation``: who may use them, start and end) and the pending jobs Slurm has not planned yet
  (a dependency, a begin time), by priority; the planner turns them into holds
  (:mod:`planner.site_timeline`);
* Slurm's answer for an exact (het) request (:func:`StartEstimator.test_only`): ``sbatch --test-only``,
  once per distinct request and time limit, cached;
* the site's history (:func:`wait_history`): ``sacct`` start - submit of past jobs per partition and
  size, with the estimator's own error on those jobs (each predicted from the others).

Every call shares one budget (default 5 s per plan): what is left out once it is spent is said in the
snapshot's ``notes``, never guessed. The result is plain data (:class:`QueueSnapshot`) for the planner.
"""
from __future__ import annotations

import getpass
import math
import re
import statistics
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta

from sailor_hpc.core.errors import SailorError, SlurmUnavailable
from sailor_hpc.core.site import Site, slurm_time_seconds
from sailor_hpc.core.start_times import (
    TEST_ONLY,
    HistoryError,
    Hold,
    PartitionState,
    PendingJob,
    QueueSnapshot,
    RequestShape,
    Reservation,
    StartEstimate,
    WaitHistory,
    shape_text,
)
from sailor_hpc.slurm.commands import (
    ReservationInfo,
    parse_gres,
    parse_kv_line,
    run_slurm,
    show_partitions,
    show_reservations,
    sinfo_nodes,
)
from sailor_hpc.slurm.hostlist import expand_hostlist
from sailor_hpc.slurm.safety import site_sbatch_options

DEFAULT_BUDGET_S = 5.0
HISTORY_DAYS = 30
_NODE_GRES = re.compile(r"Nodes=(\S+) CPU_IDs=\S+ Mem=\S+ GRES=(\S*)")
_TEST_ONLY = re.compile(r"to start at (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)")


def slurm_time(text: str | None) -> float | None:
    """Epoch seconds of a Slurm timestamp (local time, as Slurm prints it); None for Unknown/None/N/A."""
    if not text or not re.match(r"\d{4}-\d\d-\d\dT", text):
        return None
    return datetime.fromisoformat(text).timestamp()


class SlurmBudgetSpent(SlurmUnavailable):
    """The plan's seconds of Slurm calls are spent: what is left unasked is said in the snapshot's notes and
    the estimates fall back to the queue's timeline, never to a guess."""


class Budget:
    """Seconds of Slurm calls left; each call's timeout is what remains."""

    def __init__(self, seconds: float):
        self.total = seconds
        self.used = 0.0

    @property
    def left(self) -> float:
        return self.total - self.used

    def run(self, args: Sequence[str], env: Mapping[str, str] | None, *, stdin: str | None = None,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        """:func:`run_slurm` with what is left of the budget as its timeout; raises
        :class:`SlurmBudgetSpent` once it is spent (a call that runs out of it included)."""
        if self.left <= 0.05:
            raise SlurmBudgetSpent(f"the {self.total:g} s budget of Slurm calls is spent", field=args[0])
        t0 = time.perf_counter()
        try:
            return run_slurm(args, env, timeout=self.left, check=check, stdin=stdin)
        except SlurmUnavailable as exc:
            if time.perf_counter() - t0 >= self.left - 0.05:
                raise SlurmBudgetSpent(f"{args[0]} did not answer within the {self.total:g} s budget",
                                       field=args[0]) from exc
            raise
        finally:
            self.used += time.perf_counter() - t0


def _gpus(gres: str) -> int:
    return sum(g.count for g in parse_gres(gres) if g.name == "gpu")


def queue_holds(env: Mapping[str, str] | None, budget: Budget, now: float) -> tuple[list[Hold], list[PendingJob]]:
    """What running and planned pending jobs hold, per node, and the pending jobs Slurm has not planned yet
    (``scontrol -d -o show job``)."""
    out = budget.run(["scontrol", "-d", "-o", "show", "job"], env)
    records = [(line, parse_kv_line(line)) for line in out.stdout.splitlines() if line.startswith("JobId=")]
    lists = [m.group(1) for line, _ in records for m in _NODE_GRES.finditer(line)]
    lists += [kv.get("SchedNodeList", "") for _, kv in records if kv.get("JobState") == "PENDING"]
    hosts = {text: expand_hostlist(text) for text in set(lists)}  # in Python: no Slurm call of the budget
    holds: list[Hold] = []
    unplanned: list[PendingJob] = []
    for line, kv in records:
        state, job, part = kv.get("JobState", ""), kv.get("JobId", ""), kv.get("Partition", "")
        end_s = _end_s(kv, now)
        if state in ("RUNNING", "SUSPENDED", "COMPLETING"):
            for m in _NODE_GRES.finditer(line):
                holds += [Hold(part, node, _gpus(m.group(2)), 0.0, end_s, job) for node in hosts[m.group(1)]]
        elif state == "PENDING":
            start = slurm_time(kv.get("StartTime"))
            nodes = hosts.get(kv.get("SchedNodeList", ""), [])
            if start is not None and nodes:
                per_node = _gpus(kv.get("TresPerNode", "")) or _tres_gpus(kv.get("TRES", "")) // len(nodes)
                holds += [Hold(part, node, per_node, max(0.0, start - now), end_s, job) for node in nodes]
            elif (waiting := _unplanned(kv, now)) is not None:
                unplanned.append(waiting)
    return holds, unplanned


_HELD = ("JobHeld", "DependencyNeverSatisfied", "BadConstraints", "PartitionDown", "PartitionInactive")
_DEPENDENCY = re.compile(r"(after\w*):(\d+(?:[_+]\d+)?)(?:\+\d+)?\((\w+)\)")


def _unplanned(kv: Mapping[str, str], now: float) -> PendingJob | None:
    """A pending GPU job Slurm has no start and nodes for; None for one that will not start by itself (held,
    a dependency never satisfied) or asks no GPU."""
    reason, priority = kv.get("Reason", ""), _count(kv.get("Priority"))
    if priority <= 0 or reason.startswith(_HELD):
        return None
    nodes = _count(kv.get("NumNodes", "1").split("-")[0]) or 1
    per_node = _gpus(kv.get("TresPerNode", "")) or _tres_gpus(kv.get("TRES", "")) // nodes
    if per_node <= 0:
        return None
    try:
        limit = slurm_time_seconds(kv.get("TimeLimit", "UNLIMITED"))
    except ValueError:
        limit = None
    eligible = slurm_time(kv.get("EligibleTime"))
    after_start: list[str] = []
    after_end: list[str] = []
    for kind, dep, status in _DEPENDENCY.findall(kv.get("Dependency", "")):
        if status.lower() == "unfulfilled":
            (after_start if kind == "after" else after_end).append(dep)
    return PendingJob(kv.get("JobId", ""), tuple(p for p in kv.get("Partition", "").split(",") if p), nodes, per_node,
                      math.inf if limit is None else float(limit), priority,
                      0.0 if eligible is None else max(0.0, eligible - now), tuple(after_start), tuple(after_end))


def _count(text: str | None) -> int:
    t = (text or "").strip()
    return int(t) if t.isdigit() else 0


def _end_s(kv: Mapping[str, str], now: float) -> float:
    """When a job's hold ends, from now: its EndTime, else its start plus its time limit (a pending job's
    EndTime may still read Unknown), else never (no limit)."""
    end = slurm_time(kv.get("EndTime"))
    if end is None:
        start = slurm_time(kv.get("StartTime"))
        try:
            limit = slurm_time_seconds(kv.get("TimeLimit", "UNLIMITED"))
        except ValueError:
            limit = None
        end = None if start is None or limit is None else start + limit
    return math.inf if end is None else max(0.0, end - now)


def _tres_gpus(tres: str) -> int:
    m = re.search(r"gres/gpu=(\d+)", tres)
    return int(m.group(1)) if m else 0


def node_gpus(partitions: Sequence[str], env: Mapping[str, str] | None,
              budget: Budget) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, str]]]:
    """GPUs of every node of ``partitions`` a job may come to use (``sinfo -N``), and the nodes left out
    with their states (down, drained or draining, failing, not responding: none of them starts a job).
    Nodes that backfill plans for a pending job, and nodes in a reservation, are kept: the pending job's
    hold and the reservation say from when and until when they are taken."""
    t0 = time.perf_counter()
    try:
        nodes = sinfo_nodes(env, partitions)  # the project's parser of sinfo -N (its own timeout)
    finally:
        budget.used += time.perf_counter() - t0
    out: dict[str, dict[str, int]] = {p: {} for p in partitions}
    left: dict[str, dict[str, str]] = {}
    for n in nodes:
        if n.partition not in out:
            continue
        if n.usable or _only_reserved(n.state):
            out[n.partition][n.name] = n.gpus
        else:
            left.setdefault(n.partition, {})[n.name] = n.state
    return out, left


def _only_reserved(state: str) -> bool:
    """A node that is up and only planned for a pending job or in a reservation (``maint``, ``reserved``)."""
    s = state.lower()
    return not s.endswith("*") and s.rstrip("$@^-+") in ("planned", "reserved", "maint")


def partition_states(partitions: Sequence[str], env: Mapping[str, str] | None,
                     budget: Budget) -> tuple[dict[str, PartitionState], tuple[str, ...]]:
    """State, MaxTime and MaxNodes of each of ``partitions`` (``scontrol show partition``), and those Slurm
    does not have."""
    t0 = time.perf_counter()
    try:
        infos = {p.name: p for p in show_partitions(env)}
    finally:
        budget.used += time.perf_counter() - t0
    states = {}
    for name in partitions:
        info = infos.get(name)
        if info is None:
            continue
        limit = slurm_time_seconds(info.max_time) if info.max_time else None
        states[name] = PartitionState(name, info.state.upper() or "UP", math.inf if limit is None else float(limit),
                                      info.max_nodes)
    return states, tuple(p for p in partitions if p not in infos)


def reservations(env: Mapping[str, str] | None, budget: Budget, now: float, *, asked: str = "",
                 account: str = "") -> tuple[list[Reservation], list[str]]:
    """Every reservation of nodes (``scontrol show reservation``); ``asked``: the one the site's jobs ask for
    (``--reservation``), used by them where this user may (``account``: the jobs' account). Notes say when
    the one asked for is missing or not this user's."""
    t0 = time.perf_counter()
    try:
        infos = show_reservations(env)
    finally:
        budget.used += time.perf_counter() - t0
    user = getpass.getuser()
    notes, out = [], []
    for r in infos:
        if not r.nodes:
            continue
        start, end = slurm_time(r.start), slurm_time(r.end)
        mine = r.name == asked and may_use(r, user, account)
        if r.name == asked and not mine:
            notes.append(f"reservation {asked} (--reservation of the site's jobs) is not open to user {user}")
        out.append(Reservation(r.name, 0.0 if start is None else start - now,
                               math.inf if end is None else end - now, tuple(expand_hostlist(r.nodes)), r.flags, mine))
    if asked and asked not in {r.name for r in infos}:
        notes.append(f"reservation {asked} (--reservation of the site's jobs) does not exist: its jobs would be refused")
    return out, notes


def may_use(r: ReservationInfo, user: str, account: str = "") -> bool:
    """Whether ``user`` (with ``account``) may run in reservation ``r``: named in its users or accounts, or
    not excluded where it lists only exclusions (``-name``)."""
    def allowed(names: tuple[str, ...], me: str) -> bool | None:
        if not names or not me:
            return None
        if all(n.startswith("-") for n in names):
            return f"-{me}" not in names
        return me in names
    verdicts = [v for v in (allowed(r.users, user), allowed(r.accounts, account)) if v is not None]
    return any(verdicts)


def wait_history(env: Mapping[str, str] | None, budget: Budget, *, now: float | None = None,
                 days: int = HISTORY_DAYS) -> tuple[list[WaitHistory], HistoryError | None]:
    """Median wait per partition and size (nodes, to a power of two) over the past ``days`` of ``sacct``,
    and that estimator's error on those jobs, each predicted by the median of the others of its group."""
    end = datetime.fromtimestamp(now if now is not None else time.time())
    start = end - timedelta(days=days)
    fmt = "%Y-%m-%dT%H:%M:%S"
    proc = budget.run(["sacct", "-X", "-a", "-n", "-P", "-S", start.strftime(fmt), "-E", end.strftime(fmt),
                       "-o", "JobID,Partition,Submit,Start,NNodes"], env, check=False)
    if proc.returncode != 0:
        raise SailorError(f"sacct failed: {(proc.stderr or proc.stdout).strip()[:200]}", field="sacct",
                          fix="the site has no accounting database: only Slurm's own estimates are used")
    groups: dict[tuple[str, int], list[float]] = {}
    for line in proc.stdout.splitlines():
        f = line.split("|")
        if len(f) < 5:
            continue
        submit, begin = slurm_time(f[2]), slurm_time(f[3])
        if submit is None or begin is None or not f[4].isdigit():
            continue
        bucket = 1 << max(0, int(f[4]) - 1).bit_length()
        for part in f[1].split(","):
            groups.setdefault((part, bucket), []).append(max(0.0, begin - submit))
    history = [WaitHistory(p, n, statistics.median(w), len(w)) for (p, n), w in sorted(groups.items())]
    errors = [abs(w[i] - statistics.median(w[:i] + w[i + 1:])) for w in groups.values() if len(w) > 1
              for i in range(len(w))]
    if not errors:
        return history, None
    return history, HistoryError(len(errors), statistics.fmean(errors), sum(e <= 60 for e in errors) / len(errors))


class StartEstimator:
    """Gathers a :class:`QueueSnapshot` and Slurm's answers for exact requests, within one time budget;
    ``sbatch --test-only`` answers are cached per (request, time limit) for ``ttl_s``."""

    def __init__(self, env: Mapping[str, str] | None = None, *, budget_s: float = DEFAULT_BUDGET_S,
                 ttl_s: float = 30.0, history: bool = True):
        self.env = env
        self.budget = Budget(budget_s)
        self.ttl_s = ttl_s
        self.history = history
        self._tested: dict[tuple[RequestShape, int], tuple[float, float]] = {}  # key -> (asked at, start at)

    def new_plan(self) -> None:
        """A new plan's calls: the budget starts again (cached answers stay while fresh)."""
        self.budget = Budget(self.budget.total)

    def snapshot(self, partitions: Sequence[str], *, reservation: str = "", account: str = "") -> QueueSnapshot:
        """The queue of ``partitions`` now, with the site's states that decide when a request can start:
        partition states and limits, nodes left out, reservations (``reservation``: the one the site's jobs
        ask for; ``account``: theirs), and the pending jobs Slurm has not planned."""
        now = time.time()
        notes: list[str] = []
        nodes, left = node_gpus(partitions, self.env, self.budget)
        states: dict[str, PartitionState] = {}
        unknown: tuple[str, ...] = ()
        try:
            states, unknown = partition_states(partitions, self.env, self.budget)
        except SlurmUnavailable as exc:
            notes.append(f"partition states not read: {exc}")
        if unknown:
            notes.append(f"Slurm has no partition {', '.join(unknown)} of the site: not planned on")
        held: list[Reservation] = []
        try:
            held, said = reservations(self.env, self.budget, now, asked=reservation, account=account)
            notes += said
        except SlurmUnavailable as exc:
            notes.append(f"reservations not read: {exc}")
        holds: list[Hold] = []
        unplanned: list[PendingJob] = []
        try:
            holds, unplanned = queue_holds(self.env, self.budget, now)
        except SlurmUnavailable as exc:
            notes.append(f"queue not read: {exc}")
        history: list[WaitHistory] = []
        error = None
        if self.history:
            try:
                history, error = wait_history(self.env, self.budget, now=now)
            except (SlurmUnavailable, SailorError) as exc:
                notes.append(f"no wait history: {exc}")
        return QueueSnapshot(now, nodes, tuple(holds), {}, tuple(history), error, self.budget.used, tuple(notes),
                             partitions=states, reservations=tuple(held), unplanned=tuple(unplanned),
                             nodes_left_out=left, unknown_partitions=unknown)

    def site_snapshot(self, site: Site, partitions: Sequence[str] | None = None) -> QueueSnapshot:
        """:meth:`snapshot` of ``site``'s partitions (or ``partitions``), its jobs' reservation and account
        read from the site's sbatch options."""
        asked = {o.name: o.value or "" for o in site_sbatch_options(site)}
        names = [p.name for p in site.partitions] if partitions is None else list(partitions)
        return self.snapshot(names, reservation=asked.get("reservation", ""), account=asked.get("account", ""))

    def test_only(self, site: Site, snapshot: QueueSnapshot,
                  requests: Iterable[tuple[RequestShape, int]]) -> QueueSnapshot:
        """``snapshot`` with Slurm's ``sbatch --test-only`` start for each distinct (shape, time limit s),
        as far as the budget goes (the rest keep the timeline's estimate; a note says how many)."""
        tested = dict(snapshot.tested)
        skipped = 0
        for key in dict.fromkeys(requests):
            hit = self._tested.get(key)
            if hit is None or time.time() - hit[0] >= self.ttl_s:
                try:
                    asked = time.time()
                    when = self._ask(site, *key)
                except SlurmUnavailable:
                    skipped += 1
                    continue
                if when is None:  # a request Slurm refuses (a partition limit): the timeline's estimate stays
                    continue
                hit = self._tested[key] = (asked, when)
            # a wait from now: the search's own seconds since the snapshot are no queue wait
            tested[key] = StartEstimate(max(0.0, hit[1] - time.time()), TEST_ONLY, shape_text(key[0]))
        notes = snapshot.notes + ((f"{skipped} request(s) not tested: Slurm-call budget spent",) if skipped else ())
        return replace(snapshot, tested=tested, notes=notes, slurm_seconds=self.budget.used)

    def _ask(self, site: Site, shape: RequestShape, limit_s: int) -> float | None:
        """Slurm's expected start (epoch seconds) of the request, None where it refuses it."""
        proc = self.budget.run(["sbatch", "--test-only"], self.env, stdin=request_script(site, shape, limit_s),
                               check=False)
        m = _TEST_ONLY.search(proc.stderr + proc.stdout)
        return slurm_time(m.group(1)) if m else None


def request_script(site: Site, shape: RequestShape, limit_s: int, body: str = "true", name: str | None = None) -> str:
    """The batch script of a request: one het component per (partition, GPUs per node), one task per GPU,
    the site's account/QoS/constraint, ``limit_s`` rounded up to minutes; ``body`` is what it runs."""
    minutes = max(1, math.ceil(limit_s / 60))
    common = [o.text for o in site_sbatch_options(site)]
    lines = ["#!/bin/bash"]
    first = True
    for part, gpus in shape:
        gres = site.partition(part).gres
        for per_node in sorted(set(gpus), reverse=True):
            if not first:
                lines.append("#SBATCH hetjob")
            first = False
            opts = [f"--partition={part}", f"--nodes={gpus.count(per_node)}", f"--ntasks-per-node={per_node}",
                    f"--gres={gres}:{per_node}", f"--time={minutes}", *common]
            lines += [f"#SBATCH {o}" for o in opts]
    if name is not None:
        lines.insert(1, f"#SBATCH --job-name={name}")
    return "\n".join(lines + [body, ""])
