"""Saving and loading checkpoints from a running plan (and in one process), the torch side.

Ownership: pipeline layer ``l`` is written by pipeline ``l % num_pipelines`` (spreading the writes),
by TP rank 0 of the stage holding it, after gathering the stage's TP shards; every tensor therefore
has exactly one writer. Tensors are stored full, fp32 (the optimizer's master copy) and with the real
vocabulary only (padding rows are zero by construction, P6), so any plan, or a single process, can
slice what it needs. Loading reads only the files of this rank's layers, and of those only the pages
of this rank's TP shard: files are memory-mapped (``torch.load(mmap=True)``) and read one at a time,
so a rank's resume memory is its shards plus at most one layer's shard pages, not its layers in full.
"""
from __future__ import annotations

import base64
import io
import itertools
import pickle
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from megatron_patch.data import ORDER
from megatron_patch.layout import ParamInfo, full_of, local_shape, shard_of
from megatron_patch.patch import megatron_version
from sailor_hpc.core import checkpoint as ck

if TYPE_CHECKING:
    from megatron_patch.options import TrainOptions
    from megatron_patch.precision import LossScaler
    from megatron_patch.resident import Kept
    from sailor_hpc.core.models import ModelSpec
    from sailor_hpc.core.plan import Plan
    from sailor_hpc.core.roles import Role


class OptimizerState(Protocol):
    """Adam's state by Megatron name, full precision, this rank's shards."""

    def state_of(self, name: str) -> dict[str, torch.Tensor]: ...

    def adam_steps(self) -> int: ...

    def load_state(self, name: str, param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   steps: int) -> None: ...


class Checkpointed(Protocol):
    """What :func:`save` reads and :func:`load` sets: megatron_patch's ``Trainer`` and the DeepSpeed runtime's
    ``DsTrainer`` alike, so a checkpoint moves between the two runtimes."""

    step: int
    consumed_samples: int
    rank: int
    world: int
    role: Role
    plan: Plan
    spec: ModelSpec
    opts: TrainOptions
    device: torch.device
    pgc: Any  # megatron's ProcessGroupCollection (untyped): its ``tp`` group
    layout: list[ParamInfo]
    infos: dict[str, ParamInfo]
    params: OrderedDict[str, torch.nn.Parameter]

    @property  # read-only: each runtime has its own optimizer and scaler types
    def optimizer(self) -> OptimizerState: ...
    @property
    def scaler(self) -> LossScaler | None: ...


FIELDS = ("param", "exp_avg", "exp_avg_sq")


def layer_file(layer: int) -> str:
    return f"layer_{layer:03d}.pt"


def write_layer(tmp: Path, layer: int, entries: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Write pipeline layer ``layer``'s entries (name -> {"param", ...} tensors) into the checkpoint being
    built in ``tmp``; returns its manifest record (size, checksum, layer)."""
    buf = io.BytesIO()
    torch.save(entries, buf)
    return {**ck.write_file(tmp / layer_file(layer), buf.getvalue()), "layer": layer}


def owner_pipeline(layer: int, num_pipelines: int) -> int:
    return layer % num_pipelines


def _trim(t: torch.Tensor, info: ParamInfo, vocab: int) -> torch.Tensor:
    return t if info.vocab_dim is None else t.narrow(info.vocab_dim, 0, vocab)


def stored_shard(t: torch.Tensor, info: ParamInfo, tp: int, tp_rank: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard of a stored tensor (real vocabulary only) in the plan's padded layout.

    Copies only the shard's elements (of a memory-mapped ``t``, only their pages are read); padding
    rows are zeros, created here rather than by padding the full tensor first."""
    if info.vocab_dim is None or t.shape[info.vocab_dim] == info.shape[info.vocab_dim]:
        return shard_of(t, info, tp, tp_rank)
    if info.vocab_dim != info.shard_dim or info.parts != 1:
        raise ValueError(f"{info.name}: a padded vocabulary must be the (single-part) shard dim")
    d = info.vocab_dim
    out = torch.zeros(local_shape(info, tp), dtype=t.dtype)
    start = tp_rank * out.shape[d]
    real = max(0, min(out.shape[d], t.shape[d] - start))
    if real:
        out.narrow(d, 0, real).copy_(t.narrow(d, start, real))
    return out


def rng_to_json() -> str:
    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


def rng_from_json(text: str) -> None:
    torch.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype=np.uint8).copy()))


