"""Entry point of the training runtime, one process per GPU (or CPU rank), as the sbatch jobs start it.

    python -m megatron_patch.launch --plan plan.json --model M --data PREFIX | W1 P1 W2 P2 ... --save DIR
                                    [--load DIR | --auto-resume] --steps N [--dry-run]
                                    [schedule, --split, --eval-interval/--eval-iters, log options]

- Rank and rendezvous come from torchrun (RANK/WORLD_SIZE/LOCAL_RANK) or Slurm (SLURM_PROCID/
  SLURM_NTASKS/SLURM_LOCALID) plus MASTER_ADDR/MASTER_PORT (``sailor_hpc.core.dist_env``); the rank's role
  follows ``sailor_hpc.core.roles`` (pipelines, then stages, then TP ranks, in plan order).
- ``--steps N`` is the step to reach: a resumed run continues from the checkpoint's step to N.
- ``--dry-run`` prints this rank's role as one JSON line and exits 0, without torch.
- SIGUSR1 or SIGTERM (Slurm's warning before the time limit): the runtime finishes the current step,
  every rank agrees to stop (one all-reduce), a complete checkpoint is written to ``--save`` and the
  processes exit with 75 (``EXIT_SAVED_ON_SIGNAL``); a later job resumes with ``--load DIR`` under
  any plan. Exit codes: 0 done, 75 saved on a signal, 2 bad input, 1 error.
- Every rank logs JSON lines on stdout: ``start``, ``step`` (loss, lr, grad norm, iteration and sync
  seconds, peak memory: :func:`~megatron_patch.training_loop.memory_record`), ``eval``, ``saved``, ``loaded``,
  ``signal``, ``done`` (:mod:`sailor_hpc.core.runtime_events`). Rank 0 also writes human lines on stderr and a
  JSON-lines metrics file (``megatron_patch.metrics``).
- The loop itself is :mod:`megatron_patch.training_loop`'s, shared with the DeepSpeed runtime; this module is
  its :class:`~megatron_patch.training_loop.Runtime` (the trainer it builds, what ``ready`` says, evaluation).
- Before training, rank 0 checks every token id of the data against the model's vocabulary (exit 2
  naming the file, the id and its position).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from megatron_patch.mcore_import import quiet_fallback_notices
from megatron_patch.options import (
    LAYER_SPECS,
    RUN_FLAGS,
    OptionParser,
    TrainOptions,
    adam_from_args,
    add_adam_args,
    add_flags,
    add_precision_args,
    schedule_from_args,
    with_precision_from_args,
)
from megatron_patch.training_loop import Runtime, nothing, run
from sailor_hpc.core.dist_env import DistEnv
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.runtime_events import Ready
from sailor_hpc.core.training import DATA_FLAGS, LOG_FLAGS

if TYPE_CHECKING:  # torch: imported where a rank trains, never for --dry-run
    from megatron_patch.data import Samples
    from megatron_patch.engine import Trainer


def parser(prog: str = "python -m megatron_patch.launch") -> argparse.ArgumentParser:
    """Every option of both launchers (this one and ``megatron_patch.ds_runtime.launch``); their values are
    checked where they are read, before torch (:func:`megatron_patch.training_loop.check_args`)."""
    ap = OptionParser(prog=prog, description="Train a plan with the heterogeneous megatron-core runtime.")
    ap.add_argument("--plan", required=True, help="plan JSON (sailor-hpc format)")
    ap.add_argument("--model", required=True, help="model name (must match the plan's)")
    ap.add_argument("--data", required=False, nargs="+",
                    help="indexed dataset prefix (PREFIX.bin/.idx), or a blend: W1 PREFIX1 W2 PREFIX2 ...")
    ap.add_argument("--save", help="checkpoint root directory")
    ap.add_argument("--load", help="checkpoint directory, or a root whose newest complete checkpoint is loaded")
    ap.add_argument("--auto-resume", action="store_true",
                    help="resume from the newest complete checkpoint in --save when there is one")
    ap.add_argument("--dry-run", action="store_true", help="print this rank's role as JSON and exit")
    add_flags(ap, RUN_FLAGS)
    add_adam_args(ap)
    add_flags(ap, DATA_FLAGS + LOG_FLAGS)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--layer-spec", choices=LAYER_SPECS, default="local",
                    help="megatron layer spec: local modules with SDPA attention (auto = local; te is refused)")
    add_precision_args(ap)
    ap.add_argument("--grad-weighting", choices=("samples", "uniform"), default="samples",
                    help=argparse.SUPPRESS)  # "uniform" is wrong on purpose: the tests' negative control
    ap.add_argument("--wait-for", default=None,
                    help="start everything, then wait until this file exists before loading the checkpoint: a job "
                         "that takes over from a running one is ready the moment that one has saved")
    ap.add_argument("--resident", default=None, metavar="DIR",
                    help="outlive allocation changes: when training stops short (a peer's node lost, a signal saved "
                         "on), wait in DIR for the job agent's next plan and rejoin in this process "
                         "(sailor_hpc.controller.job_agent starts ranks with it)")
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return parser().parse_args(argv)


def _build(args: argparse.Namespace, plan: Plan, device: Any, train: Samples, valid: Samples | None) -> Trainer:
    from megatron_patch.engine import Trainer
    opts = TrainOptions(adam=adam_from_args(args), seed=args.seed, weighting=args.grad_weighting,
                        layer_spec=args.layer_spec, grad_bucket_mb=args.grad_bucket_mb,
                        schedule=schedule_from_args(args, plan.global_batch_size, args.steps))
    return Trainer(plan, train, with_precision_from_args(opts, args), device, valid=valid,
                   deferred_init=bool(args.load or (args.auto_resume and args.save)))  # a checkpoint may overwrite all


def _ready(trainer: Trainer, valid: Samples | None) -> Ready:
    from megatron_patch import patch
    return Ready(megatron_core=patch.megatron_version(), patches=trainer.patches,
                 params=sum(p.numel() for p in trainer.params.values()), sync_groups=trainer.sync.num_groups,
                 sync_buckets=len(trainer.sync.order), tf32=trainer.tf32, valid_samples=valid is not None)


def _prepare(_cuda: bool, _env: DistEnv) -> None:
    quiet_fallback_notices()


def _evaluate(trainer: Trainer, iters: int) -> float:
    return trainer.evaluate(iters)


RUNTIME: Runtime[Trainer] = Runtime(
    name="megatron_patch", check=nothing, prepare=_prepare,
    device_id=True, joined=lambda _plan, _cuda: {}, build=_build, ready=_ready, loaded=nothing, before_save=nothing,
    evaluate=_evaluate, fresh=lambda trainer: trainer.initialise())


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv), RUNTIME)


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown: c10d/gloo threads still owned by objects that Python frees
    at exit abort the process ("terminate called without an active exception", about 1 run in 7 here) after
    the work is done. Everything a rank writes is flushed and fsynced before this point."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
