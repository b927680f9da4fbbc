"""Training options shared by the runtime, the reference and the CLIs (torch-free, so ``launch --dry-run``
and the Slurm side can parse arguments without torch)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import NoReturn

from sailor_hpc.core.errors import EXIT_BAD_INPUT, SailorError
from sailor_hpc.core.training import DEFAULTS, FLAGS, OPTIMIZER_FLAGS, Flag, LrSchedule, check_value, check_values


@dataclass(frozen=True)
class AdamConfig:
    lr: float = DEFAULTS["lr"]  # the peak: TrainOptions.schedule gives each step's
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = DEFAULTS["adam_eps"]
    weight_decay: float = DEFAULTS["weight_decay"]
    clip_grad: float = DEFAULTS["clip_grad"]  # global gradient-norm clip; 0 disables


@dataclass(frozen=True)
class LossScaleConfig:
    """fp16's dynamic loss scale (torch GradScaler's rule): halve on an overflow, double after
    ``growth_interval`` steps without one."""

    initial: float = 2.0 ** 16
    growth_interval: int = 1000
    min_scale: float = 1.0


@dataclass(frozen=True)
class TrainOptions:
    adam: AdamConfig = field(default_factory=AdamConfig)
    seed: int = 1234
    weighting: str = "samples"  # "uniform" only for the tests' negative control
    layer_spec: str = "local"  # megatron's local modules (+ SDPA); "te" is refused (check_layer_spec)
    grad_bucket_mb: float = 40.0  # gradient all-reduce bucket cap (MB of fp32), as Megatron's DDP; <= 0: one
    tf32: bool = True  # fp32 plans on CUDA: TF32 tensor-core matmuls/convolutions
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    inject_overflow: tuple[int, int] | None = None  # (rank, step): the tests' forced fp16 overflow
    schedule: LrSchedule | None = None  # None: adam.lr at every step

    def lr_at(self, consumed_samples: int) -> float:
        return self.adam.lr if self.schedule is None else self.schedule.lr_at(consumed_samples)

    def __post_init__(self) -> None:
        check_layer_spec(self.layer_spec)


LAYER_SPECS = ("auto", "local", "te")


def check_layer_spec(name: str) -> None:
    """Refuse TransformerEngine's layer spec: its parameter names and numerics are untested here."""
    if name == "te":
        raise SailorError("--layer-spec te (TransformerEngine) is not supported: megatron_patch has never run or "
                          "tested TE's layer spec", field="--layer-spec",
                          fix="use --layer-spec local (megatron's local modules with SDPA attention and the "
                              "fusions the GPU supports)")
    if name not in LAYER_SPECS:
        raise SailorError(f"unknown layer spec {name!r}", field="--layer-spec", fix="use --layer-spec local")


