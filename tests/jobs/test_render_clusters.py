"""A job script is one Slurm job on the submitting cluster: plans across clusters, or on a cluster
reached by -M / its own SLURM_CONF, are refused with the reason (one job per cluster is not built yet)."""
from __future__ import annotations

from pathlib import Path

import pytest

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.placement import place_plan
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from sailor_hpc.jobs.render import render_job_script
from tests.simulator.conftest import two_cluster_site


def _plan(*partitions: str) -> Plan:
    site = two_cluster_site()
    gpu = {"p1": "G1", "p2": "G2"}
    stages = tuple(Stage(i * 3, i * 3 + 2, 1, gpu[p], p) for i, p in enumerate(partitions))
    return place_plan(Plan("tiny-gpt", 1, (Pipeline(1, 1, stages),)), site)


@pytest.mark.parametrize("parts, field, words", [
    (("p1", "p2"), "clusters", "spans clusters c1, c2"),
    (("p2", "p2"), "clusters[c2]", "reached by -M"),
])
def test_refused(tmp_path: Path, parts, field, words) -> None:
    with pytest.raises(SailorError) as info:
        render_job_script(_plan(*parts), two_cluster_site(), plan_path=tmp_path / "p.json", dry_run=True)
    assert info.value.field == field and words in str(info.value) and info.value.fix
