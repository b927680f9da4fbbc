"""``sailor-hpc profile --local``: the sweep's measurements as processes on this machine, no Slurm.

The same archive a Slurm sweep fills (points, memory, overhead, the link's fit), the same report and exit
codes, a failure (the sweep's timeout) recorded and completed by ``--resume``, and bad input refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from profiler.local import GRACE_S, run_ranks
from sailor_hpc.core.archive import read_archive
from sailor_hpc.core.models import get_model
from tests.data import REPO

pytest.importorskip("megatron.core")

LAPTOP = REPO / "site_configs" / "laptop.toml"
QUICK = ["--iters", "3", "--warmup", "1", "--min-time", "0", "--net-sizes", "16,18,20"]


def _profile(tmp: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.pop("SLURM_CONF", None)  # nothing of Slurm is needed, or reachable
    cmd = [str(Path(sys.executable).parent / "sailor-hpc"), "profile", "--local", "--cpu", "--site", str(LAPTOP),
           "--model", "tiny-gpt", "--archive", str(tmp / "cpu.h5"), "--folder", str(tmp / "sweep"), *QUICK, *args]
    return subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout)


def test_local_sweep_fills_the_archive_as_a_slurm_sweep_does(tmp_path: Path) -> None:
    t0 = time.monotonic()
    proc = _profile(tmp_path, "--mbs", "1,2", "--tp", "2", "--points-per-job", "2", "--json",
                    "--write-site", str(tmp_path / "measured.toml"))
    print(f"\nlocal sweep (2 points on 2 ranks, 1 link): {time.monotonic() - t0:.1f} s")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["complete"] and report["counts"] == {"ok": 3}
    jobs = [u["job_id"] for u in report["units"]]  # the two points share one run (--points-per-job 2)
    assert all(j.startswith("local:") for j in jobs) and len(set(jobs)) == 2
    a = read_archive(tmp_path / "cpu.h5")
    spec = get_model("tiny-gpt")
    L, s, h = spec.num_pipeline_layers, spec.seq_len, spec.hidden_size
    assert sorted(a.compute) == [("tiny-gpt", "cpu-core", "fp32")] and not a.failed
    points = a.compute[("tiny-gpt", "cpu-core", "fp32")]
    assert sorted(points) == [(1, 2), (2, 2)]
    for e in points.values():
        assert e.times.shape == (L, 3) and np.isfinite(e.times).all() and (e.times > 0).all()
        prov = e.provenance
        assert prov["device"] == "cpu" and prov["method"] == "wall-clock" and prov["timing"] == "chain"
        assert "slurm_job" not in prov and prov["partition"] == "cpu"  # measured here, not in a job
    # memory: a block's parameters per TP rank, by hand (as the Slurm sweep's test)
    m = a.memory_table("tiny-gpt", 2).table
    assert m[1, 0] == (3 * h * h + 3 * h + h * h + 2 * 4 * h * h + 4 * h) / 2 + 6 * h
    assert list(m[:, 1]) == [s * h] * 5 + [s]
    assert set(a.overhead) == {"cpu-core"} and set(a.overhead["cpu-core"].by_tp) == {2}
    # the link between the two ranks: the fit is numpy's fit of the series it records
    (link,) = a.network["cpu-laptop"]
    sizes, gbps = link.provenance["sizes"], link.provenance["p2p_gbps"]
    assert link.path == "network/cpu-laptop/intra:cpu:cpu:2" and sizes == [2 ** 16, 2 ** 18, 2 ** 20]
    assert np.allclose(link.fit.coeffs, np.polyfit(np.log2(np.asarray(sizes) / 1e6), gbps, 2))
    assert len(set(link.provenance["hosts"])) == 1
    # --write-site: the planner's view of this machine, as an edit of the laptop's file (its comments and name
    # kept), with the archive the profiles are in; every changed field reported
    from sailor_hpc.core.site import load_site
    site = load_site(tmp_path / "measured.toml")
    written_fit = site.intra_node_fit("cpu", 2)
    assert site.partitions[0].gpu_type == "cpu-core" and written_fit.to_dict() == link.fit.to_dict()
    # the link's measured latencies per small collective, streamed and issued after compute, written in µs to 1e-3
    latencies = ("collective_latency_s", "gather_latency_s", "issued_latency_s", "issued_gather_latency_s")
    for field in latencies:
        assert 0 < getattr(link.fit, field)
        assert getattr(written_fit, field) == pytest.approx(getattr(link.fit, field), abs=1e-9)
    # ... and how far the two ranks drifted apart doing the same work (0 where they kept together), to 1e-4
    assert 0 <= link.fit.replica_jitter == min(link.provenance["replica_jitter"], 0.45) < 0.5
    assert written_fit.replica_jitter == pytest.approx(link.fit.replica_jitter, abs=1e-4)
    assert site.name == "laptop" and site.archive == str(tmp_path / "cpu.h5")
    comments = [line for line in LAPTOP.read_text().splitlines() if line.lstrip().startswith("#")]
    assert [line for line in (tmp_path / "measured.toml").read_text().splitlines() if line.lstrip().startswith("#")] \
        == comments
    written = report["site_written"]
    assert written["file"] == str(tmp_path / "measured.toml")
    assert {c["field"]: c["new"] for c in written["changes"]} == {
        "gpu_types.core (renamed)": "cpu-core", "profiles.archive": "cpu.h5", "partitions[cpu].gpu_type": "cpu-core",
        'partitions[cpu].network.intra_node."2"': link.fit.to_dict(),
        "partitions[cpu].network.intra_node.collective_latency_us": round(link.fit.collective_latency_s * 1e6, 3),
        "partitions[cpu].network.intra_node.gather_latency_us": round(link.fit.gather_latency_s * 1e6, 3),
        "partitions[cpu].network.intra_node.issued_latency_us": round(link.fit.issued_latency_s * 1e6, 3),
        "partitions[cpu].network.intra_node.issued_gather_latency_us": round(link.fit.issued_gather_latency_s * 1e6, 3),
        **({"partitions[cpu].network.intra_node.replica_jitter": round(link.fit.replica_jitter, 4)}
           if round(link.fit.replica_jitter, 4) else {})}


def test_a_timed_out_local_sweep_is_recorded_and_resume_completes_it(tmp_path: Path) -> None:
    """The sweep's timeout ends the running measurement (its processes killed) and leaves the rest
    unstarted: exit 1, every point failed in the archive with its reason; --resume measures them."""
    args = ["--mbs", "1,2", "--tp", "1", "--network", "none"]
    proc = _profile(tmp_path, *args, "--timeout", "1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "failed: compute:cpu:mbs1:tp1: still running after the sweep's timeout of 1 s: ended" in proc.stderr
    assert "failed: compute:cpu:mbs2:tp1: not measured: the sweep's timeout of 1 s came first" in proc.stderr
    assert "--resume" in proc.stdout
    a = read_archive(tmp_path / "cpu.h5")
    assert not a.compute and sorted(a.failed[("tiny-gpt", "cpu-core", "fp32")]) == [(1, 1), (2, 1)]
    state = json.loads((tmp_path / "sweep" / "sweep-state.json").read_text())
    assert {u["status"] for u in state["units"].values()} == {"failed"}

    proc = _profile(tmp_path, *args, "--resume", "--json", "--points-per-job", "2")  # both in one run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["counts"] == {"ok": 2}
    a = read_archive(tmp_path / "cpu.h5")
    assert sorted(a.compute[("tiny-gpt", "cpu-core", "fp32")]) == [(1, 1), (2, 1)] and not a.failed
    # nothing left: a second --resume starts no process
    proc = _profile(tmp_path, *args, "--resume", "--json")
    assert proc.returncode == 0 and all(u["job_id"] is None for u in json.loads(proc.stdout)["units"])


def test_a_failing_rank_ends_the_others_and_names_itself(tmp_path: Path) -> None:
    """Rank 1 fails at once while rank 0 would wait a minute (as in a collective): rank 0 is ended after
    the grace period, and the reason is rank 1's, with its last output line and its log."""
    code = ("import os, sys, time\n"
            "if os.environ['RANK'] == '1':\n    print('rank 1 broke', flush=True); sys.exit(3)\n"
            "assert os.environ['WORLD_SIZE'] == '2' and 'SLURM_JOB_ID' not in os.environ\ntime.sleep(60)")
    logs = [tmp_path / f"r{r}.log" for r in range(2)]
    t0 = time.monotonic()
    out = run_ranks([sys.executable, "-c", code], 2, logs, deadline=None)
    took = time.monotonic() - t0
    assert out.reason == f"local rank 1 exited 3: rank 1 broke ({logs[1]})"
    assert GRACE_S <= took < GRACE_S + 20


def test_bad_local_options_exit_2_naming_the_field(tmp_path: Path) -> None:
    from sailor_hpc.cli import main
    base = ["profile", "--local", "--cpu", "--site", str(LAPTOP), "--model", "tiny-gpt",
            "--archive", str(tmp_path / "a.h5"), "--folder", str(tmp_path / "f")]
    res = CliRunner().invoke(main, [*base, "--begin", "now+1hour"])
    assert res.exit_code == 2 and "--begin" in res.output and "drop --begin" in res.output, res.output
    res = CliRunner().invoke(main, [*base, "--python", str(tmp_path / "no-python")])
    assert res.exit_code == 2 and "--python" in res.output, res.output
    import torch
    if not torch.cuda.is_available():  # a GPU sweep asked of a machine without one
        res = CliRunner().invoke(main, [x for x in base if x != "--cpu"])
        assert res.exit_code == 2 and "--cpu" in res.output and "no CUDA device" in res.output, res.output
    assert not (tmp_path / "a.h5").exists() and not (tmp_path / "f").exists()  # nothing written
