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
  seconds, peak memory: :func:`memory_record`), ``eval``, ``saved``, ``loaded``, ``signal``, ``done``. Rank 0 also writes
  human lines on stderr and a JSON-lines metrics file (``megatron_patch.metrics``).
- Before training, rank 0 checks every token id of the data against the model's vocabulary (exit 2
  naming the file, the id and its position).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

from megatron_patch.mcore_import import quiet_fallback_notices
from megatron_patch.memory import peak_rss
from megatron_patch.metrics import RunLog, open_tensorboard
from megatron_patch.options import (
    LAYER_SPECS,
    TrainOptions,
    adam_from_args,
    add_adam_args,
    add_flags,
    add_precision_args,
    check_layer_spec,
    check_train_args,
    schedule_from_args,
    with_precision_from_args,
)
from sailor_hpc.core.checkpoint import Skipped
from sailor_hpc.core.dist_env import EXIT_BAD_INPUT, EXIT_DONE, EXIT_SAVED_ON_SIGNAL, DistEnv, read_env
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.paths import writable_dir
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.roles import Role, role_of
from sailor_hpc.core.training import DATA_FLAGS, LOG_FLAGS, DataBlend, eval_due, parse_split

if TYPE_CHECKING:  # torch: imported where a rank trains, never for --dry-run
    from megatron_patch.data import Samples

_STOP: list[int] = []  # signals received (set by the handler, read at step boundaries)


def _on_signal(signum: int, _frame: Any) -> None:
    _STOP.append(signum)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m megatron_patch.launch",
                                 description="Train a plan with the heterogeneous megatron-core runtime.")
    ap.add_argument("--plan", required=True, help="plan JSON (sailor-hpc format)")
    ap.add_argument("--model", required=True, help="model name (must match the plan's)")
    ap.add_argument("--data", required=False, nargs="+",
                    help="indexed dataset prefix (PREFIX.bin/.idx), or a blend: W1 PREFIX1 W2 PREFIX2 ...")
    ap.add_argument("--save", help="checkpoint root directory")
    ap.add_argument("--load", help="checkpoint directory, or a root whose newest complete checkpoint is loaded")
    ap.add_argument("--auto-resume", action="store_true",
                    help="resume from the newest complete checkpoint in --save when there is one")
    ap.add_argument("--steps", type=int, required=True, help="train until this optimizer step")
    ap.add_argument("--save-interval", type=int, default=0, help="also save every K steps (0: only at the end)")
    ap.add_argument("--keep", type=int, default=3, help="complete checkpoints to keep")
    ap.add_argument("--dry-run", action="store_true", help="print this rank's role as JSON and exit")
    ap.add_argument("--seed", type=int, default=1234)
    add_adam_args(ap)
    add_flags(ap, DATA_FLAGS + LOG_FLAGS)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--layer-spec", choices=LAYER_SPECS, default="local",
                    help="megatron layer spec: local modules with SDPA attention (auto = local; te is refused)")
    add_precision_args(ap)
    ap.add_argument("--grad-bucket-mb", type=float, default=TrainOptions().grad_bucket_mb,
                    help="cap of a gradient all-reduce bucket in MB of fp32 (<= 0: one bucket per rank set)")
    ap.add_argument("--grad-weighting", choices=("samples", "uniform"), default="samples",
                    help=argparse.SUPPRESS)  # "uniform" is wrong on purpose: the tests' negative control
    ap.add_argument("--timeout-min", type=float, default=30.0, help="collective timeout (minutes)")
    ap.add_argument("--wait-for", default=None,
                    help="start everything, then wait until this file exists before loading the checkpoint: a job "
                         "that takes over from a running one is ready the moment that one has saved")
    return ap.parse_args(argv)


def emit(record: dict[str, Any]) -> None:
    """One JSON line in one write: ranks sharing a stdout file (torchrun's) never interleave a record and its
    newline, which ``print`` writes separately."""
    sys.stdout.write(json.dumps(record, sort_keys=True) + "\n")
    sys.stdout.flush()


def role_record(role: Role, env: DistEnv) -> dict[str, Any]:
    return {"rank": role.rank, "pipeline": role.pipeline, "stage": role.stage, "tp_rank": role.tp_rank,
            "tp": role.tp, "layers": role.layers, "gpu_type": role.gpu_type, "partition": role.partition,
            "host": env.host, "node": role.node, "local_gpu": role.local_gpu, "world_size": env.world_size,
            "local_rank": env.local_rank}


