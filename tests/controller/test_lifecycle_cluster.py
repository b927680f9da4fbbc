"""The life of a run as its user lives it, on the real local cluster, in one story:

1. the run's controller, resumed with Slurm off ``PATH``, gives up; ``run --resume`` (``PATH`` fixed) continues it,
   adopting the job that ran on meanwhile, and says why it had ended;
2. ``sailor-hpc run stop`` while it trains: every rank saves a complete checkpoint of the step it was on, every
   job ends, the controller exits 0 and journals the user's decision;
3. ``run --resume`` goes on from that checkpoint; its controller is killed and the user cancels the job with a
   plain ``scancel``: ``run status`` says what Slurm says (the job ended, unseen by the journal), and the run,
   resumed once more, stops (Slurm's accounting names the canceller, the run's own user), resubmitting nothing;
4. ``run --resume`` again; a Slurm operator (another user) cancels the job: a fault, the run resubmits and
   trains to the end.

The final parameters equal the single-process reference run's: no step was skipped or trained on wrong state.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from sailor_hpc.core.checkpoint import latest_complete, read_manifest
from tests.conftest import slurm_missing
from tests.controller import scenario as story_kit
from tests.controller.scenario import Scenario, kind, records_of, step_events
from tests.slurm.cluster import OPERATOR

pytestmark = pytest.mark.slurm

STEPS = 60
PARAM_TOL = MOMENT_TOL = 5e-6


def _cli(sc: Scenario, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["sailor-hpc", *args], cwd=sc.cluster.shared, env=env or sc.env, capture_output=True,
                          text=True, timeout=600)


def _current_job(sc: Scenario) -> str:
    return [r for r in sc.records() if r["kind"] == "submitted"][-1]["job_id"]


def _trained_past(sc: Scenario, step: int, timeout: float = 180.0) -> None:
    """Wait until the run's newest complete checkpoint is past ``step`` (the job trains)."""
    sc.wait_for(f"a checkpoint past step {step}", lambda r: r["kind"] == "checkpoint" and r["step"] > step, timeout)


def _sacct_states(sc: Scenario) -> dict[str, str]:
    """Every job of the run in accounting: id -> state as sacct words it (``CANCELLED by 0``)."""
    prefix = f"sailor-{sc.records()[0]['run_id']}-"
    out = sc.cluster.sacct_once(["-X", "-n", "-P", "-o", "JobID,JobName,State", "-S", "now-1hours"],
                                lambda text: prefix in text)
    return {row[0]: row[2] for row in (line.split("|") for line in out.splitlines())
            if len(row) == 3 and row[1].startswith(prefix)}


