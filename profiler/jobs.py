"""The functions profiling jobs run on the compute nodes (submitted by :mod:`profiler.sweep` via submitit).

- :func:`compute_job` runs in every task of a job with one task per GPU of a TP group (submitit starts
  them); the tasks form the TP group, measure (:mod:`profiler.compute`) and task 0 writes the compute
  entries (ok or failed) and the memory table into the archive itself.
- :func:`network_job` runs once, in the first task of its allocation (one or two nodes of a partition,
  or a het job over two partitions, which submitit cannot start tasks in); it starts the benchmark on
  every rank with its own ``srun`` step (:mod:`profiler.netbench`), fits the result (:mod:`profiler.fit`)
  and writes the network entry.

Both return a small summary dict that the driver reads from submitit's result file. A sweep with
``--local`` runs the same functions as processes on this machine (:mod:`profiler.local`): ranks then come
from torchrun's variables (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_PORT), which
:func:`sailor_hpc.core.dist_env.read_env` prefers over Slurm's.
"""
from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from profiler.fit import fit_bandwidth
from profiler.netspec import NetSpec
from profiler.versions import versions
from sailor_hpc.core.archive import (
    ComputeEntry,
    MemoryEntry,
    NetworkEntry,
    OverheadEntry,
    make_provenance,
    write_entries,
)
from sailor_hpc.core.dist_env import job_port, read_env
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import get_model
from sailor_hpc.core.network import MAX_JITTER_KEPT
from sailor_hpc.slurm.container import NO_CONTAINER, RankWrapper
from sailor_hpc.slurm.control import node_address as slurm_node_address
from sailor_hpc.slurm.control import run_step


@dataclass(frozen=True)
class ComputeTask:
    model: str
    partition: str
    gpu_key: str
    tp: int
    mbs: tuple[int, ...]
    archive: str
    cpu: bool
    sweep: str
    dtype: str = "fp32"
    blocks: int | None = None
    warmup: int = 3  # untimed repetitions at least (a GPU warms up until its repetition time is steady)
    iters: int = 20  # timed repetitions per point at least ...
    collective_timeout_s: float = 300.0  # how long a TP rank waits in a collective for the others
    min_time_s: float = 1.0  # ... and seconds of timed work at least (profiler.compute.Repetitions)
    remeasure: bool = True  # measure a non-monotonic point once more before flagging it (off: re-runs)
    deepspeed: bool = False  # also DeepSpeed's engine costs per point (profiler.ds_engine; TP 1)


@dataclass(frozen=True)
class NetworkTask:
    site_key: str
    kind: str
    a: str
    b: str
    senders: int
    nodes: int  # nodes of the (first) allocation: 1 (intra or het) or 2 (inter within a partition)
    sizes: tuple[int, ...]
    archive: str
    cpu: bool
    sweep: str
    folder: str
    python: str
    iters: int = 5
    warmup: int = 2
    wrapper: RankWrapper = NO_CONTAINER  # the benchmark's ranks run in the site's container

    @property
    def het(self) -> bool:
        return self.a != self.b


def node_address(node: str | None) -> str:
    """The address slurmd of ``node`` listens on (NodeAddr), which ranks on other nodes can reach."""
    if not node:
        return "127.0.0.1"
    return slurm_node_address(node) or node


def rendezvous_port() -> int:
    """This job's rendezvous port (:func:`~sailor_hpc.core.dist_env.job_port` of its id): concurrent jobs on a
    node get different ones. A port probed free and released could be bound by another job's step before ours
    binds it (EADDRINUSE, seen with several network jobs on one machine), so it follows from the job id. A run
    of one task outside Slurm (the GPU check, a laptop) has 0: the store binds a port the kernel picks."""
    if "SLURM_JOB_ID" not in os.environ and os.environ.get("SLURM_NTASKS", "1") == "1":
        return 0
    return job_port(int(os.environ.get("SLURM_JOB_ID") or 0))


def _slurm_where() -> dict[str, Any]:
    return {k: os.environ.get(v) for k, v in (("slurm_job", "SLURM_JOB_ID"), ("node", "SLURMD_NODENAME"),
                                              ("array_job", "SLURM_ARRAY_JOB_ID"),
                                              ("array_task", "SLURM_ARRAY_TASK_ID"))}


