"""The site's states as holds on the GPU timeline a request's start is read from.

A queue snapshot says what jobs hold; this adds what the site itself decides: reservations take their
nodes over their whole time (a reservation the site's jobs ask for and this user may use is the other
way round: the job may run only in it), and the pending jobs Slurm has not planned yet (held by a
dependency or a begin time, or not reached by the backfill pass) are placed where backfill would start
them, highest priority first, each at the first moment its nodes are free for its whole time limit after
it is eligible. A new request is lowest in priority (FIFO; under multifactor its age is zero), so these
jobs go first and the request backfills around them.

It also says when a request can never start (:meth:`SiteTimeline.refusal`, :meth:`SiteTimeline.never_fits`)
and what an estimate took into account (:meth:`SiteTimeline.considered`).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from sailor_hpc.core.start_times import Hold, PendingJob, QueueSnapshot, RequestShape, Reservation

MAX_UNPLANNED = 200  # pending jobs placed at most: beyond that, a request is behind them for longer than a plan


def fits(demands: tuple[int, ...], free: Mapping[str, int]) -> bool:
    """First-fit of per-node GPU demands into the nodes' free GPUs (one node per demand)."""
    return fits_sorted(demands, sorted(free.values(), reverse=True))


def fits_sorted(demands: tuple[int, ...], slots: list[int]) -> bool:
    """:func:`fits` on the free GPUs sorted largest first. First-fit over sorted nodes takes the largest
    unused node every time (a smaller one fits no demand the largest refuses), so the k-th demand lands on
    the k-th largest node: the request fits when each of those holds it."""
    return len(demands) <= len(slots) and all(have >= need for have, need in zip(slots, demands))


