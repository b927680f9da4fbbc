"""Per-layer profiles as prefix sums, so a stage's numbers cost O(1) whatever its layer range.

For one model, :class:`ProfileTables` turns the archive's entries into

* :class:`ComputeTable` per (GPU type, micro-batch size, TP): cumulative forward and backward seconds
  over layers, and the optimizer step of the profiled model;
* :class:`MemoryTable` per TP: cumulative parameters (elements per TP rank) and retained activation
  bytes (mbs 1), each layer's output size, and the largest single-layer activation of any layer range.

Tables are built on first use and cached. A point the archive lacks raises :class:`SailorError`
naming the archive entry and how to get it, never a zero.

Conventions kept from Sailor's profiles (the archive's format):

* the update column is the optimizer step of the *profiled* model (embedding + 2 transformer blocks +
  tail), repeated on every layer; an optimizer step streams over the parameters (Adam: read weights,
  grads and 2 states, write 3), so a stage's step is that time scaled by the stage's share of
  parameters (Sailor used the 2-block time unscaled for any stage), and for SGD with momentum by the
  5 words it streams against Adam's 7 (profiles time Adam: Sailor's DeepSpeed runs and our profiler).
  A profile that measured another number of blocks records it as ``profiled_blocks`` in its provenance.
* a layer never takes longer on fewer samples: a point slower than a larger micro-batch's point of
  the same layer, direction, GPU and TP is measurement noise (Sailor's GH-96 OPT profile has mbs 1
  slower than mbs 2 on the embedding, the head and some blocks; single-stage GH200 runs at mbs 1 are
  13 % faster than its per-layer sum). Forward and backward times are therefore the running minimum
  over the profiled micro-batch sizes at or above the asked one. Nothing is scaled or fitted.
* a stage runs its layers as one chain, where the host launches a layer's kernels while the previous
  layer still runs. ``sailor-hpc profile`` now times every layer as its slice of such a chain
  (provenance ``timing = "chain"``), so a stage's layers add up to the stage's time and need no
  correction. Profiles from the earlier profiler timed each layer alone and the measured layers once
  as one chain (``stack_fwd_s``, ``stack_bwd_s`` over ``stack_layers`` layers in the provenance); for
  those the difference per layer boundary is what every boundary inside a stage saves (or costs, if
  the chain was slower), only in tables asked for with ``chain_timing=True``
  (``SimOptions(chain_timing=True)``). Sailor's profiles have neither.
* memory profiles are taken at micro-batch 1 in the dtype recorded on the entry; activations scale
  linearly with the micro-batch size and with the element size of the plan's dtype. Under
  recomputation a stage keeps each block's input (the full hidden state, on every TP rank) and the
  other layers' activations.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sailor_hpc.core.archive import ProfileArchive
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import ModelSpec
from simulator.engine_costs import EngineCosts, engine_costs

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
DEFAULT_PROFILED_BLOCKS = 2
# fp32 words an optimizer step reads and writes per parameter (it is memory bound): Adam reads weight,
# grad, m, v and writes weight, m, v; SGD with momentum reads weight, grad, buffer and writes two
OPTIMIZER_STREAM_WORDS = {"adam": 7, "sgd": 5}


@dataclass(frozen=True)
class ComputeTable:
    """Seconds of one micro-batch on one GPU of a TP group, per layer range."""

    gpu: str
    mbs: int
    tp: int
    cum_fwd: np.ndarray  # (L+1,)
    cum_bwd: np.ndarray  # (L+1,)
    update_s: float  # optimizer step of the profiled model
    update_params: float  # parameters (per TP rank) that step covered
    dtype: str
    boundary_fwd: float = 0.0  # seconds a layer boundary inside a stage saves, forward (see the module doc)
    boundary_bwd: float = 0.0  # ... and backward

    # layer ranges may be ints or integer arrays (vectorised scoring): the result has their shape
    def fwd(self, first, last):
        return _chained(self.cum_fwd[last + 1] - self.cum_fwd[first], last - first, self.boundary_fwd)

    def bwd(self, first, last):
        return _chained(self.cum_bwd[last + 1] - self.cum_bwd[first], last - first, self.boundary_bwd)


def _chained(isolated, boundaries, saving: float):
    """Time of a chain of layers from the sum of their isolated times (never below a third of it)."""
    if not saving:
        return isolated
    return np.maximum(isolated - boundaries * saving, isolated / 3)


@dataclass(frozen=True)
class MemoryTable:
    """Per-TP-rank parameters and activations of every layer range (activations at micro-batch 1)."""

    tp: int
    cum_params: np.ndarray  # (L+1,) elements per TP rank
    cum_act: np.ndarray  # (L+1,) retained activation bytes at mbs 1, in ``dtype``
    act_output: np.ndarray  # (L,) elements of each layer's output (the full tensor)
    act_input: np.ndarray  # (L,) elements of each layer's input
    range_max_act: np.ndarray  # (L, L): [first, last] -> largest single-layer activation bytes
    dtype: str
    is_block: np.ndarray  # (L,) transformer blocks (what recomputation checkpoints)
    cum_keep: np.ndarray  # (L+1,) bytes at mbs 1 kept under recomputation (see recompute_keep)

    # layer ranges may be ints or integer arrays (vectorised scoring): the result has their shape
    def params(self, first, last):
        return self.cum_params[last + 1] - self.cum_params[first]

    def act_bytes(self, first, last):
        return self.cum_act[last + 1] - self.cum_act[first]

    def max_layer_act(self, first, last):
        return self.range_max_act[first, last]

    def max_layer_params(self, first, last):
        """The most parameters one layer of ``first..last`` holds (what ZeRO-3 gathers at once; ints or arrays)."""
        per = np.diff(self.cum_params)
        return np.vectorize(lambda a, b: float(per[a:b + 1].max()))(first, last)[()]

    def recompute_keep(self, first, last):
        """Bytes (mbs 1) a stage keeps per micro-batch in flight when every transformer block is
        recomputed (checkpointed one by one, as megatron_patch does): the input of each block, except a
        first block's (the received input, charged by the caller), and all of the other layers'
        activations (embedding, head: not recomputed)."""
        first_block_input = np.where(self.is_block[first], self.cum_keep[np.add(first, 1)] - self.cum_keep[first], 0.0)
        return self.cum_keep[last + 1] - self.cum_keep[first] - first_block_input


class ProfileTables:
    """Cached prefix-sum tables of one model from one (possibly layered) archive."""

    def __init__(self, archive: ProfileArchive, model: ModelSpec) -> None:
        self.archive = archive
        self.model = model
        self._compute: dict[tuple[str, int, int, str, bool], ComputeTable] = {}
        self._memory: dict[int, MemoryTable] = {}
        self._engine: dict[tuple[str, int, int, str], EngineCosts | None] = {}

    @property
    def num_layers(self) -> int:
        return self.model.num_pipeline_layers

    # ------------------------------------------------------------------ compute
    def compute(self, gpu: str, mbs: int, tp: int, dtype: str = "fp32", chain_timing: bool = False) -> ComputeTable:
        """``chain_timing``: charge the point's chain timing per layer boundary (else isolated sums)."""
        key = (gpu, mbs, tp, dtype, chain_timing)
        table = self._compute.get(key)
        if table is None:
            table = self._compute[key] = self._build_compute(gpu, mbs, tp, dtype, chain_timing)
        return table

    def _build_compute(self, gpu: str, mbs: int, tp: int, dtype: str, chain_timing: bool) -> ComputeTable:
        name = self.model.name
        points = self.archive.compute_points(name, gpu, dtype)  # only this dtype's times: never another's
        entry = points.get((mbs, tp))
        where = f"compute/{name}/{gpu}/mbs{mbs}_tp{tp}" + ("" if dtype == "fp32" else f"_{dtype}")
        if entry is None:
            failed = self.archive.failed.get((name, gpu, dtype), {}).get((mbs, tp))
            if failed is not None:
                raise SailorError(f"profiling {name} on {gpu} at micro-batch {mbs}, TP {tp} failed: "
                                  f"{failed.reason or 'no reason recorded'}", file=self.archive.where, field=where,
                                  fix="choose another micro-batch size or TP (this point does not run)")
            have = ", ".join(f"mbs{b}/tp{t}" for b, t in sorted(points))
            raise SailorError(f"no profile of {name} on {gpu} at micro-batch {mbs}, TP {tp} (have {have})",
                              file=self.archive.where, field=where,
                              fix=f"run `sailor-hpc profile --model {name} --mbs {mbs} --tp {tp} --dtype {dtype}` on a {gpu} "
                                  "partition, or use a profiled point")
        times = np.asarray(entry.times, dtype=np.float64)
        if times.ndim != 2 or times.shape[0] != self.num_layers or times.shape[1] < 3:
            raise SailorError(f"{where} has shape {times.shape}, expected ({self.num_layers}, 3) for {name}",
                              file=self.archive.where, field=where, fix="re-profile this point")
        if not np.isfinite(times).all() or (times < 0).any():
            raise SailorError(f"{where} holds negative or non-finite times", file=self.archive.where, field=where,
                              fix="re-profile this point")
        if times[:, 0].sum() <= 0 or times[:, 1].sum() <= 0:
            raise SailorError(f"{where} holds no forward or no backward time (all zero)", file=self.archive.where,
                              field=where, fix="re-profile this point")
        fwd, bwd = times[:, 0].copy(), times[:, 1].copy()
        for (b, t), other in points.items():
            if t == tp and b > mbs:
                larger = np.asarray(other.times, dtype=np.float64)
                if larger.shape == times.shape and np.isfinite(larger).all():
                    np.minimum(fwd, larger[:, 0], out=fwd)
                    np.minimum(bwd, larger[:, 1], out=bwd)
        cum_fwd = np.concatenate(([0.0], np.cumsum(fwd)))
        cum_bwd = np.concatenate(([0.0], np.cumsum(bwd)))
        blocks = int(entry.provenance.get("profiled_blocks", DEFAULT_PROFILED_BLOCKS))
        saving = self._boundary_saving(entry, times, blocks) if chain_timing else (0.0, 0.0)
        mem = self.memory(tp)
        T = self.model.num_layers
        profiled = mem.params(0, min(blocks, T))
        if self.model.tail_layers:
            profiled += mem.params(T + 1, self.num_layers - 1)
        return ComputeTable(gpu=gpu, mbs=mbs, tp=tp, cum_fwd=cum_fwd, cum_bwd=cum_bwd,
                            update_s=float(times[:, 2].max()), update_params=profiled, dtype=entry.dtype,
                            boundary_fwd=saving[0], boundary_bwd=saving[1])

    def engine_costs(self, gpu: str, mbs: int, tp: int, dtype: str = "fp32") -> EngineCosts | None:
        """DeepSpeed's engine costs the point (``gpu``, ``mbs``, ``tp``, ``dtype``) was profiled with, if any
        (:mod:`simulator.engine_costs`)."""
        key = (gpu, mbs, tp, dtype)
        if key not in self._engine:
            entry = self.archive.compute_points(self.model.name, gpu, dtype).get((mbs, tp))
            where = f"compute/{self.model.name}/{gpu}/mbs{mbs}_tp{tp}"
            self._engine[key] = None if entry is None else engine_costs(entry.provenance, where)
        return self._engine[key]

    def _boundary_saving(self, entry, times: np.ndarray, blocks: int) -> tuple[float, float]:
        """(forward, backward) seconds per layer boundary: (sum of the measured layers alone - their
        chain) / (layers - 1), from the point's own chain timing; (0, 0) without one, and for a point whose
        layers were timed inside the chain (their sum is the chain: nothing to correct)."""
        prov = entry.provenance
        if prov.get("timing") == "chain" or "stack_fwd_s" not in prov or "stack_bwd_s" not in prov:
            return 0.0, 0.0
        T = self.model.num_layers
        measured = list(range(0, min(blocks, T) + 1)) + list(range(T + 1, self.num_layers))
        n = int(prov.get("stack_layers", len(measured)))
        if n < 2 or n != len(measured):
            return 0.0, 0.0
        alone = times[measured, :2].sum(axis=0)
        chain = np.array([float(prov["stack_fwd_s"]), float(prov["stack_bwd_s"])])
        fwd, bwd = (alone - chain) / (n - 1)
        return float(fwd), float(bwd)

    def update_seconds(self, table: ComputeTable, first, last, optimizer: str = "adam"):
        """Optimizer step of a stage: the profiled (Adam) step scaled by the stage's share of parameters
        and by the words the plan's optimizer streams per parameter against Adam's."""
        words = OPTIMIZER_STREAM_WORDS[optimizer] / OPTIMIZER_STREAM_WORDS["adam"]
        if table.update_params <= 0:
            return table.update_s * words
        return table.update_s * words * self.memory(table.tp).params(first, last) / table.update_params

    # ------------------------------------------------------------------ memory
    def memory(self, tp: int) -> MemoryTable:
        table = self._memory.get(tp)
        if table is None:
            table = self._memory[tp] = self._build_memory(tp)
        return table

    def _build_memory(self, tp: int) -> MemoryTable:
        entry = self.archive.memory_table(self.model.name, tp)
        rows = np.asarray(entry.table, dtype=np.float64)
        L = self.num_layers
        if rows.shape != (L, 4):
            raise SailorError(f"memory/{self.model.name}/tp{tp} has shape {rows.shape}, expected ({L}, 4)",
                              file=self.archive.where, field=f"memory/{self.model.name}/tp{tp}",
                              fix="re-profile the model's memory")
        act = rows[:, 3]
        is_block = np.zeros(L, dtype=bool)
        is_block[1:self.model.num_layers + 1] = True
        keep = np.where(is_block, rows[:, 2] * DTYPE_BYTES[entry.dtype], act)
        return MemoryTable(tp=tp, cum_params=np.concatenate(([0.0], np.cumsum(rows[:, 0]))),
                           cum_act=np.concatenate(([0.0], np.cumsum(act))), act_output=rows[:, 1].copy(),
                           act_input=rows[:, 2].copy(), range_max_act=_range_max(act), dtype=entry.dtype,
                           is_block=is_block, cum_keep=np.concatenate(([0.0], np.cumsum(keep))))

    def boundary_bytes(self, last_layer, mbs: int, tp: int, dtype: str):
        """Bytes of the activation that leaves ``last_layer`` for the next stage (and of its gradient
        coming back). Between transformer layers it is the full hidden state, which every TP rank holds."""
        return self.memory(tp).act_output[last_layer] * mbs * DTYPE_BYTES[dtype]


def _range_max(values: np.ndarray) -> np.ndarray:
    """(L, L) table of max(values[i..j]) for i <= j (L is a few dozen layers)."""
    L = values.size
    out = np.zeros((L, L))
    for i in range(L):
        out[i, i:] = np.maximum.accumulate(values[i:])
    return out


_CACHE: dict[tuple[int, str], tuple[ProfileArchive, ProfileTables]] = {}


def tables_for(archive: ProfileArchive, model: ModelSpec) -> ProfileTables:
    """The cached tables of ``model`` in ``archive`` (one set per archive object)."""
    key = (id(archive), model.name)
    hit = _CACHE.get(key)
    if hit is None or hit[0] is not archive:
        hit = (archive, ProfileTables(archive, model))
        _CACHE[key] = hit
    return hit[1]
