"""A plan across two Slurm clusters, run as one job per cluster on two real local clusters.

``lab`` and ``lab2`` (fixture ``slurm_two_clusters``: own slurmctld, slurmd and ports, one slurmdbd) each
get the script of their ranks, submitted with their own ``SLURM_CONF``. The plan crosses the clusters both
ways: pipeline 0's stages sit in lab and lab2 (activations cross), pipeline 1 runs whole in lab2 (its
gradients meet pipeline 0's across). Rank 0 is in lab: its job publishes the rendezvous, lab2's ranks read
it. The trained parameters must equal megatron-core trained in one process on the same global batches.
"""
from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from sailor_hpc.core.checkpoint import step_dir
from sailor_hpc.jobs.layout import job_layout
from sailor_hpc.jobs.options import ClusterPart, JobOptions, Limits, Training
from sailor_hpc.jobs.render import cluster_submit_env, plan_clusters, render_job_script, write_job_script
from sailor_hpc.slurm.submit import log_path, submit_script
from sailor_hpc.slurm.watch import JobWatcher
from tests.jobs.conftest import cross_plan, two_lab_site
from tests.megatron_patch.conftest import ADAM, max_diff, ref_file, runtime_env, shipped_data  # noqa: F401 - fixtures

pytestmark = pytest.mark.slurm

STEPS = 3
PARAM_TOL = MOMENT_TOL = 1e-6  # the runtime's fp32 bound (tests/megatron_patch/test_exactness.py)


def test_plan_across_two_clusters_trains_to_the_single_process_reference(slurm_two_clusters, runtime_env,  # noqa: F811
                                                                          job_env, job_dir, ref_file):  # noqa: F811
    lab, lab2 = slurm_two_clusters
    site = two_lab_site(lab.lab, lab2.lab)
    plan = cross_plan(site, "a100", "a100_lab2")
    assert plan_clusters(plan, site) == ["lab", "lab2"]
    # every plan rank runs in exactly one cluster's job, under its plan number
    ranks = {c: job_layout(plan, [p.name for p in site.partitions if p.cluster == c]).task_ranks for c in ("lab", "lab2")}
    assert ranks == {"lab": (0,), "lab2": (1, 2)}
    plan_path = job_dir / "cross.json"
    plan.save(plan_path)
    rdzv = job_dir / f"rendezvous.{uuid.uuid4().hex}"
    save = job_dir / "ckpt"
    jobs: dict[str, tuple[str, dict[str, str]]] = {}
    logs: dict[str, Path] = {}
    for cluster in plan_clusters(plan, site):
        options = JobOptions(plan_path=plan_path, work=Training(runtime_env.data, save), steps=STEPS,
                             limits=Limits("00:10:00"), train_args=tuple(ADAM), requeue=False,
                             scope=ClusterPart(cluster, rdzv, rendezvous_wait_s=120), job_name=f"geo-{cluster}")
        script = render_job_script(plan, site, options)
        env = cluster_submit_env(site, cluster, job_env)
        rec = submit_script(write_job_script(job_dir / f"{cluster}.sh", script), env)
        jobs[cluster], logs[cluster] = (rec.job_id, env), Path(rec.log)
    for cluster, (job, env) in jobs.items():
        watcher = JobWatcher(env, poll_s=0.5)
        watcher.add([job])
        result = watcher.wait(timeout_s=240)
        text = {c: p.read_text()[-3000:] if p.exists() else "(no log)" for c, p in logs.items()}
        assert result.statuses[job].state == "COMPLETED", (cluster, result.statuses[job], text)
    # each job ran in its own cluster: sacct of lab2 knows lab2's job under lab2's name
    acct = lab2.sacct_once(["-n", "-X", "-P", "-j", jobs["lab2"][0], "-o", "jobname,partition,state"],
                           lambda out: out.endswith("|COMPLETED\n"))
    assert acct.split("\n")[0] == "geo-lab2|a100_lab2|COMPLETED", acct
    # both jobs are id 1 (ids are per cluster); each one's record still leads to its own log
    assert {c: log_path(j, env) for c, (j, env) in jobs.items()} == logs
    # lab2's ranks met at the address lab's job published
    addr, port = rdzv.read_text().split()
    assert f"rendezvous {addr}:{port}" in logs["lab2"].read_text() and f"rendezvous {addr}:{port}" in logs["lab"].read_text()
    diff = max_diff(step_dir(save, STEPS), ref_file(STEPS))
    print(f"\nplan across lab and lab2 (jobs {jobs['lab'][0]}, {jobs['lab2'][0]}) after {STEPS} steps: "
          f"max |delta| vs reference {diff}")
    assert diff["param"] <= PARAM_TOL
    assert diff["exp_avg"] <= MOMENT_TOL and diff["exp_avg_sq"] <= MOMENT_TOL
