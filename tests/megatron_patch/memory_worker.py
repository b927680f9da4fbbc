"""``python -m megatron_patch.launch`` under torch's memory profiler: what the runtime really allocates in a
training step, term by term (tests/simulator/test_memory_terms_vs_runtime.py).

The run is the runtime's own (same arguments, schedule, p2p, optimizer). The whole process runs inside
``torch.profiler.profile(profile_memory=True)``, which reports every allocation and free of torch's CPU
allocator; their running sum from the start of the process is what the allocator has handed out at any
moment (the CPU analogue of ``torch.cuda.memory_allocated``). Phases of the last step are marked with
``record_function`` ranges. After training, each rank prints one ``{"event": "memory_terms", ...}`` line:

* ``state``: bytes of the tensors the step keeps from one step to the next, counted from the runtime's own
  objects: parameters, fp32 main-grad buffers, fp32 masters (bf16/fp16), Adam's ``exp_avg``/``exp_avg_sq``;
  ``params``/``decay_params``: parameter elements of this rank, all and in the weight-decay group;
* ``start``: allocated when the step starts; ``pipeline_peak``: the most allocated during the forwards and
  backwards; ``optimizer_peak``: the most allocated during ``StageOptimizer.step`` and ``optimizer_start``
  what was allocated when it began; ``step_peak``: the most over the whole step; ``end``: after it;
* ``saved_peak``: the most bytes autograd held for backward at once (as activation_worker counts them);
* ``head_backward_peak``/``head_backward_start``: allocated at the most and at the start of the last
  micro-batch's backward through the head (the output layer), on the stage that holds it.
"""
from __future__ import annotations

import bisect
import json
import os
import sys
import warnings
from typing import Any

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from megatron_patch import launch  # noqa: E402
from megatron_patch.engine import Trainer  # noqa: E402
from megatron_patch.model import OutputLayer  # noqa: E402
from megatron_patch.optimizer import StageOptimizer  # noqa: E402
from tests.megatron_patch.activation_worker import SavedBytes, _profile, _unpack  # noqa: E402

_RESULT: list[dict[str, Any]] = []
_STATE: list[dict[str, Any]] = []
_train_step = Trainer.train_step
_pipeline = Trainer._pipeline
_opt_step = StageOptimizer.step
_head_forward = OutputLayer.forward
_SAVED: list[SavedBytes] = []


def _storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _state(trainer: Trainer) -> dict[str, Any]:
    opt = trainer.optimizer
    params = list(trainer.params.values())
    grads = [lb.flat for lb in trainer.sync.order] + [
        s.main_grad for s in trainer.sync.slots.values()
        if not any(s.main_grad.untyped_storage().data_ptr() == lb.flat.untyped_storage().data_ptr()
                   for lb in trainer.sync.order)]
    masters = list(opt.master.values()) if opt.mixed else []
    moments = [t for st in opt.state.values() for t in (st.exp_avg, st.exp_avg_sq)]
    decay = opt.groups[0]
    by_kind = {"params": _storage_bytes(params), "main_grads": _storage_bytes(grads),
               "masters": _storage_bytes(masters), "moments": _storage_bytes(moments)}
    return {**by_kind, "state": sum(by_kind.values()), "params_elems": sum(p.numel() for p in params),
            "decay_params": sum(opt.master[n].numel() for n in decay.names) if decay.weight_decay else 0,
            "param_groups": [sum(opt.master[n].numel() for n in g.names) for g in opt.groups]}


def _marked_step(self: Trainer, *args: Any, **kwargs: Any) -> Any:
    if self.role.rank == 0 and not _RESULT and os.environ.get("PROFILE_MBS"):
        _RESULT.append(_profile(self.groups.alone, int(os.environ["PROFILE_MBS"]), self.plan.dtype))
    counter = SavedBytes({p.untyped_storage().data_ptr() for p in self.module.parameters()})
    _SAVED[:] = [counter]
    with record_function("mem.step"), torch.autograd.graph.saved_tensors_hooks(counter.pack, _unpack):
        res = _train_step(self, *args, **kwargs)
    _STATE[:] = [{"rank": self.role.rank, "stage": self.role.stage, "saved_peak": counter.peak, **_state(self)}]
    return res


