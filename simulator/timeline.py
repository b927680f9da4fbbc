"""Event-driven replay of one iteration, rank by rank: the ``--timeline`` chart and the independent
check of :mod:`simulator.schedule` and :mod:`simulator.iteration`.

Every stage of every pipeline gets the instruction list DeepSpeed's ``TrainSchedule`` issues (load,
forward, backward, send/receive of activations and gradients, then the tied-embedding and gradient
all-reduces and the optimizer step), its transfers in the runtime's form (:mod:`simulator.runtimes`). An
engine then runs the lists: compute advances a rank's clock; a blocking send and its matching receive
(same boundary, same micro-batch; megatron's batched exchange is one rendezvous) start together once both
ranks have reached them and end together; a buffered send is posted (it leaves when its rank's link is
free, and the rank goes on) and its receive ends when it has arrived; a collective runs on the ranks'
communication streams, starts once its last participant is ready (its part of the gradients computed, its
previous collective done), plus the straggler wait of :mod:`simulator.iteration` (drawn as a "wait"
event); the optimizer waits for the last one. Nothing here uses the step recurrence or the closed forms of
the analytic model, so agreement between the two is a real check.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sailor_hpc.core.atomic import atomic_path, atomic_write_text
from sailor_hpc.core.errors import SailorError
from simulator.iteration import Collective, StageKey, last_met

if TYPE_CHECKING:
    from matplotlib.figure import Figure

COLORS = {"fwd": "#4c72b0", "bwd": "#55a868", "send_act": "#c4a000", "recv_act": "#c4a000", "send_grad": "#dd8452",
          "recv_grad": "#dd8452", "post_act": "#e9d98a", "post_grad": "#f0c0a0", "exchange": "#c4a000",
          "tied": "#8172b3", "grads": "#c44e52", "optimizer": "#333333", "wait": "#bbbbbb", "idle": "#eeeeee",
          "compute": "#4f8d7d"}


@dataclass(frozen=True)
class Event:
    pipeline: int
    stage: int
    kind: str  # fwd, bwd, send_act, recv_act, send_grad, recv_grad, exchange, post_act, post_grad (a message in
    # flight: its sender went on), idle (waiting for a message or a peer), tied, grads, wait, optimizer
    micro_batch: int | None
    start: float
    end: float
    peer: str = ""


@dataclass(frozen=True)
class _Op:
    kind: str
    mb: int | None = None
    seconds: float = 0.0
    key: tuple | None = None  # rendezvous key (p2p pair or collective)
    parties: int = 1
    peer: str = ""
    skew: float = 0.0  # collectives: straggler wait per second since the parties last met
    mode: str = ""  # "post": asynchronous send, "await": asynchronous receive, "": compute or rendezvous
    lead: float = 0.0  # collectives: seconds before the rank's flush that its part is ready (overlapped sync)


def deepspeed_steps(num_stages: int, stage: int, micro_batches: int) -> list[list[tuple[str, int]]]:
    """DeepSpeed ``TrainSchedule`` of one stage: per step, its (instruction, micro-batch) pairs.

    Step ``t`` maps to a micro-batch and a direction exactly as DeepSpeed's ``_step_to_micro_batch``;
    forward steps exchange with the previous stage (send the last gradient, receive the activation),
    backward steps with the next one (receive the gradient, send the last activation).
    """
    P, s, m = num_stages, stage, micro_batches
    steps: list[list[tuple[str, int]]] = []
    prev = -1

    def valid(b: int) -> bool:
        return 0 <= b < m

    for step in range(2 * (m + P - 1)):
        out: list[tuple[str, int]] = []
        even_step, even_stage = step % 2 == 0, s % 2 == 0
        if even_step and even_stage:
            mb, fwd = step // 2 - s // 2, True
        elif not even_step and not even_stage:
            mb, fwd = (step - 1) // 2 - s // 2, True
        elif even_step:
            mb, fwd = step // 2 - P + (s + 1) // 2, False
        else:
            mb, fwd = (step - 1) // 2 - P + 1 + s // 2, False
        if fwd:
            if valid(prev) and s > 0:
                out.append(("send_grad", prev))
            if valid(mb) and s > 0:
                out.append(("recv_act", mb))
            if valid(mb):
                out.append(("fwd", mb))
        else:
            if valid(mb) and s < P - 1:
                out.append(("recv_grad", mb))
            if valid(prev) and s < P - 1:
                out.append(("send_act", prev))
            if valid(mb):
                out.append(("bwd", mb))
        prev = mb
        steps.append(out)
    return steps


_BOUNDARY_SIDE = {"send_act": 0, "recv_grad": 0, "recv_act": -1, "send_grad": -1}  # boundary = stage + this


def _transfer_ops(i: int, j: int, group: list[tuple[str, int]], act: float, grad: float, asynchronous: bool,
                  serial: bool) -> list[_Op]:
    """One step's transfers of a rank with the neighbour across boundary j (stage j -> j + 1)."""
    def peer(name: str) -> str:
        return f"stage {j + 1 if name in ('send_act', 'recv_grad') else j}"

    def seconds(name: str) -> float:
        return act if name in ("send_act", "recv_act") else grad

    def key(name: str, mb: int) -> tuple:
        return ("act" if name in ("send_act", "recv_act") else "grad", i, j, mb)

    if asynchronous:  # post the sends (first, unless DeepSpeed's order says otherwise), await the receives
        if not serial:
            group = sorted(group, key=lambda op: not op[0].startswith("send"))
        return [_Op(name, mb, seconds(name), key(name, mb), 1, peer(name),
                    mode="post" if name.startswith("send") else "await") for name, mb in group]
    if serial:  # one blocking send/recv pair after the other
        return [_Op(name, mb, seconds(name), key(name, mb), 2, peer(name)) for name, mb in group]
    mbs = {("act" if name in ("send_act", "recv_act") else "grad"): mb for name, mb in group}
    return [_Op("exchange", None, max(seconds(name) for name, _ in group),
                ("x", i, j, mbs.get("act"), mbs.get("grad")), 2, peer(group[0][0]))]


