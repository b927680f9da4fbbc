"""Shrink in place on the real local Slurm cluster: a drained and a downed node handled inside the job.

The site is local-lab with one GPU per A100 node (so a 2-GPU plan spans both A100 nodes, the only way
a node of the job can be lost while another survives: Slurm ends a het job that loses a node, see
sailor_hpc.controller.inplace). Blockers hold every V100.

1. The run starts on 2 A100 (a100-1, a100-2; one job of two nodes).
2. ``state=drain`` of a100-2: the controller asks the job to checkpoint (SIGUSR1); the job's batch
   script sees the drained node, re-plans on a100-1 (1 A100), releases a100-2 from the allocation and
   starts the next ``srun`` step from that checkpoint: same job id, no queue.
3. ``state=resume``: 2 A100 are worth a restart -> a new job on both nodes (today's resize).
4. The controller is SIGKILLed, then ``state=down`` of a100-2: Slurm kills the step there; the job
   (``--no-kill``) survives on a100-1, its batch script re-plans on it by itself and resumes from the
   newest complete checkpoint; the controller, resumed, journals that from the job's log.

Checked against independent facts: sacct shows each job with two training steps, the journal has two
jobs for three allocation changes, the final parameters equal a single-process reference run of the
same steps (<= 1e-6), every step's loss is the reference's and consumed samples = step x gbs.
"""
from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from sailor_hpc.core.checkpoint import latest_complete, read_manifest
from tests.controller import scenario as story_kit
from tests.controller.scenario import GBS, Scenario, kind, step_events
from tests.slurm import ranks

STEPS = 120
PARAM_TOL = 1e-6


