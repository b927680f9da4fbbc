"""Resident ranks (``--resident DIR``) outlive an allocation change in their own processes.

This test plays the job agent (``sailor_hpc.controller.job_agent``, tried on the real cluster in
tests/controller/test_resident_cluster.py) by hand, on local gloo ranks:

- a rank is SIGKILLed mid-run (its node lost): every survivor's blocked collective fails within a second (the
  failure cascades through the connections the survivors shut down), each says it holds, takes a place in a
  new two-rank plan, loads the newest complete checkpoint and trains on, in the same process;
- a rank is frozen (SIGSTOP: its node cut off or hung, its processes alive, its connections open): no
  collective fails, the survivors would wait for the collective timeout; the agent's wake marker (written when
  the node's step ends) makes each survivor shut its own connections down, hold within seconds and rejoin;
- SIGUSR1 (a drain, a resize): every rank saves, holds, and the two that stay restore the layers they keep
  from their own memory (``from_memory``), the others' layers from the files.

Both end equal to the single-process reference run (the uninterrupted trajectory) to 1e-6.
"""
from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

from megatron_patch import local
from sailor_hpc.core.checkpoint import latest_complete, step_dir, step_of
from sailor_hpc.core.resident import Directive, read_held, write_directive, write_wake
from tests.megatron_patch.conftest import Env, events, launch_args, max_diff

STEPS = 12


def _wait(what: str, cond: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _steps(log: Path) -> list[int]:
    if not log.exists():
        return []
    return [e["step"] for e in map(json.loads, filter(None, log.read_text().splitlines())) if e.get("event") == "step"]


def _start(env: Env, root: Path, name: str) -> tuple[list[local.RankProcess], Path, Path, Path]:
    save, resident, logs = root / f"{name}-ckpt", root / f"{name}-resident", root / f"{name}-logs"
    resident.mkdir(parents=True)
    # --auto-resume with no checkpoint yet: the ranks build without weights and draw them when none loads
    argv = launch_args(env, "A", STEPS, save, "--save-interval", "2", "--resident", str(resident), "--auto-resume")
    return local.start(argv, 4, logs=logs, fork=True), save, resident, logs


def _directive(env: Env, epoch: int, ranks: list[int | None]) -> Directive:
    return Directive(epoch=epoch, plan=str(env.plans["2"]), master_addr="127.0.0.1", master_port=local.free_port(),
                     world_size=2, ranks={socket.gethostname(): ranks})


def test_survivors_of_a_lost_rank_rejoin_a_new_plan(runtime_env: Env, ref_file: Callable[[int], Path]) -> None:
    procs, save, resident, logs = _start(runtime_env, runtime_env.root, "lost")
    _wait("a checkpoint of step 4", lambda: (step_of(latest_complete(save) or "step_00000000") or 0) >= 4)
    procs[3].kill()  # its node lost: TP partner of rank 2, gradient partner of ranks 0 and 1
    t_kill = time.time()
    _wait("the three survivors holding", lambda: len(read_held(resident, 0)) == 3, timeout=60)
    held = read_held(resident, 0)
    assert all(not h.saved for h in held.values()), held
    assert max(h.t for h in held.values()) - t_kill < 5.0, held  # no collective timeout: the failure cascaded
    newest = latest_complete(save)
    assert newest is not None
    write_directive(resident, _directive(runtime_env, 1, [1, 0, None, None]))  # ranks swap: nothing from memory
    results = local.wait(procs[:3], timeout=300)
    assert [r.returncode for r in results] == [0, 0, 0], [r.stderr[-3000:] for r in results]
    for old, new in ((0, 1), (1, 0)):
        starts = events(results[old], "start")
        assert [s["world_size"] for s in starts] == [4, 2] and starts[1]["rank"] == new
        loaded = events(results[old], "loaded")[-1]
        assert loaded["step"] == step_of(newest) and loaded["from_memory"] == 0
        assert events(results[old], "done")[0]["step"] == STEPS
    assert not events(results[2], "done") and len(events(results[2], "start")) == 1  # it left
    assert max_diff(step_dir(save, STEPS), ref_file(STEPS))["param"] <= 1e-6


def test_survivors_of_a_frozen_rank_leave_when_woken(runtime_env: Env, ref_file: Callable[[int], Path]) -> None:
    procs, save, resident, logs = _start(runtime_env, runtime_env.root, "frozen")
    _wait("a checkpoint of step 4", lambda: (step_of(latest_complete(save) or "step_00000000") or 0) >= 4)
    procs[3].send_signal(signal.SIGSTOP)  # its node cut off: alive, its connections open
    time.sleep(3.0)
    assert not read_held(resident, 0), "a survivor held with no connection closed"  # they wait in a collective
    t_wake = time.time()
    write_wake(resident, 0, "step ended on the frozen rank's node")  # what the job agent writes then
    _wait("the three survivors holding", lambda: len(read_held(resident, 0)) == 3, timeout=60)
    held = read_held(resident, 0)
    assert all(not h.saved for h in held.values()) and max(h.t for h in held.values()) - t_wake < 5.0, held
    procs[3].kill()
    write_directive(resident, _directive(runtime_env, 1, [0, 1, None, None]))
    results = local.wait(procs[:3], timeout=300)
    assert [r.returncode for r in results] == [0, 0, 0], [r.stderr[-3000:] for r in results]
    # the first woken shuts its connections down: the others may fail on that before they see the marker
    assert any("woken by the job agent" in r.stderr for r in results), [r.stderr[-2000:] for r in results]
    for r in results[:2]:
        assert [s["world_size"] for s in events(r, "start")] == [4, 2]
        assert events(r, "done")[0]["step"] == STEPS
    assert max_diff(step_dir(save, STEPS), ref_file(STEPS))["param"] <= 1e-6


def test_a_signal_saves_and_the_kept_layers_come_from_memory(runtime_env: Env,
                                                             ref_file: Callable[[int], Path]) -> None:
    procs, save, resident, logs = _start(runtime_env, runtime_env.root, "drain")
    _wait("step 3", lambda: len(_steps(logs / "rank0.out")) >= 3)
    pids = [p.pid for p in procs]
    procs[2].send_signal(signal.SIGUSR1)  # one rank only: the others learn it from the step's all-reduce
    _wait("all four holding", lambda: len(read_held(resident, 0)) == 4, timeout=60)
    held = read_held(resident, 0)
    assert {h.saved for h in held.values()} == {True} and len({h.step for h in held.values()}) == 1, held
    step = next(iter(held.values())).step
    assert latest_complete(save) == step_dir(save, step)
    assert sorted(h.pid for h in held.values()) == sorted(pids)
    # plan A's rank 0 (layers 0-1) and rank 1 (layers 2-5) keep their places: all their layers from memory
    write_directive(resident, _directive(runtime_env, 1, [0, 1, None, None]))
    results = local.wait(procs, timeout=300)
    assert [r.returncode for r in results] == [0] * 4, [r.stderr[-3000:] for r in results]
    for r in results[:2]:
        loaded = events(r, "loaded")[-1]
        assert loaded["step"] == step and loaded["from_memory"] > 0, loaded
        assert events(r, "done")[0]["step"] == STEPS
    assert max_diff(step_dir(save, STEPS), ref_file(STEPS))["param"] <= 1e-6
