"""What stock DeepSpeed's engines allocate per ZeRO stage, from torch's CPU allocator (one rank of a gloo world).

Every configuration of ``ZERO_CONFIGS`` (a JSON list of ``[label, zero stage, stages]`` in the environment:
one stage x ``world`` replicas runs DeepSpeed's plain engine, ``world`` stages x 1 replica its
``PipelineEngine``) is built as ``megatron_patch.ds_runtime`` builds it (:class:`DsTrainer`) and trained
four steps, one after the other in this process, all under ``torch.profiler.profile(profile_memory=True)``,
whose events carry every allocation and free of the CPU allocator. Their running sum is what the allocator
has handed out (the CPU analogue of ``torch.cuda.memory_allocated``); unlike the resident set size it
counts a buffer that ``torch.empty`` allocates and nobody writes (ZeRO's reduce buckets), as a GPU's
allocator does.

Each rank prints one ``{"event": "zero_memory", ...}`` line: per configuration, from the allocated total
when the engine's construction began, the peak of each steady step (all but the first: ``steady_peaks``)
and the least of them (``peak``), the total when the last step began (``start``) and the largest single
allocations inside it.

The profiler records the allocator's events of this (the main) thread only. A tensor handed to a gloo
collective is also held by the collective's work item on gloo's worker thread; when that thread drops it
after the main thread did (a matter of scheduling, frequent on a loaded machine), the free happens there,
unrecorded, and the running sum keeps the buffer for the rest of the run (DeepSpeed's flattened gradient
bucket: a gradient-sized buffer more from that step on). :func:`_frees_on_this_thread` makes every
collective wait until gloo has let go of its tensors, so their last reference dies here, when the
collective is over, as a GPU's caching allocator would count it. Rank 0 also prints the layer profile a
profiling job takes (``{"event": "profile"}``, micro-batch ``PROFILE_MBS``), for the simulator.
"""
from __future__ import annotations

import bisect
import gc
import json
import os
import sys
import time
import warnings
from typing import Any

warnings.filterwarnings("ignore")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

MODEL = "tiny-gpt"


CUTS = {1: ((0, 5),), 2: ((0, 2), (3, 5)), 3: ((0, 1), (2, 3), (4, 5))}  # tiny-gpt's 6 pipeline layers


