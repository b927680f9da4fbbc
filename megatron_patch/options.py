"""Training options shared by the runtime, the reference and the CLIs (torch-free, so ``launch --dry-run``
and the Slurm side can parse arguments without torch)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field


@dataclass(frozen=True)
class AdamConfig:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_grad: float = 1.0  # global gradient-norm clip; 0 disables


@dataclass(frozen=True)
class TrainOptions:
    adam: AdamConfig = field(default_factory=AdamConfig)
    seed: int = 1234
    weighting: str = "samples"  # "uniform" only for the tests' negative control
    layer_spec: str = "auto"  # "local", "te" (TransformerEngine) or "auto" (te when installed and on GPU)
    grad_bucket_mb: float = 40.0  # gradient all-reduce bucket cap (MB of fp32), as Megatron's DDP; <= 0: one


def add_adam_args(ap: argparse.ArgumentParser) -> None:
    """The optimizer options of every CLI that trains (launch, reference, benchmarks)."""
    d = AdamConfig()
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--weight-decay", type=float, default=d.weight_decay)
    ap.add_argument("--clip-grad", type=float, default=d.clip_grad, help="global grad-norm clip (0: off)")
    ap.add_argument("--adam-eps", type=float, default=d.eps)


def adam_from_args(args: argparse.Namespace) -> AdamConfig:
    return AdamConfig(lr=args.lr, weight_decay=args.weight_decay, clip_grad=args.clip_grad, eps=args.adam_eps)
