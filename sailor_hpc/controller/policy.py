"""When to give up a running job for a better plan: only if it pays for its restart, by ``min_gain``.

A running job can only move to a new plan by stopping (it checkpoints on SIGUSR1), waiting for the
new job and loading the checkpoint: ``restart_cost_s`` seconds without training. Over the
``remaining_samples`` of the run, with the objective's measure:

- throughput: time to finish ``keep = R / thr_now`` against ``move = restart + R / thr_new``;
- cost: money to finish ``keep = R / thr_now * price_now`` against
  ``move = (restart + R / thr_new) * price_new`` (the new allocation is paid while it starts);

and the gain is ``keep / move - 1``. The run resizes when the gain is at least ``min_gain``.
So a plan twice as fast is not worth it near the end of the run, and a marginally better one never is.

The restart cost is the run's own measured restarts (allocation change to first step under the new
plan, queue wait included: it is time the run does not train) when it has some, else
``DEFAULT_RESTART_COST_S``, unless the user fixed it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sailor_hpc.core.plan import Plan

DEFAULT_RESTART_COST_S = 60.0


@dataclass(frozen=True)
class Score:
    """What the simulator predicts for a plan."""

    throughput: float  # samples per second
    cost_per_hour: float  # site cost unit per hour


@dataclass(frozen=True)
class Verdict:
    resize: bool
    gain: float  # keep / move - 1 (see module doc)
    keep: float  # seconds (throughput) or cost units (cost) to finish without moving
    move: float  # the same when moving, restart included
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def restart_cost(fixed: float | None, measured: Sequence[float]) -> float:
    """The cost of one restart in seconds: the fixed value, else the mean measured one, else the default."""
    if fixed is not None:
        return float(fixed)
    if measured:
        return sum(measured) / len(measured)
    return DEFAULT_RESTART_COST_S


def plan_shape(plan: Plan) -> tuple:
    """A plan without its placement: two plans with the same shape train identically."""
    return tuple((p.micro_batch_size, p.num_micro_batches,
                  tuple((s.first_layer, s.last_layer, s.tp, s.gpu_type, s.partition) for s in p.stages))
                 for p in plan.pipelines)


def judge(objective: str, current: Score, new: Score, remaining_samples: int, restart_s: float,
          min_gain: float) -> Verdict:
    """Whether moving from ``current`` to ``new`` gains at least ``min_gain`` after the restart."""
    if remaining_samples <= 0:
        return Verdict(False, 0.0, 0.0, restart_s, "nothing left to train")
    if new.throughput <= 0:
        return Verdict(False, -1.0, 0.0, float("inf"), "the new plan does not train")
    keep_s = remaining_samples / current.throughput if current.throughput > 0 else float("inf")
    move_s = restart_s + remaining_samples / new.throughput
    if objective == "cost":
        keep, move = keep_s * current.cost_per_hour / 3600.0, move_s * new.cost_per_hour / 3600.0
    else:
        keep, move = keep_s, move_s
    gain = keep / move - 1.0 if move > 0 else float("inf")
    unit = "s" if objective != "cost" else " cost units"
    what = f"{objective}: finish in {keep:.4g}{unit} as is vs {move:.4g}{unit} after a {restart_s:.0f} s restart"
    if gain >= min_gain:
        return Verdict(True, gain, keep, move, f"gain {gain:.1%} >= {min_gain:.0%} ({what})")
    return Verdict(False, gain, keep, move, f"gain {gain:.1%} < {min_gain:.0%} ({what})")
