"""How many 8-stage plans per second the simulator scores on one core (the planner's fast path).

Candidates: GPT-Neo-2.7B on the paper's A100-40 + V100-16 site (site_configs/a100-v100.toml), 8-stage
pipelines with random layer splits, a GPU type and TP degree per stage, micro-batch size 1/2/4 and
8..128 micro-batches. Per candidate: every stage's compute, update, memory (StageEvaluator, O(1) from
prefix sums), the stage-boundary transfer times, and the exact 1F1B schedule, all pipelines of a batch
in one numpy pass (simulator.schedule.pipeline_schedule). Also prints the one-plan path (simulate()).

    .venv/bin/python benchmarks/simulator_speed.py [--candidates N] [--batch B]
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import numpy as np

from sailor_hpc.core.archive import open_archive
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from sailor_hpc.core.site import load_site
from simulator import SimOptions, StageEvaluator, simulate
from simulator.api import CandidateBatch
from simulator.network import Endpoint
from simulator.runtimes import RUNTIMES

ROOT = Path(__file__).resolve().parents[1]
MODEL = "GPT-Neo-2.7B"
P = 8


def candidates(n: int, L: int, seed: int = 0) -> list[tuple]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        cuts = sorted(rng.sample(range(1, L), P - 1))
        bounds = [0, *cuts, L]
        stages = [(bounds[j], bounds[j + 1] - 1, rng.choice(["A100-40", "V100-16"]), rng.choice([1, 2, 4]))
                  for j in range(P)]
        out.append((rng.choice([1, 2, 4]), rng.randint(8, 128), stages))
    return out


def score(ev: StageEvaluator, batch: list[tuple]) -> tuple[np.ndarray, np.ndarray]:
    """Iteration-less pipeline time and peak memory of each candidate (the planner's inner loop)."""
    F = np.empty((len(batch), P))
    B = np.empty((len(batch), P))
    act = np.empty((len(batch), P - 1))
    grad = np.empty((len(batch), P - 1))
    asy = np.empty((len(batch), P - 1), dtype=bool)
    m = np.empty(len(batch), dtype=np.int64)
    peak = np.empty(len(batch))
    for n, (mbs, micro, stages) in enumerate(batch):
        costs = [ev.stage(g, tp, mbs, a, b) for a, b, g, tp in stages]
        ends = [Endpoint("a100" if g == "A100-40" else "v100", j, tp) for j, (_, _, g, tp) in enumerate(stages)]
        x = ev.exchanges(costs, ends)
        F[n] = [c.fwd_s for c in costs]
        B[n] = [c.bwd_s for c in costs]
        act[n], grad[n], asy[n], m[n] = x.act, x.grad, x.asynchronous, micro
        peak[n] = max(ev.stage_memory(c, stage=j, num_stages=P, micro_batches=micro).total
                      for j, c in enumerate(costs))
    res = ev.pipeline_times(F, B, act, grad, m, asy)
    return res.makespan, peak


def as_batch(batch: list[tuple], mbs: int) -> CandidateBatch:
    """The same candidates as arrays (one micro-batch size per batch, as a planner sweeps them)."""
    kinds = [(g, tp, "a100" if g == "A100-40" else "v100") for g in ("A100-40", "V100-16") for tp in (1, 2, 4)]
    index = {k: n for n, k in enumerate(kinds)}
    first = np.array([[a for a, _, _, _ in st] for _, _, st in batch])
    last = np.array([[b for _, b, _, _ in st] for _, _, st in batch])
    kind = np.array([[index[(g, tp, "a100" if g == "A100-40" else "v100")] for _, _, g, tp in st] for _, _, st in batch])
    return CandidateBatch(mbs=mbs, micro_batches=np.array([m for _, m, _ in batch]), first=first, last=last,
                          kind=kind, stage_kinds=kinds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--candidates", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=2000)
    ap.add_argument("--runtime", choices=list(RUNTIMES), default=None, help="default: each runtime in turn")
    args = ap.parse_args()
    site = load_site(ROOT / "site_configs" / "a100-v100.toml")
    archive = open_archive(site=site)
    for runtime in [args.runtime] if args.runtime else list(RUNTIMES):
        print(f"runtime {runtime}:")
        run(site, archive, SimOptions(runtime=runtime), args.candidates, args.batch)


def run(site, archive, options: SimOptions, n: int, batch: int) -> None:
    ev = StageEvaluator(archive, site, MODEL, options=options)
    cands = candidates(n, ev.model.num_pipeline_layers)
    score(ev, cands[:200])  # warm the per-stage caches as a planner's search does after its first sweep
    t0 = time.perf_counter()
    for i in range(0, len(cands), batch):
        score(ev, cands[i:i + batch])
    dt = time.perf_counter() - t0
    print(f"cached path (StageEvaluator per stage + batched schedule): {len(cands)} {P}-stage candidates "
          f"({MODEL}, A100-40/V100-16, batches of {batch}) in {dt:.2f} s -> {len(cands) / dt:,.0f} evaluations/s")
    by_mbs: dict[int, list[tuple]] = {}
    for c in cands:
        by_mbs.setdefault(c[0], []).append(c)
    batches = [as_batch(group[i:i + batch], mbs) for mbs, group in by_mbs.items()
               for i in range(0, len(group), batch)]
    t0 = time.perf_counter()
    for b in batches:
        ev.score_batch(b)
    dt = time.perf_counter() - t0
    print(f"vectorised path (StageEvaluator.score_batch): {len(cands)} candidates in {dt:.2f} s -> "
          f"{len(cands) / dt:,.0f} evaluations/s  <- the planner's path; target >= 20,000")
    t0 = time.perf_counter()
    nplans = 200
    for mbs, micro, stages in cands[:nplans]:
        plan = Plan(model=MODEL, global_batch_size=mbs * micro, pipelines=(Pipeline(mbs, micro, tuple(
            Stage(a, b, tp, g) for a, b, g, tp in stages)),))
        simulate(plan, site, archive, options=options)
    dt = time.perf_counter() - t0
    print(f"full path: simulate() on {nplans} whole plans -> {nplans / dt:,.0f} plans/s")


if __name__ == "__main__":
    main()