def plan_for(zero: int, stages: int, world: int, mbs: int, micro: int, gpus: tuple[str, ...] = ()) -> Any:
    """tiny-gpt as ``stages`` stages x ``world // stages`` replicas, ``micro`` micro-batches of ``mbs``; stage s
    on GPU type ``gpus[s]`` (default "CPU": the runtime does not read it, the simulator does)."""
    from sailor_hpc.core.deepspeed_plan import with_zero_stage
    from sailor_hpc.core.plan import Pipeline, Plan, Stage

    types = gpus or ("CPU",) * stages
    pipe = Pipeline(mbs, micro, tuple(Stage(a, b, 1, t) for (a, b), t in zip(CUTS[stages], types, strict=True)))
    return with_zero_stage(Plan(MODEL, world // stages * mbs * micro, (pipe,) * (world // stages)), zero)


COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single", "scatter", "gather")


def _tensors(args: Any) -> list[torch.Tensor]:
    if isinstance(args, torch.Tensor):
        return [args]
    if isinstance(args, (list, tuple)):
        return [t for a in args for t in _tensors(a)]
    if isinstance(args, dict):
        return _tensors(list(args.values()))
    return []


def _released(held: list[tuple[torch.Tensor, int]], what: str) -> None:
    """Wait until gloo's worker thread dropped its references to the collective's tensors (module doc)."""
    deadline = time.monotonic() + 30
    while any(t._use_count() > n for t, n in held):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: gloo still holds its tensors 30 s after the collective completed")
        time.sleep(0)


class _ReleasingWork:
    """An async collective's work whose ``wait`` also waits for gloo to let go of the tensors; the work item
    holds them too, so ``wait`` drops it first (and a waited work only answers ``is_completed``)."""

    def __init__(self, work: Any, held: list[tuple[torch.Tensor, int]], what: str) -> None:
        self._work: Any = work
        self._held, self._what = held, what

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if self._work is None:
            return True
        out = self._work.wait(*args, **kwargs)
        self._work = None
        _released(self._held, self._what)
        return out

    def is_completed(self) -> bool:
        return self._work is None or bool(self._work.is_completed())

    def __getattr__(self, name: str) -> Any:
        if self._work is None:
            raise AttributeError(f"{self._what}'s work was waited for and released; {name} is not kept")
        return getattr(self._work, name)


def _frees_on_this_thread() -> None:
    """Every collective of ``torch.distributed`` (DeepSpeed's comm calls them through the module) returns only
    once gloo's worker thread holds none of its tensors, so their frees happen on this thread (module doc)."""
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def collective(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
            held = [(t, t._use_count()) for t in _tensors((args, kwargs))]
            work = _fn(*args, **kwargs)
            if work is not None:  # async_op: a work handle, waited for later
                return _ReleasingWork(work, held, _name)
            _released(held, _name)
            return work
        setattr(dist, name, collective)


def _totals(events: Any) -> tuple[list[int], list[int]]:
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    times, totals, total = [], [], 0
    for t, n in mem:
        total += n
        times.append(t)
        totals.append(total)
    return times, totals


def main() -> None:
    import deepspeed

    from megatron_patch.data import GlobalSamples
    from megatron_patch.ds_runtime.engine import DsTrainer
    from megatron_patch.ds_runtime.launch import _without_shm_op
    _without_shm_op()
    _frees_on_this_thread()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    mbs, micro, steps = int(os.environ.get("ZERO_MBS", "4")), int(os.environ.get("ZERO_MICRO", "4")), 4
    configs = json.loads(os.environ["ZERO_CONFIGS"])
    from sailor_hpc.core.models import get_model
    samples = GlobalSamples(os.environ["ZERO_DATA"], get_model(MODEL).seq_len)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for label, zero, stages in configs:
            with record_function(f"cfg.{label}.init"):
                trainer = DsTrainer(plan_for(zero, stages, world, mbs, micro), samples)
            for i in range(steps):
                with record_function(f"cfg.{label}.step{i}"):
                    trainer.train_step()
            del trainer
            gc.collect()
    events = prof.profiler.kineto_results.events()
    times, totals = _totals(events)
    ranges = {e.name(): (e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name().startswith("cfg.")}

    def at(t: int) -> int:
        i = bisect.bisect_left(times, t)
        return totals[i - 1] if i > 0 else 0

    def peak(lo: int, hi: int) -> int:
        a, b = bisect.bisect_left(times, lo), bisect.bisect_right(times, hi)
        return max([at(lo), *totals[a:b]])

    out: dict[str, Any] = {}
    for label, _zero, _stages in configs:
        base = at(ranges[f"cfg.{label}.init"][0])
        lo, hi = ranges[f"cfg.{label}.step{steps - 1}"]
        a, b = bisect.bisect_left(times, lo), bisect.bisect_right(times, hi)
        inside = [totals[i] - (totals[i - 1] if i else 0) for i in range(a, b)]
        # the steady steps' (all but the first) peaks: under load DeepSpeed's reduction sometimes holds a
        # gradient-sized buffer a moment longer in one of them; the least is the step's own
        steady = [peak(*ranges[f"cfg.{label}.step{i}"]) - base for i in range(1, steps)]
        out[label] = {"start": at(lo) - base, "peak": min(steady), "steady_peaks": steady,
                      "largest": sorted((n for n in inside if n > 0), reverse=True)[:3]}
    print(json.dumps({"event": "zero_memory", "rank": rank, "world": world, "mbs": mbs, "micro": micro,
                      "results": out}), flush=True)
    if rank == 0:
        from profiler.compute import LayerProfiler
        prof_mbs = int(os.environ.get("PROFILE_MBS", str(mbs)))
        layers = LayerProfiler(get_model(MODEL), tp_group=dist.new_group([0]), device=torch.device("cpu"),
                               warmup=1, iters=3, min_time_s=0.0)
        print(json.dumps({"event": "profile", "mbs": prof_mbs, "times": layers.measure(prof_mbs).tolist(),
                          "memory": layers.memory_table().tolist()}), flush=True)
    else:
        dist.new_group([0])  # every rank creates every group
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
