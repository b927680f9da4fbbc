"""Profiling sweeps through submitit on the real local cluster (CPU): the archive they fill, the
simulator reading it, and failures (cancelled jobs, het job included) reported, recorded and resumed."""
from __future__ import annotations

import json
import os
import subprocess
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from sailor_hpc.core.archive import read_archive
from sailor_hpc.core.models import get_model
from sailor_hpc.core.plan import plan_from_dict
from sailor_hpc.core.site import load_site

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
LOCAL_LAB = REPO / "site_configs" / "local-lab.toml"
QUICK = ["--iters", "3", "--warmup", "1", "--net-sizes", "16,18,20,22", "--time", "10", "--lost-after", "60",
         "--poll", "0.2"]  # a job's end is seen 0.2 s after, not up to a second


@pytest.fixture()
def prof_env(slurm_cluster) -> dict[str, str]:
    env = dict(slurm_cluster.env)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _node_partitions(cluster) -> dict[str, str]:
    out = cluster.run(["sinfo", "-h", "-N", "-o", "%N %R"], check=True).stdout
    return {line.split()[0]: line.split()[1] for line in out.splitlines()}


def _profile(cluster, env, tmp: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    cmd = ["sailor-hpc", "profile", "--site", str(LOCAL_LAB), "--model", "tiny-gpt", "--cpu",
           "--archive", str(tmp / "cpu.h5"), "--folder", str(tmp / "jobs"), *QUICK, *args]
    return cluster.run(cmd, env=env, timeout=300, **kw)


def _measuring_runs(cluster, folder: Path) -> dict[str, tuple[set[str], datetime, datetime]]:
    """Each measuring job of a sweep (an array element on its own, a het job's components together) as
    accounting saw it run: its nodes, start and end."""
    state = json.loads((folder / "sweep-state.json").read_text())
    ids = sorted({u["job_id"].split("_")[0] for u in state["units"].values() if u["job_id"]})

    def ended(text: str) -> bool:
        rows = [line.split("|") for line in text.splitlines() if line]
        return bool(rows) and all(r[3] not in ("Unknown", "None", "") for r in rows)

    out = cluster.sacct_once(["-n", "-P", "-X", "-j", ",".join(ids), "-o", "JobID,NodeList,Start,End"], ended)
    runs: dict[str, tuple[set[str], datetime, datetime]] = {}
    for job, nodes, start, end in (line.split("|") for line in out.splitlines() if line):
        key = job.split("+")[0]
        hosts = set(cluster.run(["scontrol", "show", "hostnames", nodes], check=True).stdout.split())
        old = runs.get(key, (set(), datetime.max, datetime.min))
        runs[key] = (old[0] | hosts, min(old[1], datetime.fromisoformat(start)), max(old[2], datetime.fromisoformat(end)))
    return runs


def test_cpu_sweep_fills_the_archive_and_the_simulator_reads_it(slurm_cluster, prof_env, tmp_path):
    t0 = time.monotonic()
    proc = _profile(slurm_cluster, prof_env, tmp_path, "--partitions", "a100,v100", "--mbs", "1,2", "--tp", "1,2",
                    "--points-per-job", "2", "--network", "intra", "--net-senders", "2",
                    "--write-site", str(tmp_path / "measured.toml"))
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(f"\nCPU sweep (8 points in 4 jobs, 2 network jobs): {took:.1f} s")
    assert "[" + "#" * 28 + "] 10/10 (10 ok)" in proc.stderr  # the progress bar reached the end
    # measuring jobs never shared a node, nor, the lab's four nodes being one machine, ran at the same time
    assert "Slurm nodes share a machine (a100-1, a100-2, v100-1, v100-2 on localhost): measuring jobs run one " \
           "at a time" in proc.stderr
    runs = _measuring_runs(slurm_cluster, tmp_path / "jobs")
    assert len(runs) == 6  # a job per partition and TP degree (2 points each), a network job per partition
    pairs = [(a, b) for a in runs for b in runs if a < b]
    at_once = [(a, b) for a, b in pairs if runs[a][1] < runs[b][2] and runs[b][1] < runs[a][2]]
    assert not [(a, b) for a, b in at_once if runs[a][0] & runs[b][0]], runs  # on one node: --exclusive
    assert not at_once, runs  # on one machine: the sweep's queue
    assert all(nodes for nodes, _, _ in runs.values())
    spec = get_model("tiny-gpt")
    L, s, h = spec.num_pipeline_layers, spec.seq_len, spec.hidden_size
    a = read_archive(tmp_path / "cpu.h5")
    parts = _node_partitions(slurm_cluster)
    # compute: every point, under the cpu- keys only (never the GPU type names of the published profiles)
    assert sorted(a.compute) == [("tiny-gpt", "cpu-A100-40", "fp32"), ("tiny-gpt", "cpu-V100-16", "fp32")] and not a.failed
    for (_model, gpu, _dtype), points in a.compute.items():
        assert sorted(points) == [(1, 1), (1, 2), (2, 1), (2, 2)]
        for e in points.values():
            assert e.times.shape == (L, 3) and np.isfinite(e.times).all() and (e.times > 0).all()
            prov = e.provenance
            assert prov["device"] == "cpu" and prov["method"] == "wall-clock" and prov["profiled_blocks"] == 2
            assert prov["timing"] == "chain" and prov["chain_layers"] == 4  # emb, 2 blocks, head as one chain
            assert e.spread is not None and e.spread.repetitions >= 3 and e.spread.layers.shape == (L, 3)
            assert parts[prov["node"]] == {"cpu-A100-40": "a100", "cpu-V100-16": "v100"}[gpu]  # ran where it says
    # memory: parameters per TP rank by hand (see test_profiler_units), activations of the right shapes
    for tp in (1, 2):
        m = a.memory_table("tiny-gpt", tp).table
        assert m[1, 0] == (3 * h * h + 3 * h + h * h + 2 * 4 * h * h + 4 * h) / tp + 6 * h
        assert list(m[:, 1]) == [s * h] * 5 + [s] and (m[:, 3] > 0).all()
    assert set(a.overhead) == {"cpu-A100-40", "cpu-V100-16"}
    assert all(set(e.by_tp) == {1, 2} and min(e.by_tp.values()) > 0 for e in a.overhead.values())
    # network: inside one node of each partition, k = 2 ranks; the fit is the measured series' fit
    links = {e.path: e for e in a.network["cpu-local-lab"]}
    assert sorted(links) == ["network/cpu-local-lab/intra:a100:a100:2", "network/cpu-local-lab/intra:v100:v100:2"]
    for e in links.values():
        hosts = e.provenance["hosts"]
        assert len(set(hosts)) == 1 and parts[hosts[0]] == e.a
        assert e.provenance["gpu"] == "cpu" and e.provenance["torch"] and e.provenance["megatron_core"]  # rank 0's
        sizes, gbps = e.provenance["sizes"], e.provenance["p2p_gbps"]
        assert e.fit.max_gbps == pytest.approx(max(gbps)) and (e.fit.min_bytes, e.fit.max_bytes) == (min(sizes), max(sizes))
        assert np.allclose(e.fit.coeffs, np.polyfit(np.log2(np.asarray(sizes) / 1e6), gbps, 2))

    # the simulator prices a het plan from these measurements alone (cpu- GPU types, measured intra fits)
    from simulator import simulate
    site = load_site(tmp_path / "measured.toml")
    assert [p.gpu_type for p in site.partitions] == ["cpu-A100-40", "cpu-V100-16"]
    measured, written = links["network/cpu-local-lab/intra:a100:a100:2"].fit, site.intra_node_fit("a100", 2)
    assert written.to_dict() == measured.to_dict()  # the latencies per small collective: written in µs to 1e-3
    assert written.collective_latency_s == pytest.approx(measured.collective_latency_s, abs=1e-9) \
        and measured.collective_latency_s > 0
    plan = plan_from_dict({"model": "tiny-gpt", "global_batch_size": 8, "pipelines": [
        {"micro_batch_size": 2, "num_micro_batches": 2, "stages": [
            {"layers": [0, 2], "tp": 2, "gpu_type": "cpu-V100-16"}, {"layers": [3, 5], "tp": 1, "gpu_type": "cpu-A100-40"}]},
        {"micro_batch_size": 1, "num_micro_batches": 4, "stages": [{"layers": [0, 5], "tp": 1, "gpu_type": "cpu-A100-40"}]}]})
    result = simulate(plan, site, a)
    assert result.iteration_time_s > 0 and result.fits
    point = a.compute[("tiny-gpt", "cpu-V100-16", "fp32")][(2, 2)]
    v = point.times
    first = result.stages[0]
    assert first.fwd_s == pytest.approx(v[0:3, 0].sum()) and first.bwd_s == pytest.approx(v[0:3, 1].sum())
    # the layers were timed as slices of one chain: the chain-timing correction of older profiles is 0
    from simulator import SimOptions
    chained = simulate(plan, site, a, options=SimOptions(chain_timing=True)).stages[0]
    assert (chained.fwd_s, chained.bwd_s) == (first.fwd_s, first.bwd_s)
    assert first.gpu_type == "cpu-V100-16"


def _sweep_jobs(cluster) -> list[str]:
    out = cluster.run(["squeue", "-h", "-o", "%i %j"], check=True).stdout
    return sorted({line.split()[0].split("+")[0].split("_")[0] for line in out.splitlines()
                   if line.split()[1].startswith(("sailor-prof-", "sailor-net-"))})


def test_cancelled_profiling_jobs_are_reported_failed_and_resume_completes(slurm_cluster, prof_env, tmp_path):
    args = ["--partitions", "a100,v100", "--mbs", "4,8", "--tp", "1", "--network", "inter,between", "--net-senders", "1"]
    sweep = subprocess.Popen(["sailor-hpc", "profile", "--site", str(LOCAL_LAB), "--model", "tiny-gpt", "--cpu",
                              "--archive", str(tmp_path / "cpu.h5"), "--folder", str(tmp_path / "jobs"), *QUICK, *args,
                              "--begin", "now+1hour"], env=prof_env, cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        jobs: list[str] = []
        while time.monotonic() < deadline and len(jobs) < 5:  # 2 compute job arrays, 2 inter-node, 1 het job
            jobs = _sweep_jobs(slurm_cluster)
            time.sleep(0.3)
        assert len(jobs) == 5, jobs
        slurm_cluster.run(["scancel", *jobs], check=True)
        t0 = time.monotonic()
        out, err = sweep.communicate(timeout=90)
        reported_after = time.monotonic() - t0
        print(f"\ncancelled sweep reported {reported_after:.1f} s after scancel")
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 1, out + err
    assert reported_after < 30, reported_after  # never waited on: the het job included
    for unit in ("compute:a100:mbs4:tp1", "compute:v100:mbs8:tp1", "network:inter:a100:a100:k1",
                 "network:inter:v100:v100:k1", "network:inter:a100:v100:k1"):
        assert f"failed: {unit}: job " in err and "CANCELLED" in err, (unit, err)
    assert "--resume" in out
    a = read_archive(tmp_path / "cpu.h5")
    failed = {(gpu, pt): e.reason for (_, gpu, _), pts in a.failed.items() for pt, e in pts.items()}
    assert set(failed) == {(g, (b, 1)) for g in ("cpu-A100-40", "cpu-V100-16") for b in (4, 8)} and not a.compute
    assert all("CANCELLED" in r for r in failed.values())
    state = json.loads((tmp_path / "jobs" / "sweep-state.json").read_text())
    assert {u["status"] for u in state["units"].values()} == {"failed"}

    # the same command with --resume (and no deferred start) completes the sweep
    proc = _profile(slurm_cluster, prof_env, tmp_path, *args, "--resume", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["complete"] and report["counts"] == {"ok": 7}
    a = read_archive(tmp_path / "cpu.h5")
    assert not a.failed and sorted(a.compute) == [("tiny-gpt", "cpu-A100-40", "fp32"), ("tiny-gpt", "cpu-V100-16", "fp32")]
    for points in a.compute.values():  # one job array per partition and TP degree, an element per point
        assert sorted(points) == [(4, 1), (8, 1)]
        assert len({(e.provenance["array_job"], e.provenance["array_task"]) for e in points.values()}) == 2
    parts = _node_partitions(slurm_cluster)
    links = {e.path: e for e in a.network["cpu-local-lab"]}
    het = links["network/cpu-local-lab/inter:a100:v100:1"].provenance["hosts"]
    assert [parts[h] for h in het] == ["a100", "v100"]  # the het job really spans both partitions
    for p in ("a100", "v100"):
        hosts = links[f"network/cpu-local-lab/inter:{p}:{p}:1"].provenance["hosts"]
        assert len(set(hosts)) == 2 and {parts[h] for h in hosts} == {p}  # two different nodes of p
    # a second --resume finds nothing left to do and submits nothing
    proc = _profile(slurm_cluster, prof_env, tmp_path, *args, "--resume", "--json")
    assert proc.returncode == 0 and all(u["job_id"] is None for u in json.loads(proc.stdout)["units"])


def test_jobs_record_their_overhead_even_when_the_driver_dies(slurm_cluster, prof_env, tmp_path):
    """The sweep driver killed once its jobs are queued: the jobs still finish and write their points and
    their GPU's fixed memory overhead themselves, so a later --resume (which finds the points done and has
    no job results in memory) leaves nothing unrecorded."""
    sweep = subprocess.Popen(["sailor-hpc", "profile", "--site", str(LOCAL_LAB), "--model", "tiny-gpt", "--cpu",
                              "--archive", str(tmp_path / "cpu.h5"), "--folder", str(tmp_path / "jobs"), *QUICK,
                              "--partitions", "a100,v100", "--mbs", "4", "--tp", "1", "--network", "none"],
                             env=prof_env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(_sweep_jobs(slurm_cluster)) < 2:
            time.sleep(0.3)
        assert len(_sweep_jobs(slurm_cluster)) == 2
    finally:
        sweep.kill()
        sweep.wait(10)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and _sweep_jobs(slurm_cluster):
        time.sleep(0.5)
    assert not _sweep_jobs(slurm_cluster)
    a = read_archive(tmp_path / "cpu.h5")
    assert sorted(a.compute) == [("tiny-gpt", "cpu-A100-40", "fp32"), ("tiny-gpt", "cpu-V100-16", "fp32")]
    assert {g: set(e.by_tp) for g, e in a.overhead.items()} == {"cpu-A100-40": {1}, "cpu-V100-16": {1}}
    assert all(b > 0 for e in a.overhead.values() for b in e.by_tp.values())
