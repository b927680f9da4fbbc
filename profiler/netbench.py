"""Point-to-point and all-reduce bandwidth between the ranks of one ``srun`` step (torch; NCCL on GPUs,
gloo on CPU). Started by a profiling job on every rank:

    srun [--het-group=0,1] python -m profiler.netbench --spec spec.json --out result.json

Ranks come from ``SLURM_PROCID`` / ``SLURM_NTASKS`` (or, in a ``--local`` sweep, torchrun's ``RANK`` /
``WORLD_SIZE``: :func:`sailor_hpc.core.dist_env.read_env`), the rendezvous from ``MASTER_ADDR`` / ``MASTER_PORT``
(set by the job, see :mod:`profiler.jobs`). What is measured, for every message size:

* p2p, aggregate GB/s of ``k`` streams at once (Sailor's "k GPUs sending"): ``intra`` = the k ranks of
  one node each send to the next one (a ring shift, every GPU sends and receives); ``inter`` = k ranks
  on the first node (or het group) each send to their partner among the k ranks on the second. Time is
  the slowest rank's, from a barrier to its last completed transfer; the median over iterations.
* all-reduce over all ranks, as bus bandwidth (``2(n-1)/n * bytes / time``, nccl-tests' convention).
* the latency per ring step of a one-element all-reduce and all-gather, twice: in a stream of
  :data:`STREAM` back to back, and each issued alone after a burst of compute (:data:`BURST_S`), as a
  training step issues its collectives between its layers (the mean over rounds: a step pays the slow ones).
* how far the ranks drift apart doing the same work (:func:`replica_jitter`): the wait for the slowest
  rank that a step's gradient reduction pays.

Rank 0 writes the result JSON (sizes, both series, the host of every rank, its software versions).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from profiler.netspec import NetSpec
from profiler.versions import versions
from sailor_hpc.core.atomic import atomic_write_text
from sailor_hpc.core.dist_env import read_env
from simulator.iteration import expected_max_normal


def stream_pairs(kind: str, senders: int, world: int) -> list[tuple[int, int]]:
    """The (sender, receiver) ranks that transfer at the same time."""
    if kind == "intra":
        if world != senders or senders < 2:
            raise ValueError(f"intra-node p2p needs k >= 2 ranks on one node, got k={senders}, world={world}")
        return [(i, (i + 1) % senders) for i in range(senders)]
    if world != 2 * senders:
        raise ValueError(f"inter-node p2p needs k ranks on each of two nodes, got k={senders}, world={world}")
    return [(i, senders + i) for i in range(senders)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds: float, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _median_seconds(op: Callable[[], None], iters: int, warmup: int, device: torch.device) -> float:
    """Median over ``iters`` (after ``warmup``) of the slowest rank's time for ``op``, from a barrier."""
    times = []
    for it in range(warmup + iters):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        op()
        _sync(device)
        dt = _slowest(time.perf_counter() - t0, device)
        if it >= warmup:
            times.append(dt)
    return statistics.median(times)