@pytest.fixture(scope="module")
def story(slurm_cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp("inplace")
    data, archive = story_kit.build_inputs(tmp_path_factory, root)
    reference = story_kit.start_reference(root, data, STEPS)
    sc = Scenario(slurm_cluster, root, data, archive, steps=STEPS, site=story_kit.one_gpu_a100_site(root),
                  extra_args=["--restart-cost", "0", "--no-resident-ranks"])  # the srun-step loop
    times: dict[str, float] = {}
    with story_kit.cleaned_up(sc, reference):
        sc.blocker("v100-1", 8)
        sc.blocker("v100-2", 8)
        sc.start_controller()
        sc.wait_for("the first step", kind("first_step", attempt=1))
        sc.wait_for("a checkpoint", lambda r: r["kind"] == "checkpoint" and r["step"] >= sc.save_interval)
        times["drain"] = sc.set_node("a100-2", "drain")
        sc.wait_for("the first step after the drain", lambda r: r["kind"] == "recovery" and r.get("in_place"))
        times["resume"] = sc.set_node("a100-2", "resume")
        # the old job is paused while the bigger one starts, and the bigger one once it trained a step: the
        # changes below then never race with the run's last step, however slow this machine is today
        inplace_plan = sc.wait_for("the in-place step", kind("in_place", attempt=1))["plan_file"]
        grow = sc.wait_for("the bigger job submitted", kind("grow_submitted"))
        ranks.pause(inplace_plan)
        sc.wait_for("the old job asked to hand over", kind("signal_sent", reason="resize"))
        ranks.resume(inplace_plan, once_pending=signal.SIGUSR1)
        ranks.wait_in_log(Path(grow["log"]), '"event": "step"')
        ranks.pause(grow["plan_file"])
        # the handover journaled whole (the grown job is the run's attempt) before the controller dies
        sc.wait_for("the grown job's first step journaled", kind("first_step", attempt=2))
        times["killed"] = sc.kill_controller()  # the job re-plans in place by itself, without a controller
        times["down"] = sc.set_node("a100-2", "down")
        ranks.wait_in_log(Path(grow["log"]), '"event": "in_place"')
        sc.start_controller(resume=True)
        status = story_kit.finish(sc, reference)
        records = sc.records()
        jobs = [r["job_id"] for r in records if r["kind"] == "submitted"]
        steps = {j: slurm_cluster.sacct_once(["-n", "-P", "-j", j, "-o", "JobID,State"],
                                             lambda out: "RUNNING" not in out and "PENDING" not in out) for j in jobs}
        return {"sc": sc, "records": records, "times": times, "sacct": steps, "status": status, "root": root}

_records = story_kit.records_of


def test_drain_and_down_are_handled_inside_the_job(story):
    print("\n" + story["status"].stdout)
    assert [r["gpus"] for r in _records(story, "plan")] == [{"a100": 2}, {"a100": 2}]
    assert [r["attempt"] for r in _records(story, "submit_intent")] == [1, 2]  # three changes, two jobs
    drain, down = _records(story, "in_place")
    assert drain["attempt"] == 1 and drain["lost"]["a100-2"].startswith(("drain", "drng")), drain
    assert drain["released"] == ["a100-2"] and drain["gpus"] == {"a100": 1} and drain["nodes"] == ["a100-1"]
    assert down["attempt"] == 2 and down["nodes"] == ["a100-1"] and down["gpus"] == {"a100": 1}, down
    assert down["lost"]["a100-2"] != "", down
    # the down was handled while no controller ran; the resumed one journaled it from the job's log
    starts = _records(story, "controller_started")
    assert [s["resumed"] for s in starts] == [False, True] and down["seq"] > starts[1]["seq"]
    assert down["t_step_end"] < starts[1]["t"]
    assert not _records(story, "in_place_refused")
    # the controller's one signal of attempt 1 is the drain's checkpoint request; the grow is today's resize
    assert [(r["attempt"], r["reason"]) for r in _records(story, "signal_sent")] == [(1, "node draining"), (1, "resize")]


def test_grows_without_a_gap(story):
    """The bigger job is submitted while the old one trains; the old one checkpoints only once the new one
    runs, and the new one's ranks (started already) load exactly that checkpoint."""
    records = story["records"]
    grow = _records(story, "grow_submitted")[0]
    running = _records(story, "grow_running")[0]
    stopped = next(r for r in _records(story, "job_stopped") if r["attempt"] == 1)
    signal = next(r for r in _records(story, "signal_sent") if r["reason"] == "resize")
    assert grow["attempt"] == 1 and grow["next_attempt"] == 2 and grow["gpus"] == {"a100": 2}
    assert grow["seq"] < running["seq"] < signal["seq"] < stopped["seq"]  # old job trained until the new one ran
    gone = next(r for r in records if r["kind"] == "job_gone" and r.get("attempt") == 1)
    intent = next(r for r in _records(story, "submit_intent") if r["attempt"] == 2)
    assert intent["handover_from"] == 1 and intent["seq"] > gone["seq"]  # never two jobs writing checkpoints
    first = next(r for r in _records(story, "first_step") if r["attempt"] == 2)
    newest = max(r["step"] for r in _records(story, "checkpoint") if r["seq"] < first["seq"])
    assert first["loaded_step"] == stopped["step"] == newest and first["step"] == newest + 1  # no step lost
    events = [e for e in step_events(Path(grow["log"])) if e.get("event") in ("waiting", "go", "loaded")]
    for rank in (0, 1):  # each rank started, waited for the old job's ranks to be gone, then loaded
        assert [e["event"] for e in events if e["rank"] == rank][:3] == ["waiting", "go", "loaded"], events
    rec = next(r for r in _records(story, "recovery") if r["attempt"] == 2)
    assert rec["handover"] is True and rec["new_job"] is True
    print(f"\ngrow 1 -> 2 A100: ranks idle {rec['ranks_idle_s']:.1f} s (old job's last step to the new one's first), "
          f"the new job queued {rec['queue_wait_s']:.1f} s while the old one trained")


def test_sacct_shows_one_job_with_several_steps_per_change(story):
    for job, text in story["sacct"].items():
        print(f"\nsacct -j {job}:\n{text}")
        steps = sorted({line.split("|")[0] for line in text.splitlines()
                        if line.split("|")[0].split(".")[-1].isdigit() and "." in line.split("|")[0]})
        assert steps == [f"{job}.0", f"{job}.1"], (job, text)


def test_each_in_place_step_resumes_from_the_newest_checkpoint(story):
    records = story["records"]
    for change in _records(story, "in_place"):
        rec = next(r for r in _records(story, "recovery") if r.get("in_place") and r["seq"] > change["seq"])
        newest = max(r["step"] for r in _records(story, "checkpoint") if r["seq"] < rec["seq"])
        assert rec["loaded_step"] == newest and rec["step"] == newest + 1, (change, rec)
        assert rec["new_job"] is False and rec["queue_wait_s"] == 0.0
        print(f"\n{rec['trigger']} in job {change['job_id']}: ranks idle {rec['ranks_idle_s']:.1f} s, "
              f"change -> first step {rec['recovery_s']:.1f} s, no new job")
    # a drain loses nothing: the job saved at the step it stopped
    drain = _records(story, "in_place")[0]
    stopped_at = max(r["step"] for r in records if r["kind"] == "checkpoint" and r["seq"] < drain["seq"])
    first = next(r for r in _records(story, "recovery") if r.get("in_place"))
    assert first["loaded_step"] == stopped_at


def test_final_parameters_equal_the_uninterrupted_reference(story):
    from tests.megatron_patch.conftest import max_diff
    sc = story["sc"]
    final = latest_complete(sc.save)
    assert final is not None and read_manifest(final)["step"] == STEPS
    diff = max_diff(final, story["root"] / "ref" / f"ref_step_{STEPS}.pt")
    print(f"\nafter {STEPS} steps, 2 jobs, 4 steps, 2 plans: max |delta| vs reference {diff}")
    assert diff["param"] <= PARAM_TOL
    one_less = max_diff(final, story["root"] / "ref" / f"ref_step_{STEPS - 1}.pt")
    assert one_less["param"] > 100 * PARAM_TOL  # negative control


def test_consumed_samples_and_losses_match_the_reference(story):
    records = story["records"]
    ref_losses = json.loads((story["root"] / "ref" / "losses.json").read_text())
    logs = {r["log"] for r in records if r["kind"] == "submitted"}
    seen = set()
    for log in logs:
        for e in step_events(Path(log)):
            if e.get("event") == "step":
                assert abs(e["loss"] - ref_losses[e["step"] - 1]) < 1e-5, e
                assert e["consumed_samples"] == e["step"] * GBS
                seen.add(e["step"])
    assert set(range(1, STEPS + 1)) <= seen
    assert all(r["consumed_samples"] == r["step"] * GBS for r in records if r["kind"] == "checkpoint")
    assert read_manifest(latest_complete(story["sc"].save))["consumed_samples"] == STEPS * GBS


def test_status_shows_each_change(story):
    out = story["status"].stdout
    assert story["status"].returncode == 0, story["status"].stderr
    rows = out[out.index("allocation changes:"):].splitlines()
    assert sum(" y " in f" {row} " for row in rows) == 2 and sum(" n " in f" {row} " for row in rows) == 1, out
