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
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sailor_hpc.core.atomic import atomic_path, atomic_write_text
from sailor_hpc.core.errors import SailorError
from simulator.iteration import Collective, StageKey, last_met

COLORS = {"fwd": "#4c72b0", "bwd": "#55a868", "send_act": "#c4a000", "recv_act": "#c4a000", "send_grad": "#dd8452",
          "recv_grad": "#dd8452", "post_act": "#e9d98a", "post_grad": "#f0c0a0", "exchange": "#c4a000",
          "tied": "#8172b3", "grads": "#c44e52", "optimizer": "#333333", "wait": "#bbbbbb"}


@dataclass(frozen=True)
class Event:
    pipeline: int
    stage: int
    kind: str  # fwd, bwd, send_act, recv_act, send_grad, recv_grad, exchange, post_act, post_grad (a message in
    # flight: its sender went on), tied, grads, wait, optimizer
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
                    events.append(Event(k[0], k[1], op.kind, op.mb, start, clock[k], op.peer))
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
            if e.kind in ("fwd", "bwd", "send_act", "recv_act", "send_grad", "recv_grad", "exchange"):
                k = (e.pipeline, e.stage)
                out[k] = max(out.get(k, 0.0), e.end)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"iteration_time_s": self.iteration_time_s, "events": [asdict(e) for e in self.events]}

    def write_json(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=0) + "\n")

    def write_png(self, path: str | Path, title: str = "") -> None:
        write_gantt(self, path, title)


def write_gantt(timeline: Timeline, path: str | Path, title: str = "") -> None:
    """Per-rank Gantt chart of one iteration (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted({(e.pipeline, e.stage) for e in timeline.events})
    row = {k: n for n, k in enumerate(ranks)}
    fig, ax = plt.subplots(figsize=(14, max(2.6, 0.35 * len(ranks) + 1.2)))
    for e in timeline.events:
        if e.end <= e.start:
            continue
        posted = e.kind.startswith("post_")  # in flight while the sender computes: a thin bar under its row
        ax.barh(row[(e.pipeline, e.stage)] + (0.3 if posted else 0.0), e.end - e.start, left=e.start,
                height=0.2 if posted else 0.8, color=COLORS.get(e.kind, "#999"), edgecolor="none")
    ax.set_yticks(range(len(ranks)), [f"p{p} s{s}" for p, s in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title or f"one iteration: {timeline.iteration_time_s:.4g} s")
    kinds = ["fwd", "bwd", "send_act", "send_grad", "post_act", "post_grad", "tied", "wait", "grads", "optimizer"]
    labels = ["forward", "backward", "activation transfer", "gradient transfer", "activation in flight",
              "gradient in flight", "tied-embedding all-reduce",
              "wait for the slowest replica", "gradient all-reduce", "optimizer"]
    ax.legend(handles=[Patch(color=COLORS[k], label=lab) for k, lab in zip(kinds, labels)], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    with atomic_path(path) as tmp:  # the user's path in any error; nothing half-written
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
