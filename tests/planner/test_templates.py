"""A template's flush times are the simulator's own pipeline times for that pipeline, boundary by boundary
buffered or blocking as the runtime sends them (the planner ranks templates by these figures)."""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from planner.templates import TemplateBuilder, endpoints
from sailor_hpc.core.archive import open_archive
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from sailor_hpc.core.site import load_site
from simulator import SimOptions, StageEvaluator, simulate
from tests.planner.conftest import small_site

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("runtime", ["deepspeed-pipe", "megatron_patch"])
def test_template_flush_times_are_the_simulators_pipeline_times(runtime: str) -> None:
    site = load_site(REPO / "site_configs" / "a100-v100.toml")
    ev = StageEvaluator(open_archive(site=site), site, "OPT-350M", options=SimOptions(runtime=runtime))
    shapes = [(1, ((0, 8, 1), (9, 17, 2), (18, 25, 1))), (2, ((0, 12, 2), (13, 25, 2))),
              (1, ((0, 5, 4), (6, 12, 4), (13, 19, 4), (20, 25, 4)))]
    kinds = set()
    for part in site.partitions:
        builder = TemplateBuilder(ev, part, [1, 2, 4], max_stages=4, max_micro_batches=32)
        for mbs, stages in shapes:
            template = builder.finish(mbs, stages)
            costs = [ev.stage(part.gpu_type, tp, mbs, i, j) for i, j, tp in stages]
            ends = endpoints(stages, part)
            kinds.update(bool(a) for a in ev.exchanges(costs, ends).asynchronous)
            want = [float(ev.pipeline(costs, ends, m).makespan[0]) for m in range(1, len(template.flush) + 1)]
            np.testing.assert_allclose(template.flush, want, rtol=1e-12)
    if runtime == "deepspeed-pipe":  # TP-partitioned sends: the TP-4 boundaries fit NCCL's buffer, the rest not
        assert kinds == {True, False}


@pytest.mark.parametrize("gbs", [4, 8, 64])
def test_fit_checks_are_the_simulators_with_the_micro_batches_a_copy_can_run(tiny_archive, gbs: int) -> None:
    """Brute force: every split and TP vector of tiny-gpt on one V100-16 node, simulated whole as one pipeline
    running all ``gbs / mbs`` micro-batches (the most a copy of the template can run; the simulator holds
    ``min(P - s, m)`` in flight), fits exactly when the template builder keeps it. With fewer micro-batches
    than stages (gbs 4 and 8 at mbs 4) a deep stage holds m, not P - s: counting P - s threw fitting splits away."""
    site = small_site(a100_nodes=1, v100_nodes=1, gpus_per_node=8)
    options = SimOptions(runtime="megatron_patch")
    ev = StageEvaluator(tiny_archive, site, "tiny-gpt", options=options)
    part = site.partition("v100")
    mbs, tps, L = 4, [1, 2], 6
    builder = TemplateBuilder(ev, part, tps, max_stages=L, max_micro_batches=gbs)
    kept = {stages for m, stages in builder.enumerate_all([mbs], 10**6) if m == mbs}
    fits, counted_p_minus_s = set(), set()
    for P in range(1, L + 1):
        for cuts in itertools.combinations(range(1, L), P - 1):
            bounds = list(zip((0, *cuts), (*[c - 1 for c in cuts], L - 1)))
            for tp in itertools.product(tps, repeat=P):
                if sum(tp) > part.gpus_per_node:  # a job gets one node of the partition
                    continue
                stages = tuple((i, j, t) for (i, j), t in zip(bounds, tp))
                pipe = Pipeline(mbs, gbs // mbs, tuple(Stage(i, j, t, part.gpu_type, part.name) for i, j, t in stages))
                res = simulate(Plan("tiny-gpt", gbs, (pipe,)), site, tiny_archive, options=options)
                if res.fits:
                    fits.add(stages)
                # the old check: P - s in flight whatever the micro-batch count
                if all(builder._max_last(mbs, t, i, P - s) >= j for s, (i, j, t) in enumerate(stages)):
                    counted_p_minus_s.add(stages)
    assert kept == fits
    if gbs // mbs < L:
        assert counted_p_minus_s < fits  # the splits the old count lost: deep pipelines that fit
    else:
        assert counted_p_minus_s == fits
