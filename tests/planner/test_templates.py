"""A template's flush times are the simulator's own pipeline times for that pipeline, boundary by boundary
buffered or blocking as the runtime sends them (the planner ranks templates by these figures)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from planner.templates import TemplateBuilder, endpoints
from sailor_hpc.core.archive import open_archive
from sailor_hpc.core.site import load_site
from simulator import SimOptions, StageEvaluator

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
