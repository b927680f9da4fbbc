"""slurmctld stops for longer than a poll while the run trains: the controller waits and carries on.

Every Slurm command the controller runs meanwhile fails (after the client's ~10 s message timeout) while
``scontrol ping`` says the controller is down: that is SlurmUnavailable, journaled once, waited out with
back-off, never taken for a lost job or a failed submission. The job's ranks keep training on their slurmd
(they do not need slurmctld) and finish; once slurmctld is back the controller sees the job complete.
Then: one job for the whole run (nothing resubmitted, Slurm's accounting agrees), no failure, and the
final parameters equal a single-process reference run of the same steps.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from sailor_hpc.core.checkpoint import latest_complete, read_manifest
from tests.controller import scenario as story_kit
from tests.controller.scenario import Scenario, kind
from tests.slurm import ranks

STEPS = 40
PARAM_TOL = MOMENT_TOL = 5e-6  # as the resize story (tests/controller/test_resize_cluster.py)


def test_controller_waits_out_a_stopped_slurmctld(slurm_cluster, tmp_path: Path,
                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    pytest.importorskip("megatron.core")
    from tests.megatron_patch.conftest import max_diff

    data, archive = story_kit.build_inputs(tmp_path_factory, tmp_path)
    reference = story_kit.start_reference(tmp_path, data, STEPS)
    sc = Scenario(slurm_cluster, tmp_path, data, archive, steps=STEPS)
    with story_kit.cleaned_up(sc, reference):
        sc.start_controller()
        plan = sc.wait_for("the first step", kind("first_step", attempt=1))
        plan_file = sc.plan_file(1)
        ranks.pause(plan_file)  # the run must still be training when slurmctld stops
        with slurm_cluster.slurmctld_stopped() as t_down:
            ranks.resume(plan_file)  # ... and trains on while it is gone
            unavailable = sc.wait_for("Slurm unavailable", kind("error", where="slurm unavailable"), timeout=90)
            time.sleep(3 * sc.poll_s)  # gone for longer than one poll (it already was: the client waited ~10 s)
        t_up = time.time()
        back = sc.wait_for("Slurm available again", kind("error", where="slurm available"), timeout=120)
        status = story_kit.finish(sc, reference)
        records = sc.records()
        prefix = f"sailor-{records[0]['run_id']}-"
        acct = slurm_cluster.sacct_once(["-X", "-n", "-P", "-o", "JobID,JobName", "-S", "now-1hours"],
                                        lambda out: f"|{prefix}" in out)

    assert status.returncode == 0, status.stderr
    kinds = [r["kind"] for r in records]
    assert kinds.count("submit_intent") == 1 and kinds.count("submitted") == 1, kinds
    assert "failure" not in kinds and "gave_up" not in kinds and kinds[-1] == "finished", kinds
    ours = [line.split("|")[0] for line in acct.splitlines() if line.split("|")[-1].startswith(prefix)]
    assert ours == [next(r["job_id"] for r in records if r["kind"] == "submitted")], acct
    # said once while it lasted, and once when it ended, in that order, spanning more than one poll
    errors = [r for r in records if r["kind"] == "error"]
    assert [r["where"] for r in errors] == ["slurm unavailable", "slurm available"], errors
    assert t_down <= unavailable["t"] and back["t"] >= t_up and back["t"] - unavailable["t"] > sc.poll_s
    assert plan["step"] >= 1
    final = latest_complete(sc.save)
    assert final is not None and read_manifest(final)["step"] == STEPS
    diff = max_diff(final, tmp_path / "ref" / f"ref_step_{STEPS}.pt")
    print(f"\nslurmctld down {t_up - t_down:.1f} s; after {STEPS} steps max |delta| vs reference {diff}")
    assert diff["param"] <= PARAM_TOL and diff["exp_avg"] <= MOMENT_TOL and diff["exp_avg_sq"] <= MOMENT_TOL
