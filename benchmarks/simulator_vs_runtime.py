"""The whole loop on this machine: profile tiny-gpt on CPU, simulate a plan from that profile, run the
plan with megatron_patch, and compare the predicted step time with the measured one.

One gloo rank, one pipeline of one stage (all layers), 8 micro-batches per step, micro-batch sizes 1, 4
and 16. tiny-gpt's layers are so small that their time is mostly Python and dispatch overhead: the CPU
analogue of launch-bound GPU layers at small micro-batches, which is where per-layer profiles and real
stages part ways (see docs/simulator.md). Two predictions are printed: from the
per-layer times alone (the simulator's default), and with the chain timing the profiler also records
(the measured layers run as one stage would run them), charged per layer boundary
(``SimOptions(chain_timing=True)``).

Everything runs in one process and alternates (profile, run, profile, run ...) so that a busy host
slows all sides alike; medians throughout.

Then multi-stage heterogeneous plans (on by default), in two shapes of tiny-gpt (:data:`SHAPES`): as in
the catalog, whose sub-millisecond layers leave the runtime's per-micro-batch work (schedule, p2p calls,
loss) a large share of a step, as launch-bound GPU layers do; and "wide", its blocks widened until a layer
takes milliseconds on one core, as the layers of real models take on a GPU. Tiny: three gloo ranks run
two-stage pipelines whose stages have different TP degrees (TP 2 -> TP 1 and TP 1 -> TP 2), and two ranks
a TP 1 -> TP 1 one. Wide, two ranks: an even and an uneven split, and two data-parallel one-stage
pipelines with different micro-batching (4 x 4 and 2 x 8, one gradient all-reduce). Each TP degree is
profiled first by a world of its own as a profiling job would, the archive built from those profiles
predicts each plan as ``megatron_patch`` runs it over gloo (``backend="gloo"``: gloo stages nothing, so
every stage-to-stage transfer blocks both ranks), and the plans run; the step time is the slowest rank's.
The site's link is the gloo bandwidth between ranks 0 and 1 at the boundary's message size, measured by
the profiler's p2p measurement in the same world right after the plans ran. Each rank is one thread: on a
host with fewer free cores than ranks the stages cannot all compute at once, which no per-GPU model
predicts; the two-rank plans fit this machine's two cores and separate the model's error from the host's.

Then, with ``--deepspeed`` (alone: ``--deepspeed-only``), each ZeRO stage under stock DeepSpeed
(``megatron_patch.ds_runtime``): tiny-gpt on two gloo ranks, one stage, two replicas (DP 2), micro-batch 4
x 4. Step time: one world of the two ranks alternates, for every ZeRO stage in each of ``--rounds`` rounds,
a measurement and the run it predicts: each rank alone and both at once (so that both cores are as busy as
under the run), tiny-gpt's layer times and the plain engine's costs at that ZeRO stage as ``sailor-hpc
profile --runtime deepspeed`` measures them (every block measured; the engines on a group of the rank
alone), then :data:`DS_STEPS` steps of the plan, every ``torch.distributed`` collective in them timed
(:class:`CollectiveMeter`), then the link as the profiler measures it (the all-reduce bandwidth at the gradients'
size, the latency per ring step of a one-element all-reduce and all-gather, streamed and each issued alone
after a burst of compute, which the simulator charges DeepSpeed's collectives, and how far the two ranks
drift apart doing the same work, ``profiler.netbench.replica_jitter``: the median over the rounds, as one
profile would measure it); the simulator (runtime ``deepspeed``, gloo) predicts the step from each rank's
measurement, with and without the engine's costs. The measured step is the slower rank's (a synchronous step
ends with its slowest replica); the prediction is the mean of the two ranks' (a typical replica's speed,
as one profile of a GPU type gives it) with the simulator's wait for the slower replica from the measured
drift. The medians of the per-round values are printed with the load, and where the step goes: the
collectives' count and the time inside them (also per ``torch.distributed`` function), and the rest, measured
and predicted. Memory: one run under
torch's allocator accounting (``tests/deepspeed/zero_memory_worker.py``), the peak allocated beside the
simulator's (a ZeRO bucket that ``torch.empty`` allocates and nobody fills counts, as it does on a GPU; the
resident set size would not count it).

    .venv/bin/python benchmarks/simulator_vs_runtime.py [--rounds 5] [--no-pipelines] [--deepspeed | --deepspeed-only]
        [--clock cpu] [--nice -10] [--raw rounds.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_patch import local  # noqa: E402

MODEL, MICRO, SIZES = "tiny-gpt", 8, (1, 4, 16)
SITE = {"name": "this-machine", "cost_unit": "GPU-hours", "gpu_types": {"CPU": {"memory_gib": 16.0}},
        "partitions": [{"name": "cpu", "gpu_type": "CPU", "nodes": 1, "gpus_per_node": 3,
                        "network": {"intra_node": {"1": {"constant_gbps": 10.0}},
                                    "inter_node": {"1": {"constant_gbps": 1.0}}}}]}
PIPE_MBS = 4
# Shapes of the multi-stage runs: tiny-gpt itself (sub-millisecond layers, launch-bound: per-micro-batch
# runtime overhead is a large share) and its 4 blocks widened until a layer takes milliseconds on one core
# (compute-bound, as GPU layers of real models are). Only the archive knows the widths; the plans and the
# simulator see tiny-gpt's 6 pipeline layers either way.
SHAPES = {"tiny": {}, "wide": {"hidden_size": 256, "ffn_hidden_size": 1024, "seq_len": 64}}
# (shape, ranks) -> plans run by a world of that many ranks: pipelines of (mbs, micro-batches, stages
# (first, last, tp)). The two-rank plans fit this machine's two cores; the three-rank ones cannot all
# compute at once here, whatever else runs.
PIPE_PLANS = {("tiny", 3): {"TP2 -> TP1": ((4, 8, ((0, 2, 2), (3, 5, 1))),),
                            "TP1 -> TP2": ((4, 8, ((0, 2, 1), (3, 5, 2))),)},
              ("tiny", 2): {"TP1 -> TP1": ((4, 8, ((0, 2, 1), (3, 5, 1))),)},
              ("wide", 2): {"3 | 3 layers": ((4, 8, ((0, 2, 1), (3, 5, 1))),),
                            "2 | 4 layers": ((4, 8, ((0, 1, 1), (2, 5, 1))),),
                            "DP 4x4 + 2x8": ((4, 4, ((0, 5, 1),)), (2, 8, ((0, 5, 1),)))}}


def shape_spec(shape: str):
    """tiny-gpt in one of :data:`SHAPES`."""
    import dataclasses

    from sailor_hpc.core.models import get_model

    return dataclasses.replace(get_model(MODEL), **SHAPES[shape])


def _pipes(shape: str) -> list[tuple]:
    """Every (mbs, micro-batches, stages) pipeline of the shape's plans."""
    return [pipe for (sh, _), plans in PIPE_PLANS.items() if sh == shape for pipes in plans.values() for pipe in pipes]