def _peak_memory(device: Any) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss()


def memory_record(device: Any) -> dict[str, int]:
    """The step event's memory fields (peaks since the process started).

    ``mem_bytes`` (kept for the readers that have it): ``max_memory_allocated`` on CUDA, peak RSS on the
    CPU. On CUDA also ``mem_allocated_bytes`` (``max_memory_allocated``: the simulator's ``peak_allocated``),
    ``mem_reserved_bytes`` (``max_memory_reserved``: the caching allocator's peak) and ``mem_device_bytes``:
    device memory in use at the step's end (total - free from ``mem_get_info``: every process's CUDA context,
    library workspaces and NCCL buffers included), plus ``mem_device_peak_bytes``, the peak reserved plus what
    is in use outside the allocator (in use - reserved now): the simulator's ``peak_device``. The CPU has
    no allocator statistics (torch's memory profiler measures them in the tests)."""
    import torch

    out = {"mem_bytes": _peak_memory(device)}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        in_use, reserved = int(total - free), int(torch.cuda.memory_reserved(device))
        peak_reserved = int(torch.cuda.max_memory_reserved(device))
        out.update(mem_allocated_bytes=int(torch.cuda.max_memory_allocated(device)), mem_reserved_bytes=peak_reserved,
                   mem_device_bytes=in_use, mem_device_peak_bytes=peak_reserved + in_use - reserved)
    return out


def checked_data(args: argparse.Namespace, plan: Plan, rank: int) -> tuple[Samples, Samples | None]:
    """Collective: train and valid samples of ``--data``, after rank 0 checked every token id against the
    model's vocabulary (one pass over the corpus, not one per rank); all ranks raise its error alike."""
    import torch.distributed as dist

    from megatron_patch.data import build_samples, check_vocab, train_split
    blend = DataBlend.parse(args.data)
    spec = plan.model_spec
    verdict: list[Any] = [None]
    if rank == 0:
        try:
            for prefix in blend.prefixes:
                check_vocab(prefix, spec.vocab_size, spec.name)
        except SailorError as exc:
            verdict = [exc]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise verdict[0]
    data = build_samples(blend, plan.sequence_length, args.seed, parse_split(args.split))
    if args.eval_interval and data["valid"] is None:  # found now, not at the first evaluation
        raise SailorError(f"--split {args.split} leaves no document of the data for validation", field="--split",
                          fix="give the valid split more weight, or drop --eval-interval")
    return train_split(data, args.split), data["valid"]