def build_programs(F: Sequence[Sequence[float]], B: Sequence[Sequence[float]], act: Sequence[Sequence[float]],
                   grad: Sequence[Sequence[float]], micro_batches: Sequence[int], collectives: Sequence[Collective],
                   update: dict[StageKey, float], asynchronous: Sequence[Sequence[bool]] | None = None,
                   serial: bool = True) -> dict[StageKey, list[_Op]]:
    """Instruction lists of every rank (pipeline i, stage s) of one iteration.

    ``asynchronous[i][j]``: boundary j of pipeline i moves messages that fit the staging buffer (sends
    are posted, receives await the bytes); ``serial``: DeepSpeed's order, else the sends and receives of
    one step are posted together (megatron's batched exchange, one rendezvous when blocking)."""
    progs: dict[StageKey, list[_Op]] = {}
    for i, (Fi, Bi) in enumerate(zip(F, B)):
        P = len(Fi)
        for s in range(P):
            ops: list[_Op] = []
            for step in deepspeed_steps(P, s, micro_batches[i]):
                group = [(name, mb) for name, mb in step if name in _BOUNDARY_SIDE]  # one neighbour per step
                if group:
                    j = s + _BOUNDARY_SIDE[group[0][0]]
                    ops += _transfer_ops(i, j, group, act[i][j], grad[i][j],
                                         bool(asynchronous[i][j]) if asynchronous is not None else False, serial)
                ops += [_Op(name, mb, (Fi if name == "fwd" else Bi)[s]) for name, mb in step if name in ("fwd", "bwd")]
            progs[(i, s)] = ops
    for n, c in enumerate(collectives):
        for h, lead in zip(c.holders, c.lead or (0.0,) * len(c.holders)):
            progs[h].append(_Op(c.kind, None, c.seconds, ("coll", n), len(c.holders), f"layers {c.first_layer}-{c.last_layer}",
                                c.skew, lead=lead))
    for key, ops in progs.items():
        ops.append(_Op("optimizer", None, update[key]))
    return progs