def _device(cpu: bool) -> Any:
    import torch
    if cpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SailorError("no CUDA device in this profiling job", field="--cpu",
                          fix="run on GPU nodes, or sweep with --cpu into a test archive (recorded under cpu-<type>)")
    torch.cuda.set_device(read_env().local_rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def compute_job(task: ComputeTask) -> dict[str, Any] | None:
    """Measure the task's micro-batch sizes at its TP degree (every TP rank runs this)."""
    import torch
    import torch.distributed as dist

    from profiler.compute import profile_compute, resident_bytes

    baseline = resident_bytes()
    where = read_env()
    rank, world = where.rank, where.world_size
    if world != task.tp:
        raise SailorError(f"the job has {world} tasks for TP {task.tp}", field="--tp",
                          fix="one task per GPU of the TP group")
    device = _device(task.cpu)
    threads = int(os.environ.get("SLURM_CPUS_PER_TASK", "1") or 1)
    torch.set_num_threads(max(1, threads))
    # one node: every TP rank is here. The store is ours (not init_process_group's own) because the ranks
    # also agree through it on every step's outcome (profiler.compute.TPAgreement)
    port = where.master_port if where.source == "torchrun" else rendezvous_port()  # a local sweep's driver chose it
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(minutes=20))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world, store=store,
                            timeout=datetime.timedelta(minutes=20))
    t0 = time.perf_counter()
    try:
        group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=task.collective_timeout_s))
        spec = get_model(task.model)
        res = profile_compute(spec, task.mbs, tp_group=group, device=device, dtype=task.dtype, blocks=task.blocks,
                              warmup=task.warmup, iters=task.iters, min_time_s=task.min_time_s,
                              remeasure=task.remeasure, baseline_rss=baseline, store=store,
                              collective_timeout_s=task.collective_timeout_s, deepspeed=task.deepspeed)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    prov = make_provenance(f"sailor-hpc profile ({task.sweep})", device=device.type, partition=task.partition,
                           method="cuda-events" if device.type == "cuda" else "wall-clock",
                           profiled_blocks=res.profiled_blocks, **res.extra, **_slurm_where(), **versions())
    L = spec.num_pipeline_layers
    entries: list[Any] = []
    points = []
    for p in res.points:
        times = p.times if p.times is not None else np.full((L, 3), np.nan)  # None: the point failed
        entries.append(ComputeEntry(spec.name, task.gpu_key, p.mbs, task.tp, times, {**prov, **p.info},
                                    status="ok" if p.ok else "failed", reason=p.reason, dtype=task.dtype,
                                    spread=p.spread, flag=p.flag))
        totals = p.totals() if p.ok else None
        points.append({"mbs": p.mbs, "tp": task.tp, "ok": p.ok, "reason": p.reason,
                       "fwd_s": totals.seconds[0] if totals else None, "bwd_s": totals.seconds[1] if totals else None,
                       "spread": list(totals.spread) if totals else None,
                       "repetitions": p.spread.repetitions if p.spread else None, "flag": p.flag})
    if res.memory is not None:
        entries.append(MemoryEntry(spec.name, task.tp, res.memory, prov, dtype=task.dtype))
    if res.overhead_bytes:  # written by the job itself, so a resumed sweep does not lose it (0: not measurable)
        entries.append(OverheadEntry(task.gpu_key, {task.tp: float(res.overhead_bytes)}, prov))
    write_entries(task.archive, entries)
    return {"points": points, "tp": task.tp, "gpu_key": task.gpu_key, "overhead_bytes": res.overhead_bytes,
            "memory": res.memory is not None, "seconds": time.perf_counter() - t0, "node": os.environ.get("SLURMD_NODENAME")}


def _step_options(task: NetworkTask, spec_file: Path, out_file: Path) -> list[str]:
    """The ``srun`` options of the benchmark step over the whole allocation (the driver's own step holds one
    task: --overlap)."""
    bench = task.wrapper.command([task.python, "-m", "profiler.netbench", "--spec", str(spec_file), "--out", str(out_file)])
    common = ["--overlap", "--kill-on-bad-exit=1", "--distribution=block", "--cpus-per-task=1", *task.wrapper.srun_options]
    if task.kind == "intra":
        return [*common, "--nodes=1", f"--ntasks={task.senders}", *bench]
    if not task.het:
        return [*common, f"--nodes={task.nodes}", f"--ntasks={task.nodes * task.senders}",
                f"--ntasks-per-node={task.senders}", *bench]
    return ["--het-group=0", *common, "--nodes=1", f"--ntasks={task.senders}", *bench, ":",
            "--het-group=1", *common, "--nodes=1", f"--ntasks={task.senders}", *bench]


