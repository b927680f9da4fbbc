"""The whole loop on this machine: profile tiny-gpt on CPU, simulate a plan from that profile, run the
plan with megatron_patch, and compare the predicted step time with the measured one.

One gloo rank, one pipeline of one stage (all layers), 8 micro-batches per step, micro-batch sizes 1, 4
and 16. tiny-gpt's layers are so small that their time is mostly Python and dispatch overhead: the CPU
analogue of launch-bound GPU layers at small micro-batches, which is where per-layer profiles and real
stages part ways (see the simulator section of the README). Two predictions are printed: from the
per-layer times alone (the simulator's default), and with the chain timing the profiler also records
(the measured layers run as one stage would run them), charged per layer boundary
(``SimOptions(chain_timing=True)``).

Everything runs in one process and alternates (profile, run, profile, run ...) so that a busy host
slows all sides alike; medians throughout.

    .venv/bin/python benchmarks/simulator_vs_runtime.py [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_patch import local  # noqa: E402

MODEL, MICRO, SIZES = "tiny-gpt", 8, (1, 4, 16)
SITE = {"name": "this-machine", "cost_unit": "GPU-hours", "gpu_types": {"CPU": {"memory_gib": 16.0}},
        "partitions": [{"name": "cpu", "gpu_type": "CPU", "nodes": 1, "gpus_per_node": 1,
                        "network": {"intra_node": {"1": {"constant_gbps": 10.0}},
                                    "inter_node": {"1": {"constant_gbps": 1.0}}}}]}


def rank_main() -> None:
    warnings.filterwarnings("ignore")
    import numpy as np
    import torch
    import torch.distributed as dist

    from megatron_patch.data import GlobalSamples
    from megatron_patch.engine import Trainer
    from profiler.compute import LayerProfiler, resident_bytes
    from sailor_hpc.core.archive import ComputeEntry, MemoryEntry, OverheadEntry, ProfileArchive
    from sailor_hpc.core.models import get_model
    from sailor_hpc.core.plan import Pipeline, Plan, Stage
    from sailor_hpc.core.site import load_site_dict
    from simulator import SimOptions, simulate

    rounds, data = int(os.environ["BENCH_ROUNDS"]), os.environ["BENCH_DATA"]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    spec = get_model(MODEL)
    L = spec.num_pipeline_layers
    site = load_site_dict(SITE, source="<this machine>")
    prof = LayerProfiler(spec, tp_group=dist.group.WORLD, device=torch.device("cpu"), warmup=2, iters=9)
    memory = prof.memory_table()
    samples = GlobalSamples(data, spec.seq_len)
    plans = {b: Plan(MODEL, b * MICRO, (Pipeline(b, MICRO, (Stage(0, L - 1, 1, "CPU"),)),)) for b in SIZES}
    trainers = {b: Trainer(plans[b], samples, spec=spec) for b in SIZES}
    for t in trainers.values():  # first steps pay for allocations
        t.train_step()
    measured: dict[int, list[float]] = {b: [] for b in SIZES}
    profiles: dict[int, list[tuple[np.ndarray, tuple[float, float]]]] = {b: [] for b in SIZES}
    for _ in range(rounds):
        for b in SIZES:
            profiles[b].append((prof.measure(b), prof.measure_stack(b)))
            measured[b] += [trainers[b].train_step().seconds for _ in range(3)]
    times = {b: np.median(np.stack([p[0] for p in profiles[b]]), axis=0) for b in SIZES}
    stacks = {b: tuple(statistics.median(p[1][i] for p in profiles[b]) for i in range(2)) for b in SIZES}
    archive = ProfileArchive()  # what the profiler writes: every size, each with its own chain timing
    base = {"source": "benchmark", "profiled_blocks": prof.k, "stack_layers": len(prof.measured)}
    for b in SIZES:
        prov = {**base, "stack_fwd_s": stacks[b][0], "stack_bwd_s": stacks[b][1]}
        archive.add(ComputeEntry(MODEL, "CPU", b, 1, times[b], prov))
    archive.add(MemoryEntry(MODEL, 1, memory, base))
    archive.add(OverheadEntry("CPU", {1: resident_bytes()}, base))
    rows = []
    for b in SIZES:
        predicted = {label: simulate(plans[b], site, archive,
                                     options=SimOptions.megatron_patch(chain_timing=chain)).iteration_time_s
                     for label, chain in (("layers", False), ("chain", True))}
        rows.append({"mbs": b, "measured_s": statistics.median(measured[b]), **{f"{k}_s": v for k, v in predicted.items()},
                     "layer_sum_s": float(times[b][:, :2].sum()), "stack_s": sum(stacks[b]),
                     "measured_layers_alone_s": float(times[b][prof.measured, :2].sum())})
    print(json.dumps(rows), flush=True)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternating profile/run rounds")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "data")
        local.build_dataset(data)
        env = {"BENCH_ROUNDS": str(args.rounds), "BENCH_DATA": data, "BENCH_RANK_MAIN": "1"}
        out = local.run([str(Path(__file__).resolve())], 1, env, timeout=1800)[0]
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-3000:])
        rows = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{MODEL}, 1 gloo rank, 1 stage of all layers, {MICRO} micro-batches per step; median s/step")
    print(f"{'mbs':>4}{'measured':>10}{'per-layer':>11}{'err %':>7}{'+ chain':>10}{'err %':>7}"
          f"{'   chain / measured layers alone':>33}")
    for r in rows:
        e1 = (r["layers_s"] / r["measured_s"] - 1) * 100
        e2 = (r["chain_s"] / r["measured_s"] - 1) * 100
        print(f"{r['mbs']:>4}{r['measured_s']:>10.4f}{r['layers_s']:>11.4f}{e1:>+7.1f}{r['chain_s']:>10.4f}{e2:>+7.1f}"
              f"{r['stack_s'] / r['measured_layers_alone_s']:>33.3f}")
    return 0


if __name__ == "__main__":
    local.self_launching(main, rank_main)
