"""Entry point of the DeepSpeed runtime, one process per GPU (or CPU rank): ``megatron_patch.launch``'s arguments.

    python -m megatron_patch.ds_runtime.launch --plan plan.json --model M --data PREFIX --save DIR
                                               [--load DIR | --auto-resume] --steps N [optimizer options]

The plan must be one DeepSpeed's engine runs (``sailor-hpc plan --runtime deepspeed``; anything else
exits 2 with the reasons), its ZeRO stage in its notes. Checkpoints are megatron_patch's layout-free
ones: ``--load`` takes one written by either runtime, under any plan. Logs are the same JSON lines
(``start``, ``ready``, ``loaded``, ``step``, ``saved``, ``signal``, ``done``), rank 0's human lines and
metrics file too: the loop is :mod:`megatron_patch.training_loop`'s, this module its
:class:`~megatron_patch.training_loop.Runtime`. SIGUSR1/SIGTERM save and exit 75 as megatron_patch does.
Evaluation (``--eval-interval``) is megatron_patch's only.
"""
from __future__ import annotations

import argparse
import importlib
import os
import warnings
from typing import TYPE_CHECKING, Any

from megatron_patch.launch import exit_now, parser
from megatron_patch.options import TrainOptions, adam_from_args, schedule_from_args
from megatron_patch.training_loop import Runtime, run
from sailor_hpc.core.deepspeed_plan import check_engine_plan, zero_stage_of
from sailor_hpc.core.dist_env import DistEnv
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.runtime_events import Ready

if TYPE_CHECKING:  # torch and DeepSpeed: imported where a rank trains, never for --dry-run
    from megatron_patch.data import Samples
    from megatron_patch.ds_runtime.engine import DsTrainer


def _prepare(cuda: bool, env: DistEnv) -> None:
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|TransformerEngine).*")
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no probing for GPUs that are not there
    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))  # DeepSpeed's pipeline module reads it


def _without_shm_op() -> None:
    """On the CPU, DeepSpeed's communication backend builds its shared-memory all-reduce op with the host's
    C++ compiler when it starts: a compiler needed on every node, and minutes whenever torch's extension
    cache is cold or rebuilt (measured: 5 min for a launch on this busy 2-core host). Only its inference
    all-reduce uses the op; training's collectives are torch.distributed's, so it is started without it."""
    # by name: ``deepspeed.comm``'s attribute ``torch`` is torch itself, not this submodule
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    if not callable(getattr(ds_torch, "build_shm_op", None)):
        raise RuntimeError("deepspeed.comm.torch.build_shm_op is gone: DeepSpeed changed, re-check _without_shm_op")
    vars(ds_torch)["build_shm_op"] = lambda: None  # a module attribute: its namespace


def _joined(plan: Plan, cuda: bool) -> dict[str, Any]:
    """DeepSpeed's communication backend over the process group; the start event's fields."""
    import deepspeed
    if not cuda:
        _without_shm_op()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    return {"runtime": "deepspeed", "deepspeed": deepspeed.__version__, "zero_stage": zero_stage_of(plan)}


def _build(args: argparse.Namespace, plan: Plan, device: Any, train: Samples, valid: Samples | None) -> DsTrainer:
    from megatron_patch.ds_runtime.engine import DsTrainer
    opts = TrainOptions(adam=adam_from_args(args), seed=args.seed,
                        schedule=schedule_from_args(args, plan.global_batch_size, args.steps))
    return DsTrainer(plan, train, opts, device, valid=valid)


def _ready(trainer: DsTrainer, _valid: Samples | None) -> Ready:
    return Ready(params=sum(getattr(p, "ds_numel", p.numel()) for p in trainer.params.values()))


def _loaded(trainer: DsTrainer) -> None:
    trainer.resume_at(trainer.step, trainer.consumed_samples)


def _before_save(trainer: DsTrainer) -> None:
    trainer.save_state()


PROG = "python -m megatron_patch.ds_runtime.launch"
#: options of the shared parser that only megatron_patch's trainer reads (DeepSpeed keeps its own loss scale,
#: buckets and TF32 setting; its engine is built once per process, so it cannot rejoin as a resident rank): given
#: to this runtime, they would be accepted and do nothing
MEGATRON_PATCH_ONLY = ("--no-tf32", "--initial-loss-scale", "--loss-scale-window", "--min-loss-scale",
                       "--inject-overflow", "--grad-bucket-mb", "--grad-weighting", "--resident")


def _check(args: argparse.Namespace, plan: Plan) -> None:
    """Refuse megatron_patch's own options when given, then every reason DeepSpeed's engine cannot run ``plan``."""
    defaults = parser(PROG)
    for flag in MEGATRON_PATCH_ONLY:
        dest = flag.lstrip("-").replace("-", "_")
        if getattr(args, dest) != defaults.get_default(dest):
            raise SailorError("the DeepSpeed runtime does not use it", field=flag,
                              fix=f"drop {flag}, or train under megatron_patch (python -m megatron_patch.launch)")
    check_engine_plan(plan)


RUNTIME: Runtime[DsTrainer] = Runtime(
    name="DeepSpeed", check=_check,
    prepare=_prepare, device_id=False, joined=_joined, build=_build, ready=_ready, loaded=_loaded,
    before_save=_before_save, evaluate=None)


def main(argv: list[str] | None = None) -> int:
    return run(parser(PROG).parse_args(argv), RUNTIME)


if __name__ == "__main__":
    exit_now(main())