def run_programs(progs: dict[StageKey, list[_Op]]) -> list[Event]:
    """Execute the instruction lists; rendezvous ops start when every party has reached them, a posted
    send leaves once its rank's outgoing link is free (a node's NIC carries its sends to both neighbours)
    and lets its rank go on, an awaited receive ends when its bytes have arrived."""
    pc = {k: 0 for k in progs}
    clock = {k: 0.0 for k in progs}
    met: list[tuple[frozenset, float]] = []  # (ranks, end) of every collective so far
    waiting: dict[tuple, list[tuple[StageKey, float]]] = {}
    in_flight: dict[tuple, float] = {}  # posted message -> arrival time
    comm: dict[StageKey, float] = {}  # rank -> when its communication stream ends its last collective
    out_free: dict[StageKey, float] = {}  # rank -> when its node's link is free for its next send
    in_free: dict[StageKey, float] = {}  # rank -> when its node's link is free to take in its next message
    inbox = _Inbox(progs)
    events: list[Event] = []
    active = [k for k in progs if progs[k]]
    while active:
        moved = False
        for k in active:
            ops = progs[k]
            while pc[k] < len(ops):
                op = ops[pc[k]]
                if op.key is None:
                    if op.kind == "optimizer":  # after the rank's last collective
                        clock[k] = max(clock[k], comm.get(k, 0.0))
                    events.append(Event(k[0], k[1], op.kind, op.mb, clock[k], clock[k] + op.seconds, op.peer))
                    clock[k] += op.seconds
                elif op.mode == "post":
                    to = inbox.receiver[op.key]
                    if not inbox.is_next(op.key):
                        break  # the receiver's link takes an earlier message first
                    depart = max(clock[k], out_free.get(k, 0.0), in_free.get(to, 0.0))
                    in_flight[op.key] = out_free[k] = in_free[to] = depart + op.seconds
                    inbox.done(op.key)
                    events.append(Event(k[0], k[1], "post_" + op.key[0], op.mb, depart, depart + op.seconds, op.peer))
                elif op.mode == "await":
                    if op.key not in in_flight:
                        break
                    start, clock[k] = clock[k], max(clock[k], in_flight.pop(op.key))
                    # the bytes moved on the sender's link (its post_ event): here the rank only waits for them
                    events.append(Event(k[0], k[1], "idle", op.mb, start, clock[k], f"{op.kind} from {op.peer}"))
                else:
                    arrived = waiting.setdefault(op.key, [])
                    if all(r != k for r, _ in arrived):  # a collective runs on the rank's communication stream
                        ready = max(clock[k] - op.lead, comm.get(k, 0.0)) if op.key[0] == "coll" else clock[k]
                        arrived.append((k, ready))
                    if len(arrived) < op.parties:
                        break
                    _meet(progs, pc, clock, comm, events, met, op, arrived)
                    if op.key[0] != "coll":  # a blocking message holds its receiver's link until it has moved
                        for r in inbox.receivers(op.key):
                            in_free[r] = max(in_free.get(r, 0.0), clock[r])
                        inbox.done(op.key)
                    del waiting[op.key]
                    moved = True
                    continue
                pc[k] += 1
                moved = True
        active = [k for k in active if pc[k] < len(progs[k])]
        if active and not moved:
            stuck = {k: progs[k][pc[k]].kind for k in active}
            raise SailorError(f"the schedule deadlocks (ranks waiting: {stuck})", field="pipelines",
                              fix="report this plan: every send must have a matching receive")
    return events