def _marked_pipeline(self: Trainer, *args: Any, **kwargs: Any) -> Any:
    with record_function("mem.pipeline"):
        return _pipeline(self, *args, **kwargs)


def _marked_opt_step(self: StageOptimizer, *args: Any, **kwargs: Any) -> Any:
    with record_function("mem.optimizer"):
        return _opt_step(self, *args, **kwargs)


class _MarkBackward(torch.autograd.Function):
    """Identity whose backward marks, under ``label``, when the gradient reaches this point of the graph."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, label: str) -> torch.Tensor:
        ctx.label = label
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        with record_function(ctx.label):
            return g, None


def _marked_head(self: OutputLayer, h: torch.Tensor, labels: torch.Tensor, weight: Any) -> torch.Tensor:
    # the gradient reaches the head's output when its backward starts, and its input when that backward is done
    marked_input = _MarkBackward.apply(h, "mem.head_backward_end")
    return _MarkBackward.apply(_head_forward(self, marked_input, labels, weight), "mem.head_backward_start")


def _timeline(prof: Any) -> dict[str, Any]:
    """Per-phase allocated bytes of the last step, from the profiler's allocation events."""
    events = prof.profiler.kineto_results.events()
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    ranges: dict[str, list[tuple[int, int]]] = {}
    for e in events:
        if e.name().startswith("mem."):
            ranges.setdefault(e.name(), []).append((e.start_ns(), e.start_ns() + e.duration_ns()))
    total, times, totals = 0, [], []
    for t, n in mem:
        total += n
        times.append(t)
        totals.append(total)

    def at(t: int) -> int:  # allocated just before time t
        i = bisect.bisect_left(times, t)
        return totals[i - 1] if i > 0 else 0

    def peak(lo: int, hi: int) -> int:
        a, b = bisect.bisect_left(times, lo), bisect.bisect_right(times, hi)
        return max([at(lo), *totals[a:b]])

    step = ranges["mem.step"][-1]
    out = {"start": at(step[0]), "step_peak": peak(*step), "end": at(step[1] + 1)}
    pipe = [r for r in ranges["mem.pipeline"] if step[0] <= r[0] <= step[1]][-1]
    out["pipeline_peak"] = peak(*pipe)
    opt = [r for r in ranges.get("mem.optimizer", []) if step[0] <= r[0] <= step[1]]
    if opt:
        out["optimizer_start"], out["optimizer_peak"] = at(opt[-1][0]), peak(*opt[-1])
    starts = [r for r in ranges.get("mem.head_backward_start", []) if pipe[0] <= r[0] <= pipe[1]]
    ends = [r for r in ranges.get("mem.head_backward_end", []) if pipe[0] <= r[0] <= pipe[1]]
    if starts and ends:
        out["head_backward_start"] = at(starts[-1][0])
        out["head_backward_peak"] = peak(starts[-1][0], ends[-1][1])
    return out


def main() -> int:
    Trainer.train_step = _marked_step  # type: ignore[method-assign]
    Trainer._pipeline = _marked_pipeline  # type: ignore[method-assign]
    StageOptimizer.step = _marked_opt_step  # type: ignore[method-assign]
    OutputLayer.forward = _marked_head  # type: ignore[method-assign]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        code = launch.main(sys.argv[1:])
    if _STATE:
        _RESULT.append({"event": "memory_terms", **_STATE[0], **_timeline(prof)})
    for record in _RESULT:
        print(json.dumps(record), flush=True)
    return code


if __name__ == "__main__":
    launch.exit_now(main())
