"""Where a cold rank's start-up goes, and what a rank forked from a zygote still spends.

tiny-gpt on CPU (gloo), a 2-rank plan resuming from a 2-step checkpoint to step 3, as a job that takes over
after a resize does:

1. imports: one rank under ``python -X importtime -m megatron_patch.launch`` (1-rank plan), the cumulative
   time of each import the process makes at top level, the fastest of ``--repeat`` runs, grouped: the
   project's own modules (they import before torch), torch, megatron-core (through
   ``megatron_patch.mcore_import``), ``torch._dynamo`` (0 since the runtime's optimizer stopped importing it;
   ``torch.optim.AdamW`` imports it at its first parameter group) and the rest. ``-X importtime`` slows
   imports down; the groups' shares are what it tells.
2. phases, ``--repeat`` runs each way: the ranks as new interpreters (as srun and torchrun start them) and
   forked from a zygote that imported torch and megatron-core once (``megatron_patch.local.start(fork=True)``,
   the tests' way). Of the rank that reached its first step last: seconds from the start to ``joined`` (the
   ``start`` event: interpreter, imports, torch, the rendezvous), to ``built`` (``ready``: megatron-core,
   data, model, optimizer) and to the first step's end, median over runs; the checkpoint load (``loaded``'s
   seconds on the rank that waited least in its collectives); and the CPU seconds of both ranks together.

    .venv/bin/python benchmarks/rank_startup.py [--repeat 5]

Wall seconds on a shared 2-core machine move with its load; the CPU seconds move less.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_patch import local  # noqa: E402
from megatron_patch.zygote import ForkedProcess  # noqa: E402
from sailor_hpc.core.plan import Pipeline, Plan, Stage  # noqa: E402

MODEL = "tiny-gpt"
PHASES = ("start", "ready", "loaded", "step")  # the events whose first line marks each phase's end
GROUPS = ("project", "torch", "megatron-core", "torch._dynamo", "other")


def _group(module: str) -> str:
    top = module.split(".")[0]
    if top in ("megatron_patch", "sailor_hpc"):
        return "project"
    if module.startswith("torch._dynamo"):
        return "torch._dynamo"
    return {"torch": "torch", "megatron": "megatron-core"}.get(top, "other")


def import_groups(importtime: str) -> dict[str, float]:
    """Seconds per group of the top-level imports in ``-X importtime`` output (nested ones are inside them)."""
    out: dict[str, float] = defaultdict(float)
    for line in importtime.splitlines():
        if not line.startswith("import time:") or "|" not in line or "self [us]" in line:
            continue
        _, cumulative, name = line[len("import time:"):].split("|")
        if not name.startswith("  ") and name.strip():  # depth 0: a name indented by one space only
            out[_group(name.strip())] += int(cumulative) / 1e6
    return dict(out)


def _argv(plan: Path, data: str, ckpt: Path, save: Path) -> list[str]:
    return ["-m", "megatron_patch.launch", "--plan", str(plan), "--model", MODEL, "--data", data, "--load",
            str(ckpt), "--save", str(save), "--steps", "3"]


def _watch(procs: list[local.RankProcess], logs: Path, t0: float) -> list[dict[str, float]]:
    """Seconds since ``t0`` at which each rank's stdout first showed each phase's event (polled every 10 ms)."""
    seen: list[dict[str, float]] = [{} for _ in procs]
    while True:
        running = any(p.poll() is None for p in procs)
        now = time.perf_counter() - t0
        for r, marks in enumerate(seen):
            for line in (logs / f"rank{r}.out").read_text().splitlines():
                if line.startswith("{"):
                    event = json.loads(line)
                    if event.get("event") in PHASES and event["event"] not in marks:
                        marks[event["event"]] = now
                        if event["event"] == "loaded":
                            marks["load_s"] = event["seconds"]
        if not running:
            return seen
        time.sleep(0.01)


def phases(plan: Path, data: str, ckpt: Path, root: Path, fork: bool, run: int) -> dict[str, float]:
    logs = root / f"logs-{'fork' if fork else 'new'}-{run}"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    procs = local.start(_argv(plan, data, ckpt, root / f"save-{fork}-{run}"), 2, logs=logs, fork=fork)
    marks = _watch(procs, logs, t0)
    results = local.wait(procs, timeout=600)
    for r in results:
        if r.returncode != 0:
            raise RuntimeError(f"rank {r.rank} exited {r.returncode}:\n{r.stderr[-3000:]}")
    if fork:
        cpu = sum(p.cpu_s or 0.0 for p in procs if isinstance(p, ForkedProcess))
    else:
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    last = max(marks, key=lambda m: m["step"])  # the rank the run waited for (the other waits in its collectives)
    # the load's own seconds: on the rank that waited least in its collectives
    return {"joined": last["start"], "built": last["ready"], "load": min(m["load_s"] for m in marks),
            "first step": last["step"], "cpu": cpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="runs each way (new interpreters, forked)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = str(root / "data")
        local.build_dataset(data)
        plans = {}
        for n in (1, 2):
            plans[n] = root / f"plan{n}.json"
            Plan(MODEL, 8, tuple(Pipeline(8 // n, 1, (Stage(0, 5, 1, "CPU"),)) for _ in range(n))).save(plans[n])
        ckpt = root / "ckpt"
        made = local.run(["-m", "megatron_patch.launch", "--plan", str(plans[2]), "--model", MODEL, "--data", data,
                          "--save", str(ckpt), "--steps", "2"], 2, timeout=600)
        if any(r.returncode for r in made):
            raise RuntimeError(f"the checkpoint run failed:\n{made[0].stderr[-3000:]}")

        groups: dict[str, float] = {}
        for i in range(args.repeat):  # the fastest of the runs, per group: a busy machine slows some imports
            env = local.rank_env(0, 1, local.free_port())
            res = subprocess.run([sys.executable, "-X", "importtime", *_argv(plans[1], data, ckpt, root / f"one{i}")],
                                 cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
            if res.returncode != 0:
                raise RuntimeError(res.stderr[-3000:])
            for g, s in import_groups(res.stderr).items():
                groups[g] = min(groups.get(g, s), s)

        t0 = time.perf_counter()
        local.zygote_for(local.rank_env(0, 2, 0))
        zygote_s = time.perf_counter() - t0
        runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for i in range(args.repeat):  # alternating, so a change in the machine's load touches both alike
            for fork in (False, True):
                runs[fork].append(phases(plans[2], data, ckpt, root, fork, i))

    total = sum(groups.values())
    print(f"imports of one cold rank (python -X importtime, top-level imports, fastest of {args.repeat}; "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})")
    for g in GROUPS:
        print(f"  {g:<15}{groups.get(g, 0.0):>7.2f} s {100 * groups.get(g, 0.0) / total:>4.0f} %")
    print(f"  {'all':<15}{total:>7.2f} s")
    print(f"\n2 ranks resuming from a checkpoint to one step, seconds since the start (slower rank; median of "
          f"{args.repeat})")
    cols = ("joined", "built", "load", "first step", "cpu")
    print(f"  {'ranks':<22}" + "".join(f"{c:>12}" for c in cols))
    for fork, label in ((False, "new interpreters"), (True, "forked from a zygote")):
        print(f"  {label:<22}" + "".join(f"{statistics.median(r[c] for r in runs[fork]):>12.2f}" for c in cols))
    print(f"  (the zygote itself started in {zygote_s:.1f} s, once; cpu: both ranks' user + system seconds)")
    local.close_zygotes()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
