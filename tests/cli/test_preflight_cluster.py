"""Checks before a job is queued, on the real local cluster: every refusal happens before ``sbatch`` (no new job
in squeue or sacct, no file written), for ``submit``, ``run`` and ``profile``; a render-only command warns about
an interpreter without torch instead."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from sailor_hpc.core.checkpoint import FORMAT, MANIFEST, VERSION, step_dir
from sailor_hpc.core.toml_writer import dump_toml
from tests.data.tiny_archive import write_tiny_archive
from tests.jobs.conftest import LOCAL_LAB, write_plan

pytestmark = pytest.mark.slurm

def _jobs(cluster) -> set[str]:
    """Every job id squeue or sacct knows, of any user and state, but the pre-queue check's own probes (a one-task
    job that asks a compute node about an interpreter this machine does not see)."""
    queued = cluster.run(["squeue", "-h", "-t", "all", "-o", "%i %j"], check=True).stdout.splitlines()
    accounted = cluster.run(["sacct", "-a", "-X", "-n", "-P", "-o", "JobID,JobName", "-S", "now-2hours"], check=True)
    rows = [line.replace("|", " ").split() for line in [*queued, *accounted.stdout.splitlines()]]
    return {row[0] for row in rows if row and row[1:] != ["sailor-preflight"]}


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


def _refused(cluster, env, root: Path, *args: str, code: int = 2) -> str:
    """Run ``sailor-hpc ARGS`` in ``root``; it must exit ``code`` having queued and written nothing."""
    before_jobs, before_files = _jobs(cluster), _files(root)
    proc = cluster.run(["sailor-hpc", *args], env=env, cwd=root)
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out
    assert _files(root) == before_files, sorted(map(str, _files(root) - before_files))
    # nothing queued: no job id that was not there before (a finished job of another test may leave squeue meanwhile)
    assert not _jobs(cluster) - before_jobs, sorted(_jobs(cluster) - before_jobs)
    return out


def _manifest(root: Path, model: str, step: int = 5) -> Path:
    """A complete (empty) checkpoint of ``model`` under ``root``, as the runtime's manifest names it."""
    path = step_dir(root, step)
    path.mkdir(parents=True)
    (path / MANIFEST).write_text(json.dumps({"format": FORMAT, "version": VERSION, "step": step,
                                             "consumed_samples": 8 * step, "model": model, "files": {},
                                             "params": {}}))
    return path


@pytest.fixture()
def env(slurm_cluster, tmp_path: Path) -> dict[str, str]:
    out = dict(slurm_cluster.env)
    out["SAILOR_HPC_STATE_DIR"] = str(tmp_path / "job-records")
    return out


@pytest.fixture()
def work(tmp_path: Path) -> Path:
    root = tmp_path / "work"
    root.mkdir()
    for suffix in (".bin", ".idx"):
        (root / f"data{suffix}").write_bytes(b"")
    return root


def _extra_partition_site(directory: Path) -> Path:
    import tomllib

    doc = tomllib.loads(LOCAL_LAB.read_text())
    doc["partitions"].append({**doc["partitions"][0], "name": "h100x"})
    path = directory / "site-h100x.toml"
    path.write_text(dump_toml(doc))
    return path


def test_submit_refuses_before_sbatch(slurm_cluster, env, work: Path, tmp_path: Path, bare_python: Path):
    plan = write_plan(work, "a100-only")
    submit = ["submit", str(plan), "--site", str(LOCAL_LAB), "--data", str(work / "data"),
              "--save", str(work / "ckpt"), "--script", str(work / "job.sbatch")]
    # Slurm's client tools not on PATH: named, with the fix
    bare = {"PATH": str(Path(shutil.which("sailor-hpc", path=env["PATH"]) or sys.executable).parent)}
    out = _refused(slurm_cluster, bare, work, *submit)
    assert "Slurm command 'sbatch' not found in PATH" in out and "fix:" in out
    # a partition the site names that Slurm does not have
    site = _extra_partition_site(tmp_path)
    out = _refused(slurm_cluster, env, work, *[str(site) if a == str(LOCAL_LAB) else a for a in submit])
    assert "no partition 'h100x'" in out and str(site) in out
    # the compute side's interpreter has no torch
    out = _refused(slurm_cluster, env, work, *submit, "--python", str(bare_python))
    assert "has no torch, megatron.core" in out and "--python" in out
    # an interpreter this machine does not see: asked of a compute node by a one-task job (here it has none either)
    out = _refused(slurm_cluster, env, work, *submit, "--python", str(tmp_path / "nowhere" / "python"))
    assert "is not a Python interpreter that runs on a node of partition a100" in out, out
    # --save holds a checkpoint of another model: found now, not inside the job "at step None"
    _manifest(work / "ckpt", "tiny-llama")
    out = _refused(slurm_cluster, env, work, *submit)
    assert "holds a checkpoint of tiny-llama (step_00000005), not of tiny-gpt" in out and "--save" in out


