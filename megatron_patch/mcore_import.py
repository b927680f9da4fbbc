"""Import megatron-core without building its ``torch.compile`` wrappers at import time.

megatron-core 0.16.1 sets ``megatron.core.jit.jit_fuser = torch.compile`` and decorates its fusion kernels
with it while its package imports. Building those wrappers imports dynamo and inductor: 1.6 s of CPU per
process (measured: ``import megatron.core`` 4.0 s -> 2.4 s user), paid by every rank, reference and data
tool, although on the CPU the fusions are off and the kernels never run. Through :func:`import_megatron`,
``jit_fuser`` is a decorator that calls the real ``torch.compile`` (same arguments) on a kernel's first
call instead: the same compiled function wherever a fusion runs (GPU), no dynamo where none does.
Every module of this package that imports megatron calls it first; ``torch.compile`` itself is restored.

megatron-core warns, once per module, that neither Transformer Engine nor Apex is installed and that it
falls back to torch: 4-6 lines on every rank of every command. This runtime uses neither by design (torch's
SDPA and AdamW), so those lines say nothing a user can act on and are filtered; any other warning shows.
"""
from __future__ import annotations

import functools
import inspect
import sys
import warnings
from collections.abc import Callable
from typing import Any


def deferred_compile(real: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile`` that compiles a function at its first call (modules and the rest: at once)."""

    def compile_later(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # @torch.compile(mode=...) form
            return lambda m: compile_later(m, **kwargs)
        if not inspect.isfunction(model):
            return real(model, **kwargs)
        compiled: list[Callable[..., Any]] = []

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **kw: Any) -> Any:
            if not compiled:
                compiled.append(real(model, **kwargs))
            return compiled[0](*args, **kw)
        return first_call_compiles
    return compile_later


# megatron's notices that it falls back to torch: "Transformer Engine and Apex are not installed", "Apex is
# not installed. Falling back to Torch Norm", ...
FALLBACK_NOTICE = ".*(Apex|Transformer Engine|TransformerEngine).*"


def quiet_fallback_notices() -> None:
    """Filter megatron's Transformer Engine / Apex fallback notices (why: module docstring), nothing else."""
    warnings.filterwarnings("ignore", message=FALLBACK_NOTICE, category=UserWarning)


def import_megatron() -> None:
    """Import ``megatron.core`` (once per process) with :func:`deferred_compile` as its ``jit_fuser``."""
    if "megatron.core" in sys.modules:
        return
    quiet_fallback_notices()
    import torch
    real = torch.compile
    torch.compile = deferred_compile(real)
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = real
