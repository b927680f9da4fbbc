"""Checkpoints survive the failures a Slurm job meets: killed mid-write, and the time-limit signal.

- A rank SIGKILLed while writing (half a layer file; or everything written but not yet renamed) leaves
  no checkpoint that ``latest_complete`` or ``--auto-resume`` would take: the previous one is loaded,
  and training from it under another plan still matches the single-process reference.
- SIGUSR1 to one rank only: all ranks agree at the next step boundary, write one complete checkpoint
  (equal to the reference at that step), and exit 75; its manifest (step, data position) is readable
  without torch. (Resuming any checkpoint under other plans is test_exactness's chain.)
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from megatron_patch import local
from sailor_hpc.core.checkpoint import latest_complete, read_manifest, step_dir, tmp_dir
from sailor_hpc.core.dist_env import EXIT_SAVED_ON_SIGNAL
from tests.megatron_patch.conftest import GLOBAL_BATCH, Env, events, launch, launch_args, max_diff

KILLER = ["tests/megatron_patch/kill_worker.py"]


def test_checkpoint_killed_mid_write_is_never_loaded(runtime_env: Env, ref_file: Callable[[int], Path]) -> None:
    root = runtime_env.root / "killed"
    ref_losses = json.loads((runtime_env.ref / "losses.json").read_text())
    # plan A saves step 2, then rank 0 dies halfway through a layer file of step 4
    launch(runtime_env, "A", 4, root, "--save-interval", "2", program=KILLER, expect=None,
           extra_env={"FAULT": "mid_file", "FAULT_STEP": "4"}, grace=1)
    assert tmp_dir(root, 4).is_dir() and not step_dir(root, 4).exists()
    assert latest_complete(root) == step_dir(root, 2)
    assert max_diff(step_dir(root, 2), ref_file(2))["param"] <= 1e-6

    # a requeued job under another plan (two ranks, micro-batches 3x2 vs 1x2) resumes from step 2 (not the
    # torn step 4) and trains on exactly; rank 0 then dies after writing every file and the manifest of
    # step 4, before the rename
    logs = launch(runtime_env, "2", 4, root, "--auto-resume", program=KILLER, expect=None,
                  extra_env={"FAULT": "before_commit", "FAULT_STEP": "4"}, grace=1)
    assert events(logs[0], "loaded")[0]["step"] == 2
    steps = events(logs[0], "step")
    assert [e["step"] for e in steps] == [3, 4]
    # same bound as test_exactness: float32 sums in another order differ in the 6th digit, so rounding
    # both to 5 decimals could split a pair that straddles a rounding boundary (5.050985 -> .05098/.05099)
    assert all(abs(e["loss"] - ref_losses[e["step"] - 1]) < 1e-5 for e in steps), \
        [(e["loss"], ref_losses[e["step"] - 1]) for e in steps]
    assert (tmp_dir(root, 4) / "manifest.json").is_file() and not step_dir(root, 4).exists()
    assert latest_complete(root) == step_dir(root, 2)


def _wait_for_step(log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and '"event": "step"' in log.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"no training step logged in {log} after {timeout} s")


def test_signal_saves_a_complete_checkpoint_and_exits_75(
        runtime_env: Env, ref_file: Callable[[int], Path]) -> None:
    root = runtime_env.root / "signal"
    logs = runtime_env.root / "signal-logs"
    procs = local.start(launch_args(runtime_env, "A", 18, root), 4, logs=logs, fork=True)
    _wait_for_step(logs / "rank0.out")
    procs[2].send_signal(signal.SIGUSR1)  # one rank only: the others learn it from the step's all-reduce
    results = local.wait(procs, timeout=180)
    assert [r.returncode for r in results] == [EXIT_SAVED_ON_SIGNAL] * 4, [r.stderr[-2000:] for r in results]
    stopped = {events(r, "signal")[0]["step"] for r in results}
    assert len(stopped) == 1
    step = stopped.pop()
    assert step < 18
    assert all(events(r, "saved")[0]["path"] == str(step_dir(root, step)) for r in results)
    assert latest_complete(root) == step_dir(root, step)

    # the controller's view: step and data position from the manifest, without torch
    code = ("import sys, json; sys.modules['torch'] = None\n"
            "from sailor_hpc.core.checkpoint import latest_complete, read_manifest\n"
            f"m = read_manifest(latest_complete({str(root)!r}))\n"
            "print(json.dumps([m['step'], m['consumed_samples'], m['plan']['pipelines'][0]['num_micro_batches']]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=local.REPO, capture_output=True, text=True,
                         env=local.rank_env(0, 1, 0))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [step, step * GLOBAL_BATCH, 3]
    assert read_manifest(step_dir(root, step))["consumed_samples"] == step * GLOBAL_BATCH

    assert max_diff(step_dir(root, step), ref_file(step))["param"] <= 1e-6  # complete and exact

    # resuming with another seed would permute the epoch differently: every rank refuses it (bad input);
    # two ranks suffice (any plan loads the checkpoint, and each rank checks the seed itself)
    other = launch(runtime_env, "2", step + 2, root, "--auto-resume", "--seed", "987654", expect=2)
    assert all("--seed" in r.stdout + r.stderr for r in other), other[0].stderr[-2000:]
    assert latest_complete(root) == step_dir(root, step)


def test_a_corrupt_newest_checkpoint_is_named_wherever_the_run_reports(runtime_env: Env,
                                                                       ref_file: Callable[[int], Path]) -> None:
    """The newest checkpoint truncated (a full disk, say): a resume loads the one before and says so on
    stdout's events, rank 0's human log and the metrics file; an explicit --load of it exits 2; and a
    --save nobody can write is refused before any rank starts."""
    root = runtime_env.root / "truncated"
    launch(runtime_env, "2", 4, root, "--save-interval", "2")
    layer = sorted(step_dir(root, 4).glob("layer_*.pt"))[-1]
    layer.write_bytes(layer.read_bytes()[:64])
    logs = launch(runtime_env, "2", 5, root, "--auto-resume")
    (skip,) = events(logs[0], "checkpoint_skipped")
    assert skip["path"] == str(step_dir(root, 4)) and skip["reason"].startswith(f"{layer.name}: size 64 != ")
    assert skip["using"] == str(step_dir(root, 2)) and events(logs[0], "loaded")[0]["step"] == 2
    assert f"warning: checkpoint {step_dir(root, 4)} is unusable ({layer.name}: size 64" in logs[0].stderr
    assert "resumed from step 2 (" in logs[0].stderr
    kinds = [json.loads(line)["kind"] for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert kinds.count("checkpoint_skipped") == 1 and kinds.count("resumed") == 1
    assert max_diff(step_dir(root, 2), ref_file(2))["param"] <= 1e-6  # the step loaded is the reference's

    explicit = launch(runtime_env, "2", 6, runtime_env.root / "other", "--load", str(step_dir(root, 4)), expect=2)
    assert all(layer.name in r.stderr and "Traceback" not in r.stderr for r in explicit)
    refused = launch(runtime_env, "2", 1, Path("/proc/sailor-nope"), expect=2)
    for r in refused:
        assert "error: /proc/sailor-nope: --save: the directory cannot be created" in r.stderr
        assert not events(r, "start")  # refused before any rank joined the group
