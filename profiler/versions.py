"""Software and device versions for a measurement's provenance.

megatron-core's version is read from its installed metadata, not by importing it: the import costs
seconds of CPU (it pulls in torch.compile), which a network job's driver and benchmark ranks, which
never build a layer, would otherwise pay just to name the version.
"""
from __future__ import annotations

import subprocess
from importlib import metadata
from typing import Any


def versions() -> dict[str, Any]:
    """Device name, driver, CUDA, torch and megatron-core versions of this process."""
    import torch
    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        out["megatron_core"] = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        pass
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            out["driver"] = smi.stdout.split("\n")[0].strip() or None
        except (OSError, subprocess.TimeoutExpired):
            pass
    else:
        out["gpu"] = "cpu"
    return out
