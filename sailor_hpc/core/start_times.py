"""What the queue looks like, as plain data: the facts a start-time estimate is computed from.

``sailor_hpc.slurm.start_estimate`` reads them from Slurm (``sinfo``, ``squeue``, ``sbatch --test-only``,
``sacct``); the planner (which never talks to Slurm) turns them into an expected start per request shape
(:mod:`planner.start_model`). Times are seconds from the snapshot (``taken_at``, epoch seconds).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

#: a job request: per partition, the GPUs it asks of each of its nodes (largest first), partitions sorted
RequestShape = tuple[tuple[str, tuple[int, ...]], ...]

IDLE_NOW = "idle now"
TIMELINE = "squeue timeline"
TEST_ONLY = "sbatch --test-only"
HISTORY = "sacct history"
SITE_STATE = "site state"  # the request can never start under the partitions', nodes' or reservations' states

#: partition states in which Slurm starts jobs (DOWN queues them, DRAIN and INACTIVE refuse them too)
STARTS_JOBS = frozenset({"UP"})


def request_shape(demands: Mapping[str, list[int] | tuple[int, ...]]) -> RequestShape:
    """The canonical shape of per-partition, per-node GPU demands (zero-GPU nodes and partitions dropped)."""
    return tuple(sorted((p, tuple(sorted((g for g in d if g > 0), reverse=True)))
                        for p, d in demands.items() if any(g > 0 for g in d)))


def shape_text(shape: RequestShape) -> str:
    """``a100:2x4+v100:1x2`` (partition: nodes x GPUs; mixed node sizes listed one by one)."""
    out = []
    for part, gpus in shape:
        sizes = sorted(set(gpus), reverse=True)
        out.append(f"{part}:" + ",".join(f"{gpus.count(g)}x{g}" for g in sizes))
    return "+".join(out)


@dataclass(frozen=True)
class Hold:
    """GPUs of one node that a job holds over [start_s, end_s): a running job from 0 until its end (its
    time limit), a pending job Slurm has planned (``squeue --start``) from its expected start."""

    partition: str
    node: str
    gpus: int
    start_s: float
    end_s: float = math.inf  # no end known (a job without a time limit)
    job: str = ""


@dataclass(frozen=True)
class StartEstimate:
    """An expected start (seconds from the snapshot), where it came from, and the site states it took into
    account (``considered``: partition states, nodes left out, reservations, pending jobs Slurm has not
    planned). ``start_s`` is math.inf where the request can never start; ``detail`` then says why."""

    start_s: float
    source: str  # IDLE_NOW, TIMELINE, TEST_ONLY, HISTORY or SITE_STATE
    detail: str = ""
    considered: tuple[str, ...] = ()


@dataclass(frozen=True)
class PartitionState:
    """What Slurm says of a partition that decides whether and how long a job runs there."""

    name: str
    state: str = "UP"  # UP, DOWN (jobs queue, none starts), DRAIN / INACTIVE (new jobs refused)
    max_time_s: float = math.inf  # MaxTime
    max_nodes: int | None = None  # MaxNodes per job (None: unlimited)

    @property
    def starts_jobs(self) -> bool:
        return self.state.upper() in STARTS_JOBS

    def refusal(self) -> str:
        """Why a job here never starts (``""`` where it may)."""
        state = self.state.upper()
        if state == "DOWN":
            return f"partition {self.name} is DOWN: its jobs queue, none starts until an admin sets it UP"
        if state in ("DRAIN", "INACTIVE"):
            return f"partition {self.name} is {state}: Slurm accepts no new job there"
        return "" if self.starts_jobs else f"partition {self.name} is {state}"


@dataclass(frozen=True)
class Reservation:
    """A Slurm reservation of nodes over [start_s, end_s) (math.inf: no end). ``ours``: this user may use it
    and the site's jobs ask for it (``--reservation``): jobs then run in it alone; else its nodes are taken
    for its whole time (a job that would cross into it starts after it, or fits before it)."""

    name: str
    start_s: float
    end_s: float
    nodes: tuple[str, ...]
    flags: tuple[str, ...] = ()
    ours: bool = False

    def text(self) -> str:
        until = "no end" if not math.isfinite(self.end_s) else f"until +{self.end_s:.0f} s"
        when = "now" if self.start_s <= 0 else f"from +{self.start_s:.0f} s"
        return f"reservation {self.name} ({len(self.nodes)} node(s), {when}, {until})"


@dataclass(frozen=True)
class PendingJob:
    """A pending job Slurm has not planned yet (no expected start and nodes: held by a dependency or a begin
    time, or not reached by the backfill pass). Jobs ahead of a new request take their GPUs first."""

    job: str
    partitions: tuple[str, ...]  # it may start in any of them
    nodes: int
    gpus_per_node: int
    limit_s: float  # its time limit (math.inf: none)
    priority: int
    eligible_s: float = 0.0  # its begin time, from the snapshot
    after_start: tuple[str, ...] = ()  # jobs that must have started (``after:``)
    after_end: tuple[str, ...] = ()  # jobs that must have ended (``afterok``, ``afterany``, ``afternotok``)


@dataclass(frozen=True)
class WaitHistory:
    """Past queue waits (start - submit) of this site's jobs of one partition and size (nodes, rounded up
    to a power of two)."""

    partition: str
    nodes: int
    median_wait_s: float
    jobs: int


@dataclass(frozen=True)
class HistoryError:
    """How well the history estimator predicted this site's past jobs (each from the others, leave one out)."""

    jobs: int
    mean_abs_error_s: float
    within_60s: float  # share of jobs predicted within a minute


@dataclass(frozen=True)
class QueueSnapshot:
    """The queue at ``taken_at``: every usable node's GPUs, what holds them and until when, Slurm's own
    answers for exact requests, and the history of waits."""

    taken_at: float
    node_gpus: Mapping[str, Mapping[str, int]]  # partition -> usable node -> GPUs
    holds: tuple[Hold, ...] = ()
    tested: Mapping[tuple[RequestShape, int], StartEstimate] = field(default_factory=dict)  # (shape, time s)
    history: tuple[WaitHistory, ...] = ()
    history_error: HistoryError | None = None
    slurm_seconds: float = 0.0  # time spent in Slurm calls to build this
    notes: tuple[str, ...] = ()  # what could not be read (a failed sacct, the time bound reached)
    partitions: Mapping[str, PartitionState] = field(default_factory=dict)  # read from Slurm ({}: all UP)
    reservations: tuple[Reservation, ...] = ()
    unplanned: tuple[PendingJob, ...] = ()
    nodes_left_out: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # partition -> node -> state
    unknown_partitions: tuple[str, ...] = ()  # partitions of the site Slurm does not have

    def history_wait(self, partition: str, nodes: int) -> WaitHistory | None:
        """The closest history entry: this partition and size bucket, else the partition's nearest size."""
        rows = [h for h in self.history if h.partition == partition]
        if not rows:
            return None
        bucket = 1 << max(0, nodes - 1).bit_length()
        return min(rows, key=lambda h: (abs(math.log2(h.nodes) - math.log2(bucket)), -h.jobs))

    @staticmethod
    def all_idle(node_gpus: Mapping[str, Mapping[str, int]], taken_at: float = 0.0) -> QueueSnapshot:
        """A queue with nothing in it (every GPU named starts now)."""
        return QueueSnapshot(taken_at=taken_at, node_gpus={p: dict(n) for p, n in node_gpus.items()})
