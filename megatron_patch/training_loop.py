"""One rank's life under either runtime: join, build, wait for the gate, resume, train, save, stop.

``megatron_patch.launch`` and ``megatron_patch.ds_runtime.launch`` take the same arguments and write the same
events (:mod:`sailor_hpc.core.runtime_events`, one JSON line each, through the controller's codec) and the same
checkpoints; what differs between them is a :class:`Runtime`: how a rank joins (DeepSpeed's communication
backend), which trainer it builds, what its ``ready`` event says, the hooks around loading and saving
(DeepSpeed's sharded optimizer state) and whether it evaluates. Everything else is :func:`run`'s:

- SIGUSR1 or SIGTERM (Slurm's warning before the time limit): the current step finishes, every rank agrees to
  stop (the trainer's one all-reduce), a complete checkpoint is written to ``--save`` and the rank exits 75
  (``EXIT_SAVED_ON_SIGNAL``); 0 done, 2 bad input (a :class:`SailorError`, said on stderr).
- ``--wait-for FILE``: everything is built, then the rank waits for the file before it loads (a job that takes
  over from a running one is ready the moment that one has saved).
- ``--steps N`` is the step to reach: a resumed run continues from the checkpoint's step to N; the last step
  reached is saved, and every ``--save-interval`` steps.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from megatron_patch.dataset_files import check_dataset_files
from megatron_patch.memory import peak_rss
from megatron_patch.metrics import RunLog, open_tensorboard
from megatron_patch.options import check_layer_spec, check_train_args
from megatron_patch.rank_output import rank_output
from megatron_patch.resident import Kept
from sailor_hpc.core.checkpoint import Skipped, step_of
from sailor_hpc.core.dist_env import EXIT_BAD_INPUT, EXIT_DONE, EXIT_SAVED_ON_SIGNAL, DistEnv, read_env
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.paths import writable_dir, writable_file
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.resident import (
    Held,
    Seat,
    seat_of,
    store_ready_file,
    wait_directive,
    wait_for_file,
    write_held,
)
from sailor_hpc.core.roles import Role, role_of
from sailor_hpc.core.runtime_events import (
    LABEL_ENV,
    CheckpointSkipped,
    Done,
    Evaluated,
    Go,
    Loaded,
    Ready,
    RuntimeEvent,
    Saved,
    Signalled,
    Started,
    Stepped,
    Waiting,
    encode_event,
)
from sailor_hpc.core.training import DataBlend, check_dataset_prefix, eval_due, parse_split

if TYPE_CHECKING:  # torch: imported where a rank trains, never for --dry-run
    from megatron_patch.checkpoint_io import Checkpointed
    from megatron_patch.data import Samples
    from megatron_patch.engine import StepResult

    class Trainer(Checkpointed, Protocol):
        """What the loop uses of a runtime's trainer, beyond what a checkpoint reads and sets."""

        seq_len: int

        def train_step(self, stop_requested: bool = False) -> StepResult: ...

T = TypeVar("T", bound="Trainer")

_STOP: list[int] = []  # signals received (set by the handler, read at step boundaries)


def _on_signal(signum: int, _frame: Any) -> None:
    _STOP.append(signum)


def nothing(*_args: Any) -> None:
    """A :class:`Runtime` hook that has nothing to do."""


@dataclass(frozen=True)
class Runtime(Generic[T]):
    """What differs between the runtimes; each launch module has one."""

    name: str  # as a person names it in a message
    check: Callable[[argparse.Namespace, Plan], None]  # what it refuses before any rank starts
    prepare: Callable[[bool, DistEnv], None]  # before the process group (cuda?): warnings, environment
    device_id: bool  # NCCL: the process group binds the GPU (communicators built eagerly)
    joined: Callable[[Plan, bool], dict[str, Any]]  # after the process group: the start event's own fields
    build: Callable[[argparse.Namespace, Plan, Any, Samples, Samples | None], T]  # args, plan, device, data
    ready: Callable[[T, Samples | None], Ready]  # the ready event (its rank fields are the loop's)
    loaded: Callable[[T], None]  # after a checkpoint was loaded into the trainer
    before_save: Callable[[T], None]  # collective, before each checkpoint is written
    evaluate: Callable[[T, int], float] | None  # validation loss over N batches; None: --eval-interval refused
    fresh: Callable[[T], None] = nothing  # no checkpoint was loaded: a trainer built without its weights draws them


