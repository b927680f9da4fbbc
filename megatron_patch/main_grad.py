"""fp32 gradient accumulation across micro-batches (Megatron's ``main_grad``).

Why: with bf16/fp16 parameters autograd accumulates ``p.grad`` in the parameter's dtype, so the sum
over micro-batches loses bits at every addition (bf16 keeps 8 of them). As Megatron's DDP does, every
parameter gets an fp32 ``p.main_grad``; a hook that runs after each backward has accumulated into
``p.grad`` adds it to ``p.main_grad`` and frees ``p.grad``. Each micro-batch's gradient is thus rounded
to the parameter dtype once, and the sum is fp32. In fp32 the result is bit-identical to autograd's
own accumulation (0 + g1 = g1, then the same additions).

The contract with the gradient sync and the optimizer: after the backward passes (and after the
sync) every trainable parameter has ``p.main_grad``, fp32, p's shape; ``p.grad`` may be None.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["attach_main_grads", "main_grad_of", "zero_main_grads"]


def attach_main_grads(params: Mapping[str, torch.nn.Parameter], views: Mapping[str, torch.Tensor] | None = None,
                      on_accumulated: Callable[[str], None] | None = None) -> list[Any]:
    """Give every parameter an fp32 ``main_grad`` and the hook that accumulates into it.

    ``views``: fp32 tensors to use as the buffers (e.g. slices of a bucketed sync's flat buffer);
    missing names get zeros of their own. ``on_accumulated(name)`` runs after each accumulation
    (where an overlapped sync learns that a gradient is ready). Returns the hook handles.
    """
    handles = []
    for name, p in params.items():
        if not p.requires_grad:
            continue
        buf = views.get(name) if views is not None else None
        if buf is None:
            buf = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        elif buf.dtype != torch.float32 or buf.shape != p.shape:
            raise ValueError(f"{name}: main_grad view must be fp32 of shape {tuple(p.shape)}")
        _set_main_grad(p, buf)
        handles.append(p.register_post_accumulate_grad_hook(_accumulator(name, on_accumulated)))
    return handles


def _accumulator(name: str, on_accumulated: Callable[[str], None] | None) -> Callable[[torch.Tensor], None]:
    def hook(p: torch.Tensor) -> None:
        buf = main_grad_of(p)
        assert buf is not None and p.grad is not None, "the hook runs only on parameters attach_main_grads set up"
        buf.add_(p.grad)  # upcast inside add_: no fp32 copy of the gradient
        p.grad = None
        if on_accumulated is not None:
            on_accumulated(name)
    return hook


def zero_main_grads(params: Mapping[str, torch.nn.Parameter]) -> None:
    """Start the next step's accumulation (buffers are kept, as Megatron's grad buffers)."""
    for p in params.values():
        p.grad = None
        buf = main_grad_of(p)
        if buf is not None:
            buf.zero_()


def main_grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """``p.main_grad`` (None where :func:`attach_main_grads` gave it none). An accessor because torch's
    ``Tensor`` type does not declare the attribute that Megatron's convention adds to parameters."""
    buf = getattr(p, "main_grad", None)
    return buf if isinstance(buf, torch.Tensor) else None


def _set_main_grad(p: torch.Tensor, buf: torch.Tensor) -> None:
    p.main_grad = buf  # type: ignore[attr-defined]  # Megatron's attribute, unknown to torch's type
