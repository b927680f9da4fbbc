"""A sweep that stops on the real local cluster: at its first job that the compute side's environment failed
(exit 2, the cause named, no failed point in the archive, no job left), and on Ctrl-C (the jobs that keep running
and the commands that cancel them or finish the sweep; a second Ctrl-C cancels them)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from sailor_hpc.core.archive import read_archive
from sailor_hpc.core.toml_writer import dump_toml

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
LOCAL_LAB = REPO / "site_configs" / "local-lab.toml"


def _sweep(cluster, tmp: Path, *args: str) -> list[str]:
    cli = shutil.which("sailor-hpc", path=cluster.env["PATH"])
    assert cli is not None
    return [cli, "profile", "--site", str(LOCAL_LAB), "--model", "tiny-gpt", "--cpu", "--partitions", "a100",
            "--archive", str(tmp / "cpu.h5"), "--folder", str(tmp / "jobs"), "--network", "none", "--iters", "2",
            "--warmup", "1", "--min-time", "0", "--time", "5", "--poll", "0.2", *args]


def _sweep_jobs(cluster, folder: Path) -> dict[str, str]:
    """Job id -> state of the jobs whose submitit files are in ``folder``, from sacct once it has them all."""
    names = {p.name.split("_")[0] for p in folder.glob("*_submission.sh")} | \
        {p.name.split("_")[0] for p in folder.glob("*.pkl")}
    ids = sorted(n for n in names if n.isdigit())
    out = cluster.sacct_once(["-X", "-n", "-P", "-o", "JobID,State", "-j", ",".join(ids)],
                             lambda text: text.count("\n") >= len(ids) and "PENDING" not in text
                             and "RUNNING" not in text)
    return {row.split("|")[0]: row.split("|")[1] for row in out.splitlines() if "|" in row}


@pytest.mark.parametrize("broken", ["srun", "python"])
def test_an_environment_failure_stops_the_sweep_at_its_first_job(slurm_cluster, tmp_path: Path, broken: str,
                                                                 bare_python: Path):
    """srun: the site's prelude leaves the jobs a PATH without srun (submitit's batch script cannot start its
    step); python: an interpreter without submitit or torch, passed with --skip-runtime-check. Either is the
    same on every job."""
    import tomllib

    doc = tomllib.loads(LOCAL_LAB.read_text())
    extra: tuple[str, ...] = ()
    if broken == "srun":
        doc["environment"]["prelude"] = ["export PATH=/nonexistent"]
        cause = "srun: command not found"
    else:
        extra, cause = ("--python", str(bare_python), "--skip-runtime-check"), "No module named"
    site = tmp_path / "site.toml"
    site.write_text(dump_toml(doc))
    env = {**slurm_cluster.env,
           "PYTHONPATH": os.pathsep.join([str(REPO), slurm_cluster.env.get("PYTHONPATH", "")])}
    cmd = [str(site) if a == str(LOCAL_LAB) else a for a in _sweep(slurm_cluster, tmp_path, "--mbs", "1,2,4",
                                                                    "--tp", "1", *extra)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "could not start measuring" in out and cause in out and "--resume" in out, out
    assert "failed:" not in out  # no unit reported failed one by one
    assert not (tmp_path / "cpu.h5").exists() or not read_archive(tmp_path / "cpu.h5").failed
    states = _sweep_jobs(slurm_cluster, tmp_path / "jobs")
    assert states and all(s in ("FAILED", "CANCELLED") or s.startswith("CANCELLED") for s in states.values()), states
    print(f"\nstopped at the environment failure in {took:.1f} s; jobs {states}")


def test_ctrl_c_names_the_jobs_left_running_and_a_second_cancels_them(slurm_cluster, tmp_path: Path):
    env = {**slurm_cluster.env,
           "PYTHONPATH": os.pathsep.join([str(REPO), slurm_cluster.env.get("PYTHONPATH", "")])}
    # --begin keeps the jobs pending: they are still queued whenever the signals come
    # SIGINT as a terminal gives it (a worker process may have it ignored, which its children would inherit)
    proc = subprocess.Popen(_sweep(slurm_cluster, tmp_path, "--mbs", "1", "--tp", "1,2", "--begin", "now+1hour"), env=env,
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()

    def wait_for(text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.1)

    try:
        wait_for("2 queued", timeout=180.0)  # a lab whose controller is busy with another file's jobs: seconds each
        proc.send_signal(signal.SIGINT)
        wait_for("Ctrl-C again", timeout=180.0)
        said = "".join(lines)
        states = _pending(slurm_cluster, tmp_path / "jobs")
        assert len(states) == 2 and set(states.values()) == {"PENDING"}, states  # still queued after the first
        ids = " ".join(sorted(states))
        assert f"2 job(s) keep running: {ids}" in said and f"sailor-hpc cancel {ids}" in said, said
        assert "--begin now+1hour --resume" in said and "Aborted!" not in said, said
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    assert f"cancelled {ids}" in "".join(lines)
    final = _sweep_jobs(slurm_cluster, tmp_path / "jobs")
    assert sorted(final) == sorted(states) and all(s.startswith("CANCELLED") for s in final.values()), final


def _pending(cluster, folder: Path) -> dict[str, str]:
    ids = sorted({p.name.split("_")[0] for p in folder.glob("*_submission.sh")})
    out = cluster.run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T"], check=True).stdout
    return dict(line.split() for line in out.splitlines())