def train(args: argparse.Namespace, plan: Plan, env: DistEnv, role: Role) -> int:
    for signum in (signal.SIGUSR1, signal.SIGTERM):  # before anything slow: the default action kills
        signal.signal(signum, _on_signal)
    quiet_fallback_notices()
    import torch
    import torch.distributed as dist

    from megatron_patch import checkpoint_io, patch
    from megatron_patch.engine import Trainer

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if args.data is None:
        raise SailorError("--data is required to train", field="--data",
                          fix="build a dataset: python -m megatron_patch.data PREFIX")
    if args.tensorboard_dir:
        open_tensorboard(None)
    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=env.rank, world_size=env.world_size,
                            timeout=datetime.timedelta(minutes=args.timeout_min),
                            device_id=device if cuda else None)  # NCCL: communicators built eagerly
    base = {"rank": role.rank, "pipeline": role.pipeline, "stage": role.stage, "tp_rank": role.tp_rank}
    emit({"event": "start", **role_record(role, env), "device": str(device), "plan_gpus": plan.num_gpus})
    train_data, valid_data = checked_data(args, plan, env.rank)
    opts = TrainOptions(adam=adam_from_args(args), seed=args.seed, weighting=args.grad_weighting,
                        layer_spec=args.layer_spec, grad_bucket_mb=args.grad_bucket_mb,
                        schedule=schedule_from_args(args, plan.global_batch_size, args.steps))
    opts = with_precision_from_args(opts, args)
    trainer = Trainer(plan, train_data, opts, device, valid=valid_data)
    metrics = args.metrics_file or (os.path.join(args.save, "metrics.jsonl") if args.save else None)
    log = RunLog(env.rank == 0, steps=args.steps, tokens_per_step=plan.global_batch_size * trainer.seq_len,
                 log_interval=args.log_interval, metrics_file=metrics, tensorboard_dir=args.tensorboard_dir,
                 predicted_s=plan.notes.get("simulator", {}).get("iteration_time_s"))
    emit({"event": "ready", **base, "megatron_core": patch.megatron_version(), "patches": trainer.patches,
          "params": sum(p.numel() for p in trainer.params.values()), "sync_groups": trainer.sync.num_groups,
          "sync_buckets": len(trainer.sync.order), "tf32": trainer.tf32,
          "valid_samples": valid_data is not None})
    if args.wait_for:
        _wait_for(args.wait_for, base)
    resume = args.load is None and args.auto_resume and bool(args.save)
    if args.load or resume:
        t0 = time.perf_counter()

        def skipped(gone: Skipped, using: str | None) -> None:  # rank 0: a fallback is said everywhere
            emit({"event": "checkpoint_skipped", **base, **gone.to_dict(), "using": using})
            log.note("checkpoint_skipped", f"warning: {gone.line(using, 'loading')}", **gone.to_dict(), using=using)

        path = checkpoint_io.load(trainer, args.load or args.save, missing_ok=resume, on_skip=skipped)
        if path is not None:
            emit({"event": "loaded", **base, "path": path, "step": trainer.step,
                  "consumed_samples": trainer.consumed_samples, "seconds": time.perf_counter() - t0})
            log.note("resumed", f"resumed from step {trainer.step} ({path}; {trainer.consumed_samples} samples "
                     "consumed)", step=trainer.step, path=path, consumed_samples=trainer.consumed_samples)

    def save() -> None:
        if args.save:
            t0 = time.perf_counter()
            path = checkpoint_io.save(trainer, args.save, keep=args.keep)
            emit({"event": "saved", **base, "path": path, "step": trainer.step,
                  "seconds": time.perf_counter() - t0})

    start_step = trainer.step
    while trainer.step < args.steps:
        res = trainer.train_step(stop_requested=bool(_STOP))
        grad_norm = None if res.skipped else res.grad_norm
        emit({"event": "step", **base, "step": res.step, "loss": res.loss, "lr": res.lr, "grad_norm": grad_norm,
              "skipped": res.skipped, "loss_scale": res.loss_scale,
              "iter_s": res.seconds, "sync_s": res.sync_seconds, **memory_record(device),
              "consumed_samples": trainer.consumed_samples, "t": round(time.time(), 3)})
        log.train(res.step, res.loss, res.lr, grad_norm, res.seconds, trainer.consumed_samples)
        if res.stop and trainer.step < args.steps:
            emit({"event": "signal", **base, "signals": _STOP, "step": trainer.step})
            save()
            log.close()
            dist.destroy_process_group()
            return EXIT_SAVED_ON_SIGNAL
        if eval_due(trainer.step, args.eval_interval, args.steps):
            t0 = time.perf_counter()
            loss = trainer.evaluate(args.eval_iters)
            emit({"event": "eval", **base, "step": trainer.step, "loss": loss, "iters": args.eval_iters})
            log.evaluation(trainer.step, loss, args.eval_iters, time.perf_counter() - t0)
        if args.save_interval and trainer.step % args.save_interval == 0 and trainer.step < args.steps:
            save()
    if trainer.step != start_step:
        save()
    emit({"event": "done", **base, "step": trainer.step})
    log.close()
    dist.destroy_process_group()
    return EXIT_DONE


def _wait_for(path: str, base: dict[str, Any], poll_s: float = 0.05) -> None:
    """Block until ``path`` exists. Every rank polls by itself: the controller creates the file only once
    the job this one replaces is gone, so no two jobs ever write the checkpoint directory at once."""
    emit({"event": "waiting", **base, "for": path})
    t0 = time.perf_counter()
    while not os.path.exists(path):
        time.sleep(poll_s)
    emit({"event": "go", **base, "waited_s": time.perf_counter() - t0})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_layer_spec(args.layer_spec)
        check_train_args(args)
        if args.save and not args.dry_run:  # before any rank starts: not an OSError at the first save
            writable_dir(args.save, "--save")
        env = read_env()
        plan = load_plan(args.plan, model=args.model)
        role = role_of(plan, env.rank, env.world_size)
        if args.dry_run:
            emit(role_record(role, env))
            return EXIT_DONE
        return train(args, plan, env, role)
    except SailorError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown: c10d/gloo threads still owned by objects that Python frees
    at exit abort the process ("terminate called without an active exception", about 1 run in 7 here) after
    the work is done. Everything a rank writes is flushed and fsynced before this point."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
