"""Ranks that outlive an allocation change: the files the job agent and the ranks meet in (torch-free).

A job that recovers in place runs one ``srun`` step per node (``sailor_hpc.controller.job_agent``): losing a node
ends that node's step only, and the ranks of the others keep their processes. A rank started with
``--resident DIR`` does not exit when training is interrupted (a peer's connection closed: a node lost; or a
signal it saved on: a drain, a resize, the time limit); it writes a :class:`Held` marker and waits for the
agent's next :class:`Directive`, which gives every surviving rank its place in the new plan (or tells it to
leave), with a fresh rendezvous. Both are JSON files written atomically in ``DIR``:

* ``held-<epoch>/<node>.<local>.json``: a rank of epoch ``epoch`` holds (its step, whether its state is the
  checkpoint of that step, its PID);
* ``epoch-<n>.json``: the agent's answer for epoch ``n`` (1, 2, ...);
* ``wake-<epoch>.json``: the agent saw a node of epoch ``epoch`` lost (its step ended) or a rank fail: every
  rank still training must leave its communicators now. A lost node's processes may live on where it is
  unreachable (a network cut, a hung node), so no connection closes and its peers would wait in a collective
  until the timeout (30 minutes); each rank watches for this file and shuts its own connections down.

A mixed-GPU plan may run as a *bundle*, one plain job per component of its job layout (Slurm ends a whole het
job when one of its nodes goes down, a plain ``--no-kill`` job only that node's step): its agents share a folder.
Each writes ``part-<i>.json`` (its job and its nodes' tasks) when it starts and ``ended/<node>.json`` (the exit
code) when a node's step ends; the first job's agent, beside plan rank 0, answers for every rank.

A rank is named by its node and its index on the node (``SLURM_LOCALID`` of its node's step): both stay the
same for the process's whole life, whatever rank the plans give it.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sailor_hpc.core.atomic import atomic_write_text
from sailor_hpc.core.errors import SailorError

#: the environment variable naming the rank's node (``srun`` sets it on every task; the fake nodes of the
#: local cluster share one host, so the host name would not tell them apart)
NODE_ENV = "SLURMD_NODENAME"


@dataclass(frozen=True)
class Seat:
    """Where a resident rank's process lives, for its whole life."""

    node: str
    local: int

    @property
    def key(self) -> str:
        return f"{self.node}.{self.local}"


@dataclass(frozen=True)
class Held:
    """A rank of ``epoch`` stopped training and waits for the agent. ``saved``: its state is the checkpoint of
    ``step`` (it saved on a signal), so it can restore the layers it keeps from its own memory."""

    epoch: int
    node: str
    local: int
    step: int
    saved: bool
    pid: int
    reason: str
    t: float = field(default_factory=lambda: round(time.time(), 3))


@dataclass(frozen=True)
class Directive:
    """The agent's answer to a held epoch: the next epoch's plan and rendezvous, and each seat's new rank
    (``ranks[node][local]``; None or a node not named: the rank leaves with ``exit_code``). ``plan`` None: every
    rank leaves."""

    epoch: int
    plan: str | None
    master_addr: str
    master_port: int
    world_size: int
    ranks: dict[str, list[int | None]]
    exit_code: int = 0

    def rank_of(self, seat: Seat) -> int | None:
        places = self.ranks.get(seat.node, [])
        return places[seat.local] if seat.local < len(places) else None


@dataclass(frozen=True)
class Part:
    """One job of the agents that share a folder (a bundle's, or a job's alone: index 0 of 1): its nodes and
    each node's number of ranks, and the node its agent (the batch script) runs on."""

    index: int
    job_id: str
    nodes: dict[str, int]
    batch_node: str = ""


def write_part(root: Path, part: Part) -> Path:
    path = root / f"part-{part.index}.json"
    atomic_write_text(path, json.dumps(asdict(part), sort_keys=True) + "\n")
    return path


def read_parts(root: Path) -> dict[int, Part]:
    """The jobs that registered so far, by index."""
    out: dict[int, Part] = {}
    for path in root.glob("part-*.json"):
        try:
            part = Part(**_read_json(path))
        except TypeError as exc:
            raise SailorError(f"not a job's part ({exc})", file=path, fix="run one sailor-hpc version in the job") from None
        out[part.index] = part
    return out


