"""The two constants the simulator estimates from measured runs, each by a fixed procedure, so that it can
be re-estimated without the run it is checked on (leave-one-out, ``benchmarks/simulator_accuracy.py``).

* ``replica_jitter`` (a partition's step-time variation, :mod:`simulator.iteration`): Sailor's runs
  record ``red_grads``, the seconds rank 0 spent in DeepSpeed's gradient reduction: the all-reduce plus
  the wait for the slowest of its D replicas. With the jitter off the simulator gives the all-reduce
  alone; the rest, over E[max of D standard normals] and the compute before the reduction, is one
  estimate. Runs with one replica, or whose ``red_grads`` is a copied value (over half the iteration),
  give none. The site's value is the median of its runs' estimates.
* ``allocator_slack`` (the share of the activation terms the caching allocator holds, :mod:`simulator.memory`):
  on the GPU that reports the peak, the measured bytes minus every other modelled term, over the
  activation terms. The simulator's value is the median over every run whose memory is kept.

Medians, not means: one run with an odd reading must not move the constant for the others.
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from sailor_hpc.core.archive import ProfileArchive
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.plan_io import load_run
from sailor_hpc.core.site import Site
from simulator.api import SimOptions, SimResult, plan_timeline
from simulator.iteration import expected_max_normal
from simulator.timeline import Timeline

DEEPSPEED = SimOptions.deepspeed_pipe()  # every calibration run was made by DeepSpeed's pipeline engine


def with_jitter(site: Site, jitter: float) -> Site:
    """The site with every partition's ``replica_jitter`` set to ``jitter``."""
    return replace(site, partitions=tuple(replace(p, replica_jitter=jitter) for p in site.partitions))


def stage0_reduction(plan: Plan, site: Site, archive: ProfileArchive) -> tuple[float, float]:
    """From the event-driven timeline: the seconds rank (0, 0) spends from being ready for its gradient
    all-reduces to their end (what ``red_grads`` times), and when it ended its pipeline work (flush)."""
    timeline: Timeline = plan_timeline(plan, site, archive, options=DEEPSPEED)
    events = [e for e in timeline.events if (e.pipeline, e.stage) == (0, 0)]
    grads = [e for e in events if e.kind == "grads"]
    ready = max(e.end for e in events if e.kind not in ("grads", "wait", "optimizer") and e.end <= grads[0].start)
    return grads[-1].end - ready, timeline.flush_times()[(0, 0)]


def jitter_estimate(path: str | Path, site: Site, model: str, archive: ProfileArchive) -> float | None:
    """One run's estimate of the replica jitter (None: the run cannot give one)."""
    run = load_run(path, model=model, site=site)
    D = len(run.plan.pipelines)
    if run.red_grads_s is None or run.real_s is None or D < 2 or run.red_grads_s > 0.5 * run.real_s:
        return None
    comm, flush = stage0_reduction(run.plan, with_jitter(site, 0.0), archive)
    return (run.red_grads_s - comm) / (flush * expected_max_normal(D))


def slack_estimate(result: SimResult, measured_bytes: float) -> float:
    """The allocator slack that makes the peak GPU's modelled memory equal ``measured_bytes``."""
    peak = max(result.stages, key=lambda s: s.memory.total)
    m = peak.memory
    return (measured_bytes - (m.total - m.allocator_slack)) / (m.activations + m.working)


def median_without(estimates: Mapping[str, float | None], key: str | None = None) -> float | None:
    """Median of the estimates, leaving out ``key``'s own (None when none is left)."""
    rest = [v for k, v in estimates.items() if v is not None and k != key]
    return statistics.median(rest) if rest else None


__all__ = ["DEEPSPEED", "jitter_estimate", "median_without", "slack_estimate", "stage0_reduction", "with_jitter"]