def profiled_tps(shape: str) -> list[int]:
    return sorted({tp for _, _, stages in _pipes(shape) for _, _, tp in stages})


def profiled_sizes(shape: str) -> list[int]:
    return sorted({mbs for mbs, _, _ in _pipes(shape)})


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
                                     options=SimOptions.megatron_patch(chain_timing=chain, backend="gloo")).iteration_time_s
                     for label, chain in (("layers", False), ("chain", True))}
        rows.append({"mbs": b, "measured_s": statistics.median(measured[b]), **{f"{k}_s": v for k, v in predicted.items()},
                     "layer_sum_s": float(times[b][:, :2].sum()), "stack_s": sum(stacks[b]),
                     "measured_layers_alone_s": float(times[b][prof.measured, :2].sum())})
    print(json.dumps(rows), flush=True)
    dist.destroy_process_group()


def profile_rank_main() -> None:
    """One TP group (the whole world) profiles a shape at every micro-batch size its plans use, as a
    profiling job would."""
    warnings.filterwarnings("ignore")
    import numpy as np
    import torch
    import torch.distributed as dist

    from profiler.compute import LayerProfiler, resident_bytes

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    shape = os.environ["BENCH_SHAPE"]
    prof = LayerProfiler(shape_spec(shape), tp_group=dist.group.WORLD, device=torch.device("cpu"), warmup=2, iters=9)
    rounds = int(os.environ["BENCH_ROUNDS"])
    times = {b: np.median(np.stack([prof.measure(b) for _ in range(rounds)]), axis=0).tolist()
             for b in profiled_sizes(shape)}
    memory = prof.memory_table()  # runs the TP group's collectives: every rank
    if dist.get_rank() == 0:
        print(json.dumps({"times": times, "memory": memory.tolist(), "overhead": resident_bytes()}), flush=True)
    dist.destroy_process_group()


