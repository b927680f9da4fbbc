"""Per-layer forward, backward and optimizer-step times, memory per layer and fixed memory of one GPU,
measured on the layers megatron_patch trains (torch; runs inside a profiling job, one process per TP rank).

What is built: with ``megatron_patch.model.build_stage_module``, stage A = pipeline layers ``0..K``
(embedding + the first K transformer blocks) and stage B = the tail (final norm, LM head + loss), on a
TP group of all processes of the job. Blocks K+1..T have the same shapes as block K and get its
numbers (Sailor's convention, recorded as ``profiled_blocks`` = K), so a 48-block model is profiled
with the memory of K blocks.

How it is timed, per micro-batch size: every pipeline layer runs on its own, on the detached output of
the layer before (so its forward and its backward, weight gradients included, are isolated the way a
pipeline stage boundary isolates them; TP collectives inside the layer are included). CUDA events on a
GPU, the wall clock on CPU; ``warmup`` untimed iterations, then the median of ``iters``. The update
column is the optimizer step (megatron_patch's AdamW, :class:`megatron_patch.optimizer.StageOptimizer`)
of the whole profiled model, repeated on every row, as the simulator reads it.

Besides each layer alone, the measured layers also run as one chain (one forward through all of them,
one backward), the way a pipeline stage runs them: on a GPU the host launches the next layer's kernels
while the previous ones run, which per-layer timing cannot see (small micro-batches are launch-bound).
The chain's forward and backward seconds go into the point's provenance (``stack_fwd_s``,
``stack_bwd_s``, ``stack_layers``); the simulator turns the difference to the per-layer sum into a
saving per layer boundary inside a stage.

Memory at micro-batch 1: parameters per TP rank per layer from megatron_patch's layout (checked against
the built modules by ``build_stage_module``); each layer's output and input elements; retained
activation bytes = what the layer's forward keeps until its backward (CUDA: allocator delta around the
forward, as Sailor, after one warm-up pass so that one-time allocations are not counted; CPU: the unique
storages saved for backward plus the output, parameters and inputs excluded). Fixed memory: on a GPU, device
memory in use that the caching allocator does not hold
(context, cuBLAS/NCCL workspaces; ``nvidia-smi`` minus reserved) after the TP collectives ran; on CPU,
the process's resident memory after start-up (a stand-in, recorded under the ``cpu-`` key only).

Failures: a step (the memory table, a micro-batch size, its chain timing) that fails on any TP rank,
out of memory or otherwise, is recorded as failed on every rank with the reasons, and the sweep of the
job goes on with the next size (:class:`TPAgreement`: no rank is left waiting in a collective).
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_patch import patch
from megatron_patch.layout import local_shape, param_layout, params_of_layers
from megatron_patch.main_grad import attach_main_grads
from megatron_patch.model import (
    BlockLayer,
    EmbeddingLayer,
    FinalNormLayer,
    OutputLayer,
    StageModule,
    build_stage_module,
    padded_vocab_size,
)
from megatron_patch.optimizer import AdamConfig, StageOptimizer
from sailor_hpc.core.models import ModelSpec

DEFAULT_BLOCKS = 2


@dataclass
class PointResult:
    """One (micro-batch size, TP) point: (L, 3) seconds, or why it failed."""

    mbs: int
    times: np.ndarray | None
    reason: str = ""
    stack: tuple[float, float] | None = None  # forward, backward seconds of the measured layers as one chain

    @property
    def ok(self) -> bool:
        return self.times is not None


@dataclass
class ComputeResult:
    points: list[PointResult]
    memory: np.ndarray | None  # (L, 4) at micro-batch 1, or None when even that failed
    overhead_bytes: float
    profiled_blocks: int
    device: str
    extra: dict[str, Any] = field(default_factory=dict)


class _Clock:
    """Elapsed seconds of a region: CUDA events on a GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def measure(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0, out
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out


def profiled_blocks(spec: ModelSpec, blocks: int | None) -> int:
    return max(1, min(spec.num_layers, blocks or DEFAULT_BLOCKS))


def source_layer(spec: ModelSpec, layer: int, k: int) -> int:
    """The measured pipeline layer whose numbers ``layer`` gets (blocks beyond K copy block K)."""
    return k if k < layer <= spec.num_layers else layer


def layer_params(spec: ModelSpec, tp: int, padded_vocab: int) -> np.ndarray:
    """Parameters per TP rank that a stage holding only layer l keeps (tied embedding on both ends)."""
    layout = param_layout(spec, padded_vocab)
    return np.array([sum(math.prod(local_shape(p, tp)) for p in params_of_layers(layout, l, l))
                     for l in range(spec.num_pipeline_layers)], dtype=np.float64)


class _Stage:
    """A built stage and how to run one of its pipeline layers alone."""

    def __init__(self, module: StageModule, spec: ModelSpec) -> None:
        self.module = module
        self.spec = spec
        self.by_layer: dict[int, list[torch.nn.Module]] = {}
        for m in module.layers:
            self.by_layer.setdefault(int(m.index), []).append(m)

    def run(self, layer: int, x: torch.Tensor | None, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = x
        for m in self.by_layer[layer]:
            if isinstance(m, EmbeddingLayer):
                pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
                h = m(tokens, pos)
            elif isinstance(m, BlockLayer):
                rotary = self.module.rotary(h.shape[0]) if self.module.rotary is not None else None
                h = m(h, self.module._causal_mask(h.shape[0]), rotary)
            elif isinstance(m, FinalNormLayer):
                h = m(h)
            elif isinstance(m, OutputLayer):
                tied = self.module.layers[0].embedding.word_embeddings.weight if m.linear.weight is None else None
                h = m(h, labels, tied)
        assert h is not None
        return h


def _inputs(spec: ModelSpec, mbs: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)  # the same batch on every TP rank, as megatron requires
    tokens = torch.randint(0, spec.vocab_size, (mbs, spec.seq_len), generator=g)
    labels = torch.randint(0, spec.vocab_size, (mbs, spec.seq_len), generator=g)
    return tokens.to(device), labels.to(device)


def _grad_like(out: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out.shape, generator=g, dtype=torch.float32).to(device=out.device, dtype=out.dtype)


def _retained_bytes(fn: Callable[[], torch.Tensor], exclude: Sequence[torch.Tensor],
                    device: torch.device) -> tuple[torch.Tensor, float]:
    """Run a forward; bytes it leaves allocated for the backward (see the module doc)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        # never below 0: the allocator may free a cached block during the forward
        return out, max(0.0, float(torch.cuda.memory_allocated(device) - before))
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            kept[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    st = out.untyped_storage()
    kept[st.data_ptr()] = st.nbytes()
    return out, float(sum(kept.values()))


class LayerProfiler:
    """Builds the profiled stages once and measures any micro-batch size on them."""

    def __init__(self, spec: ModelSpec, *, tp_group: Any, device: torch.device, dtype: str = "fp32",
                 blocks: int | None = None, warmup: int = 3, iters: int = 10, seed: int = 1234) -> None:
        self.spec, self.device, self.dtype = spec, device, dtype
        self.k = profiled_blocks(spec, blocks)
        self.warmup, self.iters, self.seed = warmup, iters, seed
        self.tp, self.rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        self.padded = padded_vocab_size(spec, (self.tp,))
        self.clock = _Clock(device)
        patch.apply(cpu=device.type == "cpu")  # what the runtime installs before building stages
        patch.seed_model_parallel_rng(seed, dist.get_rank(tp_group))
        T, L = spec.num_layers, spec.num_pipeline_layers
        common = dict(tp_group=tp_group, dtype=dtype, padded_vocab=self.padded, device=device, seed=None)
        self.stages = [_Stage(build_stage_module(spec, 0, self.k, **common), spec)]
        if L - 1 > T:
            self.stages.append(_Stage(build_stage_module(spec, T + 1, L - 1, **common), spec))
        self.measured = [l for st in self.stages for l in sorted(st.by_layer)]
        infos = {p.name: p for p in param_layout(spec, self.padded)}
        for st in self.stages:  # the runtime's fp32 gradient accumulation: its add and its 4 bytes/param are timed
            attach_main_grads(st.module.canonical_params())
        self.optimizers = [StageOptimizer(st.module.canonical_params(), infos, AdamConfig()) for st in self.stages]

    def _stage_of(self, layer: int) -> _Stage:
        return next(st for st in self.stages if layer in st.by_layer)

    def _forward_chain(self, tokens: torch.Tensor, labels: torch.Tensor,
                       each: Callable[[int, Callable[[], torch.Tensor], torch.Tensor | None], torch.Tensor]) -> None:
        """Run every measured layer once, each on the detached output of the one before."""
        prev: torch.Tensor | None = None
        for layer in self.measured:
            x = None if prev is None else prev.detach().requires_grad_(True)
            stage = self._stage_of(layer)
            prev = each(layer, lambda s=stage, l=layer, x=x: s.run(l, x, tokens, labels), x)

    def measure(self, mbs: int) -> np.ndarray:
        """(L, 3) seconds: forward, backward, optimizer step of the profiled model."""
        tokens, labels = _inputs(self.spec, mbs, self.device, self.seed + mbs)
        fwd: dict[int, list[float]] = {l: [] for l in self.measured}
        bwd: dict[int, list[float]] = {l: [] for l in self.measured}
        upd: list[float] = []
        for it in range(self.warmup + self.iters):
            timed = it >= self.warmup

            def each(layer: int, run: Callable[[], torch.Tensor], _x: torch.Tensor | None,
                     timed: bool = timed) -> torch.Tensor:
                if layer == 1:
                    _injected_failure(self.rank, mbs)
                tf, out = self.clock.measure(run)
                grad = _grad_like(out, self.seed + layer)
                tb, _ = self.clock.measure(functools.partial(out.backward, grad))
                if timed:
                    fwd[layer].append(tf)
                    bwd[layer].append(tb)
                return out

            self._forward_chain(tokens, labels, each)
            # the step as the runtime takes it: fp32 master gradients first (bf16/fp16 keep their grads on the
            # low-precision copies; without this the step would find no gradient and skip every parameter)
            tu, _ = self.clock.measure(lambda: [(opt.main_grads(), opt.step(1.0)) for opt in self.optimizers])
            for opt in self.optimizers:
                opt.zero_grad()
            if timed:
                upd.append(tu)
        L = self.spec.num_pipeline_layers
        times = np.zeros((L, 3))
        update = statistics.median(upd)
        for l in range(L):
            src = source_layer(self.spec, l, self.k)
            times[l] = (statistics.median(fwd[src]), statistics.median(bwd[src]), update)
        return times

    def measure_stack(self, mbs: int) -> tuple[float, float]:
        """Forward and backward seconds of all measured layers run as one chain (medians)."""
        tokens, labels = _inputs(self.spec, mbs, self.device, self.seed + mbs)
        fwd: list[float] = []
        bwd: list[float] = []
        for it in range(self.warmup + self.iters):
            def chain() -> torch.Tensor:
                h: torch.Tensor | None = None
                for layer in self.measured:
                    h = self._stage_of(layer).run(layer, h, tokens, labels)
                assert h is not None
                return h

            tf, out = self.clock.measure(chain)
            grad = _grad_like(out, self.seed + self.measured[-1])
            tb, _ = self.clock.measure(functools.partial(out.backward, grad))
            for opt in self.optimizers:
                opt.zero_grad()
            if it >= self.warmup:
                fwd.append(tf)
                bwd.append(tb)
        return statistics.median(fwd), statistics.median(bwd)

    def memory_table(self) -> np.ndarray:
        """(L, 4) at micro-batch 1: params, act_output, act_input (elements per TP rank), act_mem_bytes.

        Measured after one untimed forward and backward of every layer: the first pass allocates what
        stays for the process's lifetime (the cuBLAS workspace, cached masks and rotary tables, gradient
        buffers), which the allocator delta around a layer's forward would otherwise count as that layer's
        activations. (On CPU the retained bytes come from the saved tensors, which a warm-up does not
        change; the GPU path cannot be tested on a CPU-only machine.)"""
        tokens, labels = _inputs(self.spec, 1, self.device, self.seed)
        self._forward_chain(tokens, labels, self._warm_up_layer)
        for opt in self.optimizers:
            opt.zero_grad()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        L = self.spec.num_pipeline_layers
        table = np.zeros((L, 4))
        table[:, 0] = layer_params(self.spec, self.tp, self.padded)
        measured: dict[int, tuple[float, float, float]] = {}
        params = [p for st in self.stages for p in st.module.parameters()]

        def each(layer: int, run: Callable[[], torch.Tensor], x: torch.Tensor | None) -> torch.Tensor:
            exclude = params + ([x] if x is not None else [tokens, labels])
            out, kept = _retained_bytes(run, exclude, self.device)
            inp = float(x.numel()) if x is not None else float(2 * tokens.numel())  # token + position ids
            measured[layer] = (float(out.numel()), inp, kept)
            out.backward(_grad_like(out, self.seed))
            return out

        self._forward_chain(tokens, labels, each)
        for opt in self.optimizers:
            opt.zero_grad()
        for l in range(L):
            table[l, 1:] = measured[source_layer(self.spec, l, self.k)]
        return table

    def _warm_up_layer(self, layer: int, run: Callable[[], torch.Tensor], _x: torch.Tensor | None) -> torch.Tensor:
        out = run()
        out.backward(_grad_like(out, self.seed + layer))
        return out

    def overhead_bytes(self, baseline_rss: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            return float(total - free - torch.cuda.memory_reserved(self.device))
        return baseline_rss


def resident_bytes() -> float:
    """This process's resident set size (Linux /proc; 0 where unavailable)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


FAIL_ENV = "SAILOR_PROFILER_FAIL"


def _injected_failure(rank: int, mbs: int) -> None:
    """For tests only: ``SAILOR_PROFILER_FAIL=<rank>:<mbs>`` makes that TP rank fail at that micro-batch size
    just before the first block's forward, so the other ranks wait in that block's TP collective, as they
    do when one GPU runs out of memory."""
    if os.environ.get(FAIL_ENV) == f"{rank}:{mbs}":
        raise RuntimeError(f"injected failure ({FAIL_ENV}) on TP rank {rank} at micro-batch {mbs}")


def _describe(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return f"{'out of memory' if is_oom(exc) else type(exc).__name__}: {first}"


class TPAgreement:
    """Every step of a profiling job (the memory table, one micro-batch size, its chain timing) ends with
    all TP ranks knowing its outcome on every rank.

    Why: an exception on one rank (out of memory, typically) leaves the others waiting in a TP collective
    that rank never joins, and a rank that went on alone would pair its next collectives with the others'
    old ones. So each rank posts its outcome to the job's rendezvous store and waits for everyone's: the
    step failed if it failed anywhere (with each failing rank's reason, in the order they failed), and then
    every rank records it as failed. A rank still waiting in a collective is released: on NCCL a watchdog
    thread that sees another rank's failure aborts the communicator (what ends a waiting NCCL kernel);
    gloo cannot be interrupted (its pending collectives ignore abort and destroy), so the group carries a
    per-collective timeout. After a failed step the group may hold half-done collectives, so
    :meth:`renew` replaces it before the next step (every rank does, as every rank knows the outcome).
    """

    def __init__(self, group: Any, store: Any | None = None, *, collective_timeout_s: float = 300.0,
                 agree_timeout_s: float = 1800.0, poll_s: float = 0.1) -> None:
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if self.world > 1 and store is None:
            raise ValueError("the ranks of a TP group agree through the job's store: pass it")
        self.store = None if store is None or self.world == 1 else dist.PrefixStore("sailor-profile/", store)
        self.collective_timeout_s, self.agree_timeout_s, self.poll_s = collective_timeout_s, agree_timeout_s, poll_s
        self.steps = 0

    def run(self, step: str, fn: Callable[[], Any]) -> tuple[Any, str]:
        """(fn's value, "") when the step succeeded on every rank, else (None, why) on every rank."""
        self.steps += 1
        key = f"{self.steps}:{step}"
        done = threading.Event()
        if self.world > 1 and dist.get_backend(self.group) == "nccl":
            threading.Thread(target=self._watch, args=(key, done), daemon=True).start()
        try:
            value, why = fn(), ""
        except Exception as exc:  # noqa: BLE001 - any failure of a point is recorded, never the job's end
            value, why = None, _describe(exc)
            if self.store is not None:
                why = f"{self.store.add(f'{key}/failures', 1)} {why}"
        finally:
            done.set()
        if self.store is None:
            return value, why
        failures = self._verdicts(key, why)
        return (None, failures) if failures else (value, "")

    def _verdicts(self, key: str, why: str) -> str:
        """Post this rank's outcome, then every failing rank's reason in the order they failed ("" if none)."""
        assert self.store is not None
        self.store.set(f"{key}/rank{self.rank}", f"failed {why}" if why else "ok")
        keys = [f"{key}/rank{r}" for r in range(self.world)]
        self.store.wait(keys, datetime.timedelta(seconds=self.agree_timeout_s))
        failed = []
        for r, k in enumerate(keys):
            verdict = self.store.get(k).decode()
            if verdict.startswith("failed "):
                order, _, reason = verdict[len("failed "):].partition(" ")
                failed.append((int(order), f"rank {r}: {reason}"))
        return "; then ".join(text for _, text in sorted(failed))

    def _watch(self, key: str, done: threading.Event) -> None:
        """NCCL only: abort this rank's communicator once another rank failed the step, which ends a
        collective kernel still waiting for that rank (untested here: it needs GPUs)."""
        assert self.store is not None
        while not done.wait(self.poll_s):
            if self.store.add(f"{key}/failures", 0) > 0:
                self.group.abort()
                return

    def finish(self) -> None:
        """The last word: rank 0 hosts the store, so it leaves only after every rank has read its last verdict."""
        if self.store is None:
            return
        self.store.set(f"finished/rank{self.rank}", "1")
        if self.rank == 0:
            self.store.wait([f"finished/rank{r}" for r in range(self.world)],
                            datetime.timedelta(seconds=self.agree_timeout_s))

    def renew(self) -> None:
        """A fresh TP group over the same ranks (called by every rank after a failed step)."""
        if self.world == 1:
            return
        old = self.group
        ranks, backend = dist.get_process_group_ranks(old), dist.get_backend(old)
        for retire in (old.abort, lambda: dist.destroy_process_group(old)):
            with contextlib.suppress(Exception):  # an aborted or timed-out group: only its resources are left
                retire()
        self.group = dist.new_group(ranks, backend=backend,
                                    timeout=datetime.timedelta(seconds=self.collective_timeout_s))


def _release(prof: LayerProfiler, device: torch.device) -> None:
    """After a failed step: drop the gradients and the allocator's cache before the next point."""
    for opt in prof.optimizers:
        opt.zero_grad()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def profile_compute(spec: ModelSpec, mbs_list: Sequence[int], *, tp_group: Any, device: torch.device,
                    dtype: str = "fp32", blocks: int | None = None, warmup: int = 3, iters: int = 10,
                    baseline_rss: float = 0.0, store: Any | None = None,
                    collective_timeout_s: float = 300.0) -> ComputeResult:
    """Measure every micro-batch size of ``mbs_list`` (ascending) at this TP degree. A step that fails on any
    rank (out of memory or any other error) is recorded as failed on every rank with the reasons
    (:class:`TPAgreement`; ``store`` is the job's rendezvous store, needed for TP > 1), and the larger sizes
    are still tried, after freeing the cache, on a fresh group and freshly built stages."""
    agree = TPAgreement(tp_group, store, collective_timeout_s=collective_timeout_s)

    def build() -> LayerProfiler:
        return LayerProfiler(spec, tp_group=agree.group, device=device, dtype=dtype, blocks=blocks, warmup=warmup,
                             iters=iters)

    def recover() -> None:
        nonlocal prof
        _release(prof, device)
        if agree.world == 1:
            return
        prof = None  # the failed stages go before new ones are built: after an OOM there is no room for both
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        agree.renew()
        prof = build()

    prof: LayerProfiler | None = build()
    memory, memory_failure = agree.run("memory", prof.memory_table)
    if memory_failure:
        recover()
    points = []
    for mbs in sorted(mbs_list):
        times, why = agree.run(f"mbs{mbs}", functools.partial(prof.measure, mbs))
        if why:
            points.append(PointResult(mbs=mbs, times=None, reason=f"micro-batch {mbs}: {why}"))
            recover()
            continue
        # the chain holds every measured layer's activations at once: it may fail where the layers fit
        stack, why = agree.run(f"mbs{mbs}-chain", functools.partial(prof.measure_stack, mbs))
        if why:
            recover()
        points.append(PointResult(mbs=mbs, times=times, stack=stack))
    agree.finish()
    return ComputeResult(points=points, memory=memory, overhead_bytes=prof.overhead_bytes(baseline_rss),
                         profiled_blocks=prof.k, device=device.type,
                         extra={"padded_vocab": prof.padded, "warmup": warmup, "iters": iters,
                                "stack_layers": len(prof.measured),
                                **({"memory_failure": memory_failure} if memory_failure else {})})
