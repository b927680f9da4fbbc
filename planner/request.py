"""What the planner is asked: a model on a site, what is available, the objective and the constraints."""
from __future__ import annotations

from dataclasses import dataclass, field

from planner.time_goal import TimeGoal
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.precision import DTYPES
from simulator.runtimes import RUNTIMES

OBJECTIVES = ("throughput", "cost", "time")


@dataclass(frozen=True)
class Constraints:
    """Hard limits a plan must meet (None = no limit). Costs are in the site's cost unit."""

    max_cost_per_hour: float | None = None
    max_cost_per_iteration: float | None = None
    min_throughput: float | None = None  # samples per second
    max_gpus: int | None = None


@dataclass(frozen=True)
class PlanRequest:
    model: str
    global_batch_size: int
    objective: str = "throughput"
    constraints: Constraints = Constraints()
    available: dict[str, int] = field(default_factory=dict)  # partition -> GPUs that may be used
    seq_len: int | None = None
    dtype: str = "fp32"  # or "auto": the best the available GPU types train in and the archive has profiles of
    max_stages: int | None = None
    top_k: int = 5
    space: str = "full"  # "full", "sailor" (Sailor's plan shape) or "homogeneous" (one partition)
    runtime: str = "megatron_patch"  # who runs the plan: its plans are scored as that runtime runs them
    time_goal: TimeGoal | None = None  # objective "time": steps to train and the queue (planner.time_goal)

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise SailorError(f"unknown objective {self.objective!r}", field="--objective",
                              fix=f"use one of {', '.join(OBJECTIVES)}")
        if self.objective == "time" and self.time_goal is None:
            raise SailorError("objective time needs the run's length and the queue", field="--objective",
                              fix="pass --steps N or --tokens T with --objective time")
        if self.global_batch_size <= 0:
            raise SailorError("must be positive", field="--gbs")
        if self.dtype not in (*DTYPES, "auto"):
            raise SailorError(f"unknown dtype {self.dtype!r}", field="--dtype", fix=f"use auto or one of {', '.join(DTYPES)}")
        if self.runtime not in RUNTIMES:
            raise SailorError(f"unknown runtime {self.runtime!r}", field="--runtime", fix=f"use one of {', '.join(RUNTIMES)}")
        if self.space not in ("full", "sailor", "homogeneous"):
            raise SailorError(f"unknown search space {self.space!r}", field="space")