class _Inbox:
    """The messages each rank takes in, in its program's order (the schedule's step order): a node's incoming
    link serves them in that order, so a posted message leaves only once every earlier one to the same rank
    has been sent (or, blocking, has moved)."""

    def __init__(self, progs: dict[StageKey, list[_Op]]) -> None:
        self.receiver: dict[tuple, StageKey] = {}
        self.queue: dict[StageKey, list[tuple]] = {}
        for k, ops in progs.items():
            for op in ops:
                if op.key is not None and (op.mode == "await" or op.kind.startswith("recv") or op.kind == "exchange"):
                    self.receiver[op.key] = k
                    self.queue.setdefault(k, []).append(op.key)
        self.pos = {k: 0 for k in self.queue}
        self.finished: set[tuple] = set()

    def receivers(self, key: tuple) -> list[StageKey]:
        """Who takes the message in (a batched blocking exchange: both of its ranks)."""
        return [self.receiver[key]] if key[0] != "x" else [k for k, q in self.queue.items() if key in q]

    def is_next(self, key: tuple) -> bool:
        r = self.receiver[key]
        return self.queue[r][self.pos[r]] == key

    def done(self, key: tuple) -> None:
        self.finished.add(key)
        for r in self.receivers(key):
            q = self.queue[r]
            while self.pos[r] < len(q) and q[self.pos[r]] in self.finished:
                self.pos[r] += 1


def _meet(progs: dict[StageKey, list[_Op]], pc: dict[StageKey, int], clock: dict[StageKey, float],
          comm: dict[StageKey, float], events: list[Event], met: list[tuple[frozenset, float]], op: _Op,
          arrived: list[tuple[StageKey, float]]) -> None:
    """Every party of a rendezvous has arrived: run it (with a collective's straggler wait) for all of them;
    a collective ends on the ranks' communication streams, a transfer on their clocks."""
    start = max(t for _, t in arrived)
    if op.skew:
        wait = op.skew * (start - last_met(met, [r for r, _ in arrived]))
        events.extend(Event(r[0], r[1], "wait", None, start, start + wait, "slowest replica") for r, _ in arrived)
        start += wait
    coll = op.key is not None and op.key[0] == "coll"
    if coll:
        met.append((frozenset(r for r, _ in arrived), start + op.seconds))
    else:  # a blocking transfer: whoever came first waits for its peer (a collective waits on its comm stream)
        events.extend(Event(r[0], r[1], "idle", op.mb, ready, start, f"{progs[r][pc[r]].kind}: peer not ready")
                      for r, ready in arrived if ready < start)
    for r, _ in arrived:
        rop = progs[r][pc[r]]
        events.append(Event(r[0], r[1], rop.kind, rop.mb, start, start + rop.seconds, rop.peer))
        if coll:
            comm[r] = start + rop.seconds
        else:
            clock[r] = start + rop.seconds
        pc[r] += 1


@dataclass(frozen=True)
class Timeline:
    events: tuple[Event, ...]
    gpu_types: Mapping[StageKey, str] = field(default_factory=dict)  # (pipeline, stage) -> GPU type: row names

    @property
    def iteration_time_s(self) -> float:
        return max(e.end for e in self.events)

    def stage_end(self, kind: str | None = None) -> dict[StageKey, float]:
        """Last end time per rank (of one kind of event, or of all)."""
        out: dict[StageKey, float] = {}
        for e in self.events:
            if kind is None or e.kind == kind:
                k = (e.pipeline, e.stage)
                out[k] = max(out.get(k, 0.0), e.end)
        return out

    def flush_times(self) -> dict[StageKey, float]:
        """When each rank ended its last pipeline instruction (compute or transfer)."""
        out: dict[StageKey, float] = {}
        for e in self.events:
            if e.kind in ("fwd", "bwd", "send_act", "recv_act", "send_grad", "recv_grad", "exchange", "idle"):
                k = (e.pipeline, e.stage)
                out[k] = max(out.get(k, 0.0), e.end)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"iteration_time_s": self.iteration_time_s, "events": [asdict(e) for e in self.events]}

    def write_json(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=0) + "\n")

    def write_png(self, path: str | Path, title: str = "") -> None:
        write_gantt(self, path, title)

    def figure(self, title: str = "") -> Figure:
        return gantt_figure(self, title)