class SiteTimeline:
    """The holds of a snapshot with the reservations' and the unplanned pending jobs' added."""

    def __init__(self, snapshot: QueueSnapshot):
        self.snapshot = snapshot
        self.node_gpus = snapshot.node_gpus
        self._partitions_of: dict[str, list[str]] = {}
        for part, nodes in snapshot.node_gpus.items():
            for node in nodes:
                self._partitions_of.setdefault(node, []).append(part)
        reserved = tuple(h for r in snapshot.reservations for h in self._reservation_holds(r))
        self.holds_without_unplanned: tuple[Hold, ...] = tuple(snapshot.holds) + reserved
        self.unplanned_holds: tuple[Hold, ...] = self._place_unplanned(self.holds_without_unplanned)
        self.holds: tuple[Hold, ...] = self.holds_without_unplanned + self.unplanned_holds
        self._placed = {h.job for h in self.unplanned_holds}

    # ------------------------------------------------------------------------------------------ holds

    def _on_node(self, node: str, gpus_of: dict[str, int] | None, start: float, end: float, job: str) -> list[Hold]:
        """Holds of ``node`` in every partition that has it (a node in two partitions is one node)."""
        return [Hold(p, node, self.node_gpus[p][node] if gpus_of is None else gpus_of[p], start, end, job)
                for p in self._partitions_of.get(node, ())]

    def _reservation_holds(self, r: Reservation) -> list[Hold]:
        label = f"reservation {r.name}"
        start, end = max(0.0, r.start_s), r.end_s
        if not r.ours:
            return [h for node in r.nodes for h in self._on_node(node, None, start, end, label)]
        # the job asks for it: it runs on its nodes during it, nowhere else and never after it
        inside = set(r.nodes)
        out: list[Hold] = []
        for node in self._partitions_of:
            if node not in inside:
                out += self._on_node(node, None, 0.0, math.inf, f"{label} (the job asks for it)")
                continue
            if start > 0:
                out += self._on_node(node, None, 0.0, start, f"{label} (not started yet)")
            if math.isfinite(end):
                out += self._on_node(node, None, end, math.inf, f"{label} (ended)")
        return out

    def _place_unplanned(self, holds: tuple[Hold, ...]) -> tuple[Hold, ...]:
        jobs = sorted(self.snapshot.unplanned, key=lambda j: (-j.priority, _job_order(j.job)))[:MAX_UNPLANNED]
        placed: list[Hold] = []
        for job in jobs:
            earliest = self._eligible(job, (*holds, *placed))
            if not math.isfinite(earliest):
                continue
            best: tuple[float, str, list[str]] | None = None
            for part in job.partitions:
                found = self._earliest_nodes(part, job, earliest, (*holds, *placed))
                if found is not None and (best is None or found[0] < best[0]):
                    best = (found[0], part, found[1])
            if best is None:
                continue
            start, part, nodes = best
            end = start + job.limit_s
            gpus = {p: job.gpus_per_node for p in self.node_gpus}
            placed += [h for node in nodes for h in self._on_node(node, gpus, start, end, job.job)]
        return tuple(placed)

    def _eligible(self, job: PendingJob, holds: tuple[Hold, ...]) -> float:
        """When ``job`` may start: its begin time and its dependencies (a job no longer in the queue has
        ended; one still pending that is not placed yet starts no sooner than never)."""
        t = max(0.0, job.eligible_s)
        known = {h.job for h in holds}
        pending = {j.job for j in self.snapshot.unplanned}
        for dep in job.after_start:
            if dep in known:
                t = max(t, min(h.start_s for h in holds if h.job == dep))
            elif dep in pending:
                return math.inf
        for dep in job.after_end:
            if dep in known:
                t = max(t, max(h.end_s for h in holds if h.job == dep))
            elif dep in pending:
                return math.inf
        return t

    def _earliest_nodes(self, part: str, job: PendingJob, earliest: float,
                        holds: tuple[Hold, ...]) -> tuple[float, list[str]] | None:
        """The first start from ``earliest`` at which ``job.nodes`` nodes of ``part`` each keep
        ``job.gpus_per_node`` free for its whole limit, and those nodes (the fullest first: best fit)."""
        nodes = self.node_gpus.get(part, {})
        if not nodes or self.partition_refusal(part, job.nodes):
            return None
        mine = [h for h in holds if h.partition == part]
        times = sorted({earliest, *(t for h in mine for t in (h.start_s, h.end_s) if math.isfinite(t) and t > earliest)})
        for t0 in times:
            ends = t0 + job.limit_s
            checks = [t for t in times if t0 <= t < ends]
            free_at = [self.free_at(part, t, mine) for t in checks]
            ok = [n for n in nodes if all(f[n] >= job.gpus_per_node for f in free_at)]
            if len(ok) >= job.nodes:
                return t0, sorted(ok, key=lambda n: (free_at[0][n], n))[:job.nodes]
        return None

    def free_at(self, partition: str, t: float, holds: Iterable[Hold]) -> dict[str, int]:
        """Free GPUs per usable node of ``partition`` at ``t`` under ``holds``."""
        free = dict(self.node_gpus.get(partition, {}))
        for h in holds:
            if h.partition == partition and h.node in free and h.start_s <= t < h.end_s:
                free[h.node] -= h.gpus
        return free

    # ------------------------------------------------------------------------------- never / considered

    def partition_refusal(self, part: str, nodes: int = 1) -> str:
        """Why a request of ``nodes`` nodes of ``part`` never starts ("" where it may)."""
        snap = self.snapshot
        if part in snap.unknown_partitions:
            return f"Slurm has no partition {part}"
        state = snap.partitions.get(part)
        if state is not None:
            why = state.refusal()
            if why:
                return why
            if state.max_nodes is not None and nodes > state.max_nodes:
                return f"the request asks {nodes} nodes of {part}, above its MaxNodes {state.max_nodes}"
        if not self.node_gpus.get(part):
            left = snap.nodes_left_out.get(part, {})
            states = ", ".join(sorted(set(left.values())))
            return f"partition {part} has no usable node" + (f" ({len(left)} {states})" if left else "")
        return ""

    def refusal(self, shape: RequestShape) -> str:
        """Why ``shape`` can never start under the partitions' states and limits ("" where it may)."""
        return next((why for part, gpus in shape if (why := self.partition_refusal(part, len(gpus)))), "")

    def never_fits(self, part: str, gpus: tuple[int, ...]) -> str:
        """Why ``gpus`` never fit ``part``'s nodes that some time frees ("" where they may)."""
        forever = {h.node for h in self.holds_without_unplanned
                   if h.partition == part and not math.isfinite(h.end_s) and h.job.startswith("reservation ")}
        nodes = self.node_gpus.get(part, {})
        if fits(gpus, {n: g for n, g in nodes.items() if n not in forever}):
            return ""
        if forever and fits(gpus, nodes):
            names = sorted({h.job for h in self.holds_without_unplanned if h.node in forever and h.partition == part})
            return f"{', '.join(names)} hold(s) {len(forever)} node(s) of {part} with no end"
        return f"the request asks more than the usable nodes of {part} have ({len(nodes)} node(s))"

    def considered(self, shape: RequestShape) -> tuple[str, ...]:
        """The site states an estimate of ``shape`` took into account, in words."""
        snap = self.snapshot
        out: list[str] = []
        parts = [p for p, _ in shape]
        nodes = {n for p in parts for n in (*self.node_gpus.get(p, {}), *snap.nodes_left_out.get(p, {}))}
        for p in parts:
            state = snap.partitions.get(p)
            if state is not None:
                out.append(f"partition {p} {state.state.upper()}")
            left = snap.nodes_left_out.get(p, {})
            if left:
                out.append(f"{len(left)} node(s) of {p} left out: " + ", ".join(f"{n} {s}" for n, s in sorted(left.items())))
        out += [r.text() for r in snap.reservations if nodes & set(r.nodes) or r.ours]
        ahead = [j for j in snap.unplanned if set(j.partitions) & set(parts)]
        if ahead:
            placed = sum(j.job in self._placed for j in ahead)
            out.append(f"{len(ahead)} pending job(s) Slurm has not planned, ahead of this request "
                       f"({placed} placed on the timeline)")
        return tuple(out)

    def freed_by(self, shape: RequestShape, start: float) -> str:
        """What ends when ``shape`` starts (``""`` at once): the jobs and reservations it waits for."""
        if start <= 0:
            return ""
        parts = {p for p, _ in shape}
        ends = sorted({_label(h.job, h.job in self._placed) for h in self.holds
                       if h.partition in parts and h.end_s == start})
        if not ends:
            return ""
        return f"when {ends[0]} ends" if len(ends) == 1 else f"when {', '.join(ends[:-1])} and {ends[-1]} end"


def _label(job: str, unplanned: bool) -> str:
    if job.startswith("reservation "):
        return job.split(" (")[0]
    return f"pending job {job} (not planned by Slurm)" if unplanned else f"job {job}"


def _job_order(job: str) -> tuple[int, str]:
    head = job.split("_")[0].split("+")[0]
    return (int(head), job) if head.isdigit() else (0, job)


__all__ = ["MAX_UNPLANNED", "SiteTimeline", "fits", "fits_sorted"]