def network_job(task: NetworkTask) -> dict[str, Any]:
    """Run the bandwidth benchmark on the allocation's ranks, fit it, write the network entry."""
    folder = Path(task.folder)
    job = os.environ.get("SLURM_JOB_ID", str(os.getpid()))
    spec_file, out_file = folder / f"net-{job}.spec.json", folder / f"net-{job}.result.json"
    write_net_spec(task, spec_file)
    env = dict(os.environ)
    env.update(MASTER_ADDR=node_address(os.environ.get("SLURMD_NODENAME")), MASTER_PORT=str(job_port(int(job))))
    for var in ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES", "SLURM_STEP_NUM_TASKS"):
        env.pop(var, None)  # the driver's own one-task step must not shape the benchmark step
    options = _step_options(task, spec_file, out_file)
    proc = run_step(options, env)
    if proc.returncode != 0 or not out_file.exists():
        raise RuntimeError(f"benchmark step failed (exit {proc.returncode}): srun {' '.join(options)}\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return record_network(task, json.loads(out_file.read_text()))


def write_net_spec(task: NetworkTask, spec_file: Path) -> None:
    """The benchmark's input, read by every rank of :mod:`profiler.netbench`."""
    spec_file.write_text(NetSpec(kind="intra" if task.kind == "intra" else "inter", senders=task.senders,
                                 sizes=task.sizes, iters=task.iters, warmup=task.warmup,
                                 device="cpu" if task.cpu else "cuda").to_json())


# profiler.netbench's result keys -> the NetworkFit fields they become
NETBENCH_LATENCIES = {"all_reduce_latency_s": "collective_latency_s", "all_gather_latency_s": "gather_latency_s",
                      "all_reduce_issued_latency_s": "issued_latency_s",
                      "all_gather_issued_latency_s": "issued_gather_latency_s", "replica_jitter": "replica_jitter"}


def record_network(task: NetworkTask, result: dict[str, Any]) -> dict[str, Any]:
    """Fit a benchmark's result (rank 0's JSON) and write the network entry; the summary for the driver."""
    # the link's latency per ring step of a small collective, back to back and issued alone after compute,
    # charged by the simulator per collective a runtime issues (a result without one: none)
    measured = {field: float(result.get(key, 0.0)) for key, field in NETBENCH_LATENCIES.items()}
    fit = replace(fit_bandwidth(result["sizes"], result["p2p_gbps"]),
                  collective_latency_s=measured["collective_latency_s"], gather_latency_s=measured["gather_latency_s"],
                  issued_latency_s=measured["issued_latency_s"],
                  issued_gather_latency_s=measured["issued_gather_latency_s"],
                  # a larger drift is an oversubscribed host's: kept below a site's bound (the provenance has the raw one)
                  replica_jitter=min(measured["replica_jitter"], MAX_JITTER_KEPT))
    ar_fit = fit_bandwidth(result["sizes"], result["allreduce_busbw_gbps"])
    prov = make_provenance(f"sailor-hpc profile ({task.sweep})", device=result["device"], backend=result["backend"],
                           hosts=result["hosts"], pairs=result["pairs"], sizes=result["sizes"],
                           p2p_gbps=result["p2p_gbps"], allreduce_busbw_gbps=result["allreduce_busbw_gbps"],
                           allreduce_fit=list(ar_fit.coeffs or ()),
                           **measured, **_slurm_where(),
                           **result["versions"])
    entry = NetworkEntry(task.site_key, "intra" if task.kind == "intra" else "inter", task.a, task.b, task.senders,
                         fit, prov)
    write_entries(task.archive, [entry])
    return {"path": entry.path, "coeffs": list(fit.coeffs or ()), "max_gbps": fit.max_gbps, "hosts": result["hosts"],
            "allreduce_max_gbps": max(result["allreduce_busbw_gbps"])}