@pytest.fixture(scope="module")
def story(slurm_cluster, tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("megatron.core")
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        slurm_missing("the operator's cancel runs scancel as another user: needs root and setpriv (util-linux)")
    root = tmp_path_factory.mktemp("lifecycle")
    data, archive = story_kit.build_inputs(tmp_path_factory, root)
    reference = story_kit.start_reference(root, data, STEPS)
    sc = Scenario(slurm_cluster, root, data, archive, steps=STEPS, save_interval=5)
    out: dict[str, Any] = {"sc": sc, "reference": reference}
    with story_kit.cleaned_up(sc, reference):
        # 1. resumed with Slurm off PATH (its job runs on), the run gives up at once, saying why; --resume with
        # PATH fixed continues it
        sc.start_controller()
        sc.wait_for("the first job", kind("submitted"))
        sc.kill_controller()
        cli = shutil.which("sailor-hpc", path=sc.env["PATH"])
        assert cli is not None, sc.env["PATH"]
        bare = {**sc.env, "PATH": str(Path(cli).parent)}
        sc.proc = subprocess.Popen(sc.command(resume=True), cwd=sc.cluster.shared, env=bare, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        out["gave_up"] = (sc.wait_exit(timeout=120), sc.proc.stdout.read() if sc.proc.stdout else "")
        sc.start_controller(resume=True)
        _trained_past(sc, 5)
        # 2. the user stops it: every rank checkpoints, every job ends, the controller exits 0
        stopped_job = _current_job(sc)
        out["stop"] = _cli(sc, "run", "stop", str(sc.run_dir))
        out["stop_exit"] = sc.wait_exit(timeout=120)
        stop_t = sc.records()[-1]["t"]
        out["after_stop"] = read_manifest(latest_complete(sc.save))["step"]  # older ones are pruned later
        out["stopped_job"] = stopped_job
        # 3. resumed; its controller is killed, and the user cancels the job with scancel meanwhile: status says
        # what Slurm says, and the controller resumed once more stops the run (the user's decision), resubmits nothing
        sc.start_controller(resume=True)
        sc.wait_for("the resumed run's job", lambda r: r["kind"] == "submitted" and r["t"] > stop_t, timeout=120)
        _trained_past(sc, out["after_stop"])
        out["own_cancelled"] = _current_job(sc)
        sc.kill_controller()
        sc.slurm("scancel", out["own_cancelled"])
        sc.cluster.wait_job(out["own_cancelled"], timeout=120)
        out["status_unwatched"] = _cli(sc, "run", "status", str(sc.run_dir), "--no-events")
        sc.start_controller(resume=True)
        out["own_cancel_exit"] = sc.wait_exit(timeout=120)
        out["status_after_cancel"] = _cli(sc, "run", "status", str(sc.run_dir), "--no-events")
        # 4. resumed; an operator cancels the job: a fault, the run resubmits and trains to the end
        cancelled_t = sc.records()[-1]["t"]
        sc.start_controller(resume=True)
        sc.wait_for("the job after the second resume", lambda r: r["kind"] == "submitted" and r["t"] > cancelled_t)
        _trained_past(sc, read_manifest(latest_complete(sc.save))["step"])
        out["operator_cancelled"] = _current_job(sc)
        proc = sc.cluster.as_operator(["scancel", out["operator_cancelled"]])
        assert proc.returncode == 0, proc.stderr
        out["status"] = story_kit.finish(sc, reference)
        out["records"] = sc.records()
        out["sacct"] = _sacct_states(sc)
        out["output"] = sc.controller_output()
    return out


def test_a_run_that_gave_up_resumes_once_the_cause_is_fixed(story):
    rc, said = story["gave_up"]
    assert rc == 1 and "gave up" in said, said
    first = next(r for r in story["records"] if r["kind"] == "gave_up")
    assert "squeue" in first["reason"] or "Slurm" in first["reason"], first
    resumed = records_of(story, "run_resumed")[0]
    assert resumed["was"].startswith("gave up")
    first_job = next(r["job_id"] for r in story["records"] if r["kind"] == "submitted")
    assert any(r["kind"] == "job_running" and r["job_id"] == first_job for r in story["records"])  # adopted, ran on
    assert "resuming" in story["output"] and "gave up" in story["output"]


def test_stop_checkpoints_every_rank_and_ends_every_job(story):
    stop = story["stop"]
    assert stop.returncode == 0 and story["stop_exit"] == 0, stop.stdout + stop.stderr
    recs = story["records"]
    asked = next(i for i, r in enumerate(recs) if r["kind"] == "stop_requested")
    ended = next(i for i, r in enumerate(recs) if r["kind"] == "run_stopped")
    between = [r for r in recs[asked:ended] if r["kind"] in ("signal_sent", "job_gone", "submit_intent")]
    assert [(r["kind"], r.get("job_id")) for r in between] == [("signal_sent", story["stopped_job"]),
                                                               ("job_gone", story["stopped_job"])], between
    stopped = records_of(story, "run_stopped")[0]
    assert stopped["how"] == "stop" and stopped["by"] == "root" and list(stopped["jobs"]) == [story["stopped_job"]]
    # the checkpoint the ranks saved on the signal is the step they were on: nothing trained was lost
    log = next(r["log"] for r in story["records"] if r["kind"] == "submitted" and r["job_id"] == story["stopped_job"])
    last = max(e["step"] for e in step_events(Path(log)) if e.get("event") == "step")
    assert story["after_stop"] == stopped["step"] == last
    # the ranks exit 75 (saved on the signal) and the job, kept from requeueing itself, ends with that code
    assert story["sacct"][story["stopped_job"]] in ("COMPLETED", "FAILED"), story["sacct"]


def test_a_cancel_by_the_runs_user_stops_the_run_and_by_an_operator_is_recovered(story):
    own, other = story["own_cancelled"], story["operator_cancelled"]
    assert story["own_cancel_exit"] == 0
    stops = records_of(story, "run_stopped")
    assert [(s["how"], s["by"], list(s["jobs"])) for s in stops] == [("stop", "root", [story["stopped_job"]]),
                                                                     ("cancelled", "root", [own])]
    recs = story["records"]
    at = next(i for i, r in enumerate(recs) if r["kind"] == "run_stopped" and r["how"] == "cancelled")
    assert recs[at + 1]["kind"] == "controller_started", recs[at + 1]  # nothing resubmitted before the next resume
    unwatched = story["status_unwatched"].stdout
    assert f"job {own} ended (CANCELLED) and the journal does not say so yet" in unwatched, unwatched
    assert "its controller is not running" in unwatched and "newest complete checkpoint on disk: step" in unwatched
    after = story["status_after_cancel"].stdout
    assert "stopped by root (cancelled)" in after and "now: no job of the run in Slurm" in after, after
    sacct = story["sacct"]
    assert sacct[own] == "CANCELLED by 0" and sacct[other] == f"CANCELLED by {65534}", sacct
    gone = next(r for r in recs if r["kind"] == "job_stopped" and r["job_id"] == other)
    assert gone["reason"] == f"cancelled by {OPERATOR}, not the run's user: a fault"  # someone else's cancel ...
    after = [r for r in recs if r["kind"] == "submit_intent"][-1]
    assert after["t"] > gone["t"]  # ... and the run resubmitted
    assert recs[-1]["kind"] == "finished" and recs[-1]["step"] == STEPS


def test_the_run_trains_every_step_and_matches_the_reference(story):
    from tests.megatron_patch.conftest import max_diff
    assert story["status"].returncode == 0, story["status"].stderr
    final = latest_complete(story["sc"].save)
    assert final is not None and read_manifest(final)["step"] == STEPS
    diff = max_diff(final, story["sc"].root / "ref" / f"ref_step_{STEPS}.pt")
    print(f"\nafter {STEPS} steps, stopped, cancelled twice and resumed: max |delta| vs reference {diff}")
    assert diff["param"] <= PARAM_TOL and diff["exp_avg"] <= MOMENT_TOL and diff["exp_avg_sq"] <= MOMENT_TOL


def test_cancel_ends_every_job_at_once_and_the_run_resumes_from_its_checkpoint(slurm_cluster, tmp_path_factory):
    """``run cancel`` while the controller watches a training job: no checkpoint is asked for (no signal), the job
    is cancelled, the controller exits 0 and the run is stopped by its user, to be resumed from its newest
    checkpoint."""
    pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp("cancel")
    data, archive = story_kit.build_inputs(tmp_path_factory, root)
    sc = Scenario(slurm_cluster, root, data, archive, steps=STEPS, save_interval=5)
    try:
        sc.start_controller()
        _trained_past(sc, 0)
        job = _current_job(sc)
        cancel = _cli(sc, "run", "cancel", str(sc.run_dir))
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        assert sc.wait_exit(timeout=120) == 0, sc.controller_output()
        recs = sc.records()
        asked = next(i for i, r in enumerate(recs) if r["kind"] == "stop_requested")
        assert recs[asked]["how"] == "cancel" and not [r for r in recs[asked:] if r["kind"] == "signal_sent"]
        stopped = recs[-1]
        assert stopped["kind"] == "run_stopped" and stopped["how"] == "cancel" and stopped["jobs"] == {job: "CANCELLED"}
        assert sc.cluster.wait_job(job, timeout=60) == ["CANCELLED"]
        status = _cli(sc, "run", "status", str(sc.run_dir), "--no-events")
        assert "stopped by root (cancel)" in status.stdout and "now: no job of the run in Slurm" in status.stdout
    finally:
        sc.cleanup()
