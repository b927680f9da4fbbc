"""Iteration time, throughput, peak memory and cost of heterogeneous training plans.

Public API (the planner and the CLI use only this; there is no other copy of the model):

Whole plans
    ``simulate(plan, site, archive=None, *, options=None) -> SimResult``
        ``options``: :class:`SimOptions`; ``SimOptions(runtime="megatron_patch" | "deepspeed-pipe")`` names the
        runtime that runs the plan (:mod:`simulator.runtimes`; default deepspeed-pipe, the runtime of Sailor's
        measured runs; the planner and ``sailor-hpc plan/simulate`` use megatron_patch).
        ``plan``: :class:`sailor_hpc.core.plan.Plan` (ours or a converted Sailor ``plan_config``; placed on
        ``site`` when it carries no placement). ``archive``: a :class:`sailor_hpc.core.archive.ProfileArchive`
        (default: ``open_archive(site=site)``). ``SimResult`` has ``iteration_time_s``,
        ``throughput_samples_per_s``, ``tokens_per_s``, ``peak_memory_bytes`` (max over GPUs),
        ``stages`` (per stage: compute, transfers, flush and end times, :class:`~simulator.memory.StageMemory`
        by component, capacity, ``fits``), ``stage_memory`` (list of bytes), ``memory_by_gpu_type()``,
        ``fits``, ``cost_per_iteration``, ``cost_per_hour`` (site units), ``breakdown`` and ``to_dict()``.
        Bad plans raise :class:`sailor_hpc.core.errors.SailorError`; a plan that overflows memory is
        evaluated and reported with ``fits = False``.
    ``plan_timeline(plan, site, archive=None) -> Timeline``
        Per-rank events of one iteration from the event-driven engine (``write_png``, ``write_json``).

Fast path (no Plan objects)
    ``StageEvaluator(archive, site, model, *, dtype="fp32", optimizer="adam", recompute=False, options=None)``
        ``.stage(gpu, tp, mbs, first, last) -> StageCost`` (fwd/bwd/update seconds, boundary bytes,
        parameters, gradient bytes; O(1) from prefix sums, cached);
        ``.stage_memory(cost, stage=s, num_stages=P, micro_batches=m) -> StageMemory``;
        ``.p2p(a, b, nbytes)``, ``.allreduce(holders, per_gpu_bytes, elem_bytes)`` on
        :class:`simulator.network.Endpoint` s;
        ``.pipeline(costs, ends, m) -> ScheduleResult`` (one pipeline);
        ``.iteration(costs, ends, micro_batches) -> IterationTiming`` (several pipelines, with the tied
        and per-layer gradient all-reduces and the optimizer steps: what ``simulate`` computes);
        ``.score_batch(CandidateBatch) -> BatchScores`` (N single pipelines as (N, P) arrays: times,
        per-stage memory, fits; about 50,000 8-stage candidates per second on one core,
        ``benchmarks/simulator_speed.py``);
        ``.exchanges(costs, ends) -> Exchanges`` (per boundary: activation and gradient seconds, buffered or not);
        ``.pipeline_times(F, B, act, grad, m, asynchronous)`` = :func:`simulator.schedule.pipeline_schedule` in
        the runtime's exchange order, the exact 1F1B schedule of N pipelines from per-stage numbers.

The model, module by module: :mod:`simulator.tables` (profiles as prefix sums), :mod:`simulator.network`
(stage-to-stage streams, ring all-reduces), :mod:`simulator.runtimes` (what each runtime does differently),
:mod:`simulator.schedule` (1F1B with blocking or buffered exchanges in each runtime's order, exact),
:mod:`simulator.iteration` (gradient syncs with the straggler wait, optimizer after the flush),
:mod:`simulator.memory`, :mod:`simulator.cost`, :mod:`simulator.timeline` (independent event-driven replay),
:mod:`simulator.validation` (measured runs), :mod:`simulator.calibration` (the constants estimated from
measured runs, and how). The CLI is ``sailor-hpc simulate`` / ``sailor-hpc validate-sim``.
"""
from simulator.api import (
                           BatchScores,
                           CandidateBatch,
                           IterationTiming,
                           SimOptions,
                           SimResult,
                           StageCost,
                           StageEvaluator,
                           StageReport,
                           plan_timeline,
                           simulate,
)
from simulator.network import Endpoint
from simulator.schedule import pipeline_schedule

__all__ = ["BatchScores", "CandidateBatch", "Endpoint", "IterationTiming", "SimOptions", "SimResult", "StageCost",
           "StageEvaluator", "StageReport", "pipeline_schedule", "plan_timeline", "simulate"]
