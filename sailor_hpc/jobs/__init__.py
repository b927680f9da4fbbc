"""Slurm jobs of a plan: render (sbatch_templates), submit, watch (het-aware), cancel, logs.

Attributes are imported lazily so that the per-rank wrapper (:mod:`sailor_hpc.jobs.rank_env`) does
not pay for Jinja2 on every rank.
"""
from __future__ import annotations

from typing import Any

_EXPORTS = {
    "render_job_script": "sailor_hpc.jobs.render",
    "write_job_script": "sailor_hpc.jobs.render",
    "job_layout": "sailor_hpc.jobs.layout",
    "JobLayout": "sailor_hpc.jobs.layout",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(name)
    import importlib
    return getattr(importlib.import_module(_EXPORTS[name]), name)
