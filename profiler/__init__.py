"""Profiling sweeps that fill the shared profile archive from real measurements.

Per GPU type (partition): per-layer forward, backward and optimizer-step times of the layers
megatron_patch trains, memory per layer and the fixed per-GPU memory, over micro-batch sizes and TP
degrees (:mod:`profiler.compute`); bandwidth inside a node, between nodes and between partitions, with
the fit the simulator reads (:mod:`profiler.netbench`, :mod:`profiler.fit`). Jobs go through submitit
(:mod:`profiler.executors`, het jobs included); :mod:`profiler.sweep` submits, watches, records every
failure and resumes. CPU measurements are kept apart from GPU profiles (:mod:`profiler.keys`).

This package imports torch only inside the jobs (:mod:`profiler.compute`, :mod:`profiler.netbench`);
the driver runs on a login node without it.
"""
