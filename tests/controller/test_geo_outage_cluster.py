"""A run across two real local Slurm clusters whose second slurmctld is down while the first group is submitted.

The group's intent (every cluster's job name, unique to the run) is journaled before the first ``sbatch``;
lab's job is submitted, lab2's ``sbatch`` does not answer (SlurmUnavailable). The run waits it out with
back-off like the single-cluster controller (one ``error`` when it starts, one when every cluster answers
again), then goes on as a resumed run: the half-submitted group, never journaled as submitted, is found in
Slurm by its jobs' names and stopped, and the next group trains the run to its end. While that group trains,
lab2's slurmctld is stopped again: the same loop waits it out, adopts the group (its jobs kept running on their
slurmd) and the group trains on: no third group. Then: Slurm's accounting
holds exactly those jobs of the run (nothing submitted twice, nothing left behind) and the final parameters
equal a single-process reference of the same steps.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sailor_hpc.controller import Controller
from sailor_hpc.controller.spec import RunSpec, new_run_id
from sailor_hpc.controller.state import RunDir
from sailor_hpc.core.checkpoint import latest_complete, read_manifest
from sailor_hpc.core.site import load_site
from sailor_hpc.core.toml_writer import dump_toml
from tests.controller.scenario import wire
from tests.data.tiny_archive import write_tiny_archive
from tests.jobs.conftest import cross_plan, two_lab_doc
from tests.megatron_patch.conftest import ADAM, python
from tests.shared_inputs import shipped_dataset
from tests.slurm.ranks import pause, rank_pids, resume

pytestmark = pytest.mark.slurm

STEPS = 6
PARAM_TOL = MOMENT_TOL = 5e-6  # as test_cosched_clusters.py


Jobs = dict[str, tuple[str, str]]


def _parse(acct: str, prefix: str) -> Jobs:
    rows = [line.split("|") for line in acct.splitlines()]
    return {r[1]: (r[0], r[2].split()[0]) for r in rows if len(r) == 3 and r[1].startswith(prefix)}


def _run_jobs(cluster: Any, prefix: str, settled: Callable[[Jobs], bool]) -> Jobs:
    """The run's jobs in the cluster's accounting, name -> (job id, state), once ``settled`` holds."""
    acct = cluster.sacct_once(["-X", "-n", "-P", "-o", "JobID,JobName,State", "-S", "now-1hours"],
                              lambda out: settled(_parse(out, prefix)))
    return _parse(acct, prefix)


def test_a_geo_run_waits_out_outages_while_it_submits_and_trains(slurm_two_clusters, job_env_two, tmp_path: Path,
                                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    pytest.importorskip("megatron.core")
    from tests.megatron_patch.conftest import max_diff

    lab, lab2 = slurm_two_clusters
    data = shipped_dataset(tmp_path_factory)
    ref = python("-m", "megatron_patch.reference", "--model", "tiny-gpt", "--data", data, "--global-batch", "8",
                 "--steps", str(STEPS), "--snapshots", str(STEPS), "--out", str(tmp_path / "ref"), *ADAM)
    assert ref.returncode == 0, ref.stderr[-3000:]
    site_file = tmp_path / "two-labs.toml"
    site_file.write_text(dump_toml(two_lab_doc(lab.lab, lab2.lab, gbps=100.0)))
    both = cross_plan(load_site(site_file), "a100", "a100_lab2")
    spec = RunSpec.of(run_id=new_run_id(), site=str(site_file), model="tiny-gpt", objective="throughput", data=data,
                   save=str(tmp_path / "ckpt"), steps=STEPS, gbs=8, profiles=str(write_tiny_archive(tmp_path / "tiny.h5")),
                   grow_timeout_s=120.0, poll_s=0.3, save_interval=1, train_args=tuple(ADAM))
    rundir = RunDir.create(tmp_path / "run", spec)
    geo = Controller(rundir, job_env_two, plan_for=lambda cs: {("lab", "lab2"): both}[cs])
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["exit"] = geo.run()
        except Exception as exc:  # noqa: BLE001 - reported below
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)

    def wait_for(seen: Any, after: float) -> None:
        deadline = time.monotonic() + 120
        while not any(seen(r) and r["t"] >= after for r in wire(rundir.records())):
            assert time.monotonic() < deadline and "error" not in out, (out, wire(rundir.records()))
            time.sleep(0.2)

    with lab2.slurmctld_stopped() as t_down:
        thread.start()
        wait_for(lambda r: r["kind"] == "error", t_down)
        time.sleep(2.0)  # gone for more than one back-off
    t_up = time.time()
    # and again while the second group trains: the same loop waits it out and adopts the group, which goes on.
    # Its ranks are paused (SIGSTOP) meanwhile, so the group cannot finish before slurmctld is back however fast
    # the machine is that day
    wait_for(lambda r: r["kind"] == "group_submitted" and r["group"] == 2, t_up)
    plan2 = next(r["plan_file"] for r in wire(rundir.records()) if r["kind"] == "group_submitted")
    deadline = time.monotonic() + 120
    while len(rank_pids(plan2)) < both.num_gpus:  # one rank per GPU
        assert time.monotonic() < deadline and "error" not in out, (rank_pids(plan2), wire(rundir.records()))
        time.sleep(0.2)
    pause(plan2)
    try:
        wait_for(lambda r: r["kind"] == "group_running" and r["group"] == 2, t_up)
        with lab2.slurmctld_stopped() as t_down2:
            wait_for(lambda r: r["kind"] == "error", t_down2)
            time.sleep(2.0)
        wait_for(lambda r: r["kind"] in ("group_adopted", "group_stopped", "finished"), t_down2)
    finally:
        resume(plan2)
    thread.join(timeout=300)
    records = wire(rundir.records())
    assert not thread.is_alive() and out.get("exit") == 0, (out, records)

    grouped = [(r["kind"], r.get("group")) for r in records if "group" in r]
    print(f"\nslurmctld of lab2 down {t_up - t_down:.1f} s, then again while group 2 trains:", *grouped, sep="\n  ")
    assert grouped[:4] == [("group_intent", 1), ("error", 1), ("error", 1), ("group_stopped", 1)], grouped
    assert ("group_submitted", 1) not in grouped and ("group_submitted", 2) in grouped
    assert grouped[-1] == ("finished", 2) and not any(g == 3 for _, g in grouped)  # group 2 was never replaced
    second_outage = grouped[grouped.index(("group_running", 2)) + 1:]
    assert second_outage[:3] == [("error", 2), ("error", 2), ("group_adopted", 2)], grouped
    errors = [r for r in records if r["kind"] == "error"]
    assert [e["where"] for e in errors] == ["slurm unavailable", "slurm available"] * 2, errors
    assert errors[0]["t"] >= t_down and errors[1]["t"] - errors[0]["t"] >= 2.0  # not before it was back
    assert errors[2]["t"] >= t_down2 and errors[3]["t"] - errors[2]["t"] >= 2.0
    first, second = (r for r in records if r["kind"] == "group_intent")
    prefix = f"sailor-{spec.run_id}-"
    assert all(n.startswith(prefix) for n in [*first["job_names"].values(), *second["job_names"].values()])
    # lab's job of the cut-short group was found by its name and stopped; lab2 never got one
    stopped = next(r for r in records if r["kind"] == "group_stopped" and r["group"] == 1)
    assert set(stopped["states"]) == {"lab"} and "lab2" in stopped["reason"], stopped
    submitted = next(r for r in records if r["kind"] == "group_submitted")
    on_lab = _run_jobs(lab, prefix, lambda jobs: len(jobs) == 2)
    on_lab2 = _run_jobs(lab2, prefix, lambda jobs: [s for _, s in jobs.values()] == ["COMPLETED"])
    assert set(on_lab) == {first["job_names"]["lab"], second["job_names"]["lab"]}, on_lab
    assert on_lab[first["job_names"]["lab"]][1] == stopped["states"]["lab"] != "COMPLETED"  # ended by the stop
    assert on_lab[second["job_names"]["lab"]] == (submitted["jobs"]["lab"], "COMPLETED")
    assert on_lab2 == {second["job_names"]["lab2"]: (submitted["jobs"]["lab2"], "COMPLETED")}, on_lab2

    final = latest_complete(tmp_path / "ckpt")
    assert final is not None and read_manifest(final)["step"] == STEPS
    diff = max_diff(final, tmp_path / "ref" / f"ref_step_{STEPS}.pt")
    print(f"after {STEPS} steps: max |delta| vs reference {diff}")
    assert diff["param"] <= PARAM_TOL and diff["exp_avg"] <= MOMENT_TOL and diff["exp_avg_sq"] <= MOMENT_TOL


def test_a_geo_run_gives_up_after_its_restarts_without_a_checkpoint(slurm_two_clusters, job_env_two,
                                                                     tmp_path: Path) -> None:
    """A group whose jobs fail (here: no interpreter on the compute nodes) is retried on the same clusters; the
    run gives up by the one-cluster rule, ``max_restarts`` restarts in a row without a new checkpoint."""
    lab, lab2 = slurm_two_clusters
    site_file = tmp_path / "two-labs.toml"
    site_file.write_text(dump_toml(two_lab_doc(lab.lab, lab2.lab, gbps=100.0)))
    both = cross_plan(load_site(site_file), "a100", "a100_lab2")
    spec = RunSpec.of(run_id=new_run_id(), site=str(site_file), model="tiny-gpt", objective="throughput",
                   data=str(tmp_path / "data"), save=str(tmp_path / "ckpt"), steps=STEPS, gbs=8,
                   profiles=str(write_tiny_archive(tmp_path / "tiny.h5")), poll_s=0.3, max_restarts=1,
                   python=str(tmp_path / "no-python"), extra_sbatch=("--mem=600M",), time_limit="00:20:00",
                   time_min="00:10:00", signal_grace_s=90)
    rundir = RunDir.create(tmp_path / "run", spec)
    assert Controller(rundir, job_env_two, plan_for=lambda cs: {("lab", "lab2"): both}[cs]).run() == 1
    records = wire(rundir.records())
    steps = [(r["kind"], r.get("group")) for r in records if r["kind"] in (
        "group_submitted", "group_failed", "cluster_lost", "group_stopped", "gave_up")]
    assert steps == [("group_submitted", 1), ("group_failed", 1), ("group_stopped", 1),
                     ("group_submitted", 2), ("group_failed", 2), ("group_stopped", 2), ("gave_up", None)], steps
    assert records[-1]["reason"] == "all 1 restarts used without a new checkpoint"
    prefix = f"sailor-{spec.run_id}-"
    submitted = [r["jobs"] for r in records if r["kind"] == "group_submitted"]
    # nothing left, nothing twice: exactly the two groups' jobs, each ended
    for name, cluster in (("lab", lab), ("lab2", lab2)):
        jobs = _run_jobs(cluster, prefix, lambda jobs: len(jobs) == 2)
        assert sorted(i for i, _ in jobs.values()) == sorted(g[name] for g in submitted), (name, jobs)
    # every cluster's job of every group was submitted with the run's own job options (its extra sbatch options,
    # time limit, backfill minimum, signal grace), as a one-cluster run's job is: Slurm holds them
    for name, cluster in (("lab", lab), ("lab2", lab2)):
        acct = cluster.sacct_once(["-X", "-n", "-P", "-o", "JobName,ReqMem,TimelimitRaw", "-S", "now-1hours"],
                                  lambda out: out.count(prefix) == 2)
        rows = [r.split("|") for r in acct.splitlines() if r.startswith(prefix)]
        # backfill may start a job with any limit from --time-min up to --time (seen here: 20, and 10 minutes)
        assert len(rows) == 2 and all(mem.startswith("600M") and 10 <= int(limit) <= 20 for _, mem, limit in rows), rows
        for group in (1, 2):
            script = rundir.script_file(group, name).read_text()
            assert "#SBATCH --time-min=00:10:00" in script and "#SBATCH --signal=USR1@90" in script, script[:2000]
        assert all(state in ("FAILED", "CANCELLED") for _, state in jobs.values()), (name, jobs)