def save(trainer: Checkpointed, root: str, keep: int = 3) -> str:
    """Collective over all ranks of the plan: write a complete checkpoint of the trainer's state."""
    t = trainer
    rank, role = t.rank, t.role
    tmp = ck.tmp_dir(root, t.step)
    if rank == 0:
        ck.start_tmp(root, t.step)
    dist.barrier()
    files: dict[str, dict[str, Any]] = {}
    params: dict[str, dict[str, Any]] = {}
    tp_group = t.pgc.tp
    n_pipes = len(t.plan.pipelines)
    vocab = t.spec.vocab_size
    for layer in role.layers:
        if owner_pipeline(layer, n_pipes) != role.pipeline:
            continue
        entries: dict[str, dict[str, torch.Tensor]] = {}
        for info in (i for i in t.layout if i.layer == layer):
            state = t.optimizer.state_of(info.name)
            full: dict[str, torch.Tensor] = {}
            for key in FIELDS:
                local = state[key].detach().float().contiguous()  # gathered on the device (NCCL needs it)
                if info.shard_dim is not None and role.tp > 1:
                    shards = [torch.empty_like(local) for _ in range(role.tp)]
                    dist.all_gather(shards, local, group=tp_group)
                    local = full_of(shards, info)
                full[key] = _trim(local, info, vocab).cpu().clone()
            entries[info.name] = full
            params[info.name] = {"file": layer_file(layer), "shape": list(full["param"].shape)}
        if role.tp_rank == 0:
            files[layer_file(layer)] = write_layer(tmp, layer, entries)
    gathered: list[Any] = [None] * t.world if rank == 0 else []
    dist.gather_object((files, params if role.tp_rank == 0 else {}), gathered if rank == 0 else None, dst=0)
    final = ""
    if rank == 0:
        all_files: dict[str, Any] = {}
        all_params: dict[str, Any] = {}
        for f, p in gathered:
            all_files.update(f)
            all_params.update(p)
        manifest = {
            "step": t.step, "consumed_samples": t.consumed_samples, "global_batch_size": t.plan.global_batch_size,
            "adam_steps": t.optimizer.adam_steps(), "seed": t.opts.seed, "data_order": ORDER, "model": t.spec.name,
            "vocab_size": vocab, "dtype": t.plan.dtype, "plan": t.plan.to_dict(),
            "megatron_core": megatron_version(), "torch": torch.__version__,
            "rng": {"torch_cpu": rng_to_json()}, "files": all_files, "params": all_params,
            "loss_scale": t.scaler.state() if t.scaler is not None else None,  # fp16; equal on all ranks
            # the schedule is a function of consumed_samples; stored to refuse a resume under another one
            "lr_schedule": t.opts.schedule.to_dict() if t.opts.schedule is not None else None,
        }
        final = str(ck.publish(tmp, manifest))
        ck.prune(root, keep)
    out = [final]
    dist.broadcast_object_list(out, src=0)
    return out[0]


_DAMAGED = "the checkpoint is damaged: delete this step_* directory (an older one is used) or restore it"
# what torch.load raised on damaged layer files in tests/fuzz (a truncated or flipped zip, pickle or tensor data)
_LOAD_ERRORS = (RuntimeError, pickle.UnpicklingError, UnicodeDecodeError)