def pipelines_rank_main() -> None:
    """Run each plan of :data:`PIPE_PLANS` for this shape and world size; rank 0 prints the median step
    (slowest rank) and the gloo link between ranks 0 and 1 at the boundary's message size (what the site
    is given)."""
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from megatron_patch.data import GlobalSamples
    from megatron_patch.engine import Trainer
    from profiler.netbench import p2p_gbps

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    shape = os.environ["BENCH_SHAPE"]
    spec = shape_spec(shape)
    samples = GlobalSamples(os.environ["BENCH_DATA"], spec.seq_len)
    trainers = {name: Trainer(plan, samples, spec=spec)
                for name, plan in pipeline_plans(shape, dist.get_world_size()).items()}
    for t in trainers.values():  # first steps pay for allocations
        t.train_step()
    measured: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(int(os.environ["BENCH_ROUNDS"])):
        for name, t in trainers.items():
            for _ in range(3):
                step = torch.tensor([t.train_step().seconds])
                dist.all_reduce(step, op=dist.ReduceOp.MAX)  # the step ends with its slowest rank
                measured[name].append(float(step))
    gbps = p2p_gbps([(0, 1)], boundary_bytes(shape), 20, 5, torch.device("cpu"))  # the profiler's measurement
    if dist.get_rank() == 0:
        print(json.dumps({"steps": {name: statistics.median(v) for name, v in measured.items()}, "gbps": gbps}),
              flush=True)
    dist.destroy_process_group()


def boundary_bytes(shape: str) -> int:
    """One micro-batch's activation at a stage boundary (fp32, micro-batch :data:`PIPE_MBS`)."""
    spec = shape_spec(shape)
    return PIPE_MBS * spec.seq_len * spec.hidden_size * 4


def pipeline_plans(shape: str, ranks: int):
    from sailor_hpc.core.plan import Pipeline, Plan, Stage

    def plan(pipes) -> Plan:
        built = tuple(Pipeline(mbs, m, tuple(Stage(a, b, tp, "CPU") for a, b, tp in stages)) for mbs, m, stages in pipes)
        return Plan(MODEL, sum(p.samples for p in built), built)

    return {name: plan(pipes) for name, pipes in PIPE_PLANS[(shape, ranks)].items()}


LATENCY_KEYS = ("collective_latency_us", "gather_latency_us", "issued_latency_us", "issued_gather_latency_us")


def measured_site(gbps: float, latency_s: tuple[float, ...] = (), jitter: float = 0.0) -> dict:
    """The benchmark site with its links set to the gloo bandwidth measured at the boundary's (or gradients')
    size and, where measured, the link's latency per ring step of a small all-reduce and all-gather, streamed
    and issued alone after compute (:data:`LATENCY_KEYS`, in that order), and how far the ranks drift apart
    (``replica_jitter``), as a profile's network measurement writes them."""
    lat: dict[str, float] = {k: v * 1e6 for k, v in zip(LATENCY_KEYS, latency_s) if v}
    if jitter:
        lat["replica_jitter"] = jitter
    part = {**SITE["partitions"][0], "network": {"intra_node": {"1": {"constant_gbps": gbps}, **lat},
                                                  "inter_node": {"1": {"constant_gbps": gbps}, **lat}}}
    return {**SITE, "partitions": [part]}


def pipelines(env: dict[str, str]) -> list[dict]:
    """Per shape: profile each TP degree its plans use (a world each), run the plans, predict them from the
    profiles as megatron_patch runs them over gloo."""
    import numpy as np

    from sailor_hpc.core.archive import ComputeEntry, MemoryEntry, OverheadEntry, ProfileArchive
    from sailor_hpc.core.site import load_site_dict
    from simulator import SimOptions, simulate

    rows = []
    for shape in SHAPES:
        archive, base = ProfileArchive(), {"source": "benchmark", "shape": shape}
        overhead = {}
        for tp in profiled_tps(shape):
            prof = _launch({**env, "BENCH_PART": "profile", "BENCH_SHAPE": shape}, tp)
            for mbs, times in prof["times"].items():
                archive.add(ComputeEntry(MODEL, "CPU", int(mbs), tp, np.array(times), base))
            archive.add(MemoryEntry(MODEL, tp, np.array(prof["memory"]), base))
            overhead[tp] = prof["overhead"]
        archive.add(OverheadEntry("CPU", overhead, base))
        for ranks in sorted(r for sh, r in PIPE_PLANS if sh == shape):
            measured = _launch({**env, "BENCH_PART": "pipelines", "BENCH_SHAPE": shape}, ranks)
            site = load_site_dict(measured_site(measured["gbps"]), source="<this machine, gloo link measured>")
            for name, plan in pipeline_plans(shape, ranks).items():
                res = simulate(plan, site, archive, options=SimOptions.megatron_patch(backend="gloo"))
                # what the step would take if the stages could not compute at once (fewer free cores than ranks)
                serial = sum(plan.pipelines[s.pipeline].num_micro_batches * (s.fwd_s + s.bwd_s) for s in res.stages) \
                    + max(s.update_s for s in res.stages)
                rows.append({"shape": shape, "plan": name, "ranks": ranks, "gbps": measured["gbps"],
                             "measured_s": measured["steps"][name], "predicted_s": res.iteration_time_s,
                             "serial_s": serial})
    return rows


