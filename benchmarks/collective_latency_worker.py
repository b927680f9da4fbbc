"""One rank of a two-rank gloo world: the link as the profiler measures it (its latency per ring step of a
small all-reduce and all-gather, the all-reduce bandwidth at the gradients' size), then, timed independently,
the collectives one step of DeepSpeed issues for tiny-gpt at DP 2 under each ZeRO stage (the sequence counted
on DeepSpeed 0.19.8 by ``benchmarks/simulator_vs_runtime.py --deepspeed-only``'s meter: 2 / 6 / 9 / 59), with
their real sizes.

The link and the steps are measured in turn, :data:`ROUNDS` times; rank 0 prints ``{"latency_s": [all-reduce,
all-gather], "gbps", "steps": {zero: seconds}}``, medians over the rounds of the slowest rank's times.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from profiler.netbench import allreduce_busbw, collective_latency_s  # noqa: E402
from sailor_hpc.core.models import get_model  # noqa: E402
from simulator.zero_collectives import PARAM_GROUPS, layer_tensors  # noqa: E402

MICRO = 4
ROUNDS = 10


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    spec = get_model("tiny-gpt")
    tensors = layer_tensors(spec, 0, spec.num_pipeline_layers - 1)
    grads = torch.ones(sum(tensors))
    half = torch.ones(sum(tensors) // 2)
    scalar = torch.ones(1)
    parts = [(torch.ones((n + 1) // 2), torch.empty(2 * ((n + 1) // 2))) for n in tensors]
    groups = [(torch.ones(sum(tensors) // (2 * PARAM_GROUPS)), torch.empty(sum(tensors) // PARAM_GROUPS))] * PARAM_GROUPS

    def step(zero: int) -> None:
        if zero == 0:
            dist.all_reduce(grads)
        elif zero == 1:
            dist.all_reduce(grads)
        elif zero == 2:
            for _ in range(MICRO):
                dist.all_reduce(grads)
        else:
            for _ in range(MICRO):
                dist.reduce_scatter_tensor(half, grads)
        if zero:
            dist.all_reduce(scalar)  # the overflow check
            dist.all_reduce(scalar)  # the gradient norm
        if zero in (1, 2):
            for part, full in groups:
                dist.all_gather_into_tensor(full, part)
        if zero == 3:
            for part, full in parts:
                dist.all_gather_into_tensor(full, part)
        dist.all_reduce(scalar)  # the runtime's loss and stop flag

    # the link and the steps in turn, round after round, so that a busy host's load drifts over both alike
    cpu = torch.device("cpu")
    samples: dict[str, list[float]] = {k: [] for k in ("all_reduce", "all_gather", "gbps", "0", "1", "2", "3")}
    for _ in range(ROUNDS):
        for kind in ("all_reduce", "all_gather"):
            samples[kind].append(collective_latency_s(kind, 3, 1, cpu))
        samples["gbps"].append(allreduce_busbw(grads.numel() * 4, 3, 1, cpu))
        for zero in range(4):
            times = []
            for _ in range(3):
                dist.barrier()
                t0 = time.perf_counter()
                step(zero)
                dt = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's
                times.append(float(dt))
            samples[str(zero)].append(statistics.median(times))
    latency = [statistics.median(samples[k]) for k in ("all_reduce", "all_gather")]
    gbps = statistics.median(samples["gbps"])
    steps = {z: statistics.median(samples[str(z)]) for z in range(4)}
    if dist.get_rank() == 0:
        print(json.dumps({"latency_s": latency, "gbps": gbps, "steps": steps,
                          "load": os.getloadavg()[0]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