def test_run_refuses_before_its_run_directory(slurm_cluster, env, work: Path, tmp_path: Path):
    archive = write_tiny_archive(tmp_path / "tiny.h5")
    run = ["run", "--site", str(LOCAL_LAB), "--profiles", str(archive), "--model", "tiny-gpt", "--gbs", "64",
           "--data", str(work / "data"), "--save", str(work / "ckpt")]
    _manifest(work / "ckpt", "tiny-llama")
    out = _refused(slurm_cluster, env, work, *run)
    assert "holds a checkpoint of tiny-llama" in out and not (work / "ckpt" / "controller").exists()
    shutil.rmtree(work / "ckpt")
    site = _extra_partition_site(tmp_path)
    out = _refused(slurm_cluster, env, work, *[str(site) if a == str(LOCAL_LAB) else a for a in run])
    assert "no partition 'h100x'" in out and not (work / "ckpt").exists()


def test_profile_refuses_before_its_jobs(slurm_cluster, env, work: Path, tmp_path: Path):
    profile = ["profile", "--site", str(LOCAL_LAB), "--model", "tiny-gpt", "--cpu", "--partitions", "a100",
               "--mbs", "1", "--tp", "1", "--network", "none", "--folder", str(work / "jobs")]
    # /proc refuses a new file even to root: the error names the archive, not a lock or shard file
    out = _refused(slurm_cluster, env, work, *profile, "--archive", "/proc/sailor/profiles.h5")
    assert "/proc/sailor/profiles.h5: --archive: the profile archive cannot be written" in out
    assert ".lock" not in out and ".shard" not in out
    site = _extra_partition_site(tmp_path)
    out = _refused(slurm_cluster, env, work, *[str(site) if a == str(LOCAL_LAB) else a for a in profile],
                   "--partitions", "a100,h100x", "--archive", str(work / "cpu.h5"))
    assert "no partition 'h100x'" in out


def test_a_rendered_job_warns_of_an_interpreter_without_torch(slurm_cluster, env, work: Path, bare_python: Path):
    plan = write_plan(work, "a100-only")
    proc = slurm_cluster.run(["sailor-hpc", "sbatch", str(plan), "--site", str(LOCAL_LAB), "--data",
                              str(work / "data"), "--save", str(work / "ckpt"), "--python", str(bare_python),
                              "-o", str(work / "job.sbatch")], env=env, cwd=work)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"{bare_python}, which has no torch, megatron.core" in warnings[0], proc.stderr
    assert (work / "job.sbatch").exists()


def test_live_availability_names_a_partition_slurm_lacks(slurm_cluster, env, tmp_path: Path):
    site = _extra_partition_site(tmp_path)
    proc = slurm_cluster.run(["sailor-hpc", "plan", "--site", str(site), "--model", "tiny-gpt", "--gbs", "8",
                              "--profiles", str(write_tiny_archive(tmp_path / "tiny.h5")), "--available", "live"],
                             env={**env, "PYTHONWARNINGS": "ignore"}, cwd=tmp_path)
    assert "warning: --available live: Slurm has no partition 'h100x'" in proc.stderr, proc.stdout + proc.stderr
    assert os.fspath(site) in proc.stderr


def test_an_interpreter_only_the_compute_nodes_see_is_asked_of_one(slurm_cluster, env, monkeypatch):
    """The one-task probe job (srun on a node of the partition) reports the modules the node's interpreter lacks;
    the job is in accounting under its own name."""
    from sailor_hpc.cli.preflight import missing_modules_on
    from sailor_hpc.core.site import load_site

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    site = load_site(LOCAL_LAB)
    assert missing_modules_on(site, "a100", sys.executable, ("torch", "megatron.core")) == []
    assert missing_modules_on(site, "v100", sys.executable, ("torch", "no_such_module_here")) == ["no_such_module_here"]
    out = slurm_cluster.sacct_once(["-X", "-n", "-P", "-o", "JobName,State", "-S", "now-10minutes"],
                                   lambda text: text.count("sailor-preflight|COMPLETED") >= 2)
    assert out.count("sailor-preflight|COMPLETED") >= 2, out