DENSE_EVENTS = 80  # work events in one row beyond which the whole iteration is drawn binned, with a zoom
BINS = 600
_TRANSFERS = ("send_act", "recv_act", "send_grad", "recv_grad", "exchange")
_LEGEND = [("fwd", "forward"), ("bwd", "backward"), ("send_act", "activation transfer"),
           ("send_grad", "gradient transfer"), ("post_act", "activation in flight"), ("post_grad", "gradient in flight"),
           ("idle", "waiting for a message or a peer"), ("tied", "tied-embedding all-reduce"),
           ("wait", "wait for the slowest replica"), ("grads", "gradient all-reduce"), ("optimizer", "optimizer")]


def chart_rows(timeline: Timeline) -> list[tuple[str, StageKey]]:
    """One row per distinct rank schedule: replicas whose events are identical (same kinds, same times) share
    a row, labelled with how many it stands for; a 64-replica plan is as many rows as it has shapes. A row is
    named by its GPU type and stage (what tells a mixed plan's rows apart), then the pipeline(s) it draws:
    ``V100-16 stage 1 (p16 +63 identical)``."""
    by_rank: dict[StageKey, list[tuple]] = {}
    for e in timeline.events:
        by_rank.setdefault((e.pipeline, e.stage), []).append((e.kind, round(e.start, 9), round(e.end, 9)))
    groups: dict[tuple, list[StageKey]] = {}
    for k in sorted(by_rank):
        groups.setdefault((k[1], tuple(sorted(by_rank[k]))), []).append(k)
    rows = []
    for ranks in sorted(groups.values()):
        p, s = ranks[0]
        gpu = timeline.gpu_types.get((p, s))
        name = f"{gpu} stage {s}" if gpu else f"stage {s}"
        rows.append((f"{name} (p{p}" + (f" +{len(ranks) - 1} identical)" if len(ranks) > 1 else ")"), ranks[0]))
    return rows


def _binned(events: list[Event], end: float) -> list[tuple[float, float, str]]:
    """A row's iteration in :data:`BINS` slices, each coloured by what takes most of it (compute = forward and
    backward together), merged into runs: readable however many micro-batches the plan has."""
    width = end / BINS
    share = [dict[str, float]() for _ in range(BINS)]
    for e in events:
        kind = "compute" if e.kind in ("fwd", "bwd") else "send_act" if e.kind in _TRANSFERS else e.kind
        lo, hi = int(e.start / width), min(BINS - 1, int(e.end / width))
        for b in range(lo, hi + 1):
            overlap = min(e.end, (b + 1) * width) - max(e.start, b * width)
            if overlap > 0:
                share[b][kind] = share[b].get(kind, 0.0) + overlap
    runs: list[tuple[float, float, str]] = []
    for b, sh in enumerate(share):
        if not sh:
            continue
        kind = max(sh, key=lambda k: sh[k])
        if runs and runs[-1][2] == kind and abs(runs[-1][0] + runs[-1][1] - b * width) < width / 2:
            runs[-1] = (runs[-1][0], runs[-1][1] + width, kind)
        else:
            runs.append((b * width, width, kind))
    return runs


