"""What a training job is rendered from besides the plan and the site: one typed value, built once.

The CLI (``sbatch``, ``submit``, ``plan --sbatch``) and the controller (each attempt, each cluster's part)
build a :class:`JobOptions`; :func:`sailor_hpc.jobs.render.render_job_script` lays it out. The modes of a
job are nested values rather than flags that exclude each other:

- ``work``: :class:`Training` (dataset, checkpoints), :class:`DryRun` (every rank only prints its role) or
  :class:`UserEntry` (the user's own DeepSpeed script with the plan's ds_config.json);
- ``scope``: :class:`WholePlan` (one job runs every rank), :class:`InPlace` (the controller's run
  directory: a loop of ``srun`` steps that re-plans on the surviving nodes) or :class:`ClusterPart`
  (one cluster's ranks of a plan across clusters, joined by a rendezvous file);
- ``limits``: time limit, backfill minimum and checkpoint signal grace (:class:`Limits`).

Everything that can be checked without the plan and the site is checked on construction, so a bad
combination is a :class:`SailorError` naming the option and its fix before any search or file write; what
depends on the plan (which clusters it spans, partitions' walltime maxima) is checked when rendering.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Union

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.site import format_slurm_time, slurm_time_seconds
from sailor_hpc.slurm import safety

PathLike = Union[str, "os.PathLike[str]"]
#: the module each runtime's ranks run
LAUNCH_MODULES = {"megatron_patch": "megatron_patch.launch", "deepspeed": "megatron_patch.ds_runtime.launch"}
DEFAULT_STEPS = 100
DEFAULT_RENDEZVOUS_WAIT_S = 600  # a cluster's job waits this long for the rendezvous address of rank 0's job


def parse_time_limit(time: str, option: str = "--time") -> tuple[str, int]:
    """A Slurm time text as Slurm's normalized text and seconds (a SailorError naming ``option`` if it is none)."""
    safety.no_control_chars(time, option)
    try:
        seconds = slurm_time_seconds(time)
    except ValueError:
        seconds = None
    if seconds is None:
        raise SailorError(f"{time!r} is not a Slurm time limit", field=option,
                          fix='use "D-HH:MM:SS", "HH:MM:SS" or minutes')
    return format_slurm_time(seconds), seconds


@dataclass(frozen=True)
class Training:
    """The ranks train: ``data`` (a prefix or a blend) and ``save`` (the checkpoint directory) are needed;
    ``load`` is used until the job has a checkpoint of its own in ``save``."""

    data: PathLike
    save: PathLike
    load: PathLike | None = None

    def __post_init__(self) -> None:
        for name, value in (("--data", self.data), ("--save", self.save)):
            if value is None or not str(value).strip():
                raise SailorError("training needs a dataset prefix and a checkpoint directory", field=name,
                                  fix="pass --data PREFIX and --save DIR (or a dry run, whose ranks only print "
                                      "their role)")
        for name, path in (("--data", self.data), ("--save", self.save), ("--load", self.load)):
            if path is not None:
                safety.no_control_chars(str(path), name)


@dataclass(frozen=True)
class DryRun:
    """Every rank only prints its role: no data, no checkpoints, no requeue."""


@dataclass(frozen=True)
class UserEntry:
    """The user's own DeepSpeed script, started on every rank as ``python SCRIPT --deepspeed_config DS_CONFIG
    ARGS...`` (DeepSpeed's own convention: ``deepspeed.add_config_arguments`` parses it and
    ``deepspeed.initialize(args=...)`` reads it) under the plan's allocation and the torch.distributed
    environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); ``SAILOR_PLAN`` and
    ``SAILOR_DS_CONFIG`` name the plan and the config for a script that wants them. The script owns its data
    and checkpoints: it is requeued only if it exits 75 after the limit signal (SIGUSR1), as the runtimes do."""

    script: PathLike
    ds_config: PathLike  # written from the plan (sailor_hpc.core.ds_config); checked against it when rendering
    args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "args", tuple(self.args))
        safety.shell_path(self.script, "--entry")
        safety.shell_path(self.ds_config, "ds_config")
        for arg in self.args:
            safety.no_control_chars(arg, "--entry arguments")


@dataclass(frozen=True)
class WholePlan:
    """One (het) job runs every rank of the plan."""


