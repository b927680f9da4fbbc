"""Fixtures of the runs across two real local Slurm clusters (test_cosched_clusters.py, test_geo_outage_cluster.py)."""
from __future__ import annotations

import os

import pytest

from tests.jobs.conftest import REPO


@pytest.fixture(scope="module")
def job_env_two(slurm_two_clusters, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The first cluster's environment, with this checkout importable on the compute nodes (both clusters'
    jobs get their own SLURM_CONF from the site when submitted)."""
    lab, _ = slurm_two_clusters
    env = dict(lab.env)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["SAILOR_HPC_STATE_DIR"] = str(tmp_path_factory.mktemp("records"))
    return env
