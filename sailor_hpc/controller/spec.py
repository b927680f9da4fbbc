"""What a controlled run was asked to do (``run.json`` in the run directory), fixed at ``sailor-hpc run``.

The spec is written once, when the run starts, so that ``sailor-hpc run --resume DIR`` needs nothing
but the directory: the resumed controller plans, submits and judges resizes exactly as the first one.
Everything the planner needs (site, model, objective, constraints, batch size), everything the job
needs (data, checkpoint directory, steps, runtime arguments, interpreter, time limit) and the
controller's own knobs (minimum gain, restart cost, restarts, back-off, polling) are in it.
"""
from __future__ import annotations

import json
import math
import sys
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from planner import Constraints, PlanRequest
from planner.time_goal import TimeGoal
from sailor_hpc.core.atomic import atomic_write_text
from sailor_hpc.core.deepspeed_plan import NOTES_KEY as DEEPSPEED_NOTES
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.precision import DTYPES
from sailor_hpc.core.typed_json import Mismatch, from_json
from sailor_hpc.jobs.render import parse_time_limit

SPEC_FORMAT = "sailor-hpc-run"
SPEC_VERSION = 1
#: runtime arguments the controller sets itself (a --train-arg must not fight them)
RESERVED_TRAIN_ARGS = ("--plan", "--model", "--data", "--save", "--load", "--auto-resume", "--steps",
                       "--save-interval", "--dry-run", "--wait-for")
#: who trains the run's jobs; auto: at each re-plan DeepSpeed when its best plan is within min_gain of the best
RUN_RUNTIMES = ("megatron_patch", "deepspeed", "auto")


def new_run_id() -> str:
    """A short random id; it names the run's Slurm jobs (``sailor-<id>-<attempt>``) so they can be found again."""
    return uuid.uuid4().hex[:8]


