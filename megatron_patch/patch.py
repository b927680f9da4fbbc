"""The patch to megatron-core 0.16.1, in one place, change by change.

megatron-core 0.16.1 is the last release installable on Python 3.11 (0.17+ need 3.12). Its model code
already accepts explicit process groups (``pg_collection`` / ``tp_group``); what it lacks for
heterogeneous plans, and for running on CPU, is listed in :data:`CHANGES` and implemented here or in
the module named there. ``apply()`` checks the version first: every monkeypatch below is written
against 0.16.1's source and must be re-read before the pin moves.

=====  =========================================  ======  ==================================================
id     what                                       when    why
=====  =========================================  ======  ==================================================
P1     no ``initialize_model_parallel``; every    always  its groups are one homogeneous tp x pp x dp grid;
       group built from the plan and passed              a plan has several pipelines with their own stage
       explicitly (``megatron_patch.groups``)             counts and TP per stage
P2     ``parallel_state._set_global_memory_       always  DotProductAttention's scratch buffer is created by
       buffer()``                                          ``initialize_model_parallel`` only (P1 skips it)
P3     ``cross_entropy(logits, target, tp_group)``always  0.16.1's ``vocab_parallel_cross_entropy`` reads
       (backport of the >=0.17 ``tp_group=`` API)         the global TP group, which P1 never sets
P4     ``HeteroP2PCommunicator``                  always  ``P2PCommunicator`` pairs ranks of one pp group;
       (``megatron_patch.p2p``)                           stages with different TP have no such pairing
P5     ``StageGroup``: a pipeline's stage index   always  the 1F1B schedule only asks the pp group for
       and stage count as rank()/size()                   rank()/size(); a heterogeneous pipeline spans
                                                          TP groups of different sizes, so no real group fits
P6     padded vocabulary logits masked to -inf    always  the padded vocabulary depends on the TP degrees of
       (``megatron_patch.model``)                         the plan; masked, the loss and the trained weights
                                                          do not, so checkpoints move between plans exactly
P7     ``torch`` seen by the megatron modules in  CPU     they call ``torch.cuda.current_device()``,
       :data:`CPU_MODULES` is a proxy mapping             ``torch.cuda.synchronize()`` and create tensors
       CUDA devices/calls to the CPU                      with ``device="cuda"`` (schedules.py:2138)
P8     RNG tracker on the CPU generator           CPU     ``CudaRNGStatesTracker`` stores CUDA generator
       (``_get/_set_cuda_rng_state``)                     states (dropout regions fork it)
=====  =========================================  ======  ==================================================

P7/P8 are installed only in CPU mode (``apply(cpu=True)``); on GPU megatron runs unmodified apart from
P2 (a call) and the additions P3-P6, which are new code rather than changes to megatron's.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

MEGATRON_CORE_VERSION = "0.16.1"

CPU_MODULES = (
    "megatron.core.utils",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.random",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
)


@dataclass(frozen=True)
class Change:
    id: str
    mode: str  # "always" or "cpu"
    summary: str


CHANGES = (
    Change("P1", "always", "process groups from the plan, passed explicitly (megatron_patch.groups)"),
    Change("P2", "always", "parallel_state global memory buffer created without initialize_model_parallel"),
    Change("P3", "always", "vocab-parallel cross entropy with an explicit tp_group (patch.cross_entropy)"),
    Change("P4", "always", "stage-boundary communicator across TP mismatches (p2p.HeteroP2PCommunicator)"),
    Change("P5", "always", "virtual pipeline group for the 1F1B schedule (p2p.StageGroup)"),
    Change("P6", "always", "padded vocabulary logits masked (model.OutputLayer)"),
    Change("P7", "cpu", "torch proxy: CUDA devices and calls mapped to the CPU in " + ", ".join(CPU_MODULES)),
    Change("P8", "cpu", "megatron RNG tracker forks the CPU generator"),
)

_applied: set[str] = set()


def megatron_version() -> str:
    from megatron.core import package_info
    return f"{package_info.MAJOR}.{package_info.MINOR}.{package_info.PATCH}"


def check_version() -> None:
    found = megatron_version()
    if found != MEGATRON_CORE_VERSION:
        raise RuntimeError(f"megatron_patch is written against megatron-core {MEGATRON_CORE_VERSION}, found {found}; "
                           "re-check every change in megatron_patch/patch.py before moving the pin")


def apply(cpu: bool) -> list[str]:
    """Install the changes (idempotent); returns the ids installed by this process so far."""
    check_version()
    from megatron.core import parallel_state
    if "P2" not in _applied:
        if parallel_state._GLOBAL_MEMORY_BUFFER is None:
            parallel_state._set_global_memory_buffer()
        _applied.add("P2")
    if cpu and "P7" not in _applied:
        _install_cpu_torch()
        _applied.add("P7")
    if cpu and "P8" not in _applied:
        _install_cpu_rng()
        _applied.add("P8")
    return sorted(_applied)


# ---------------------------------------------------------------- P3: cross entropy with an explicit TP group

class _VocabParallelCrossEntropy(torch.autograd.Function):
    """0.16.1's ``_VocabParallelCrossEntropy`` with the TP group as an argument (no label smoothing)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, tp_group: Any) -> torch.Tensor:
        from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as V
        from megatron.core.tensor_parallel.utils import VocabUtility
        tp = dist.get_world_size(tp_group)
        logits, logits_max = V.calculate_logits_max(logits)
        if tp > 1:  # at TP 1 the reductions are identities
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp_group)
        part = logits.size(-1)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(part, dist.get_rank(tp_group), tp)
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = V.calculate_predicted_logits(
            logits, target, logits_max, start, end)
        if tp > 1:
            dist.all_reduce(predicted, op=dist.ReduceOp.SUM, group=tp_group)
            dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=tp_group)
        exp_logits, loss = V.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as V
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, update, grad_input = V.prepare_gradient_calculation_operands(softmax, target_mask)
        grad_input = V.calculate_gradients(grad_2d, arange_1d, masked_target_1d, update, grad_input, grad_output)
        return grad_input, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """Per-token loss [s, b] from vocab-parallel logits [s, b, V/tp] (P3)."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group)


# ---------------------------------------------------------------- P7: CUDA -> CPU inside megatron modules

def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int)  # a CUDA device index


class _CpuCuda:
    """What ``torch.cuda`` looks like to the patched modules in CPU mode."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(*_a: Any, **_k: Any) -> None:
        return None

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def get_rng_state(*_a: Any, **_k: Any) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