def emit(event: RuntimeEvent) -> None:
    """One JSON line in one write: ranks sharing a stdout file (torchrun's) never interleave a record and its
    newline, which ``print`` writes separately."""
    sys.stdout.write(encode_event(event) + "\n")
    sys.stdout.flush()


def role_record(role: Role, env: DistEnv) -> dict[str, Any]:
    """Where a rank trains: ``--dry-run``'s line, and the start event's fields."""
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


def _device(cuda: bool, local_rank: int) -> Any:
    """This rank's GPU (one per local rank), or the CPU."""
    import torch
    if not cuda:
        return torch.device("cpu")
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def _epoch_store(resident: Residency, env: DistEnv, timeout: datetime.timedelta) -> Any:
    """A rejoining world's rendezvous store: rank 0 listens first and says so, then the others connect."""
    from torch.distributed import TCPStore

    ready = store_ready_file(resident.root, resident.epoch)
    if env.rank == 0:
        store = TCPStore(env.master_addr, env.master_port, env.world_size, True, timeout=timeout,
                         wait_for_workers=False)
        ready.touch()
        return store
    wait_for_file(ready)
    return TCPStore(env.master_addr, env.master_port, env.world_size, False, timeout=timeout)


def _wait_for(path: str, where: dict[str, Any], poll_s: float = 0.05) -> None:
    """Block until ``path`` exists. Every rank polls by itself: the controller creates the file only once
    the job this one replaces is gone, so no two jobs ever write the checkpoint directory at once."""
    emit(Waiting(**where, path=path))
    t0 = time.perf_counter()
    while not os.path.exists(path):
        time.sleep(poll_s)
    emit(Go(**where, waited_s=time.perf_counter() - t0))


@dataclass
class Residency:
    """A resident rank's life so far (``--resident DIR``): where it meets the job agent, its seat, the epoch it
    trains in (0: as started; n: under the agent's n-th directive) and the state it kept from the last one."""

    root: Path
    seat: Seat
    epoch: int = 0
    kept: Kept | None = None
    data: dict[int, Any] = dataclasses.field(default_factory=dict)  # checked samples by sequence length


@dataclass(frozen=True)
class Interrupted:
    """A resident rank stopped training (a peer gone, or a signal it saved on) and holds."""

    held: Held
    kept: Kept | None


def train(args: argparse.Namespace, plan: Plan, env: DistEnv, role: Role, runtime: Runtime[T],
          resident: Residency | None = None) -> int | Interrupted:
    """Collective: train ``plan`` as this rank; the exit code (a resident rank: or why it holds)."""
    import torch

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    runtime.prepare(cuda, env)
    device = _device(cuda, env.local_rank)
    if args.tensorboard_dir:
        open_tensorboard(None)
    os.environ["MASTER_ADDR"] = env.master_addr
    os.environ["MASTER_PORT"] = str(env.master_port)
    if resident is None:
        return _train(args, plan, env, role, runtime, device, cuda, None)
    from megatron_patch.resident import Waker, abort_communication
    with Waker(resident.root, resident.epoch, gloo=not cuda):  # the agent's wake: a node lost whose connections stay open
        try:
            return _train(args, plan, env, role, runtime, device, cuda, resident)
        except RuntimeError as exc:  # a peer's connection closed (its node lost), timed out or woken: hold
            abort_communication()
            first = (str(exc).strip().splitlines() or [""])[0]
            return Interrupted(Held(epoch=resident.epoch, node=resident.seat.node, local=resident.seat.local,
                                    step=-1, saved=False, pid=os.getpid(),
                                    reason=f"{type(exc).__name__}: {first[:300]}"), None)


