"""The local test cluster itself: GPUs in jobs, het jobs over both partitions, sacct."""
from __future__ import annotations

import pytest

from sailor_hpc.slurm.commands import sacct

pytestmark = pytest.mark.slurm


def _sacct_rows(cluster, job: str, want: int) -> list[list[str]]:
    """``sacct -X`` rows (JobID, Partition, State, AllocTRES) once ``want`` rows are in a final state."""
    def rows(out: str) -> list[list[str]]:
        return [line.split("|") for line in out.splitlines() if line.strip()]

    # a short job can first show up half-recorded (JobName "allocation", no Partition) until slurmctld's
    # job-start message reaches slurmdbd: wait for the partition as well
    out = cluster.sacct_once(["-n", "-P", "-X", "-j", job, "-o", "JobID,Partition,State,AllocTRES"],
                             lambda out: len(rows(out)) == want and all(
                                 r[2] not in ("PENDING", "RUNNING") and r[1] for r in rows(out)))
    return rows(out)


def test_nodes_idle_and_partitions(slurm_cluster):
    out = slurm_cluster.run(["sinfo", "-h", "-N", "-o", "%N %P %T %G"], check=True).stdout
    rows = sorted(line.split() for line in out.splitlines() if line.strip())
    assert [r[0] for r in rows] == ["a100-1", "a100-2", "v100-1", "v100-2"]
    assert {r[1] for r in rows} == {"a100*", "v100"}          # a100 is the default partition
    assert {r[3] for r in rows} == {"gpu:a100:4", "gpu:v100:8"}


def test_plain_job_gets_cuda_visible_devices(slurm_cluster):
    proc = slurm_cluster.run(["srun", "-p", "a100", "--gres=gpu:a100:2", "-c", "1",
                              "bash", "-c", 'echo "$SLURMD_NODENAME|$CUDA_VISIBLE_DEVICES|$SLURM_GPUS_ON_NODE"'],
                             timeout=60)
    assert proc.returncode == 0, proc.stderr
    node, cvd, n = proc.stdout.strip().split("|")
    assert node.startswith("a100-")
    assert len(cvd.split(",")) == 2 and n == "2", proc.stdout


def test_batch_job_gets_cuda_visible_devices(slurm_cluster):
    out = slurm_cluster.shared / "plain-%j.out"
    job = slurm_cluster.sbatch(["-p", "v100", "--gres=gpu:v100:3", "-o", str(out),
                                "--wrap", 'echo "cvd=$CUDA_VISIBLE_DEVICES node=$SLURMD_NODENAME"'])
    assert slurm_cluster.wait_job(job) == ["COMPLETED"]
    text = (slurm_cluster.shared / f"plain-{job}.out").read_text()
    assert "cvd=0,1,2 " in text and "node=v100-" in text, text


def test_het_job_runs_in_both_groups_and_sacct_completed(slurm_cluster):
    script = f"""#!/bin/bash
#SBATCH -J het-test
#SBATCH -o {slurm_cluster.shared}/het-%j.out
#SBATCH -p a100 -N 1 --gres=gpu:a100:2 -c 1
#SBATCH hetjob
#SBATCH -p v100 -N 2 --gres=gpu:v100:4 -c 1
echo "HET_SIZE=$SLURM_HET_SIZE"
srun --het-group=0,1 --label bash -c 'echo "node=$SLURMD_NODENAME cvd=$CUDA_VISIBLE_DEVICES"'
"""
    job = slurm_cluster.sbatch([], script)
    states = slurm_cluster.wait_job(job, timeout=90)
    text = (slurm_cluster.shared / f"het-{job}.out").read_text()
    assert states == ["COMPLETED", "COMPLETED"], text
    assert "HET_SIZE=2" in text, text
    seen = {}
    for line in text.splitlines():
        if "node=" in line:
            node = line.split("node=")[1].split()[0]
            seen[node] = line.split("cvd=")[1].strip()
    nodes = sorted(seen)
    assert len(nodes) == 3 and nodes[0].startswith("a100-") and nodes[1:] == ["v100-1", "v100-2"], text
    assert all(len(cvd.split(",")) == (2 if node.startswith("a100") else 4) for node, cvd in seen.items()), seen

    rows = _sacct_rows(slurm_cluster, job, want=2)
    assert sorted(r[0] for r in rows) == [f"{job}+0", f"{job}+1"], rows
    assert all(r[2] == "COMPLETED" for r in rows), rows
    tres = {r[1]: r[3] for r in rows}
    assert "gres/gpu:a100=2" in tres["a100"] and "gres/gpu:v100=8" in tres["v100"], tres


def test_failed_job_shows_failed_in_sacct_wrapper(slurm_cluster):
    job = slurm_cluster.sbatch(["-p", "v100", "--gres=gpu:v100:1", "-o", "/dev/null", "--wrap", "exit 3"])
    assert slurm_cluster.wait_job(job) == ["FAILED"]
    _sacct_rows(slurm_cluster, job, want=1)
    rows = [r for r in sacct(slurm_cluster.env, jobs=[job]) if not r.is_step]
    assert len(rows) == 1 and rows[0].base_state == "FAILED" and rows[0].exit_code == "3:0", rows
    assert rows[0].partition == "v100" and "gres/gpu:v100=1" in rows[0].alloc_tres


def test_a_bundle_of_plain_jobs_is_one_job_to_poll_signal_and_cancel(slurm_cluster):
    """Two plain jobs, one per partition, named as a bundle (``A,B``): its status has both as components in
    order, its components are theirs, and one ``cancel`` ends both; Slurm's own view (squeue) agrees."""
    import time

    from sailor_hpc.core.errors import SailorError
    from sailor_hpc.slurm.control import job_components
    from sailor_hpc.slurm.handle import SlurmCluster
    from sailor_hpc.slurm.safety import BUNDLE_SEP

    ids = [slurm_cluster.sbatch(["-p", p, "-w", f"{p}-1", f"--gres=gpu:{p}:1", "-o", "/dev/null", "--wrap",
                                 "sleep 300"]) for p in ("v100", "a100")]
    job = SlurmCluster("", slurm_cluster.env).job(BUNDLE_SEP.join(ids))
    deadline = time.monotonic() + 60
    while (status := job.status()).state != "RUNNING" or len(status.components) < 2 or any(
            c.state != "RUNNING" for c in status.components):
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
    assert [c.job_id for c in status.components] == ids and [c.partition for c in status.components] == ["v100", "a100"]
    assert [(c.job_id, c.partition, c.nodes) for c in job_components(job.id, slurm_cluster.env)] == [
        (ids[0], "v100", ["v100-1"]), (ids[1], "a100", ["a100-1"])]
    # one job ended alone (as Slurm ends one that loses its batch node): the bundle's other job still takes a signal
    # and a cancel, the ended one refusing both
    slurm_cluster.run(["scancel", ids[0]])
    assert slurm_cluster.wait_job(ids[0]) == ["CANCELLED"]
    job.signal("CONT")
    job.cancel()
    for j in ids:
        assert slurm_cluster.wait_job(j) == ["CANCELLED"]
    assert job.status().state == "CANCELLED"
    with pytest.raises(SailorError):  # no job of it runs
        job.signal("CONT")
