"""DeepSpeed's own per-step work, from the profile, for the stages of a plan the ``deepspeed`` runtime runs.

``sailor-hpc profile --runtime deepspeed`` measures, per micro-batch size on each GPU type, what DeepSpeed's
engines add to a step beyond the layers and torch's AdamW (:mod:`profiler.ds_engine`: its engine wrappers,
ZeRO's bookkeeping, the pipeline engine's instruction interpreter), split into a part paid once per step
and a part paid per micro-batch, each ``rest + per_block x blocks`` over the stage's transformer blocks. It
is kept in the compute point's provenance under ``deepspeed_engine``. The simulator adds, per stage, the
per-micro-batch part to every micro-batch's backward (where DeepSpeed's backward wrapper, ZeRO's
gradient hooks and the pipeline engine's instructions run; the forward's share is not separated) and the
per-step part to the stage's optimizer step. Which costs apply: the plain engine's (``engine/<ZeRO>``) for a
plan of one stage, the pipeline engine's (``pipe/<ZeRO>``) for a plan of several.

A point without them (Sailor's profiles, a profile taken for megatron_patch) charges nothing, and the
simulation says so (:attr:`simulator.api.SimResult.breakdown` ``deepspeed_engine``): on layers that take a
GPU milliseconds the engine's work is a small share of a step, on tiny layers most of it.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sailor_hpc.core.errors import SailorError

KEY = "deepspeed_engine"
FAILED_KEY = "deepspeed_engine_failed"


@dataclass(frozen=True)
class EngineCosts:
    """Seconds a DeepSpeed engine adds to a step, per ``"<engine>/<ZeRO stage>"``: (rest, per block)."""

    per_step: Mapping[str, tuple[float, float]]
    per_micro_batch: Mapping[str, tuple[float, float]]
    version: str

    def stage(self, engine: str, zero: int, blocks: int) -> tuple[float, float] | None:
        """(per step, per micro-batch) seconds for a stage of ``blocks`` transformer blocks; None when this
        engine and ZeRO stage were not measured. A negative sum (a cost below the measurement's noise) is 0."""
        key = f"{engine}/{zero}"
        if key not in self.per_step:
            return None
        (s0, s1), (m0, m1) = self.per_step[key], self.per_micro_batch[key]
        return max(0.0, s0 + s1 * blocks), max(0.0, m0 + m1 * blocks)


def _pair(value: Any, where: str) -> tuple[float, float]:
    ok = (isinstance(value, list | tuple) and len(value) == 2
          and all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value))
    if not ok:
        raise SailorError(f"{where} is {value!r}, not [rest, per block] seconds", field=KEY,
                          fix="re-profile with `sailor-hpc profile --runtime deepspeed`")
    return float(value[0]), float(value[1])


def engine_costs(provenance: Mapping[str, Any], where: str = "") -> EngineCosts | None:
    """The costs a compute point's provenance holds (None: none were measured)."""
    doc = provenance.get(KEY)
    if doc is None:
        return None
    costs = doc.get("costs") if isinstance(doc, dict) else None
    if not isinstance(costs, dict):
        raise SailorError(f"{where}: {KEY} has no 'costs' object", field=KEY,
                          fix="re-profile with `sailor-hpc profile --runtime deepspeed`")
    per_step, per_micro = {}, {}
    for key, value in costs.items():
        if not isinstance(value, dict):
            raise SailorError(f"{where}: {KEY}.costs.{key} is not an object", field=KEY,
                              fix="re-profile with `sailor-hpc profile --runtime deepspeed`")
        per_step[key] = _pair(value.get("fixed_s"), f"{where}: {KEY}.costs.{key}.fixed_s")
        per_micro[key] = _pair(value.get("micro_batch_s"), f"{where}: {KEY}.costs.{key}.micro_batch_s")
    return EngineCosts(per_step, per_micro, str(doc.get("deepspeed", "")))


__all__ = ["EngineCosts", "FAILED_KEY", "KEY", "engine_costs"]
