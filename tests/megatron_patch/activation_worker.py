"""``python -m megatron_patch.launch`` that also reports the activation bytes each rank really held
(test_memory_vs_runtime).

The run is the runtime's own (same arguments, schedule and p2p). Every tensor autograd saves for a
backward during a training step is counted, per storage, from the moment it is saved until autograd
releases it; parameters and the step's input data are left out, as the profiler leaves them out of a
layer's activations. The highest total is what a stage holds for its micro-batches in flight. After
training, each rank prints ``{"event": "saved_bytes", "rank", "stage", "peak"}`` for the last step. Before
its first step, rank 0 profiles every layer on its TP group of one (``PROFILE_MBS``) and prints
``{"event": "profile", "times", "memory"}``: what ``sailor-hpc profile`` writes into an archive.
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

warnings.filterwarnings("ignore")

from megatron_patch import launch  # noqa: E402
from megatron_patch.engine import Trainer  # noqa: E402


class SavedBytes:
    """Live bytes of the storages autograd holds for backward, and their peak."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, t: Any) -> Any:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in self.exclude or st.nbytes() == 0:
            return t
        if self.refs.get(ptr, 0) == 0:
            self.sizes[ptr] = st.nbytes()
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        return _Held(t, ptr, self)

    def release(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if self.refs[ptr] == 0:
            self.live -= self.sizes.pop(ptr)


class _Held:
    """What autograd keeps instead of the tensor: releasing it is the end of the tensor's life as an activation."""

    def __init__(self, tensor: Any, ptr: int, owner: SavedBytes) -> None:
        self.tensor, self.ptr, self.owner = tensor, ptr, owner

    def __del__(self) -> None:
        self.owner.release(self.ptr)


def _unpack(x: Any) -> Any:
    return x.tensor if isinstance(x, _Held) else x


_PEAK: list[dict[str, Any]] = []
_PROFILE: list[dict[str, Any]] = []
_train_step = Trainer.train_step
_micro_batches = Trainer._micro_batches


def _data_recorded(self: Trainer, *args: Any, **kwargs: Any) -> Any:
    """The step's micro-batches, cut before its first forward: left out of the count from the start."""
    out = _micro_batches(self, *args, **kwargs)
    counter = getattr(self, "_saved_bytes", None)
    if counter is not None:
        counter.exclude.update(t.untyped_storage().data_ptr() for mb in out for t in mb.values())
    return out


def _counted_train_step(self: Trainer, *args: Any, **kwargs: Any) -> Any:
    import torch

    if self.role.rank == 0 and not _PROFILE:
        _PROFILE.append(_profile(self.groups.alone, int(os.environ["PROFILE_MBS"])))
    counter = SavedBytes({p.untyped_storage().data_ptr() for p in self.module.parameters()})
    self._saved_bytes = counter  # type: ignore[attr-defined]
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, _unpack):
            res = _train_step(self, *args, **kwargs)
    finally:
        self._saved_bytes = None  # type: ignore[attr-defined]
    _PEAK[:] = [{"event": "saved_bytes", "rank": self.role.rank, "stage": self.role.stage, "peak": counter.peak,
                 "live_after": counter.live}]
    return res


def _profile(alone: Any, mbs: int, dtype: str = "fp32") -> dict[str, Any]:
    """Every layer at TP 1, as a profiling job measures it, on rank 0's group of one (``alone``: the runtime's)."""
    import torch

    from profiler.compute import LayerProfiler
    from sailor_hpc.core.models import get_model

    prof = LayerProfiler(get_model("tiny-gpt"), tp_group=alone, device=torch.device("cpu"),
                         dtype=dtype, warmup=1, iters=2)
    return {"event": "profile", "dtype": dtype, "times": prof.measure(mbs).tolist(),
            "memory": prof.memory_table().tolist()}


def main() -> int:
    Trainer.train_step = _counted_train_step  # type: ignore[method-assign]
    Trainer._micro_batches = _data_recorded  # type: ignore[method-assign]
    code = launch.main(sys.argv[1:])
    for record in _PEAK + _PROFILE:
        print(json.dumps(record), flush=True)
    return code


if __name__ == "__main__":
    launch.exit_now(main())
