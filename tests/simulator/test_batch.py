"""The planner's vectorised path gives the same numbers as simulate() on the same pipelines."""
from __future__ import annotations

import numpy as np
import pytest

from sailor_hpc.core.plan import Pipeline, Plan, Stage
from simulator import StageEvaluator, simulate
from simulator.api import CandidateBatch


@pytest.mark.parametrize("recompute", [False, True])
def test_score_batch_equals_simulate(a100v100, sailor_archive, recompute: bool):
    rng = np.random.default_rng(1)
    kinds = [(g, tp, p) for g, p in (("A100-40", "a100"), ("V100-16", "v100")) for tp in (1, 2, 4)]
    ev = StageEvaluator(sailor_archive, a100v100, "GPT-Neo-2.7B", recompute=recompute)
    N, P, L = 12, 4, 34
    first, last, kind = [], [], []
    for _ in range(N):
        cuts = np.sort(rng.choice(np.arange(1, L), P - 1, replace=False))
        b = [0, *cuts, L]
        first.append(b[:-1])
        last.append([x - 1 for x in b[1:]])
        kind.append(rng.integers(0, len(kinds), P))
    m = rng.integers(2, 40, N)
    results, same = [], []
    for i in range(N):
        stages = tuple(Stage(int(first[i][s]), int(last[i][s]), kinds[kind[i][s]][1], kinds[kind[i][s]][0])
                       for s in range(P))
        res = simulate(Plan("GPT-Neo-2.7B", 2 * int(m[i]), (Pipeline(2, int(m[i]), stages),), recompute=recompute),
                       a100v100, sailor_archive)
        placed = res.plan.pipelines[0].stages  # simulate() packs TP groups onto nodes
        same.append([placed[j].partition == placed[j + 1].partition and placed[j].placement.node ==
                     placed[j + 1].placement.node for j in range(P - 1)])
        results.append(res)
    assert any(map(any, same)) and not all(map(all, same))  # both kinds of boundaries occur
    scores = ev.score_batch(CandidateBatch(mbs=2, micro_batches=m, first=np.array(first), last=np.array(last),
                                           kind=np.array(kind), stage_kinds=kinds, same_node=np.array(same)))
    for i, res in enumerate(results):
        # the batch path leaves gradient collectives to the caller (a single pipeline has only the tied one)
        assert scores.time_s[i] == pytest.approx(max(s.flush_s + s.update_s for s in res.stages), rel=1e-12)
        assert res.iteration_time_s >= scores.time_s[i]
        assert scores.flush[i] == pytest.approx([s.flush_s for s in res.stages], rel=1e-12)
        assert scores.memory[i] == pytest.approx([s.memory.total for s in res.stages], rel=1e-12)
        assert bool(scores.fits[i]) == res.fits