@dataclass(frozen=True)
class InPlace:
    """The controller's run directory: ``--no-kill`` and training as a loop of ``srun`` steps that re-plans on
    the surviving nodes when a step loses some (:mod:`sailor_hpc.controller.inplace`)."""

    run_dir: PathLike
    resident: bool = False  # one step per node and resident ranks (sailor_hpc.controller.job_agent)
    bundle: BundlePart | None = None  # one partition's job of a mixed-GPU plan's bundle

    def __post_init__(self) -> None:
        safety.shell_path(self.run_dir, "--run-dir")
        if self.bundle is not None and not self.resident:
            raise SailorError("a bundle's jobs recover together only with resident ranks", field="bundle",
                              fix="render a mixed-GPU plan as one het job, or with resident=True")


@dataclass(frozen=True)
class BundlePart:
    """Job ``index`` of the ``count`` plain jobs that run a mixed-GPU plan together (a *bundle*), one per
    component of its job layout (``partition``: the component's; a het job would have these components): Slurm
    ends a whole het job when one of its nodes goes down, a plain ``--no-kill`` job only that node's step. Job 0
    holds plan rank 0 and writes the rendezvous address to ``folder``; the others read it there; their agents and
    resident ranks share the folder (:mod:`sailor_hpc.controller.job_agent`)."""

    partition: str
    index: int
    count: int
    folder: PathLike

    def __post_init__(self) -> None:
        safety.slurm_word(self.partition, "partition")
        if not 0 <= self.index < self.count:
            raise SailorError(f"job {self.index} of {self.count}", field="bundle", fix="0 <= index < count")
        safety.shell_path(self.folder, "bundle folder")


@dataclass(frozen=True)
class ClusterPart:
    """One cluster's ranks of a plan (a job cannot span clusters). Across clusters, the job holding plan
    rank 0 writes its address to ``rendezvous_file`` (fresh per submission, on a filesystem every cluster
    shares) and the others wait for it up to ``rendezvous_wait_s``."""

    cluster: str
    rendezvous_file: PathLike | None = None
    rendezvous_wait_s: int = DEFAULT_RENDEZVOUS_WAIT_S

    def __post_init__(self) -> None:
        safety.slurm_word(self.cluster, "cluster")
        if not isinstance(self.rendezvous_wait_s, int) or self.rendezvous_wait_s <= 0:
            raise SailorError(f"must be a positive number of seconds, got {self.rendezvous_wait_s!r}",
                              field="rendezvous_wait_s", fix="give the other clusters' jobs time to start")
        if self.rendezvous_file is not None:
            safety.shell_path(self.rendezvous_file, "rendezvous_file")


@dataclass(frozen=True)
class Limits:
    """The job's time limit (None: 1 h, capped by the partitions), the shortest limit backfill may give it
    (``--time-min``: each limit ends in a checkpoint, so a shorter one is safe) and how long before the limit
    the ranks are signalled to checkpoint (None: a tenth of the limit, at most 300 s)."""

    time: str | None = None
    time_min: str | None = None
    signal_grace_s: int | None = None

    def __post_init__(self) -> None:
        limit = parse_time_limit(self.time)[1] if self.time is not None else None
        if limit is not None and limit <= 0:
            raise SailorError("the time limit must be positive", field="--time")
        if self.time_min is not None:
            least = parse_time_limit(self.time_min, "--time-min")[1]
            if least <= 0 or (limit is not None and least > limit):
                raise SailorError(f"--time-min {self.time_min} must be positive and at most the job's time limit",
                                  field="--time-min", fix="give a minimum below --time")
        if self.signal_grace_s is not None and (isinstance(self.signal_grace_s, bool)
                                                or not isinstance(self.signal_grace_s, int)
                                                or self.signal_grace_s <= 0
                                                or (limit is not None and self.signal_grace_s >= limit)):
            raise SailorError(f"signal grace {self.signal_grace_s!r} s must be between 0 and the time limit",
                              field="--signal-grace",
                              fix="checkpointing needs time before the limit, but less than all of it")