def _train(args: argparse.Namespace, plan: Plan, env: DistEnv, role: Role, runtime: Runtime[T], device: Any,
           cuda: bool, resident: Residency | None) -> int | Interrupted:
    import torch.distributed as dist
    timeout = datetime.timedelta(minutes=args.timeout_min)
    store = _epoch_store(resident, env, timeout) if resident is not None and resident.epoch > 0 else None
    dist.init_process_group("nccl" if cuda else "gloo", rank=env.rank, world_size=env.world_size, timeout=timeout,
                            device_id=device if cuda and runtime.device_id else None, store=store)
    from megatron_patch import checkpoint_io

    emit(Started(**role_record(role, env), device=str(device), plan_gpus=plan.num_gpus, **runtime.joined(plan, cuda),
                 pid=os.getpid(), epoch=resident.epoch if resident is not None else None))
    where: dict[str, Any] = {"rank": role.rank, "pipeline": role.pipeline, "stage": role.stage, "tp_rank": role.tp_rank}
    if resident is not None and plan.sequence_length in resident.data:  # checked and indexed once per process
        train_data, valid_data = resident.data[plan.sequence_length]
    else:
        train_data, valid_data = checked_data(args, plan, env.rank)
        if resident is not None:
            resident.data[plan.sequence_length] = (train_data, valid_data)
    trainer = runtime.build(args, plan, device, train_data, valid_data)
    metrics = args.metrics_file or (os.path.join(args.save, "metrics.jsonl") if args.save else None)
    log = RunLog(env.rank == 0, steps=args.steps, tokens_per_step=plan.global_batch_size * trainer.seq_len,
                 log_interval=args.log_interval, metrics_file=metrics, tensorboard_dir=args.tensorboard_dir,
                 predicted_s=plan.notes.get("simulator", {}).get("iteration_time_s"))
    emit(dataclasses.replace(runtime.ready(trainer, valid_data), **where))
    if args.wait_for and (resident is None or resident.epoch == 0):
        _wait_for(args.wait_for, where)
    kept = resident.kept if resident is not None else None
    path = None
    if args.load or (args.auto_resume and args.save):
        t0 = time.perf_counter()

        def skipped(gone: Skipped, using: str | None) -> None:  # rank 0: a fallback is said everywhere
            emit(CheckpointSkipped(**where, path=str(gone.path), reason=gone.reason, step=step_of(gone.path),
                                   using=using))
            log.note("checkpoint_skipped", f"warning: {gone.line(using, 'loading')}", **gone.to_dict(), using=using)

        path = checkpoint_io.load(trainer, args.load or args.save, missing_ok=args.load is None, on_skip=skipped,
                                  kept=kept)
        if path is not None:
            runtime.loaded(trainer)
            emit(Loaded(**where, path=path, step=trainer.step, consumed_samples=trainer.consumed_samples,
                        seconds=time.perf_counter() - t0, from_memory=len(kept.used) if kept else 0))
            log.note("resumed", f"resumed from step {trainer.step} ({path}; {trainer.consumed_samples} samples "
                     "consumed)", step=trainer.step, path=path, consumed_samples=trainer.consumed_samples)
    if path is None:
        runtime.fresh(trainer)

    def save() -> None:
        if args.save:
            t0 = time.perf_counter()
            runtime.before_save(trainer)
            path = checkpoint_io.save(trainer, args.save, keep=args.keep)
            seconds = time.perf_counter() - t0
            emit(Saved(**where, path=path, step=trainer.step, seconds=seconds))
            log.note("saved", f"saved step {trainer.step} ({path}, {seconds:.2f} s)", step=trainer.step, path=path,
                     seconds=seconds)

    def leave(code: int) -> int:
        log.close()
        dist.destroy_process_group()
        return code

    start_step = trainer.step
    while trainer.step < args.steps:
        res = trainer.train_step(stop_requested=bool(_STOP))
        grad_norm = None if res.skipped else res.grad_norm
        emit(Stepped(**where, step=res.step, loss=res.loss, lr=res.lr, grad_norm=grad_norm, skipped=res.skipped,
                     loss_scale=res.loss_scale, iter_s=res.seconds, sync_s=res.sync_seconds, **memory_record(device),
                     consumed_samples=trainer.consumed_samples, t=round(time.time(), 3)))
        log.train(res.step, res.loss, res.lr, grad_norm, res.seconds, trainer.consumed_samples)
        if res.stop and trainer.step < args.steps:
            emit(Signalled(**where, signals=list(_STOP), step=trainer.step))
            log.note("signal", f"stopping after step {trainer.step} on signal {', '.join(map(str, _STOP))}: "
                     "saving a checkpoint", step=trainer.step, signals=list(_STOP))
            save()
            if resident is not None:  # hold with this state: it is the checkpoint just written
                from megatron_patch.resident import abort_communication, kept_state
                log.close()
                held = Held(epoch=resident.epoch, node=resident.seat.node, local=resident.seat.local,
                            step=trainer.step, saved=bool(args.save), pid=os.getpid(),
                            reason=f"signal {', '.join(map(str, _STOP))}")
                mine = kept_state(trainer) if args.save else None
                abort_communication()
                return Interrupted(held, mine)
            return leave(EXIT_SAVED_ON_SIGNAL)
        if runtime.evaluate is not None and eval_due(trainer.step, args.eval_interval, args.steps):
            t0 = time.perf_counter()
            loss = runtime.evaluate(trainer, args.eval_iters)
            emit(Evaluated(**where, step=trainer.step, loss=loss, iters=args.eval_iters))
            log.evaluation(trainer.step, loss, args.eval_iters, time.perf_counter() - t0)
        if args.save_interval and trainer.step % args.save_interval == 0 and trainer.step < args.steps:
            save()
    if trainer.step != start_step:
        save()
    emit(Done(**where, step=trainer.step))
    log.note("done", f"done: step {trainer.step} of {args.steps}", step=trainer.step)
    return leave(EXIT_DONE)


