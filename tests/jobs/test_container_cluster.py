"""Jobs whose ranks run in a real container on the local Slurm cluster: Charliecloud's ``ch-run`` with an image
made from this host (tests/slurm/container_image.py), whose interpreter lives at ``/opt/venv/bin/python``, a
path that exists only inside the container. A job that gets anywhere with that interpreter ran its ranks in
the container; the same command on the site without a container is refused by the preflight probe.

- ``submit``: the preflight probe asks a node in the container, and the job trains tiny-gpt to the same
  parameters as megatron-core in one process (the runtime's fp32 bound);
- ``profile``: a compute point and a network link measured by ranks in the container (the network job's
  driver outside it, starting the benchmark's step).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from sailor_hpc.core.archive import read_archive
from sailor_hpc.core.checkpoint import step_dir
from sailor_hpc.core.site import load_site
from sailor_hpc.slurm.watch import JobWatcher
from tests.conftest import slurm_missing
from tests.jobs.conftest import LOCAL_LAB, cross_plan
from tests.megatron_patch.conftest import ADAM, max_diff, ref_file, runtime_env, shipped_data  # noqa: F401 - fixtures
from tests.slurm.container_image import PYTHON_INSIDE, local_lab_in_image, user_env, why_no_charliecloud

pytestmark = pytest.mark.slurm

STEPS = 3
PARAM_TOL = MOMENT_TOL = 1e-6  # the runtime's fp32 bound (tests/megatron_patch/test_exactness.py)


@pytest.fixture(scope="module")
def ch_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """local-lab with an ``[environment.container]`` of Charliecloud and the host image."""
    why = why_no_charliecloud()
    if why:
        slurm_missing(f"no container runtime for the container jobs: {why}")
    return local_lab_in_image(tmp_path_factory.mktemp("charliecloud"), tmp_path_factory.getbasetemp())


@pytest.fixture()
def ch_env(job_env: dict[str, str]) -> dict[str, str]:
    return {**job_env, **user_env()}


def test_a_container_job_trains_to_the_single_process_reference(slurm_cluster, ch_site, ch_env, job_dir,  # noqa: F811
                                                                runtime_env, ref_file):  # noqa: F811
    site = load_site(ch_site)
    plan = cross_plan(site, "a100", "a100")  # 3 ranks: a pipeline of 2 stages and a whole-model replica
    plan_path = job_dir / "plan.json"
    plan.save(plan_path)
    save = job_dir / "ckpt"
    args = [str(plan_path), "--python", PYTHON_INSIDE, "--data", runtime_env.data, "--save", str(save),
            "--steps", str(STEPS), "--time", "00:10:00", *ADAM]
    # the same job on the site without a container: the probe finds no such interpreter on the node
    bare = slurm_cluster.run(["sailor-hpc", "submit", "--site", str(LOCAL_LAB), *args], env=ch_env, timeout=180)
    assert bare.returncode == 2 and PYTHON_INSIDE in bare.stderr and "node of partition a100" in bare.stderr, bare.stderr
    t0 = time.monotonic()
    proc = slurm_cluster.run(["sailor-hpc", "submit", "--site", str(ch_site), *args], env=ch_env, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = proc.stdout.strip()
    watcher = JobWatcher(ch_env, poll_s=0.5)
    watcher.add([job])
    result = watcher.wait(timeout_s=300)
    log = slurm_cluster.run(["sailor-hpc", "logs", job], env=ch_env).stdout
    assert result.statuses[job].state == "COMPLETED", (result.statuses[job], log[-3000:])
    diff = max_diff(step_dir(save, STEPS), ref_file(STEPS))
    print(f"\ncharliecloud job {job}: {STEPS} steps in {time.monotonic() - t0:.1f} s, max |delta| vs reference {diff}")
    assert diff["param"] <= PARAM_TOL
    assert diff["exp_avg"] <= MOMENT_TOL and diff["exp_avg_sq"] <= MOMENT_TOL


def test_a_profiling_sweep_measures_in_the_container(slurm_cluster, ch_site, ch_env, tmp_path):
    archive = tmp_path / "cpu.h5"
    proc = slurm_cluster.run(["sailor-hpc", "profile", "--site", str(ch_site), "--model", "tiny-gpt", "--cpu",
                              "--python", PYTHON_INSIDE, "--archive", str(archive), "--folder", str(tmp_path / "jobs"),
                              "--partitions", "a100", "--mbs", "1", "--tp", "1", "--network", "intra",
                              "--net-senders", "2", "--iters", "3", "--warmup", "1", "--net-sizes", "16,18,20",
                              "--time", "10", "--poll", "0.2"], env=ch_env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    a = read_archive(archive)
    [point] = a.compute[("tiny-gpt", "cpu-A100-40", "fp32")].values()
    assert np.isfinite(point.times).all() and (point.times > 0).all()
    [link] = a.network["cpu-local-lab"]
    assert link.path == "network/cpu-local-lab/intra:a100:a100:2" and link.fit.max_gbps > 0
    assert link.provenance["torch"]  # rank 0 of the benchmark, in the container, named its torch