def _load_layer(path: Path) -> Any:
    """A layer file's tensors, memory-mapped; a file torch cannot read is a CheckpointError naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except _LOAD_ERRORS as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ck.CheckpointError(f"layer file cannot be read ({type(exc).__name__}: {first[:200]})", file=path,
                                 fix=_DAMAGED) from None


class CheckpointReader:
    """Reads a verified checkpoint's tensors by Megatron name, one memory-mapped layer file at a time.

    Tensors are views of the mapped file: pages are read when touched, and released with the file,
    which is when another file is opened (one open file: a reader never holds a stage's layers)."""

    def __init__(self, path: str, deep: bool = True) -> None:
        self.choice = ck.choose(path, deep=deep)  # with the newer checkpoints passed over, for the caller to name
        assert self.choice.path is not None
        self.path = self.choice.path
        self.manifest = ck.read_manifest(self.path)
        self._open: tuple[str, dict[str, dict[str, torch.Tensor]]] | None = None

    def names(self) -> list[str]:
        return list(self.manifest["params"])

    def file_of(self, name: str) -> str:
        try:
            return self.manifest["params"][name]["file"]
        except KeyError:
            raise ck.CheckpointError(f"checkpoint has no parameter {name!r}", file=self.path) from None

    @property
    def fresh_optimizer(self) -> bool:
        """Weights without Adam state (an import, ``megatron_patch.hf_llama``): Adam starts afresh."""
        return self.manifest.get("optimizer_state", True) is False

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """``{"param", "exp_avg", "exp_avg_sq"}`` full fp32 tensors (real vocabulary only), memory-mapped.

        A checkpoint without optimizer state gives zero moments (with ``adam_steps`` 0: Adam's initial
        state, so resuming equals a fresh start from these weights), as stride-0 views of one zero."""
        fname = self.file_of(name)
        if self._open is None or self._open[0] != fname:
            self._open = None  # release the previous file's mapping first
            self._open = (fname, _load_layer(self.path / fname))
        entry = self._checked(self._open[1], name, self.path / fname)
        if self.fresh_optimizer:
            zeros = torch.zeros((), dtype=entry["param"].dtype).expand(entry["param"].shape)
            return {"param": entry["param"], "exp_avg": zeros, "exp_avg_sq": zeros}
        return entry

    def _checked(self, layer: Any, name: str, path: Path) -> dict[str, torch.Tensor]:
        """``name``'s fields in a loaded layer file: floating tensors of the manifest's shape. A file whose
        checksum matches can still hold something else (written by a bug, or loaded without the checks),
        and a resume would otherwise fail deep in the slicing with a shape error."""
        entry = layer.get(name) if isinstance(layer, dict) else None
        if not isinstance(entry, dict):
            raise ck.CheckpointError(f"layer file holds no parameter {name!r}", file=path, field=name, fix=_DAMAGED)
        shape = list(self.manifest["params"][name]["shape"])
        for key in ("param",) if self.fresh_optimizer else FIELDS:
            t = entry.get(key)
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or list(t.shape) != shape:
                got = f"a {t.dtype} tensor of shape {list(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)[:80]
                raise ck.CheckpointError(f"{key} is {got}, the manifest says a float tensor of shape {shape}",
                                         file=path, field=name, fix=_DAMAGED)
        return entry

    def shards(self, infos: Iterable[ParamInfo], tp: int,
               tp_rank: int) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """``(name, {field: TP shard})`` for ``infos``, file by file (each file mapped once, then released)."""
        for info in sorted(infos, key=lambda i: self.file_of(i.name)):
            full = self.tensors(info.name)
            yield info.name, {k: stored_shard(full[k], info, tp, tp_rank) for k in FIELDS}
        self._open = None

    def full_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every parameter, full (memory-mapped, every file stays mapped): what a single process needs."""
        return {n: self.tensors(n) for n in self.names()}


def _check_schedule(manifest: dict[str, Any], t: Checkpointed, path: object) -> None:
    """Refuse to continue a run under another learning-rate schedule (a resume or resize must pass the
    same schedule options; a checkpoint without one was trained at a constant rate)."""
    saved = manifest.get("lr_schedule")
    now = t.opts.schedule.to_dict() if t.opts.schedule is not None else None
    if saved is None or now is None or saved == now:
        return
    diff = ", ".join(f"{k} {saved.get(k)} -> {now.get(k)}" for k in sorted(now) if saved.get(k) != now.get(k))
    raise ck.CheckpointError(f"checkpoint was trained under another learning-rate schedule ({diff}; warm-up and "
                             "decay in samples)", file=path,
                             fix="resume with the run's schedule options (with --lr-decay-iters fixed when --steps "
                                 "changes), or start a new run")


def _warn_skipped(skipped: ck.Skipped, using: str | None) -> None:
    print(f"warning: {skipped.line(using, 'loading')}", file=sys.stderr, flush=True)


def load(trainer: Checkpointed, path: str, *, missing_ok: bool = False,
         on_skip: Callable[[ck.Skipped, str | None], None] = _warn_skipped, kept: Kept | None = None) -> str | None:
    """Collective: load a checkpoint written under any plan into this trainer's layout.

    Rank 0 alone picks it (the newest complete one under ``path``, every checksum verified once, not
    once per rank) and tells the others, so all ranks load the same one or all stop with the same
    error. ``missing_ok``: no checkpoint under ``path`` yet returns None (a fresh start). Every newer
    checkpoint passed over (torn, truncated, corrupt) goes to ``on_skip`` on rank 0 with the one loaded
    (None: none verifies), so a fallback to an older step is never silent; an explicit ``step_*`` path
    that does not verify is an error, never a fallback. ``kept``: a resident rank's own state of the step it
    saved, used for the shards it still trains when the checkpoint loaded is that step (the files otherwise)."""
    t = trainer
    decision: list[Any] = [None]
    if t.rank == 0:
        try:
            choice = ck.newest_usable(path) if missing_ok else ck.choose(path)
            decision = [("load", str(choice.path)) if choice.path is not None else ("fresh", "")]
            for skipped in choice.skipped:
                on_skip(skipped, None if choice.path is None else str(choice.path))
        except ck.CheckpointError as exc:
            decision = [("error", exc)]
    dist.broadcast_object_list(decision, src=0)
    what, arg = decision[0]
    if what == "error":
        raise arg
    if what == "fresh":
        return None
    reader = CheckpointReader(arg, deep=False)
    m = reader.manifest
    if m.get("model") != t.spec.name:
        raise ck.CheckpointError(f"checkpoint is for {m.get('model')}, not {t.spec.name}", file=reader.path)
    if "seed" in m and int(m["seed"]) != t.opts.seed:  # the data order is a permutation by (seed, epoch)
        raise ck.CheckpointError(f"checkpoint was trained with --seed {m['seed']}, this run has --seed {t.opts.seed}",
                                 file=reader.path, fix=f"resume with --seed {m['seed']} (another seed would repeat "
                                                       "and skip samples of the current epoch)")
    if m.get("data_order", "numpy-permutation") != ORDER:  # written before the order became a function
        raise ck.CheckpointError(f"checkpoint's sample order is {m.get('data_order', 'numpy-permutation')!r}, this "
                                 f"runtime's is {ORDER!r}", file=reader.path,
                                 fix="finish the run with the megatron_patch that wrote it, or start a new run "
                                     "(resuming would repeat and skip samples of the current epoch)")
    _check_schedule(m, t, reader.path)
    step = int(m["step"])
    in_memory: dict[str, dict[str, torch.Tensor]] = {}
    if kept is not None:
        kept.used.clear()
        for n in t.params:
            own = kept.shard(n, t.role.tp, t.role.tp_rank, t.params[n], step)
            if own is not None:
                in_memory[n] = own
    from_files = reader.shards((t.infos[n] for n in t.params if n not in in_memory), t.role.tp, t.role.tp_rank)
    for name, shard in itertools.chain(in_memory.items(), from_files):
        shard = {k: v.to(t.device) for k, v in shard.items()}
        t.optimizer.load_state(name, shard["param"], shard["exp_avg"], shard["exp_avg_sq"], int(m["adam_steps"]))
    if t.scaler is not None and m.get("loss_scale"):  # else (fp32/bf16 checkpoint): the initial scale
        t.scaler.load(m["loss_scale"])
    t.step = step
    t.consumed_samples = int(m["consumed_samples"])
    if "rng" in m:  # an imported checkpoint has none: the RNG stays as a fresh start seeds it
        rng_from_json(m["rng"]["torch_cpu"])
    return arg
