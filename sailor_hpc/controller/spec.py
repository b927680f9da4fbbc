"""What a controlled run was asked to do (``run.json`` in the run directory), fixed at ``sailor-hpc run``.

The spec is written once, when the run starts, so that ``sailor-hpc run --resume DIR`` needs nothing
but the directory: the resumed controller plans, submits and judges resizes exactly as the first one.
It comes in three parts, each read whole by the code it is for (as torchtitan's ``JobConfig`` sections):
:class:`PlanningSpec`, what the planner needs (site, model, objective, constraints, batch size, runtime);
:class:`JobSpec`, what every job needs (data, checkpoint directory, steps, runtime arguments, interpreter,
limits, extra sbatch options); :class:`ControlSpec`, the controller's own knobs (minimum gain, restart cost,
restarts, back-off, polling).
"""
from __future__ import annotations

import json
import math
import sys
import uuid
from dataclasses import MISSING, asdict, dataclass, field, fields
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


def _bad(field: str, message: str, fix: str | None = None, source: str | None = None) -> SailorError:
    return SailorError(message, file=source, field=field, fix=fix)


def _option(name: str) -> str:
    return f"--{name.replace('_', '-')}"


@dataclass(frozen=True)
class PlanningSpec:
    """What the planner is asked at every re-plan: the site, model and objective, the constraints, the runtime."""

    site: str  # absolute path of the site TOML
    model: str
    objective: str  # "throughput", "cost" or "time" (expected finish on the GPUs free now)
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

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *DTYPES):
            raise _bad("--dtype", f"unknown dtype {self.dtype!r}", f"use auto or one of {', '.join(DTYPES)}")
        if self.runtime not in RUN_RUNTIMES:
            raise _bad("--runtime", f"unknown runtime {self.runtime!r}", f"use one of {', '.join(RUN_RUNTIMES)}")
        if self.objective not in ("throughput", "cost", "time"):
            raise _bad("--objective", f"unknown objective {self.objective!r}", "use throughput, cost or time")
        _positive_int("gbs", self.gbs)

    def request(self, available: dict[str, int], time_goal: TimeGoal | None = None,
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


@dataclass(frozen=True)
class JobSpec:
    """What every job of the run trains with, whatever its plan and scope (:mod:`.attempt_job` builds them)."""

    data: str  # dataset prefix (absolute)
    save: str  # checkpoint root (absolute), shared by every job of the run
    steps: int  # optimizer step to reach
    save_interval: int = 50  # the job checkpoints every K steps (a lost node costs at most K steps)
    time_limit: str | None = None
    time_min: str | None = None  # --time-min: backfill may start a job sooner with a limit down to this
    signal_grace_s: int | None = None
    python: str = sys.executable
    train_args: tuple[str, ...] = ()
    extra_sbatch: tuple[str, ...] = ()
    resident_ranks: bool = True  # in place, the surviving ranks go on in their processes (controller.job_agent)

    def __post_init__(self) -> None:
        _positive_int("steps", self.steps)
        _positive_int("save_interval", self.save_interval)
        for arg in self.train_args:
            if arg.split("=", 1)[0] in RESERVED_TRAIN_ARGS:
                raise _bad("--train-arg", f"{arg!r} is set by the controller",
                           "use --steps / --save-interval / --data / --save of sailor-hpc run instead")
        if self.time_min is not None:
            try:
                _, least = parse_time_limit(self.time_min)
            except SailorError as exc:
                raise _bad("--time-min", exc.message, exc.fix) from None
            if self.time_limit is not None and least > parse_time_limit(self.time_limit)[1]:
                raise _bad("--time-min", f"{self.time_min} is longer than --time {self.time_limit}",
                           "give a minimum at most the time limit")


@dataclass(frozen=True)
class ControlSpec:
    """The controller's policy: when a resize pays, how often it re-plans and polls, how long it waits and retries."""

    min_gain: float = 0.10  # resize only if the new plan is this much better after the restart cost
    restart_cost_s: float | None = None  # None: measured from this run's own restarts
    max_restarts: int = 10  # restarts in a row without a new checkpoint (resizes for more GPUs are free)
    backoff_s: float = 30.0  # wait before re-submitting after a job that failed without a step
    backoff_max_s: float = 600.0
    poll_s: float = 2.0
    replan_interval_s: float = 30.0  # at most one re-plan for more idle GPUs per interval
    grow_timeout_s: float = 300.0  # a bigger job submitted beside the running one must start by then

    def __post_init__(self) -> None:
        if not isinstance(self.max_restarts, int) or isinstance(self.max_restarts, bool) or self.max_restarts < 0:
            raise _bad("--max-restarts", f"must be a non-negative integer, got {self.max_restarts!r}")
        for name in ("min_gain", "backoff_s", "backoff_max_s", "poll_s", "replan_interval_s", "grow_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise _bad(_option(name), f"must be a non-negative number, got {value!r}")
        if self.poll_s <= 0:
            raise _bad("--poll", "must be positive")
        if self.restart_cost_s is not None and (not math.isfinite(self.restart_cost_s) or self.restart_cost_s < 0):
            raise _bad("--restart-cost", f"must be a non-negative number of seconds, got {self.restart_cost_s!r}")


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _bad(_option(name), f"must be a positive integer, got {value!r}")


#: the parts, in the order run.json's fields are checked (steps before gbs, as they always were)
PARTS: dict[str, type] = {"job": JobSpec, "planning": PlanningSpec, "control": ControlSpec}


@dataclass(frozen=True)
class RunSpec:
    """The run's id and its three parts, each read whole by the code it is for: ``planning`` by the planner
    (:meth:`PlanningSpec.request`), ``job`` by the one job builder, ``control`` by the controller's policies.
    ``run.json`` keeps one flat object (every part's fields side by side), as it always has."""

    run_id: str
    planning: PlanningSpec
    job: JobSpec
    control: ControlSpec = field(default_factory=ControlSpec)

    def __post_init__(self) -> None:
        if not self.run_id or not self.run_id.isalnum():
            raise _bad("run_id", f"{self.run_id!r} is not alphanumeric")

    @classmethod
    def of(cls, run_id: str, **flat: Any) -> RunSpec:
        """A spec from the parts' fields given flat, as the command line and run.json name them."""
        unknown = sorted(flat.keys() - {f for part in PARTS.values() for f in _names(part)})
        if unknown:
            raise TypeError(f"RunSpec.of: unknown fields {unknown}")
        parts: dict[str, Any] = {key: part(**{k: v for k, v in flat.items() if k in _names(part)})
                                 for key, part in PARTS.items()}
        return cls(run_id, **parts)

    def changed(self, **flat: Any) -> RunSpec:
        """This spec with some of its parts' fields (named flat) changed, every part checked again."""
        mine = {k: v for k, v in self.to_dict().items() if k not in ("format", "version", "run_id")}
        return RunSpec.of(self.run_id, **{**mine, **flat})

    def to_dict(self) -> dict[str, Any]:
        flat: dict[str, Any] = {"run_id": self.run_id}
        for key in PARTS:
            flat.update(asdict(getattr(self, key)))
        flat["train_args"] = list(self.job.train_args)
        flat["extra_sbatch"] = list(self.job.extra_sbatch)
        return {"format": SPEC_FORMAT, "version": SPEC_VERSION, **flat}

    @classmethod
    def from_dict(cls, data: Any, source: str | None = None) -> RunSpec:
        """The spec of a parsed run.json (``source``: its path, for errors), every key typed and numbers finite."""
        if not isinstance(data, dict) or data.get("format") != SPEC_FORMAT or data.get("version") != SPEC_VERSION:
            raise SailorError(f"not a {SPEC_FORMAT} v{SPEC_VERSION} file", file=source,
                              fix="point --resume at the directory `sailor-hpc run` created")
        envelope = ("format", "version", "run_id")
        try:
            unknown = sorted(data.keys() - set(envelope) - {f for part in PARTS.values() for f in _names(part)})
            if unknown:
                raise Mismatch("unknown", unknown)
            required = {f.name for part in PARTS.values() for f in fields(part)
                        if f.default is MISSING and f.default_factory is MISSING}
            missing = sorted(required - data.keys())
            if missing:
                raise Mismatch("missing", missing)
            if not isinstance(data.get("run_id"), str):
                raise Mismatch("missing", ["run_id"]) if "run_id" not in data else \
                    Mismatch("type", ["run_id"], "str", data["run_id"])
            parts: dict[str, Any] = {key: from_json(part, {k: v for k, v in data.items() if k in _names(part)},
                                                    finite=True) for key, part in PARTS.items()}
            return cls(data["run_id"], **parts)
        except Mismatch as exc:
            names = sorted(exc.names)
            said, fix = {"unknown": (f"unknown keys {names}", "this run directory was written by another sailor-hpc version"),
                         "missing": (f"missing keys {names}", None),
                         "type": (f"must be {exc.expected}, got {exc.value!r}",
                                  "run.json was edited or damaged: restore it, or start a new run")}[exc.problem]
            raise SailorError(said, file=source, field=names[0], fix=fix) from None
        except SailorError as exc:  # a part's own validation: name the file
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


def _names(part: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(part))