_FACTORIES = frozenset({"empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "empty_like",
                        "zeros_like", "ones_like"})


class _CpuTorch:
    """``torch`` as seen by a patched module: factories never land on a CUDA device, torch.cuda is _CpuCuda."""

    cuda = _CpuCuda()

    @functools.cache  # noqa: B019  (one proxy per process)
    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name not in _FACTORIES:
            return attr

        @functools.wraps(attr)
        def on_cpu(*args: Any, **kwargs: Any) -> Any:
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return attr(*args, **kwargs)
        return on_cpu


def cpu_torch_in(modules: tuple[str, ...]) -> None:
    """Give ``modules`` the P7 ``torch`` proxy (idempotent). Benchmarks use it for megatron modules
    the runtime does not run (its DDP and optimizer)."""
    for name in modules:
        mod = importlib.import_module(name)
        if isinstance(getattr(mod, "torch", None), _CpuTorch):
            continue
        if getattr(mod, "torch", None) is not torch:
            raise RuntimeError(f"{name}.torch is not torch: megatron-core changed, re-check patch P7")
        vars(mod)["torch"] = _PROXY  # a module's attributes are its namespace; the module type declares none


_PROXY = _CpuTorch()


def _install_cpu_torch() -> None:
    cpu_torch_in(CPU_MODULES)


# ---------------------------------------------------------------- P8: RNG tracker on the CPU generator

def _install_cpu_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    for fn in ("_get_cuda_rng_state", "_set_cuda_rng_state"):
        if not callable(getattr(mrandom, fn, None)):
            raise RuntimeError(f"megatron.core.tensor_parallel.random.{fn} is gone: re-check patch P8")
    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state


def seed_model_parallel_rng(seed: int, tp_rank: int) -> None:
    """Megatron's RNG tracker states for this rank, without parallel_state (uses P1's explicit tp_rank)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0, force_reset_rng=True)
