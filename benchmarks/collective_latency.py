"""The link's per-collective latency against the collectives it prices: two gloo ranks measure their link as
the profiler does (``profiler.netbench``: a small all-reduce's and all-gather's latency per ring step, the
all-reduce bandwidth at tiny-gpt's gradient size), then time, independently, the collectives one DeepSpeed step
issues for tiny-gpt at DP 2 under each ZeRO stage, with their real sizes (``collective_latency_worker.py``).
The simulator, given only the measured link, prices the same step's collectives (:mod:`simulator.zero_collectives`:
counts, kinds, ZeRO's bytes); both must agree.

Without the latency term the simulator charged ZeRO 3's 59 collectives their bytes alone (2.5 all-reduces of
the gradients: a tenth or less of what they take here, where gloo's all-gathers of a few bytes cost 0.3-0.9 ms
each). ZeRO 3 stays below its run: gloo's reduce-scatter takes twice an all-reduce of its size (1.9 against
1.0 ms for tiny-gpt's gradients), where the ring model, as NCCL runs it, moves half the bytes.

A benchmark, not a test: on a shared 2-core host the link's measured bandwidth and latencies swing by 2x with
the load (0.27-0.58 GB/s), and the ratio with them. Run: ``python benchmarks/collective_latency.py``; it prints
each ZeRO stage's measured and modelled collective time (0.4-1.5x of the run at load 5-8)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_patch import local  # noqa: E402
from sailor_hpc.core.archive import ComputeEntry, MemoryEntry, OverheadEntry, ProfileArchive  # noqa: E402
from sailor_hpc.core.deepspeed_plan import with_zero_stage  # noqa: E402
from sailor_hpc.core.models import get_model  # noqa: E402
from sailor_hpc.core.plan import Pipeline, Plan, Stage  # noqa: E402
from sailor_hpc.core.site import load_site_dict  # noqa: E402
from simulator import SimOptions, simulate  # noqa: E402
from simulator.zero_collectives import layer_tensors  # noqa: E402

WORKER = Path(__file__).with_name("collective_latency_worker.py")
MICRO = 4


def _site(gbps: float, latency: list[float]) -> dict:
    link = {"1": {"constant_gbps": gbps}, "collective_latency_us": latency[0] * 1e6,
            "gather_latency_us": latency[1] * 1e6}
    return {"name": "gloo", "cost_unit": "GPU-hours", "gpu_types": {"CPU": {"memory_gib": 16.0}},
            "partitions": [{"name": "cpu", "gpu_type": "CPU", "nodes": 1, "gpus_per_node": 2,
                            "network": {"intra_node": link, "inter_node": link}}]}


def _archive() -> ProfileArchive:
    """tiny-gpt with its real parameters per layer (what the collectives move) and next to no compute."""
    spec = get_model("tiny-gpt")
    L = spec.num_pipeline_layers
    params = [sum(layer_tensors(spec, i, i)) for i in range(L)]
    archive, prov = ProfileArchive(), {"source": "test"}
    archive.add(ComputeEntry("tiny-gpt", "CPU", 4, 1, np.full((L, 3), 1e-6), prov))  # ~no compute: the step is its collectives
    archive.add(MemoryEntry("tiny-gpt", 1, np.column_stack([params, np.ones(L), np.ones(L), np.ones(L)]), prov))
    archive.add(OverheadEntry("CPU", {1: 0.0}, prov))
    return archive


def _collective_seconds(zero: int, site: dict) -> float:
    L = get_model("tiny-gpt").num_pipeline_layers
    plan = with_zero_stage(Plan("tiny-gpt", 2 * 4 * MICRO, (Pipeline(4, MICRO, (Stage(0, L - 1, 1, "CPU"),)),) * 2), zero)
    res = simulate(plan, load_site_dict(site, source="<measured gloo link>"), _archive(),
                   options=SimOptions(runtime="deepspeed", backend="gloo"))
    return res.iteration_time_s - res.breakdown["flush_s"] - res.breakdown["optimizer_s"]


def main() -> int:
    out = local.run([str(WORKER)], 2, {}, timeout=300)
    assert all(r.returncode == 0 for r in out), out[0].stderr[-3000:] + out[1].stderr[-3000:]
    measured = json.loads(out[0].stdout.strip().splitlines()[-1])
    site = _site(measured["gbps"], measured["latency_s"])
    bytes_only = _site(measured["gbps"], [0.0, 0.0])
    lines = []
    for zero in range(4):
        run = measured["steps"][str(zero)]
        model, without = _collective_seconds(zero, site), _collective_seconds(zero, bytes_only)
        lines.append(f"ZeRO {zero}: measured {run * 1e3:.2f} ms, modelled {model * 1e3:.2f} ms "
                     f"({(model / run - 1) * 100:+.0f} %), bytes only {without * 1e3:.2f} ms")
    report = (f"link: {measured['gbps']:.3f} GB/s, latency per ring step {measured['latency_s'][0] * 1e6:.0f} us "
              f"(all-reduce) / {measured['latency_s'][1] * 1e6:.0f} us (all-gather), load {measured['load']:.1f} on "
              f"{os.cpu_count()} cores\n" + "\n".join(lines))
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
