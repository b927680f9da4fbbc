"""Training options shared by the runtime, the reference and the CLIs (torch-free, so ``launch --dry-run``
and the Slurm side can parse arguments without torch)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.training import DEFAULTS, FLAGS, OPTIMIZER_FLAGS, Flag, LrSchedule, check_values


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


def add_flags(ap: argparse.ArgumentParser, flags: tuple[Flag, ...]) -> None:
    """argparse options of ``sailor_hpc.core.training``'s table (the CLI builds its own from the same)."""
    for f in flags:
        ap.add_argument(f.flag, type=f.type, default=f.default, choices=f.choices, help=f.help)


def add_adam_args(ap: argparse.ArgumentParser) -> None:
    """The optimizer and schedule options of every CLI that trains (launch, reference, benchmarks)."""
    add_flags(ap, OPTIMIZER_FLAGS)


def check_train_args(args: argparse.Namespace) -> None:
    """The table's checks on parsed arguments (bad values: SailorError, exit code 2)."""
    check_values({f.dest: getattr(args, f.dest) for f in FLAGS if hasattr(args, f.dest)})


def add_precision_args(ap: argparse.ArgumentParser) -> None:
    """TF32 and fp16 loss-scale options (the plan's ``dtype`` picks fp32/bf16/fp16)."""
    d = LossScaleConfig()
    ap.add_argument("--no-tf32", action="store_true", help="fp32 plans on CUDA: no TF32 matmuls (exact fp32)")
    ap.add_argument("--initial-loss-scale", type=float, default=d.initial, help="fp16: first dynamic loss scale")
    ap.add_argument("--loss-scale-window", type=int, default=d.growth_interval,
                    help="fp16: double the loss scale after this many steps without overflow")
    ap.add_argument("--min-loss-scale", type=float, default=d.min_scale)
    ap.add_argument("--inject-overflow", default=None, help=argparse.SUPPRESS)  # "RANK:STEP", tests only


def with_precision_from_args(opts: TrainOptions, args: argparse.Namespace) -> TrainOptions:
    """``opts`` with the fields that :func:`add_precision_args`' options set."""
    inject: tuple[int, int] | None = None
    if args.inject_overflow:
        rank, step = (int(x) for x in args.inject_overflow.split(":"))
        inject = (rank, step)
    return replace(opts, tf32=not args.no_tf32, inject_overflow=inject,
                   loss_scale=LossScaleConfig(initial=args.initial_loss_scale, growth_interval=args.loss_scale_window,
                                              min_scale=args.min_loss_scale))


def adam_from_args(args: argparse.Namespace) -> AdamConfig:
    return AdamConfig(lr=args.lr, weight_decay=args.weight_decay, clip_grad=args.clip_grad, eps=args.adam_eps)


def schedule_from_args(args: argparse.Namespace, global_batch: int, steps: int) -> LrSchedule:
    """The run's learning-rate schedule from :func:`add_adam_args`' options (steps: the step to reach)."""
    return LrSchedule.resolve({f.dest: getattr(args, f.dest) for f in OPTIMIZER_FLAGS}, global_batch, steps)