def check_user_entry(runtime: str, train_args: tuple[str, ...], scope: WholePlan | InPlace | ClusterPart) -> None:
    """What a :class:`UserEntry` job needs of the other options (callers check it before writing anything)."""
    if runtime != "deepspeed":
        raise SailorError("--entry starts your own DeepSpeed script with the plan's ds_config.json", field="--entry",
                          fix="add --runtime deepspeed (only plans DeepSpeed's engine runs)")
    if train_args:
        raise SailorError("--train-arg and the training options are arguments of sailor-hpc's runtimes; with --entry "
                          "the training options go into the ds_config.json", field="--train-arg",
                          fix="pass your script's own arguments after --")
    if isinstance(scope, InPlace):
        raise SailorError("in-place steps re-plan and restart sailor-hpc's runtimes, not a user's script",
                          field="scope", fix="render a user's entry point for the whole plan")


@dataclass(frozen=True)
class JobOptions:
    """Everything a training job script is rendered from besides the plan and the site.

    ``plan_path``: the (placed) plan file the ranks read; it must hold exactly the plan rendered.
    ``runtime``: ``megatron_patch`` or ``deepspeed`` (``megatron_patch.ds_runtime.launch``, the same
    arguments; only plans DeepSpeed's engine runs). ``train_args``: extra arguments of the launch module.
    ``python``: the interpreter on the compute nodes (None: the one running this, a virtualenv on the shared
    filesystem where sailor-hpc is installed, rather than a bare ``python`` that is often the system's).
    ``extra_sbatch``: ``--option=value`` header lines. ``workdir`` (default: the plan's directory) and
    ``log_dir`` (default: ``workdir``). ``requeue``: the job requeues itself after a checkpoint on the limit
    signal and lets Slurm requeue it on a node failure; False for a controller that resubmits by itself.
    """

    plan_path: PathLike
    work: Training | DryRun | UserEntry
    steps: int = DEFAULT_STEPS
    model: str | None = None
    runtime: str = "megatron_patch"
    train_args: tuple[str, ...] = ()
    python: str | None = None
    job_name: str | None = None
    limits: Limits = field(default_factory=Limits)
    extra_sbatch: tuple[str, ...] = ()
    workdir: PathLike | None = None
    log_dir: PathLike | None = None
    requeue: bool = True
    scope: WholePlan | InPlace | ClusterPart = field(default_factory=WholePlan)

    def __post_init__(self) -> None:
        # sequences given as lists are kept as tuples: the value stays immutable and comparable
        object.__setattr__(self, "train_args", tuple(self.train_args))
        object.__setattr__(self, "extra_sbatch", tuple(self.extra_sbatch))
        if not isinstance(self.work, (Training, DryRun, UserEntry)):
            raise SailorError(f"work must be Training(...), DryRun() or UserEntry(...), got {self.work!r}",
                              field="work", fix="pass --data and --save, --dry-run, or --entry SCRIPT")
        if not isinstance(self.scope, (WholePlan, InPlace, ClusterPart)):
            raise SailorError(f"scope must be WholePlan(), InPlace(...) or ClusterPart(...), got {self.scope!r}",
                              field="scope", fix="choose one scope")
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps <= 0:
            raise SailorError(f"must be a positive integer, got {self.steps!r}", field="--steps")
        if self.runtime not in LAUNCH_MODULES:
            raise SailorError(f"unknown runtime {self.runtime!r}", field="--runtime",
                              fix=f"use one of {', '.join(LAUNCH_MODULES)}")
        for arg in self.train_args:
            safety.no_control_chars(arg, "--train-arg")
        if self.python is not None:
            safety.quoted_python_exe(self.python)
        if self.job_name is not None:
            safety.job_name(self.job_name)
        safety.shell_path(self.plan_path, "plan_path")
        if isinstance(self.work, UserEntry):
            check_user_entry(self.runtime, self.train_args, self.scope)
        if isinstance(self.scope, ClusterPart) and self.scope.rendezvous_file is not None and self.requeue:
            raise SailorError("one cluster's job requeued alone would wait for ranks that have left",
                              field="requeue", fix="render with requeue=False; the controller resubmits every "
                                                   "cluster's job")

    @property
    def dry_run(self) -> bool:
        return isinstance(self.work, DryRun)

    @property
    def launch_module(self) -> str:
        return LAUNCH_MODULES[self.runtime]


__all__ = ["BundlePart", "ClusterPart", "DEFAULT_RENDEZVOUS_WAIT_S", "DEFAULT_STEPS", "DryRun", "InPlace", "JobOptions",
           "LAUNCH_MODULES", "Limits", "PathLike", "Training", "UserEntry", "WholePlan", "check_user_entry",
           "parse_time_limit"]