def check_args(args: argparse.Namespace, runtime: Runtime[Any]) -> None:
    """What no runtime takes, refused on every rank before torch is imported and before anything is written:
    values out of range, options that would do nothing, datasets whose files disagree, paths that cannot be
    read or written (each tried: a file made and removed where a run writes)."""
    check_train_args(args)
    check_layer_spec(args.layer_spec)  # both runtimes build megatron's local modules
    if args.eval_interval and runtime.evaluate is None:
        raise SailorError(f"the {runtime.name} runtime does not evaluate", field="--eval-interval",
                          fix="drop --eval-interval, or train under megatron_patch")
    if args.dry_run:
        return
    if args.data is None:
        raise SailorError("--data is required to train", field="--data",
                          fix="build a dataset: python -m megatron_patch.data PREFIX")
    for prefix in DataBlend.parse(args.data).prefixes:
        check_dataset_prefix(prefix)
        check_dataset_files(prefix)
    for option, needs_save in (("--auto-resume", args.auto_resume), ("--save-interval", args.save_interval)):
        if needs_save and not args.save:  # it would be accepted and do nothing
            raise SailorError("does nothing without --save", field=option, fix=f"add --save DIR, or drop {option}")
    if args.save:  # not an OSError at the first save
        writable_dir(args.save, "--save")
    if args.load is not None and not os.path.isdir(args.load):
        raise SailorError("no checkpoint directory (or checkpoint root) here", file=args.load, field="--load",
                          fix="check the path: --load takes a step_* directory or the --save root holding them")
    if args.metrics_file:
        writable_file(args.metrics_file, "--metrics-file")
    if args.tensorboard_dir:
        writable_dir(args.tensorboard_dir, "--tensorboard-dir")
    if args.wait_for is not None:
        check_gate_path(args.wait_for)
    if args.resident is not None:
        writable_dir(args.resident, "--resident")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise SailorError("no CUDA device is visible to this process", field="--device",
                              fix="run on a GPU node (check CUDA_VISIBLE_DEVICES), or use --device cpu / auto")


def check_gate_path(path: str) -> None:
    """``--wait-for``: a file that can appear one day (the controller makes its folder when it opens the gate)."""
    target = Path(path).expanduser().absolute()
    if target.is_dir():
        raise SailorError("is a directory: the rank would never wait", file=target, field="--wait-for",
                          fix="give the path of the gate file (it need not exist yet)")
    existing = next(d for d in target.parents if d.exists())
    if not existing.is_dir():
        raise SailorError(f"can never exist: {existing} is a file", file=target, field="--wait-for",
                          fix="give a gate file path in a directory")


