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
    """An expected start (seconds from the snapshot) and where it came from."""

    start_s: float
    source: str  # IDLE_NOW, TIMELINE, TEST_ONLY or HISTORY
    detail: str = ""


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