def _draw(ax, rows: list[tuple[str, StageKey]], events: dict[StageKey, list[Event]], t_end: float | None,
          binned: bool) -> None:
    """One panel: every row's events up to ``t_end`` (None: all), one ``broken_barh`` per row and kind."""
    for n, (_, k) in enumerate(rows):
        mine = [e for e in events[k] if e.end > e.start and (t_end is None or e.start < t_end)]
        posted = [e for e in mine if e.kind.startswith("post_")]
        work = [e for e in mine if not e.kind.startswith("post_")]
        spans: dict[str, list[tuple[float, float]]] = {}
        if binned:
            for start, width, kind in _binned(work, max(e.end for e in work)):
                spans.setdefault(kind, []).append((start, width))
        else:
            for e in work:
                spans.setdefault(e.kind, []).append((e.start, min(e.end, t_end or e.end) - e.start))
        for kind, xs in spans.items():
            ax.broken_barh(xs, (n - 0.4, 0.8), facecolors=COLORS.get(kind, "#999"), edgecolor="none",
                           hatch="////" if kind == "idle" else None)
        if not binned:  # in flight while the sender computes: a thin bar under its row
            for kind in ("post_act", "post_grad"):
                xs = [(e.start, e.end - e.start) for e in posted if e.kind == kind]
                if xs:
                    ax.broken_barh(xs, (n + 0.2, 0.2), facecolors=COLORS[kind], edgecolor="none")
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)


def present_transfer(timeline: Timeline) -> bool:
    return any(e.kind in _TRANSFERS for e in timeline.events)


def write_gantt(timeline: Timeline, path: str | Path, title: str = "") -> None:
    """:func:`gantt_figure` as a PNG, written atomically (the user's path in any error; nothing half-written)."""
    fig = gantt_figure(timeline, title)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")


def gantt_figure(timeline: Timeline, title: str = "") -> Figure:
    """Per-rank Gantt chart of one iteration (matplotlib, no display needed; tests read the figure back).

    Identical replicas share a row (:func:`chart_rows`). Up to :data:`DENSE_EVENTS` events a row, every
    event is drawn; beyond, the first panel shows the whole iteration binned (what takes most of each
    slice: pipeline fill and drain, steady state, all-reduce tail) and a second panel the first micro-batches
    in full, where the schedule's pattern shows (later micro-batches repeat it)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = chart_rows(timeline)
    events: dict[StageKey, list[Event]] = {}
    for e in timeline.events:
        events.setdefault((e.pipeline, e.stage), []).append(e)
    work = max(sum(1 for e in events[k] if e.kind in ("fwd", "bwd")) for _, k in rows)
    dense = work > DENSE_EVENTS
    height = max(2.6, 0.3 * len(rows) + 1.2)
    fig = Figure(figsize=(14, height * (2 if dense else 1)))
    axes = fig.subplots(2 if dense else 1, 1, squeeze=False)
    ax = axes[0][0]
    _draw(ax, rows, events, None, binned=dense)
    ax.set_xlabel("seconds")
    ax.set_title(title or f"one iteration: {timeline.iteration_time_s:.4g} s")
    legend = [(k, lab) for k, lab in _LEGEND if k != "fwd" and k != "bwd"] if dense else _LEGEND
    if dense:
        legend = [("compute", "forward + backward"), *legend]
        zoom_ax = axes[1][0]
        first = rows[0][1]
        bwd = sorted(e.end for e in events[first] if e.kind == "bwd")
        stages = 1 + max(s for p, s in events if p == first[0])
        t_zoom = bwd[min(len(bwd), 2 * stages + 2) - 1]
        _draw(zoom_ax, rows, events, t_zoom, binned=False)
        zoom_ax.set_xlim(0, t_zoom)
        zoom_ax.set_xlabel("seconds")
        zoom_ax.set_title(f"the first {min(len(bwd), 2 * stages + 2)} micro-batches of {rows[0][0].split(' (')[0]} "
                          f"in full ({work} forward and backward events a row in all)", fontsize=10)
        legend += [(k, lab) for k, lab in _LEGEND if k in ("fwd", "bwd")]
    present = {e.kind for e in timeline.events} | {"compute", "send_act" if present_transfer(timeline) else ""}
    ax.set_xlim(0, timeline.iteration_time_s)
    ax.legend(handles=[Patch(facecolor=COLORS[k], hatch="////" if k == "idle" else None, label=lab)
                       for k, lab in legend if k in present], loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
