"""Entry point of the DeepSpeed runtime, one process per GPU (or CPU rank): ``megatron_patch.launch``'s arguments.

    python -m megatron_patch.ds_runtime.launch --plan plan.json --model M --data PREFIX --save DIR
                                               [--load DIR | --auto-resume] --steps N [optimizer options]

The plan must be one DeepSpeed's engine runs (``sailor-hpc plan --runtime deepspeed``; anything else
exits 2 with the reasons), its ZeRO stage in its notes. Checkpoints are megatron_patch's layout-free
ones: ``--load`` takes one written by either runtime, under any plan. Logs are the same JSON lines
(``start``, ``ready``, ``loaded``, ``step``, ``saved``, ``signal``, ``done``); SIGUSR1/SIGTERM save and
exit 75 as megatron_patch does. Evaluation (``--eval-interval``) is megatron_patch's only.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import os
import signal
import sys
import time
import warnings
from typing import Any

from megatron_patch.launch import _wait_for, checked_data, emit, exit_now, memory_record, parse_args, role_record
from megatron_patch.options import TrainOptions, adam_from_args, check_train_args, schedule_from_args
from sailor_hpc.core.deepspeed_plan import check_engine_plan, zero_stage_of
from sailor_hpc.core.dist_env import EXIT_BAD_INPUT, EXIT_DONE, EXIT_SAVED_ON_SIGNAL, DistEnv, read_env
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.paths import writable_dir
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.roles import Role, role_of

_STOP: list[int] = []


def _on_signal(signum: int, _frame: Any) -> None:
    _STOP.append(signum)


def _device(cuda: bool, local_rank: int) -> Any:
    """This rank's GPU (one per local rank), or the CPU."""
    import torch
    if not cuda:
        return torch.device("cpu")
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


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


def train(args: argparse.Namespace, plan: Plan, env: DistEnv, role: Role) -> int:
    for signum in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(signum, _on_signal)
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|TransformerEngine).*")
    import torch
    import torch.distributed as dist

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no probing for GPUs that are not there
    from megatron_patch import checkpoint_io
    from megatron_patch.ds_runtime.engine import DsTrainer

    device = _device(cuda, env.local_rank)
    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))  # DeepSpeed's pipeline module reads it
    dist.init_process_group("nccl" if cuda else "gloo", rank=env.rank, world_size=env.world_size,
                            timeout=datetime.timedelta(minutes=args.timeout_min))
    import deepspeed
    if not cuda:
        _without_shm_op()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    base = {"rank": role.rank, "pipeline": role.pipeline, "stage": role.stage, "tp_rank": role.tp_rank}
    emit({"event": "start", **role_record(role, env), "device": str(device), "plan_gpus": plan.num_gpus,
          "runtime": "deepspeed", "deepspeed": deepspeed.__version__, "zero_stage": zero_stage_of(plan)})
    train_data, valid_data = checked_data(args, plan, env.rank)
    opts = TrainOptions(adam=adam_from_args(args), seed=args.seed,
                        schedule=schedule_from_args(args, plan.global_batch_size, args.steps))
    trainer = DsTrainer(plan, train_data, opts, device, valid=valid_data)
    emit({"event": "ready", **base, "params": sum(getattr(p, "ds_numel", p.numel()) for p in trainer.params.values())})
    if args.wait_for:  # a job started beside the one it replaces (the controller's grow): load only once that is gone
        _wait_for(args.wait_for, base)
    if args.load or (args.auto_resume and args.save):
        t0 = time.perf_counter()
        path = checkpoint_io.load(trainer, args.load or args.save, missing_ok=args.load is None)
        if path is not None:
            trainer.resume_at(trainer.step, trainer.consumed_samples)
            emit({"event": "loaded", **base, "path": path, "step": trainer.step,
                  "consumed_samples": trainer.consumed_samples, "seconds": time.perf_counter() - t0})

    def save() -> None:
        if args.save:
            t0 = time.perf_counter()
            trainer.save_state()
            path = checkpoint_io.save(trainer, args.save, keep=args.keep)
            emit({"event": "saved", **base, "path": path, "step": trainer.step, "seconds": time.perf_counter() - t0})

    start_step = trainer.step
    while trainer.step < args.steps:
        res = trainer.train_step(stop_requested=bool(_STOP))
        emit({"event": "step", **base, "step": res.step, "loss": res.loss, "lr": res.lr, "grad_norm": res.grad_norm,
              "iter_s": res.seconds, **memory_record(device), "consumed_samples": trainer.consumed_samples,
              "t": round(time.time(), 3)})
        if res.stop and trainer.step < args.steps:
            emit({"event": "signal", **base, "signals": _STOP, "step": trainer.step})
            save()
            dist.destroy_process_group()
            return EXIT_SAVED_ON_SIGNAL
        periodic = bool(args.save_interval) and trainer.step % args.save_interval == 0
        if periodic or (trainer.step == args.steps and trainer.step != start_step):  # and the last step's state
            save()
    emit({"event": "done", **base, "step": trainer.step})
    dist.destroy_process_group()
    return EXIT_DONE


def check_args(args: argparse.Namespace) -> None:
    """What this runtime refuses before any rank starts (bad values, no data, evaluation, an unwritable --save)."""
    check_train_args(args)
    if args.data is None and not args.dry_run:
        raise SailorError("--data is required to train", field="--data",
                          fix="build a dataset: python -m megatron_patch.data PREFIX")
    if args.eval_interval:
        raise SailorError("the DeepSpeed runtime does not evaluate", field="--eval-interval",
                          fix="drop --eval-interval, or train under megatron_patch")
    if args.save and not args.dry_run:
        writable_dir(args.save, "--save")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
        env = read_env()
        plan = load_plan(args.plan, model=args.model)
        check_engine_plan(plan)  # exit 2 with every reason DeepSpeed cannot run it
        role = role_of(plan, env.rank, env.world_size)
        if not args.dry_run:
            return train(args, plan, env, role)
        emit(role_record(role, env))
        return EXIT_DONE
    except SailorError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    exit_now(main())
