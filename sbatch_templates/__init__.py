"""Jinja2 templates of the job scripts sailor-hpc submits (``*.j2``, shipped as package data).

The templates only lay values out; :mod:`sailor_hpc.jobs.render` validates and quotes every value
before it reaches them (see README.md in this directory for the contract between the script, the
plan and the runtime).
"""
from __future__ import annotations

from pathlib import Path

TEMPLATE_DIR = Path(__file__).resolve().parent
TRAIN_TEMPLATE = "train.sbatch.j2"
