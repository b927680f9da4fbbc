"""Per-layer forward, backward and optimizer-step times, memory per layer and fixed memory of one GPU,
measured on the layers megatron_patch trains (torch; runs inside a profiling job, one process per TP rank).

What is built: with ``megatron_patch.model.build_stage_module``, stage A = pipeline layers ``0..K``
(embedding + the first K transformer blocks) and stage B = the tail (final norm, LM head + loss), on a
TP group of all processes of the job. Blocks K+1..T have the same shapes as block K and get its
numbers (Sailor's convention, recorded as ``profiled_blocks`` = K), so a 48-block model is profiled
with the memory of K blocks.

How it is timed, per micro-batch size (why: the first H100 run timed each layer alone with a host
synchronisation after it and built the output gradients on the CPU between forward and backward, so
the GPU idled most of the sweep, its clocks fell, every layer paid launch latency, and the profile was
neither monotonic nor what training runs; see :class:`Repetitions`):

* the measured layers run as one chain per repetition, as a pipeline stage runs them: a forward through
  all of them, each on the detached output of the one before (so each layer's backward, weight
  gradients and TP collectives included, can be bracketed on its own), then their backwards from the
  last to the first, each fed the input gradient the layer after it produced, then the optimizer step.
  A mark (a CUDA event on a GPU, ``perf_counter`` on CPU) is recorded between consecutive layers and
  nothing waits for the device inside a repetition, so a layer's time is its slice of the chain and
  the per-layer times of a repetition sum to the chain's time exactly;
* tokens, labels and the gradient of the chain's last output are made on the device once per micro-batch
  size, outside any timed region;
* before each size, untimed repetitions warm the device up: on a GPU until the repetition time stops
  falling (clocks ramp up under load), on CPU a few;
* then repetitions run back to back (a GPU synchronises once per batch of them) until there are at
  least ``iters`` of them and ``min_time_s`` of timed work; each layer's number is the median, and the
  relative interquartile range of every layer and of the whole model goes into the archive beside it
  (:class:`sailor_hpc.core.archive.PointSpread`);
* after all sizes, a point whose spread says the node was busy (above 20 %, :mod:`profiler.noise`) is
  measured again, twice at most, and flagged "noisy" when no measurement was quiet; then a point whose
  whole-model forward or backward is faster than a smaller size's by more than their spreads allow
  (:mod:`profiler.monotonic`) is measured once more, and if it still breaks monotonicity it is written
  with a flag saying so.

The update column is the optimizer step (megatron_patch's AdamW, :class:`megatron_patch.optimizer.StageOptimizer`)
of the whole profiled model, repeated on every row, as the simulator reads it.

Memory at micro-batch 1: parameters per TP rank per layer from megatron_patch's layout (checked against
the built modules by ``build_stage_module``); each layer's output and input elements; retained
activation bytes = what the layer's forward keeps until its backward (CUDA: allocator delta around the
forward, as Sailor, after one warm-up pass so that one-time allocations are not counted; CPU: the unique
storages saved for backward plus the output, parameters and inputs excluded). Fixed memory: on a GPU, device
memory in use that the caching allocator does not hold
(context, cuBLAS/NCCL workspaces; ``nvidia-smi`` minus reserved) after the TP collectives ran; on CPU,
the process's resident memory after start-up (a stand-in, recorded under the ``cpu-`` key only).

Failures: a step (the memory table, a micro-batch size, its re-measure) that fails on any TP rank,
out of memory or otherwise, is recorded as failed on every rank with the reasons, and the sweep of the
job goes on with the next size (:class:`TPAgreement`: no rank is left waiting in a collective).
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_patch import patch
from megatron_patch.layout import local_shape, param_layout, params_of_layers
from megatron_patch.main_grad import attach_main_grads
from megatron_patch.model import PipelineLayer, StageModule, build_stage_module, padded_vocab_size
from megatron_patch.optimizer import AdamConfig, StageOptimizer
from profiler.monotonic import ModelTotals, violations
from profiler.noise import QUIET_RETRIES, noisy, worst_spread
from sailor_hpc.core.archive import PointSpread
from sailor_hpc.core.models import ModelSpec

DEFAULT_BLOCKS = 2


@dataclass(frozen=True)
class Repetitions:
    """How long a point is measured. The defaults are the issue's: at least 20 repetitions and a second of
    timed work per point, after a warm-up that brings a GPU to steady clocks (an H100 idles at 345 MHz and
    boosts to 1980 MHz: a profile taken while it ramps up is slow by a factor no model can undo). Tests
    pass smaller numbers; the CPU is warm after a few repetitions, so the steady-clock search is GPU-only."""

    warmup: int = 3  # untimed repetitions at least
    iters: int = 20  # timed repetitions at least
    min_time_s: float = 1.0  # timed work at least (sum of the repetitions' times)
    max_reps: int = 2000  # at most, whatever min_time_s asks (tiny layers would need tens of thousands)
    steady_tol: float = 0.02  # warm when two consecutive repetitions fell by less than this fraction each
    warmup_min_s: float = 0.2  # GPU: sustained load before steadiness is judged (the clock governor's reaction)
    warmup_max_s: float = 5.0  # GPU: give up waiting for steady clocks after this (the point then says so)
    batch_s: float = 0.5  # GPU: timed work enqueued between host synchronisations


@dataclass
class Samples:
    """Seconds of every timed repetition of one point, per measured layer (in ``LayerProfiler.measured``
    order), and how the warm-up went."""

    fwd: np.ndarray  # (R, n)
    bwd: np.ndarray  # (R, n)
    upd: np.ndarray  # (R,)
    warmup_reps: int
    warmup_settled: bool  # False: the warm-up cap ran out before the repetition time stopped falling

    @property
    def repetitions(self) -> int:
        return int(self.upd.shape[0])


@dataclass
class PointResult:
    """One (micro-batch size, TP) point: (L, 3) seconds and their spread, or why it failed."""

    mbs: int
    times: np.ndarray | None
    reason: str = ""
    spread: PointSpread | None = None
    flag: str = ""  # why the point is suspect (see profiler.monotonic), "" when it is not
    info: dict[str, Any] = field(default_factory=dict)  # per-point provenance (warm-up, re-measure)

    @property
    def ok(self) -> bool:
        return self.times is not None

    def totals(self) -> ModelTotals:
        assert self.times is not None
        return ModelTotals.of(self.mbs, self.times, self.spread)


@dataclass
class ComputeResult:
    points: list[PointResult]
    memory: np.ndarray | None  # (L, 4) at micro-batch 1, or None when even that failed
    overhead_bytes: float
    profiled_blocks: int
    device: str
    extra: dict[str, Any] = field(default_factory=dict)


class _Clock:
    """Marks between the regions of a repetition: CUDA events on a GPU (recorded on the stream, so marking
    never waits for the device), ``perf_counter`` on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, marks: Sequence[Any]) -> np.ndarray:
        """Seconds between consecutive marks; on a GPU after waiting for the last one, the only host
        synchronisation of the repetitions enqueued before it."""
        if self.cuda:
            marks[-1].synchronize()
            return np.array([a.elapsed_time(b) for a, b in zip(marks, marks[1:])]) / 1000.0
        return np.diff(np.asarray(marks, dtype=np.float64))