def write_ended(root: Path, node: str, rc: int) -> Path:
    """A node's step ended with ``rc`` (the node was lost, its ranks failed, left or finished)."""
    path = root / "ended" / f"{node}.json"
    atomic_write_text(path, json.dumps({"node": node, "rc": rc}) + "\n")
    return path


def read_ended(root: Path) -> dict[str, int]:
    """Node -> exit code of its step, for every node whose step ended."""
    folder = root / "ended"
    if not folder.is_dir():
        return {}
    out = {}
    for path in folder.glob("*.json"):
        data = _read_json(path)
        out[str(data["node"])] = int(data["rc"])
    return out


def held_dir(root: Path, epoch: int) -> Path:
    return root / f"held-{epoch}"


def directive_file(root: Path, epoch: int) -> Path:
    return root / f"epoch-{epoch}.json"


def store_ready_file(root: Path, epoch: int) -> Path:
    """Made by the new rank 0 once its rendezvous store listens: the others connect only then (a client that
    comes first retries every ~0.5 s, measured on torch 2.13: half a recovery's budget)."""
    return root / f"store-{epoch}.ready"


def wait_for_file(path: Path, poll_s: float = 0.005, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise SailorError(f"did not appear within {timeout_s:.0f} s", file=path,
                              fix="the rank that should make it is gone: the job agent ends the job")
        time.sleep(poll_s)


def wake_file(root: Path, epoch: int) -> Path:
    return root / f"wake-{epoch}.json"


def write_wake(root: Path, epoch: int, reason: str) -> Path:
    """Tell every rank of ``epoch`` still training to leave its communicators (once: the first reason stays)."""
    path = wake_file(root, epoch)
    if not path.exists():
        atomic_write_text(path, json.dumps({"epoch": epoch, "reason": reason, "t": round(time.time(), 3)}) + "\n")
    return path


def write_held(root: Path, held: Held) -> Path:
    path = held_dir(root, held.epoch) / f"{held.node}.{held.local}.json"
    atomic_write_text(path, json.dumps(asdict(held), sort_keys=True) + "\n")
    return path


def read_held(root: Path, epoch: int) -> dict[str, Held]:
    """The markers of the ranks of ``epoch`` that hold, by seat key."""
    out: dict[str, Held] = {}
    folder = held_dir(root, epoch)
    if not folder.is_dir():
        return out
    for path in folder.glob("*.json"):
        data = _read_json(path)
        try:
            held = Held(**data)
        except TypeError as exc:
            raise SailorError(f"not a held marker ({exc})", file=path, fix="the job agent and the runtime disagree: "
                              "run one sailor-hpc version in the job") from None
        out[Seat(held.node, held.local).key] = held
    return out


def write_directive(root: Path, directive: Directive) -> Path:
    path = directive_file(root, directive.epoch)
    atomic_write_text(path, json.dumps(asdict(directive), sort_keys=True) + "\n")
    return path


def read_directive(root: Path, epoch: int) -> Directive | None:
    """The directive of ``epoch``, or None while the agent has not written it."""
    path = directive_file(root, epoch)
    if not path.exists():
        return None
    data = _read_json(path)
    try:
        return Directive(**data)
    except TypeError as exc:
        raise SailorError(f"not a directive ({exc})", file=path,
                          fix="the job agent and the runtime disagree: run one sailor-hpc version in the job") from None


def wait_directive(root: Path, epoch: int, poll_s: float = 0.02) -> Directive:
    """Block until the agent answered ``epoch``. The agent always answers (a new plan, or leave), and a job
    whose agent died is ended by Slurm with its batch script, ranks included."""
    while True:
        d = read_directive(root, epoch)
        if d is not None:
            return d
        time.sleep(poll_s)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SailorError(f"cannot be read ({exc})", file=path) from None
    if not isinstance(data, dict):
        raise SailorError("is not a JSON object", file=path)
    return data


def seat_of(env: dict[str, str] | os._Environ[str], local_rank: int) -> Seat:
    """This process's seat: its node (Slurm's name for it, else the host) and its index there."""
    return Seat(env.get(NODE_ENV) or socket.gethostname(), local_rank)
