"""``slurm_ops.cancel_and_wait`` on a real Slurm: the state it returns for a bundle that went on without one of
its jobs is the state of the jobs it kept, as the status the controller journals is (``events.without_ended_jobs``)."""
from __future__ import annotations

from sailor_hpc.controller import slurm_ops
from sailor_hpc.slurm.handle import SlurmCluster
from sailor_hpc.slurm.safety import BUNDLE_SEP


def test_a_bundle_cancelled_without_its_ended_job_ends_in_the_kept_jobs_state(slurm_cluster):
    # the V100 job ends by itself (FAILED, as a job whose batch node went down ends NODE_FAIL); the A100 job runs on
    ended = slurm_cluster.sbatch(["-p", "v100", "-w", "v100-1", "--gres=gpu:v100:1", "-o", "/dev/null",
                                  "--wrap", "exit 3"])
    kept = slurm_cluster.sbatch(["-p", "a100", "-w", "a100-1", "--gres=gpu:a100:1", "-o", "/dev/null",
                                 "--wrap", "sleep 300"])
    assert slurm_cluster.wait_job(ended) == ["FAILED"]
    job = SlurmCluster("", slurm_cluster.env).job(BUNDLE_SEP.join([ended, kept]))
    assert slurm_ops.cancel_and_wait(job, poll_s=0.2, grace_s=0.0, lost={"v100-1"}) == "CANCELLED"
    assert slurm_cluster.wait_job(kept) == ["CANCELLED"]
    # the whole bundle's aggregate (what it returned before) names the failure of the job it went on without
    assert slurm_ops.cancel_and_wait(job, poll_s=0.2) == "FAILED"
