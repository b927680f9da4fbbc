"""sailor-hpc: plan and run LLM training on the mixed GPU partitions of a SLURM site.

The package is layered (tests/test_architecture.py checks it): :mod:`sailor_hpc.core` is the data
model every other package speaks (site, model catalog, plan, profile archive, errors) and the torch-free
contract between job script, controller and runtime; :mod:`sailor_hpc.slurm` is all Slurm I/O;
:mod:`sailor_hpc.jobs` renders plans as sbatch jobs; :mod:`sailor_hpc.controller` re-plans and resizes
runs; :mod:`sailor_hpc.cli` is the thin command line on top.
"""
__version__ = "0.1.0"