def run(args: argparse.Namespace, runtime: Runtime[Any]) -> int:
    """A launch module's main: ``--dry-run`` prints this rank's role as one JSON line (no torch), else it trains;
    bad input is said on stderr and exits 2."""
    # first: the default action kills. A launcher that saw another rank refuse its input stops this one with
    # SIGTERM; held until the checks end, this rank says its own refusal too (a valid one trains to its first
    # step, saves and exits 75, as on any signal)
    for signum in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(signum, _on_signal)
    try:
        check_args(args, runtime)
        env = read_env()
        rank_output(env.rank, label=bool(os.environ.get(LABEL_ENV)))
        plan = load_plan(args.plan, model=args.model)
        runtime.check(args, plan)
        role = role_of(plan, env.rank, env.world_size)
        if args.dry_run:
            print(json.dumps(role_record(role, env), sort_keys=True), flush=True)
            return EXIT_DONE
        if args.resident:
            return _resident(args, plan, env, role, runtime)
        out = train(args, plan, env, role, runtime)
        assert isinstance(out, int)
        return out
    except SailorError as exc:
        sys.stderr.write(f"error: {exc}\n")  # one write: ranks sharing a stderr never split each other's line
        sys.stderr.flush()
        _let_siblings_refuse()
        return EXIT_BAD_INPUT


def _resident(args: argparse.Namespace, plan: Plan, env: DistEnv, role: Role, runtime: Runtime[Any]) -> int:
    """Train plan after plan in this one process: each time training stops short (a peer gone, a signal saved
    on), say so to the job agent, take its next directive (a place in the new plan, or leave) and rejoin; the
    imports, the data's index and this rank's own state stay (:mod:`sailor_hpc.core.resident`)."""
    res = Residency(Path(args.resident), seat_of(os.environ, env.local_rank))
    while True:
        out = train(args, plan, env, role, runtime, res)
        if isinstance(out, int):
            return out
        sys.stderr.write(f"rank {env.rank} holds after step {out.held.step if out.held.saved else '?'}: "
                         f"{out.held.reason}\n")
        sys.stderr.flush()
        write_held(res.root, out.held)
        directive = wait_directive(res.root, res.epoch + 1)
        rank = directive.rank_of(res.seat) if directive.plan is not None else None
        if rank is None:
            return directive.exit_code
        assert directive.plan is not None
        plan = load_plan(directive.plan, model=args.model)
        env = dataclasses.replace(env, rank=rank, world_size=directive.world_size,
                                  master_addr=directive.master_addr, master_port=directive.master_port)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(directive.world_size))
        role = role_of(plan, rank, directive.world_size)
        args.plan = directive.plan
        if args.save:  # from now on the run's own newest checkpoint, never the one it started from
            args.load, args.auto_resume = None, True
        _STOP.clear()
        res = Residency(res.root, res.seat, directive.epoch, out.kept, res.data)


#: how long a rank that refused its input waits at most, under torchrun's agent (which stops every rank the
#: moment one exits), for the ranks started with it to reach their own checks (from there they hold the agent's
#: SIGTERM until they have said their refusal). Under srun, ``--wait`` gives them a minute.
SIBLING_GRACE_S = 30.0


def _let_siblings_refuse(poll_s: float = 0.05) -> None:
    """Under torchrun, mark this rank's refusal in its own folder of the agent's log folder and wait until every
    local rank has marked its own (or :data:`SIBLING_GRACE_S`): a loaded machine may still be starting a sibling
    when this rank is done, and the agent would kill it before it says anything. A valid sibling never marks:
    then this rank waits the whole grace, and the agent stops that sibling at its rendezvous."""
    world = os.environ.get("WORLD_SIZE", "1")
    if "TORCHELASTIC_RUN_ID" not in os.environ or not world.isdigit() or int(world) <= 1:
        return
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not error_file or not local.isdigit():  # no log folder to meet in: a fixed grace
        time.sleep(2.0)
        return
    mine = os.path.dirname(error_file)
    attempt = os.path.dirname(mine)
    try:
        open(os.path.join(mine, "refused"), "w").close()
    except OSError:
        time.sleep(2.0)
        return
    deadline = time.monotonic() + SIBLING_GRACE_S
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(attempt, str(i), "refused")) for i in range(int(local))):
            return
        time.sleep(poll_s)