def _rel_iqr(x: np.ndarray) -> np.ndarray:
    """Interquartile range / median along the repetitions (axis 0); 0 where the median is 0."""
    q25, med, q75 = np.percentile(x, [25, 50, 75], axis=0)
    return np.divide(q75 - q25, med, out=np.zeros_like(med), where=med > 0)


def _settled(times: Sequence[float], tol: float) -> bool:
    """The repetition time stopped falling: neither of the last two repetitions was faster than the one
    before it by more than ``tol``."""
    return len(times) >= 3 and all(times[i] >= (1 - tol) * times[i - 1] for i in (-1, -2))


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
        self.by_layer: dict[int, list[PipelineLayer]] = {}
        for m in module.pipeline_layers:
            self.by_layer.setdefault(m.index, []).append(m)

    def run(self, layer: int, x: torch.Tensor | None, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.module.run_layers(self.by_layer[layer], x, tokens, labels)


def _inputs(spec: ModelSpec, mbs: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)  # the same batch on every TP rank, as megatron requires
    tokens = torch.randint(0, spec.vocab_size, (mbs, spec.seq_len), generator=g)
    labels = torch.randint(0, spec.vocab_size, (mbs, spec.seq_len), generator=g)
    return tokens.to(device), labels.to(device)


def _grad_like(out: torch.Tensor, seed: int) -> torch.Tensor:
    """A gradient for ``out``, made on its device (a CPU tensor copied over from pageable memory stalls the
    GPU), the same on every TP rank (same seed, same generator kernel)."""
    g = torch.Generator(device=out.device).manual_seed(seed)
    return torch.randn(out.shape, generator=g, device=out.device, dtype=torch.float32).to(out.dtype)


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
                 blocks: int | None = None, warmup: int = 3, iters: int = 20, min_time_s: float = 1.0,
                 seed: int = 1234) -> None:
        self.spec, self.device, self.dtype = spec, device, dtype
        self.k = profiled_blocks(spec, blocks)
        self.reps = Repetitions(warmup=warmup, iters=iters, min_time_s=min_time_s)
        self.seed, self.group = seed, tp_group
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
                       each: Callable[[int, Callable[[], torch.Tensor], torch.Tensor | None], torch.Tensor]
                       ) -> torch.Tensor:
        """Run every measured layer once, each on the detached output of the one before; the last output."""
        prev: torch.Tensor | None = None
        for layer in self.measured:
            x = None if prev is None else prev.detach().requires_grad_(True)
            stage = self._stage_of(layer)
            prev = each(layer, functools.partial(stage.run, layer, x, tokens, labels), x)
        assert prev is not None
        return prev

    def _repetition(self, tokens: torch.Tensor, labels: torch.Tensor, grad: torch.Tensor) -> list[Any]:
        """One forward and backward of the chain and the optimizer step, marked between layers: n forward
        marks, n backward marks (last layer first), one after the step. Nothing waits for the device."""
        marks = [self.clock.mark()]
        inputs: list[torch.Tensor | None] = []
        outputs: list[torch.Tensor] = []

        def each(_layer: int, run: Callable[[], torch.Tensor], x: torch.Tensor | None) -> torch.Tensor:
            out = run()
            marks.append(self.clock.mark())
            inputs.append(x)
            outputs.append(out)
            return out

        self._forward_chain(tokens, labels, each)
        g: torch.Tensor | None = grad
        for x, out in zip(reversed(inputs), reversed(outputs)):
            out.backward(g)  # the gradient the next layer's backward left on its input, as in a stage
            marks.append(self.clock.mark())
            g = x.grad if x is not None else None
        # the step as the runtime takes it: fp32 master gradients first (bf16/fp16 keep their grads on the
        # low-precision copies; without this the step would find no gradient and skip every parameter)
        for opt in self.optimizers:
            opt.main_grads()
            opt.step(1.0)
        marks.append(self.clock.mark())
        for opt in self.optimizers:  # after the last mark: not timed
            opt.zero_grad()
        return marks

    def _most(self, wish: int) -> int:
        """The largest ``wish`` of the TP ranks. Why: a rank decides from its own timings how many more
        repetitions to run, and a rank that ran one more than the others would wait in its layers' TP
        collectives for ranks that never come. Asked between batches only, never inside a timed region."""
        if self.tp == 1:
            return wish
        t = torch.tensor([wish], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def _warm_up(self, run: Callable[[], list[Any]], reps: Repetitions) -> tuple[int, bool, float]:
        """Untimed repetitions until the device is warm: (how many, whether the time settled, the last
        repetition's seconds). On a GPU: at least ``warmup_min_s`` of load and until the repetition time
        stops falling, at most ``warmup_max_s``; on CPU ``warmup`` repetitions (at least one, whose time
        sizes the batches). Every TP rank goes on while any of them is not warm yet."""
        t0 = time.perf_counter()
        times: list[float] = []
        settled = False
        while True:
            times.append(float(self.clock.seconds(run()).sum()))
            spent = time.perf_counter() - t0
            settled = not self.clock.cuda or (spent >= reps.warmup_min_s and _settled(times, reps.steady_tol))
            done = len(times) >= max(1, reps.warmup) and (settled or spent >= reps.warmup_max_s)
            if not self._most(int(not done)):
                return len(times), settled, times[-1]

    def _batch(self, done: int, timed: float, rep_s: float, reps: Repetitions) -> int:
        """How many repetitions to enqueue next (0: enough), the same on every TP rank."""
        if done >= reps.max_reps or (done >= reps.iters and timed >= reps.min_time_s):
            wish = 0
        else:
            need = max(reps.iters - done, math.ceil((reps.min_time_s - timed) / max(rep_s, 1e-9)))
            # a GPU runs a batch back to back (the host only enqueues): one synchronisation per batch
            per_batch = max(1, int(reps.batch_s / max(rep_s, 1e-9))) if self.clock.cuda else 1
            wish = max(1, min(need, per_batch))
        return min(self._most(wish), reps.max_reps - done)

    def sample(self, mbs: int, reps: Repetitions | None = None) -> Samples:
        """Every timed repetition of micro-batch ``mbs`` (see the module doc)."""
        reps = reps or self.reps
        _injected_failure(self.rank, mbs)
        tokens, labels = _inputs(self.spec, mbs, self.device, self.seed + mbs)
        with torch.no_grad():  # only the shape of the chain's output, for its gradient
            grad = _grad_like(self._forward_chain(tokens, labels, lambda _l, run, _x: run()), self.seed)
        run = functools.partial(self._repetition, tokens, labels, grad)
        warm, settled, rep_s = self._warm_up(run, reps)
        rows: list[np.ndarray] = []
        timed = 0.0
        while count := self._batch(len(rows), timed, rep_s, reps):
            batch = [run() for _ in range(count)]
            rows += [self.clock.seconds(marks) for marks in batch]
            timed = float(sum(r.sum() for r in rows))
            rep_s = timed / len(rows)
        d = np.stack(rows)
        n = len(self.measured)
        return Samples(fwd=d[:, :n], bwd=d[:, n:2 * n][:, ::-1], upd=d[:, 2 * n], warmup_reps=warm,
                       warmup_settled=settled)

    def summarise(self, mbs: int, s: Samples) -> PointResult:
        """Medians per pipeline layer (blocks beyond K copy block K) and their spreads."""
        L = self.spec.num_pipeline_layers
        index = [self.measured.index(source_layer(self.spec, l, self.k)) for l in range(L)]
        upd = np.repeat(s.upd[:, None], L, axis=1)  # the profiled model's step, on every row
        per_rep = np.stack([s.fwd[:, index], s.bwd[:, index], upd], axis=2)  # (R, L, 3)
        model = _rel_iqr(per_rep[:, :, :2].sum(axis=1))
        spread = PointSpread(layers=_rel_iqr(per_rep), model=(float(model[0]), float(model[1])),
                             repetitions=s.repetitions)
        info = {"warmup_reps": s.warmup_reps, **({} if s.warmup_settled else {"warmup_settled": False})}
        return PointResult(mbs=mbs, times=np.median(per_rep, axis=0), spread=spread, info=info)

    def measure_point(self, mbs: int) -> PointResult:
        return self.summarise(mbs, self.sample(mbs))

    def measure(self, mbs: int) -> np.ndarray:
        """(L, 3) seconds: forward, backward, optimizer step of the profiled model."""
        times = self.measure_point(mbs).times
        assert times is not None
        return times

    def measure_stack(self, mbs: int) -> tuple[float, float]:
        """Forward and backward seconds of all measured layers as one chain (medians over repetitions).
        Kept for callers of the earlier profiler: the per-layer times are now slices of this chain."""
        s = self.sample(mbs)
        return float(np.median(s.fwd.sum(axis=1))), float(np.median(s.bwd.sum(axis=1)))

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
    just before the point's first forward (outside any timed region), so the other ranks wait in that
    forward's first TP collective, as they do when one GPU runs out of memory."""
    if os.environ.get(FAIL_ENV) == f"{rank}:{mbs}":
        raise RuntimeError(f"injected failure ({FAIL_ENV}) on TP rank {rank} at micro-batch {mbs}")


def _describe(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return f"{'out of memory' if is_oom(exc) else type(exc).__name__}: {first}"


class TPAgreement:
    """Every step of a profiling job (the memory table, one micro-batch size, its re-measure) ends with
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

    def rank0(self, step: str, value: Any) -> Any:
        """Rank 0's ``value`` (JSON) on every rank. Why: a decision taken from measured times (which points
        to measure again) differs a little between ranks, and ranks that took different steps would pair
        their next collectives with the wrong ones."""
        if self.store is None:
            return value
        self.steps += 1
        key = f"{self.steps}:{step}/rank0"
        if self.rank == 0:
            self.store.set(key, json.dumps(value))
        self.store.wait([key], datetime.timedelta(seconds=self.agree_timeout_s))
        return json.loads(self.store.get(key).decode())

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
                    dtype: str = "fp32", blocks: int | None = None, warmup: int = 3, iters: int = 20,
                    min_time_s: float = 1.0, remeasure: bool = True, baseline_rss: float = 0.0,
                    store: Any | None = None, collective_timeout_s: float = 300.0,
                    quiet_retries: int = QUIET_RETRIES, deepspeed: bool = False) -> ComputeResult:
    """Measure every micro-batch size of ``mbs_list`` (ascending) at this TP degree. A step that fails on any
    rank (out of memory or any other error) is recorded as failed on every rank with the reasons
    (:class:`TPAgreement`; ``store`` is the job's rendezvous store, needed for TP > 1), and the larger sizes
    are still tried, after freeing the cache, on a fresh group and freshly built stages.

    A point whose spread says the node was busy (:mod:`profiler.noise`) is measured again, up to
    ``quiet_retries`` times, keeping the quietest measurement; one that stays noisy is flagged so.

    Then the measured points are checked for monotonicity (:mod:`profiler.monotonic`): the points of a
    pair that breaks it are measured once more (``remeasure``; the sweep driver re-runs a job with it off
    when the pair spans two jobs), and a pair that still breaks it flags both points.

    ``deepspeed``: every measured point also gets what DeepSpeed's engines add to a step of its micro-batch
    size (:mod:`profiler.ds_engine`) in its provenance, or why that could not be measured."""
    agree = TPAgreement(tp_group, store, collective_timeout_s=collective_timeout_s)

    def build() -> LayerProfiler:
        return LayerProfiler(spec, tp_group=agree.group, device=device, dtype=dtype, blocks=blocks, warmup=warmup,
                             iters=iters, min_time_s=min_time_s)

    current = [build()]  # the one live profiler; a list so that recover() can drop it before building the next

    def recover() -> None:
        _release(current[0], device)
        if agree.world == 1:
            return
        current.clear()  # the failed stages go before new ones are built: after an OOM there is no room for both
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        agree.renew()
        current.append(build())

    def measure(mbs: int, step: str) -> PointResult:
        point, why = agree.run(step, functools.partial(current[0].measure_point, mbs))
        if why:
            recover()
            return PointResult(mbs=mbs, times=None, reason=f"micro-batch {mbs}: {why}")
        return point

    memory, memory_failure = agree.run("memory", current[0].memory_table)
    if memory_failure:
        recover()
    points = {mbs: measure(mbs, f"mbs{mbs}") for mbs in sorted(set(mbs_list))}
    for attempt in range(1, quiet_retries + 1):  # a busy node's points, again: the quietest measurement is kept
        loud: list[int] = agree.rank0(f"noisy{attempt}", sorted(m for m, p in points.items() if p.ok and noisy(p.spread)))
        for mbs in loud:
            again = measure(mbs, f"mbs{mbs}-quiet{attempt}")
            if again.ok and worst_spread(again.spread) < worst_spread(points[mbs].spread):
                points[mbs] = again
            points[mbs].info["measurements"] = attempt + 1
        if not loud:
            break
    suspect = _non_monotonic(points.values())
    again_mbs: list[int] = agree.rank0("remeasure", sorted(suspect) if remeasure else [])
    if again_mbs:
        for mbs in again_mbs:
            again = measure(mbs, f"mbs{mbs}-again")
            if again.ok:  # a re-measure that fails leaves the first measurement (and its flag) standing
                again.info["remeasured"] = True
                points[mbs] = again
        suspect = _non_monotonic(points.values())
    for mbs, p in points.items():
        p.flag = " | ".join(filter(None, (noisy(p.spread) if p.ok else "", suspect.get(mbs, ""))))
    if deepspeed:
        _deepspeed_costs(spec, [p for p in points.values() if p.ok], agree, device=device, dtype=dtype, blocks=blocks)
    agree.finish()
    prof = current[0]
    return ComputeResult(points=list(points.values()), memory=memory, overhead_bytes=prof.overhead_bytes(baseline_rss),
                         profiled_blocks=prof.k, device=device.type,
                         extra={"padded_vocab": prof.padded, "warmup": warmup, "iters": iters, "min_time_s": min_time_s,
                                "timing": "chain", "chain_layers": len(prof.measured),
                                **({"memory_failure": memory_failure} if memory_failure else {})})


def _deepspeed_costs(spec: ModelSpec, points: Sequence[PointResult], agree: TPAgreement, *, device: torch.device,
                     dtype: str, blocks: int | None) -> None:
    """Each point's DeepSpeed engine costs into its provenance (``deepspeed_engine``), or the reason they are
    missing (``deepspeed_engine_failed``): DeepSpeed's engine runs TP 1 only, and a failure leaves the
    point's layer times standing."""
    if agree.world != 1:
        for p in points:
            p.info["deepspeed_engine_failed"] = f"measured at TP 1 only (this job is TP {agree.world})"
        return
    from profiler.ds_engine import KEY, engine_costs

    for p in points:
        costs, why = agree.run(f"deepspeed{p.mbs}", functools.partial(engine_costs, spec, p.mbs, device=device,
                                                                       dtype=dtype, blocks=blocks))
        if why:
            p.info["deepspeed_engine_failed"] = why
        else:
            p.info[KEY] = costs


def _non_monotonic(points: Iterable[PointResult]) -> dict[int, str]:
    return violations(p.totals() for p in points if p.ok)