def p2p_gbps(pairs: Sequence[tuple[int, int]], nbytes: int, iters: int, warmup: int, device: torch.device) -> float:
    me = dist.get_rank()
    n = max(1, nbytes // 4)
    send = torch.ones(n, dtype=torch.float32, device=device)
    recv = torch.empty(n, dtype=torch.float32, device=device)

    def exchange() -> None:
        ops = [dist.P2POp(dist.isend, send, d) for s, d in pairs if s == me] + \
              [dist.P2POp(dist.irecv, recv, s) for s, d in pairs if d == me]
        for req in (dist.batch_isend_irecv(ops) if ops else []):
            req.wait()

    return len(pairs) * n * 4 / _median_seconds(exchange, iters, warmup, device) / 1e9


def allreduce_busbw(nbytes: int, iters: int, warmup: int, device: torch.device) -> float:
    world = dist.get_world_size()
    n = max(1, nbytes // 4)
    buf = torch.ones(n, dtype=torch.float32, device=device)
    seconds = _median_seconds(lambda: dist.all_reduce(buf), iters, warmup, device)
    return 2 * (world - 1) / world * n * 4 / seconds / 1e9


BURST_S = 0.003  # compute before each issued collective: a few ms, as a step's layers run between its collectives
# the fewest rounds a profile's issued latency takes (each a burst and one collective): its mean is heavy-tailed
# (gloo, two ranks here: 170-880 us per ring step in five measurements of 15 rounds, 410-550 us of 40)
ISSUED_ROUNDS = 40
_BURST_DIM = 64  # the burst's matmuls: small, so every rank stops within tens of µs of its deadline


def _compute_burst(seconds: float, device: torch.device) -> None:
    """Keep this rank's core (or GPU) busy with matmuls for ``seconds``: its communication threads idle, as
    in a step's layers. Timed rather than counted, so the ranks reach the collective together and what is
    measured after it is the collective's own cost, not one rank's slower compute."""
    a = torch.rand(_BURST_DIM, _BURST_DIM, device=device)
    out = torch.empty_like(a)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.mm(a, a, out=out)
        _sync(device)


SPREAD_SPAN_S = 0.05  # compute between two collectives when measuring how far replicas drift apart
SPREAD_ROUNDS = 40  # 4 s: the drift over 15 rounds ranged 0-0.34 here, over 40 rounds 0.04-0.17


def _fixed_work(seconds: float, device: torch.device) -> Callable[[], float]:
    """The same matmuls as :func:`_compute_burst`, counted instead of timed: as many as take about ``seconds`` on
    the slowest rank now (every rank does the same work), run to the end whatever it takes, as a step's layers
    are."""
    a = torch.rand(_BURST_DIM, _BURST_DIM, device=device)
    out = torch.empty_like(a)

    def run(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            torch.mm(a, a, out=out)
        _sync(device)
        return time.perf_counter() - t0

    probe = min(seconds, 0.2)
    n, took = 16, run(16)
    while took < probe / 4:  # grow the probe until it is long enough to time
        n *= 2
        took = run(n)
    count = torch.tensor([n * seconds / took], dtype=torch.float64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)  # the slowest rank's count: no rank takes much over ``seconds``
    iterations = max(1, int(count.item()))
    return lambda: run(iterations)


def replica_jitter(rounds: int, warmup: int, device: torch.device, span_s: float = SPREAD_SPAN_S) -> float:
    """How far replicas doing the same work drift apart, as the simulator charges it
    (:mod:`simulator.iteration`: a collective waits ``jitter * E[max of W standard normals]`` per second of
    compute since its ranks last met). Each round every rank does the same work, about ``span_s`` of
    matmuls, then one all-reduce; the mean time inside it (mean over rounds: a step pays every late arrival,
    not the median one), less the same after a *timed* burst, where every rank arrives at once, is the wait
    for the slowest rank. Per second of the work (as long as it took), over E[max] of the world. 0 for one
    rank, or where the ranks kept together better than the measurement resolves (a negative difference)."""
    world = dist.get_world_size()
    if world < 2:
        return 0.0
    work = _fixed_work(span_s, device)
    one = torch.ones(1, dtype=torch.float32, device=device)

    def inside(prepare: Callable[[], float | None]) -> tuple[float, float]:
        """(mean seconds inside the all-reduce, mean seconds the preparation took), over rounds and ranks."""
        times, took = [], []
        for it in range(warmup + rounds):
            dist.barrier()
            t_prep = time.perf_counter()
            prepare()
            t0 = time.perf_counter()
            dist.all_reduce(one)
            _sync(device)
            if it >= warmup:
                times.append(time.perf_counter() - t0)
                took.append(t0 - t_prep)
        mean = torch.tensor([statistics.fmean(times), statistics.fmean(took)], dtype=torch.float64, device=device)
        dist.all_reduce(mean)  # the ranks' sums
        return float(mean[0].item()) / world, float(mean[1].item()) / world

    waited, span = inside(work)
    aligned, _ = inside(lambda: _compute_burst(span_s, device))
    return max(0.0, (waited - aligned) / span / expected_max_normal(world))


def _one_element_op(kind: str, device: torch.device) -> tuple[Callable[[], None], int]:
    """A one-element ``kind`` collective ("all_reduce" or "all_gather") over the world, and its ring steps."""
    world = dist.get_world_size()
    if world < 2:
        raise ValueError("a link's latency needs two ranks or more")
    one = torch.ones(1, dtype=torch.float32, device=device)
    out = torch.empty(world, dtype=torch.float32, device=device)
    ops = {"all_reduce": (lambda: dist.all_reduce(one), 2 * (world - 1)),
           "all_gather": (lambda: dist.all_gather_into_tensor(out, one), world - 1)}
    return ops[kind]


STREAM = 20  # collectives per streamed latency sample, back to back: the least a small collective costs


def collective_latency_s(kind: str, iters: int, warmup: int, device: torch.device) -> float:
    """The link's latency per ring step of a one-element ``kind`` ("all_reduce": ``2(W - 1)`` steps, or
    "all_gather": ``W - 1``): a stream of :data:`STREAM` back to back (median over ``iters``, slowest rank,
    from a barrier), per collective and step. What every collective pays whatever it moves (the alpha of an
    alpha-beta model, :mod:`simulator.network`) when nothing runs between them; a step's own, issued between
    its compute, cost more (:func:`issued_latency_s`)."""
    op, steps = _one_element_op(kind, device)

    def stream() -> None:
        for _ in range(STREAM):
            op()

    return _median_seconds(stream, iters, warmup, device) / (STREAM * steps)


def issued_latency_s(kind: str, rounds: int, warmup: int, device: torch.device, burst_s: float = BURST_S) -> float:
    """The link's latency per ring step of a one-element ``kind`` collective issued alone after
    ``burst_s`` of compute on every rank, as a training step issues its collectives (DeepSpeed's, one at a
    time between its layers), where :func:`collective_latency_s` streams them back to back. Between compute
    the ranks' communication threads sleep and the peers' must be woken (on an oversubscribed host, each
    rank must get its core back), which a stream pays once. Per round, the mean over ranks of the time
    each spends inside the collective (what a step's time inside its collectives counts), from a barrier;
    the mean over ``rounds`` (after ``warmup``): a rank not woken at once costs a round milliseconds where
    the median one costs a tenth of that, and a step pays every such round, not the median one."""
    op, steps = _one_element_op(kind, device)
    world = dist.get_world_size()
    times = []
    for it in range(warmup + rounds):
        dist.barrier()
        _compute_burst(burst_s, device)
        t0 = time.perf_counter()
        op()
        _sync(device)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(t)  # the ranks' sum
        if it >= warmup:
            times.append(float(t.item()) / world)
    return statistics.fmean(times) / steps


def run(spec: NetSpec) -> dict[str, object]:
    """Measure on an initialised process group; the result (rank 0's view) as a dict."""
    cuda = spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(read_env().local_rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    pairs = stream_pairs(spec.kind, spec.senders, dist.get_world_size())
    hosts: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, os.environ.get("SLURMD_NODENAME") or os.uname().nodename)
    p2p = [p2p_gbps(pairs, s, spec.iters, spec.warmup, device) for s in spec.sizes]
    ar = [allreduce_busbw(s, spec.iters, spec.warmup, device) for s in spec.sizes]
    latency = {f"{k}_latency_s": collective_latency_s(k, spec.iters, spec.warmup, device)
               for k in ("all_reduce", "all_gather")}
    # one sample a round (not a stream's mean): at least ISSUED_ROUNDS for a steady mean
    rounds = max(spec.iters, ISSUED_ROUNDS)
    issued = {f"{k}_issued_latency_s": issued_latency_s(k, rounds, spec.warmup, device)
              for k in ("all_reduce", "all_gather")}
    jitter = replica_jitter(max(spec.iters, SPREAD_ROUNDS), spec.warmup, device)
    return {"sizes": list(spec.sizes), "p2p_gbps": p2p, "allreduce_busbw_gbps": ar, **latency, **issued,
            "replica_jitter": jitter,
            "pairs": pairs, "hosts": hosts,
            "device": device.type, "backend": dist.get_backend(), "world": dist.get_world_size()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m profiler.netbench")
    ap.add_argument("--spec", required=True, help="NetSpec JSON file")
    ap.add_argument("--out", required=True, help="result JSON (written by rank 0)")
    args = ap.parse_args(argv)
    spec = NetSpec.from_json(open(args.spec).read())
    where = read_env()  # srun's ranks, or a local sweep's (torchrun's variables)
    rank, world = where.rank, where.world_size
    cuda = spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available())
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    try:
        result = run(spec)
        if rank == 0:  # its versions: the job's driver, which writes the entry, never imports torch
            atomic_write_text(args.out, json.dumps({**result, "versions": versions()}) + "\n")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
