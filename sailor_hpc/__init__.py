"""sailor-hpc: the shared data model (site, model catalog, plan, profile archive), errors, CLI and Slurm I/O.

The data model modules import none of the other top-level packages (simulator, planner, profiler,
megatron_patch); those packages speak this model.
"""
__version__ = "0.1.0"