@dataclass(frozen=True)
class RunSpec:
    run_id: str
    site: str  # absolute path of the site TOML
    model: str
    objective: str  # "throughput", "cost" or "time" (expected finish on the GPUs free now)
    data: str  # dataset prefix (absolute)
    save: str  # checkpoint root (absolute), shared by every job of the run
    steps: int  # optimizer step to reach
    gbs: int  # global batch size
    profiles: str | None = None  # archive; None: $SAILOR_PROFILES, the site's, then the embedded one
    seq_len: int | None = None
    dtype: str = "auto"  # the plan's precision, or auto: re-chosen at every re-plan (checkpoints keep fp32 masters)
    max_cost_per_hour: float | None = None
    max_cost_per_iteration: float | None = None
    min_throughput: float | None = None
    max_gpus: int | None = None
    max_stages: int | None = None
    runtime: str = "megatron_patch"  # one of RUN_RUNTIMES; a run.json without it predates DeepSpeed runs
    min_gain: float = 0.10  # resize only if the new plan is this much better after the restart cost
    restart_cost_s: float | None = None  # None: measured from this run's own restarts
    max_restarts: int = 10  # restarts in a row without a new checkpoint (resizes for more GPUs are free)
    backoff_s: float = 30.0  # wait before re-submitting after a job that failed without a step
    backoff_max_s: float = 600.0
    poll_s: float = 2.0
    replan_interval_s: float = 30.0  # at most one re-plan for more idle GPUs per interval
    grow_timeout_s: float = 300.0  # a bigger job submitted beside the running one must start by then
    save_interval: int = 50  # the job checkpoints every K steps (a lost node costs at most K steps)
    time_limit: str | None = None
    time_min: str | None = None  # --time-min: backfill may start a job sooner with a limit down to this
    signal_grace_s: int | None = None
    python: str = sys.executable
    train_args: tuple[str, ...] = ()
    extra_sbatch: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, source: str | None = None) -> None:
        def bad(field: str, message: str, fix: str | None = None) -> SailorError:
            return SailorError(message, file=source, field=field, fix=fix)

        if self.dtype not in ("auto", *DTYPES):
            raise bad("--dtype", f"unknown dtype {self.dtype!r}", f"use auto or one of {', '.join(DTYPES)}")
        if self.runtime not in RUN_RUNTIMES:
            raise bad("--runtime", f"unknown runtime {self.runtime!r}", f"use one of {', '.join(RUN_RUNTIMES)}")
        if self.objective not in ("throughput", "cost", "time"):
            raise bad("--objective", f"unknown objective {self.objective!r}", "use throughput, cost or time")
        for name in ("steps", "gbs", "max_restarts", "save_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "max_restarts" else 1):
                raise bad(f"--{name.replace('_', '-')}", f"must be a positive integer, got {value!r}")
        for name in ("min_gain", "backoff_s", "backoff_max_s", "poll_s", "replan_interval_s", "grow_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise bad(f"--{name.replace('_', '-')}", f"must be a non-negative number, got {value!r}")
        if self.poll_s <= 0:
            raise bad("--poll", "must be positive")
        if self.restart_cost_s is not None and (not math.isfinite(self.restart_cost_s) or self.restart_cost_s < 0):
            raise bad("--restart-cost", f"must be a non-negative number of seconds, got {self.restart_cost_s!r}")
        for arg in self.train_args:
            if arg.split("=", 1)[0] in RESERVED_TRAIN_ARGS:
                raise bad("--train-arg", f"{arg!r} is set by the controller",
                          "use --steps / --save-interval / --data / --save of sailor-hpc run instead")
        if self.time_min is not None:
            try:
                _, least = parse_time_limit(self.time_min)
            except SailorError as exc:
                raise bad("--time-min", exc.message, exc.fix) from None
            if self.time_limit is not None and least > parse_time_limit(self.time_limit)[1]:
                raise bad("--time-min", f"{self.time_min} is longer than --time {self.time_limit}",
                          "give a minimum at most the time limit")
        if not self.run_id or not self.run_id.isalnum():
            raise bad("run_id", f"{self.run_id!r} is not alphanumeric")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["train_args"] = list(self.train_args)
        d["extra_sbatch"] = list(self.extra_sbatch)
        return {"format": SPEC_FORMAT, "version": SPEC_VERSION, **d}

    @classmethod
    def from_dict(cls, data: Any, source: str | None = None) -> RunSpec:
        """The spec of a parsed run.json (``source``: its path, for errors), every key typed and numbers finite."""
        if not isinstance(data, dict) or data.get("format") != SPEC_FORMAT or data.get("version") != SPEC_VERSION:
            raise SailorError(f"not a {SPEC_FORMAT} v{SPEC_VERSION} file", file=source,
                              fix="point --resume at the directory `sailor-hpc run` created")
        try:
            return from_json(cls, data, skip=("format", "version"), finite=True)
        except Mismatch as exc:
            names = sorted(exc.names)
            said, fix = {"unknown": (f"unknown keys {names}", "this run directory was written by another sailor-hpc version"),
                         "missing": (f"missing keys {names}", None),
                         "type": (f"must be {exc.expected}, got {exc.value!r}",
                                  "run.json was edited or damaged: restore it, or start a new run")}[exc.problem]
            raise SailorError(said, file=source, field=names[0], fix=fix) from None
        except SailorError as exc:  # the spec's own validation: name the file
            raise SailorError(exc.message, file=source, field=exc.field, fix=exc.fix) from None

    def write(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> RunSpec:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise SailorError("run spec not found", file=path,
                              fix="--resume needs the run directory of an earlier `sailor-hpc run`") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SailorError(f"not valid JSON: {exc}", file=path) from None
        return cls.from_dict(data, source=str(path))

    def plan_request(self, available: dict[str, int], time_goal: TimeGoal | None = None,
                     runtime: str | None = None) -> PlanRequest:
        """The planner's request for this run on ``available`` GPUs per partition (objective time: ``time_goal``),
        searched for ``runtime`` (default: the run's; under ``auto``, which searches both, megatron_patch)."""
        runtime = runtime or (self.runtime if self.runtime != "auto" else "megatron_patch")
        return PlanRequest(model=self.model, global_batch_size=self.gbs, objective=self.objective, time_goal=time_goal,
                           constraints=Constraints(self.max_cost_per_hour, self.max_cost_per_iteration,
                                                   self.min_throughput, self.max_gpus),
                           available=dict(available), seq_len=self.seq_len, dtype=self.dtype, max_stages=self.max_stages,
                           top_k=1, runtime=runtime)

    def runtime_of(self, plan: Plan) -> str:
        """The runtime whose ranks train ``plan``: the run's, or under ``auto`` the one whose search found it
        (DeepSpeed's search writes its space and ZeRO stage into the plan's notes, which the plan file keeps,
        so a resumed controller launches the same runtime for the same plan)."""
        if self.runtime != "auto":
            return self.runtime
        space = plan.notes.get("planner", {}).get("space") if isinstance(plan.notes.get("planner"), dict) else None
        return "deepspeed" if space == "deepspeed" or DEEPSPEED_NOTES in plan.notes else "megatron_patch"