class OptionParser(argparse.ArgumentParser):
    """argparse with the runtime's refusal: one line, ``error: ... (fix: ...)``, exit 2, as a SailorError
    says it (argparse's own is the usage text, then its error, on every rank)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"error: {message} (fix: `{self.prog} --help` lists the options)\n")


#: the numeric options of the launchers beyond the table's (``sailor_hpc.core.training``), with their ranges
RUN_FLAGS: tuple[Flag, ...] = (
    Flag("--steps", int, None, "train until this optimizer step", minimum=1, required=True),
    Flag("--save-interval", int, 0, "also save every K steps (0: only at the end)", minimum=0),
    Flag("--keep", int, 3, "complete checkpoints to keep", minimum=1),
    Flag("--seed", int, 1234, "seed of the initial weights and the data order", minimum=0, maximum=2**32 - 1),
    Flag("--grad-bucket-mb", float, TrainOptions.grad_bucket_mb,
         "cap of a gradient all-reduce bucket in MB of fp32 (0: one bucket per rank set)", minimum=0.0),
    Flag("--timeout-min", float, 30.0, "collective timeout (minutes)", above=0.0, maximum=10.0 ** 6),
)
PRECISION_FLAGS: tuple[Flag, ...] = (
    Flag("--initial-loss-scale", float, LossScaleConfig.initial, "fp16: first dynamic loss scale", above=0.0),
    Flag("--loss-scale-window", int, LossScaleConfig.growth_interval,
         "fp16: double the loss scale after this many steps without overflow", minimum=1),
    Flag("--min-loss-scale", float, LossScaleConfig.min_scale, "fp16: the loss scale never falls below this",
         above=0.0),
)


def add_flags(ap: argparse.ArgumentParser, flags: tuple[Flag, ...]) -> None:
    """argparse options of a table of flags (the CLI builds its own from ``sailor_hpc.core.training``'s)."""
    for f in flags:
        ap.add_argument(f.flag, type=f.type, default=f.default, choices=f.choices, help=f.help, required=f.required)


def add_adam_args(ap: argparse.ArgumentParser) -> None:
    """The optimizer and schedule options of every CLI that trains (launch, reference, benchmarks)."""
    add_flags(ap, OPTIMIZER_FLAGS)


def check_train_args(args: argparse.Namespace) -> None:
    """The tables' checks on parsed arguments (bad values: SailorError, exit code 2)."""
    check_values({f.dest: getattr(args, f.dest) for f in FLAGS if hasattr(args, f.dest)})
    for f in RUN_FLAGS + PRECISION_FLAGS:
        if hasattr(args, f.dest):
            check_value(f, getattr(args, f.dest))
    if hasattr(args, "min_loss_scale") and args.min_loss_scale > args.initial_loss_scale:
        raise SailorError(f"{args.min_loss_scale!r} exceeds --initial-loss-scale {args.initial_loss_scale!r}",
                          field="--min-loss-scale", fix="give a minimum no larger than the initial loss scale")
    if getattr(args, "inject_overflow", None) is not None:
        injected_overflow(args.inject_overflow)


def add_precision_args(ap: argparse.ArgumentParser) -> None:
    """TF32 and fp16 loss-scale options (the plan's ``dtype`` picks fp32/bf16/fp16)."""
    ap.add_argument("--no-tf32", action="store_true", help="fp32 plans on CUDA: no TF32 matmuls (exact fp32)")
    add_flags(ap, PRECISION_FLAGS)
    ap.add_argument("--inject-overflow", default=None, help=argparse.SUPPRESS)  # "RANK:STEP", tests only


def injected_overflow(text: str) -> tuple[int, int]:
    """``--inject-overflow RANK:STEP`` (the tests' forced fp16 overflow) as (rank, step)."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise SailorError(f"{text!r} is not RANK:STEP", field="--inject-overflow", fix="e.g. --inject-overflow 1:3")
    return int(parts[0]), int(parts[1])


def with_precision_from_args(opts: TrainOptions, args: argparse.Namespace) -> TrainOptions:
    """``opts`` with the fields that :func:`add_precision_args`' options set."""
    inject = injected_overflow(args.inject_overflow) if args.inject_overflow else None
    return replace(opts, tf32=not args.no_tf32, inject_overflow=inject,
                   loss_scale=LossScaleConfig(initial=args.initial_loss_scale, growth_interval=args.loss_scale_window,
                                              min_scale=args.min_loss_scale))


def adam_from_args(args: argparse.Namespace) -> AdamConfig:
    return AdamConfig(lr=args.lr, weight_decay=args.weight_decay, clip_grad=args.clip_grad, eps=args.adam_eps)


def schedule_from_args(args: argparse.Namespace, global_batch: int, steps: int) -> LrSchedule:
    """The run's learning-rate schedule from :func:`add_adam_args`' options (steps: the step to reach)."""
    return LrSchedule.resolve({f.dest: getattr(args, f.dest) for f in OPTIMIZER_FLAGS}, global_batch, steps)
