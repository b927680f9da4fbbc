"""Training precisions: the dtypes a plan may train in, and which GPU types run them.

A plan has one dtype. ``bf16`` needs tensor cores of compute capability 8.0 or newer (Ampere, Hopper,
Ada, Blackwell; AMD CDNA2+); Volta and Turing (V100, T4, Titan RTX, RTX 20xx) train mixed precision in
``fp16`` with loss scaling instead. A site may override a GPU type's list (``dtypes`` under
``[gpu_types]``); otherwise it comes from the GPU type's name by :func:`default_dtypes`.
"""
from __future__ import annotations

import re

DTYPES = ("fp32", "bf16", "fp16")
# the order `--dtype auto` prefers: bf16 (no loss scaling, fp32's range), then fp16, then fp32
PREFERENCE = ("bf16", "fp16", "fp32")

_BF16_NAMES = re.compile(
    r"^(a100|a800|a10|a30|a40|a6000|h100|h200|h800|h20|gh|gb|b100|b200|l4|l40|rtx-?(30|40|50)\d\d|rtx-?a\d|mi2[05]0|mi3)",
    re.IGNORECASE)


def default_dtypes(gpu_type: str) -> tuple[str, ...]:
    """The dtypes a GPU type trains in, from its name (A100-40 -> fp32, bf16, fp16; V100-16 -> fp32, fp16)."""
    if _BF16_NAMES.match(gpu_type.replace("_", "-")):
        return DTYPES
    return ("fp32", "fp16")