DS_MBS, DS_MICRO, DS_STEPS = 4, 4, 5
ZERO_WORKER = ROOT / "tests" / "deepspeed" / "zero_memory_worker.py"


# torch.distributed's collectives DeepSpeed 0.19 calls through its TorchBackend (looked up at call time, or at
# the backend's start for the tensor all-gather and reduce-scatter: wrapped before it starts)
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather", "reduce_scatter",
               "broadcast", "reduce", "barrier", "all_reduce_coalesced")


class _TimedWork:
    """An asynchronous collective's handle whose ``wait`` counts into the meter (torch's Work is read-only)."""

    def __init__(self, work: Any, meter: CollectiveMeter, name: str) -> None:
        self._work, self._meter, self._name = work, meter, name

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._meter.add(self._name, time.perf_counter() - t0, 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CollectiveMeter:
    """Wall seconds each rank spends inside torch.distributed's collectives (the call and, for an asynchronous
    one, its ``wait``), and how many it issues: where a step's time goes between computing and waiting; per
    function too (``by_kind``: name -> [count, seconds]), to set each kind's cost beside the link's latency."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.count, self.seconds = 0, 0.0
        self.by_kind: dict[str, list[float]] = {}
        for name in COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, self._timed(name, getattr(dist, name)))

    def add(self, name: str, seconds: float, count: int) -> None:
        self.seconds += seconds
        self.count += count
        kind = self.by_kind.setdefault(name, [0, 0.0])
        kind[0] += count
        kind[1] += seconds

    def _timed(self, name: str, op: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            work = op(*args, **kwargs)
            self.add(name, time.perf_counter() - t0, 1)
            if work is not None and hasattr(work, "wait"):  # an asynchronous one: its wait is inside it too
                return _TimedWork(work, self, name)
            return work
        return timed

    def take(self) -> tuple[int, float, dict[str, list[float]]]:
        """(collectives, seconds, per kind [count, seconds]) since the last take."""
        out = (self.count, self.seconds, self.by_kind)
        self.count, self.seconds, self.by_kind = 0, 0.0, {}
        return out


def ds_rank_main() -> None:
    """Both ranks, in turn: measure (each alone, at once) tiny-gpt's layers and the plain engine's costs under
    ZeRO z, as ``sailor-hpc profile --runtime deepspeed`` does (:class:`profiler.compute.LayerProfiler`,
    :class:`profiler.ds_engine.EngineMeter` on a group of this rank alone), then run the DP-2 plan under ZeRO z
    (``megatron_patch.ds_runtime``'s trainer); every ZeRO stage in every round. Each rank prints its rows."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if os.environ.get("BENCH_NICE"):  # ahead of the host's other work (root only): a quieter machine
        os.setpriority(os.PRIO_PROCESS, 0, int(os.environ["BENCH_NICE"]))
    if os.environ.get("BENCH_CLOCK") == "cpu":  # every clock of this process (profiler, engine meter, runtime)
        time.perf_counter = time.thread_time  # counts this rank's own work only: robust to a busy host
    import deepspeed
    import torch
    import torch.distributed as dist

    from megatron_patch.data import GlobalSamples
    from megatron_patch.ds_runtime.engine import DsTrainer
    from megatron_patch.ds_runtime.launch import _without_shm_op
    from profiler.compute import LayerProfiler
    from profiler.ds_engine import ENGINE_ROUNDS, EngineMeter
    from profiler.netbench import (
        ISSUED_ROUNDS,
        SPREAD_ROUNDS,
        allreduce_busbw,
        collective_latency_s,
        issued_latency_s,
        replica_jitter,
    )

    _without_shm_op()
    meter = CollectiveMeter()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    spec, cpu = shape_spec("tiny"), torch.device("cpu")
    alone = [dist.new_group([r]) for r in range(world)][rank]
    prof = LayerProfiler(spec, tp_group=alone, device=cpu, blocks=spec.num_layers, warmup=2, iters=9, min_time_s=0.3)
    samples = GlobalSamples(os.environ["BENCH_DATA"], spec.seq_len)
    trainers = {z: DsTrainer(_ds_plan(z), samples, spec=spec) for z in range(4)}
    meters = {z: EngineMeter("engine", z, spec, DS_MBS, device=cpu, blocks=spec.num_layers, group=alone)
              for z in range(4)}
    for t in trainers.values():  # first steps pay for allocations
        t.train_step()
    grad_bytes = 4 * sum(p.numel() for p in trainers[0].params.values())
    rows = []
    for r in range(int(os.environ["BENCH_ROUNDS"])):
        for z in range(4):
            load = os.getloadavg()[0]
            dist.barrier()  # both ranks measure at once: neither has a core to itself while the other waits
            times = prof.measure(DS_MBS)
            dist.barrier()
            costs = {meters[z].key: meters[z].measure(ENGINE_ROUNDS)}
            steps, inside, cpu_s = [], [], []
            for _ in range(DS_STEPS):
                meter.take()
                c0 = time.thread_time()
                seconds = trainers[z].train_step().seconds
                cpu_s.append(time.thread_time() - c0)
                inside.append(meter.take())
                step = torch.tensor([seconds])
                dist.all_reduce(step, op=dist.ReduceOp.MAX)  # the step ends with its slowest rank
                steps.append(float(step))
            gbps = allreduce_busbw(grad_bytes, 10, 2, cpu)  # the link the gradients' collectives see, now
            # ... and per collective: streamed, then each issued alone after compute, and the ranks' drift (as many
            # rounds as a profile takes)
            latency = [collective_latency_s(k, 5, 1, cpu) for k in ("all_reduce", "all_gather")] \
                + [issued_latency_s(k, ISSUED_ROUNDS, 2, cpu) for k in ("all_reduce", "all_gather")]
            jitter = replica_jitter(SPREAD_ROUNDS, 2, cpu)
            rows.append({"round": r, "zero": z, "load": load, "times": times.tolist(), "costs": costs,
                         "blocks": meters[z].sizes, "measured_s": statistics.median(steps), "gbps": gbps,
                         "latency_s": latency, "jitter": jitter,
                         "collectives": statistics.median(n for n, _, _ in inside),
                         "collective_s": statistics.median(s for _, s, _ in inside), "cpu_s": statistics.median(cpu_s),
                         "by_kind": {name: [statistics.median(k.get(name, [0, 0.0])[i] for _, _, k in inside)
                                            for i in range(2)] for name in {n for _, _, k in inside for n in k}}})
    print(json.dumps({"rank": rank, "rows": rows, "memory": prof.memory_table().tolist()}), flush=True)
    dist.destroy_process_group()


def _ds_archive(times: list, memory: list, costs: dict | None = None, blocks: list | None = None) -> Any:
    """A profile archive of tiny-gpt at micro-batch :data:`DS_MBS` (with DeepSpeed's engine costs of one ZeRO stage)."""
    import numpy as np

    from profiler.ds_engine import ENGINE_ROUNDS, KEY, document
    from sailor_hpc.core.archive import ComputeEntry, MemoryEntry, OverheadEntry, ProfileArchive

    archive, prov = ProfileArchive(), {"source": "benchmark", "profiled_blocks": shape_spec("tiny").num_layers}
    point = {**prov, **({KEY: document(costs, blocks or [], ENGINE_ROUNDS)} if costs is not None else {})}
    archive.add(ComputeEntry(MODEL, "CPU", DS_MBS, 1, np.array(times), point))
    archive.add(MemoryEntry(MODEL, 1, np.array(memory), prov))
    archive.add(OverheadEntry("CPU", {1: 0.0}, prov))
    return archive


def _ds_plan(zero: int) -> Any:
    from sailor_hpc.core.deepspeed_plan import with_zero_stage
    from sailor_hpc.core.plan import Pipeline, Plan, Stage

    L = shape_spec("tiny").num_pipeline_layers
    return with_zero_stage(Plan(MODEL, 2 * DS_MBS * DS_MICRO, (Pipeline(DS_MBS, DS_MICRO, (Stage(0, L - 1, 1, "CPU"),)),)
                                * 2), zero)


def _compute_s(res: Any) -> float:
    """A one-stage step without its collectives: the micro-batches' compute and the optimizer step (what a
    rank's own thread does: the CPU clock's comparison)."""
    return res.breakdown["flush_s"] + res.breakdown["optimizer_s"]


def deepspeed_zero(env: dict[str, str], rounds: int, clock: str = "wall") -> dict[str, Any]:
    """Every ZeRO stage of a DP-2 one-stage plan under DeepSpeed, measured beside the simulator (see the doc):
    the rounds of :func:`ds_rank_main` in one world of two ranks, and one allocator-counted run."""
    from sailor_hpc.core.network import MAX_JITTER_KEPT
    from sailor_hpc.core.site import load_site_dict
    from simulator import SimOptions, simulate

    options = SimOptions(runtime="deepspeed", backend="gloo")
    out = local.run([str(Path(__file__).resolve())], 2, {**env, "BENCH_PART": "ds", "BENCH_ROUNDS": str(rounds),
                                                         "BENCH_CLOCK": clock}, timeout=3600)
    seconds = _compute_s if clock == "cpu" else (lambda res: res.iteration_time_s)
    bad = [r for r in out if r.returncode != 0]
    if bad:
        raise RuntimeError(bad[0].stderr[-3000:])
    ranks = [json.loads(r.stdout.strip().splitlines()[-1]) for r in out]
    time_rows: list[dict[str, Any]] = []
    # how far the replicas drift apart is the host's, which a profile measures once: the median of the
    # rounds' measurements (each a few dozen collectives, heavy-tailed; both ranks report the same figure)
    jitter = min(statistics.median(x["jitter"] for x in ranks[0]["rows"]), MAX_JITTER_KEPT)
    for i, row in enumerate(ranks[0]["rows"]):
        mine = [rk["rows"][i] for rk in ranks]  # each rank measured its own profile at the same time
        plan = _ds_plan(row["zero"])
        site = load_site_dict(measured_site(row["gbps"], tuple(row["latency_s"]), jitter),
                              source="<this machine, gloo all-reduce measured>")
        sims = [simulate(plan, site, _ds_archive(x["times"], rk["memory"], x["costs"], x["blocks"]), options=options)
                for x, rk in zip(mine, ranks, strict=True)]
        predicted = [seconds(res) for res in sims]
        layers = [seconds(simulate(plan, site, _ds_archive(x["times"], rk["memory"]), options=options))
                  for x, rk in zip(mine, ranks, strict=True)]
        time_rows.append({"round": row["round"], "zero": row["zero"], "load": row["load"], "gbps": row["gbps"],
                          "latency_s": [statistics.fmean(x["latency_s"][k] for x in mine)
                                        for k in range(len(row["latency_s"]))],
                          "by_kind": {name: [statistics.fmean(x["by_kind"].get(name, [0, 0.0])[i] for x in mine)
                                             for i in range(2)] for name in row["by_kind"]},
                          # a step ends with its slowest replica: measured as the slower rank's; predicted for a
                          # typical replica (the mean of the ranks' predictions, each from its own profile) with the
                          # simulator's wait for the slower one, from the measured drift
                          "measured_s": row["measured_s"], "predicted_s": statistics.fmean(predicted),
                          "predicted_by_rank": predicted, "layers_only_s": statistics.fmean(layers), "jitter": jitter,
                          "collectives": statistics.fmean(x["collectives"] for x in mine),
                          "collective_s": statistics.fmean(x["collective_s"] for x in mine),
                          "cpu_s": statistics.fmean(x["cpu_s"] for x in mine),
                          "predicted_collective_s": statistics.fmean(res.iteration_time_s - _compute_s(res)
                                                                     for res in sims)})
    return {"time": time_rows, "memory": zero_memory(env), "clock": clock}


def zero_memory(env: dict[str, str]) -> list[dict[str, Any]]:
    """Peak allocated per ZeRO stage (the smaller of the two replicas' steady steps), from torch's CPU allocator
    (``tests/deepspeed/zero_memory_worker.py``), beside the simulator's from the layer profile the same run takes."""
    import numpy as np

    from sailor_hpc.core.archive import ComputeEntry, MemoryEntry, OverheadEntry, ProfileArchive
    from sailor_hpc.core.site import load_site_dict
    from simulator import SimOptions, simulate

    configs = [[f"z{z}", z, 1] for z in range(4)]
    out = local.run([str(ZERO_WORKER)], 2, {"ZERO_CONFIGS": json.dumps(configs), "ZERO_DATA": env["BENCH_DATA"],
                                            "ZERO_MBS": str(DS_MBS), "ZERO_MICRO": str(DS_MICRO)}, timeout=1800)
    bad = [r for r in out if r.returncode != 0]
    if bad:
        raise RuntimeError(bad[0].stderr[-3000:])
    lines = [json.loads(x) for r in out for x in r.stdout.splitlines() if x.startswith('{"event"')]
    ranks = [e for e in lines if e["event"] == "zero_memory"]  # both replicas do the same work: the smaller peak
    (prof,) = [e for e in lines if e["event"] == "profile"]
    archive, base = ProfileArchive(), {"source": "benchmark"}
    archive.add(ComputeEntry(MODEL, "CPU", prof["mbs"], 1, np.array(prof["times"]), base))
    archive.add(MemoryEntry(MODEL, 1, np.array(prof["memory"]), base))
    archive.add(OverheadEntry("CPU", {1: 0.0}, base))
    site = load_site_dict(SITE, source="<this machine>")
    rows = []
    for zero in range(4):
        res = simulate(_ds_plan(zero), site, archive, options=SimOptions(runtime="deepspeed", backend="gloo"))
        rows.append({"zero": zero, "measured_bytes": min(e["results"][f"z{zero}"]["peak"] for e in ranks),
                     "predicted_bytes": float(res.stages[0].memory.peak_allocated)})
    return rows


def print_deepspeed(result: dict[str, Any]) -> None:
    rows = result["time"]
    rounds = max(r["round"] for r in rows) + 1
    loads = sorted({round(r["load"], 1) for r in rows})
    print(f"\n{MODEL} under DeepSpeed, 2 gloo ranks: one stage x 2 replicas, mbs {DS_MBS} x {DS_MICRO}; "
          f"{rounds} rounds (load {loads[0]}-{loads[-1]} on {os.cpu_count()} cores)")
    if result["clock"] == "cpu":
        print("clock: each rank's thread CPU time (its own work, whatever else the host runs), measured and predicted "
              "without the collectives")
    print("step time: each round and ZeRO stage, both ranks measure layers + the engine's costs at once, then run "
          f"{DS_STEPS} steps; medians over rounds of the per-round values (s/step, slowest rank); gloo all-reduce "
          f"measured at the gradients' size: median {statistics.median(r['gbps'] for r in rows):.3f} GB/s; latency per "
          f"ring step of a one-element all-reduce / all-gather, streamed: median "
          f"{statistics.median(r['latency_s'][0] for r in rows) * 1e6:.0f} / "
          f"{statistics.median(r['latency_s'][1] for r in rows) * 1e6:.0f} us"
          + (f"; issued alone after compute (what the prediction charges): median "
             f"{statistics.median(r['latency_s'][2] for r in rows) * 1e6:.0f} / "
             f"{statistics.median(r['latency_s'][3] for r in rows) * 1e6:.0f} us" if len(rows[0]["latency_s"]) > 2 else "")
          + (f"; the ranks' drift (replica_jitter, median of the rounds): {rows[0]['jitter']:.3f}" if "jitter" in rows[0]
             else ""))
    print(f"{'ZeRO':>5}{'measured':>10}{'layers only':>13}{'err %':>7}{'+ engine':>10}{'err %':>7}"
          f"{'   per-round err % (+ engine)':>30}")
    for zero in range(4):
        mine = [r for r in rows if r["zero"] == zero]
        errs = [(r["predicted_s"] / r["measured_s"] - 1) * 100 for r in mine]
        bare = [(r["layers_only_s"] / r["measured_s"] - 1) * 100 for r in mine]
        med = {k: statistics.median(r[k] for r in mine) for k in ("measured_s", "predicted_s", "layers_only_s")}
        print(f"{zero:>5}{med['measured_s']:>10.4f}{med['layers_only_s']:>13.4f}{statistics.median(bare):>+7.1f}"
              f"{med['predicted_s']:>10.4f}{statistics.median(errs):>+7.1f}   "
              + " ".join(f"{e:+.1f}" for e in errs))
    print("where the step goes (medians; measured and predicted: mean of the two ranks): collectives "
          "issued per step, wall seconds inside them measured and predicted, the rest of the step (computing or waiting "
          "for a core) measured and predicted, thread CPU seconds")
    print(f"{'ZeRO':>5}{'count':>7}{'in coll.':>10}{'predicted':>11}{'rest':>9}{'predicted':>11}{'CPU':>8}")
    for zero in range(4):
        mine = [r for r in rows if r["zero"] == zero]
        med = {k: statistics.median(r[k] for r in mine)
               for k in ("collectives", "collective_s", "predicted_collective_s", "cpu_s")}
        rest = statistics.median(r["measured_s"] - r["collective_s"] for r in mine)
        prest = statistics.median(r["predicted_s"] - r["predicted_collective_s"] for r in mine)
        print(f"{zero:>5}{med['collectives']:>7.0f}{med['collective_s']:>10.4f}{med['predicted_collective_s']:>11.4f}"
              f"{rest:>9.4f}{prest:>11.4f}{med['cpu_s']:>8.4f}")
    print("inside the collectives by function (medians over rounds, mean of the two ranks): count a step x ms each")
    for zero in range(4):
        mine = [r for r in rows if r["zero"] == zero and "by_kind" in r]
        names = sorted({n for r in mine for n in r["by_kind"]})
        each = []
        for name in names:
            n = statistics.median(r["by_kind"].get(name, [0, 0.0])[0] for r in mine)
            ms = statistics.median(r["by_kind"][name][1] / r["by_kind"][name][0] * 1e3 for r in mine
                                   if r["by_kind"].get(name, [0, 0.0])[0])
            each.append(f"{name} {n:.0f} x {ms:.2f}")
        print(f"{zero:>5}   " + ", ".join(each))
    print("peak allocated (torch's CPU allocator, as max_memory_allocated on a GPU; the smaller of the two replicas'"
          " steady steps), MB")
    print(f"{'ZeRO':>5}{'measured':>10}{'predicted':>11}{'err %':>7}")
    for r in result["memory"]:
        print(f"{r['zero']:>5}{r['measured_bytes'] / 1e6:>10.2f}{r['predicted_bytes'] / 1e6:>11.2f}"
              f"{(r['predicted_bytes'] / r['measured_bytes'] - 1) * 100:>+7.1f}")


def _launch(script_env: dict[str, str], world: int):
    out = local.run([str(Path(__file__).resolve())], world, script_env, timeout=1800)
    bad = [r for r in out if r.returncode != 0]
    if bad:
        raise RuntimeError(min(bad, key=lambda r: "Connection closed" in r.stderr).stderr[-3000:])
    return json.loads(out[0].stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternating profile/run rounds")
    ap.add_argument("--no-pipelines", dest="pipelines", action="store_false", help="skip the multi-stage plans")
    ap.add_argument("--deepspeed", action="store_true", help="also each ZeRO stage under DeepSpeed")
    ap.add_argument("--deepspeed-only", action="store_true", help="only the DeepSpeed ZeRO stages")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="DeepSpeed rounds: wall-clock steps (with the collectives), or each rank's thread CPU time "
                         "on both sides (its own work: the engine's costs against a busy host's noise)")
    ap.add_argument("--nice", type=int, default=None,
                    help="run the DeepSpeed rounds' ranks at this niceness (e.g. -10, root only): ahead of the host's "
                         "other work, as if on a quieter machine")
    ap.add_argument("--raw", default=None, help="also write the DeepSpeed rounds' per-round values (JSON) here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "data")
        local.build_dataset(data)
        env = {"BENCH_ROUNDS": str(args.rounds), "BENCH_DATA": data, "BENCH_RANK_MAIN": "1",
               **({"BENCH_NICE": str(args.nice)} if args.nice is not None else {})}
        zero = deepspeed_zero(env, args.rounds, args.clock) if args.deepspeed or args.deepspeed_only else None
        if zero is not None and args.raw:
            Path(args.raw).write_text(json.dumps(zero))
        if zero is not None and args.deepspeed_only:
            print_deepspeed(zero)
            return 0
        rows = _launch(env, 1)
        pipes = pipelines(env) if args.pipelines else []
    print(f"{MODEL}, 1 gloo rank, 1 stage of all layers, {MICRO} micro-batches per step; median s/step")
    print(f"{'mbs':>4}{'measured':>10}{'per-layer':>11}{'err %':>7}{'+ chain':>10}{'err %':>7}"
          f"{'   chain / measured layers alone':>33}")
    for r in rows:
        e1 = (r["layers_s"] / r["measured_s"] - 1) * 100
        e2 = (r["chain_s"] / r["measured_s"] - 1) * 100
        print(f"{r['mbs']:>4}{r['measured_s']:>10.4f}{r['layers_s']:>11.4f}{e1:>+7.1f}{r['chain_s']:>10.4f}{e2:>+7.1f}"
              f"{r['stack_s'] / r['measured_layers_alone_s']:>33.3f}")
    if pipes:
        print(f"\n{MODEL} (tiny: as in the catalog; wide: blocks of width {SHAPES['wide']['hidden_size']}, sequence "
              f"{SHAPES['wide']['seq_len']}), heterogeneous plans, global batch {PIPE_MBS * MICRO}; median s/step "
              "(slowest rank), predicted as megatron_patch runs them over gloo; gloo link measured at the boundary's size")
        print(f"{'shape':>6}{'plan':>14}{'ranks':>6}{'link GB/s':>10}{'measured':>10}{'predicted':>11}{'err %':>7}"
              f"{'stages one at a time':>22}{'err %':>7}")
        for r in pipes:
            print(f"{r['shape']:>6}{r['plan']:>14}{r['ranks']:>6}{r['gbps']:>10.3f}{r['measured_s']:>10.4f}"
                  f"{r['predicted_s']:>11.4f}{(r['predicted_s'] / r['measured_s'] - 1) * 100:>+7.1f}"
                  f"{r['serial_s']:>22.4f}{(r['serial_s'] / r['measured_s'] - 1) * 100:>+7.1f}")
    if zero is not None:
        print_deepspeed(zero)
    return 0


def _rank_main() -> None:
    part = os.environ.get("BENCH_PART")
    {"pipelines": pipelines_rank_main, "profile": profile_rank_main,
     "ds": ds_rank_main}.get(part or "", rank_main)()


if __name__ == "__main__":
    local.self_launching(main, _rank_main)
