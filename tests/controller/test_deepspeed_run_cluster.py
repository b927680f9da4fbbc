"""``run --runtime deepspeed`` on the real local Slurm cluster: DeepSpeed trains the run to its end across a restart.

tiny-gpt, global batch 64, at most 2 GPUs (2 CPU ranks), 20 steps, a checkpoint every 5. The controller plans
among the plans DeepSpeed's engine runs and its job launches ``megatron_patch.ds_runtime.launch``. Once the
first job has saved a checkpoint its ranks are paused (so the test never races the run's last step) and sent
SIGTERM, as preemption does: the job saves at the step it is at and exits 75; the controller re-plans and the
second job, again DeepSpeed, loads that checkpoint and trains to step 20.

Checked against independent facts: both jobs' logs show the DeepSpeed runtime starting (its ``start`` record
carries DeepSpeed's version) from the DeepSpeed launch module in the job script; the second job loaded the
step the first saved on its signal; every logged step's loss is the single-process reference's (same
parameters, same samples) and the final parameters and Adam moments equal the reference's step 20, not its
step 19.

``run --runtime auto --min-gain 1%`` (:func:`auto_story`): megatron_patch's heterogeneous plan first, then the
controller's grow onto DeepSpeed's plan, which loads megatron_patch's checkpoint; compared with the reference too.
"""
from __future__ import annotations

import importlib.util
import json
import signal
from pathlib import Path
from typing import Any

import pytest

from sailor_hpc.core.checkpoint import latest_complete, read_manifest
from tests.conftest import slurm_missing
from tests.controller import scenario
from tests.slurm import ranks

if importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("megatron") is None:
    slurm_missing("needs the deepspeed and runtime extras (make install-test)", module=True)

STEPS = 20
# the reference is one process (megatron_patch.reference): fp32 summation order differs, as in test_resize_cluster
PARAM_TOL = 5e-6
MOMENT_TOL = 5e-6


@pytest.fixture(scope="module")
def story(slurm_cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("ds-run")
    data, archive = scenario.build_inputs(tmp_path_factory, root)
    reference = scenario.start_reference(root, data, STEPS)
    sc = scenario.Scenario(slurm_cluster, root, data, archive, steps=STEPS, extra_args=["--runtime", "deepspeed"])
    with scenario.cleaned_up(sc, reference):
        sc.start_controller()
        first = sc.wait_for("the first job submitted", scenario.kind("submitted", attempt=1), timeout=180)
        ranks.wait_in_log(Path(first["log"]), '"event": "saved"', timeout=240)
        ranks.pause(sc.plan_file(1))  # at most a few steps past the first checkpoint
        sc.slurm("scancel", "--signal=TERM", first["job_id"])  # what preemption (or the time-limit warning) sends
        ranks.resume(sc.plan_file(1), once_pending=signal.SIGTERM)
        status = scenario.finish(sc, reference)
        return {"sc": sc, "records": sc.records(), "status": status, "root": root}


def test_every_job_is_planned_for_and_launched_by_deepspeed(story):
    print("\n" + story["status"].stdout)
    sc = story["sc"]
    assert json.loads((sc.run_dir / "run.json").read_text())["runtime"] == "deepspeed"
    plans = scenario.records_of(story, "plan")
    assert len(plans) == 2 and all(p["runtime"] == "deepspeed" for p in plans), plans
    for attempt in (1, 2):
        plan = json.loads(sc.plan_file(attempt).read_text())
        assert plan["notes"]["deepspeed"]["zero_stage"] in (0, 1), plan["notes"]  # the planner's DeepSpeed space
        assert "-m megatron_patch.ds_runtime.launch" in (sc.run_dir / "scripts" / f"attempt-{attempt:03d}.sbatch").read_text()
        log = Path(next(r for r in story["records"] if r["kind"] == "submitted" and r["attempt"] == attempt)["log"])
        starts = [e for e in scenario.step_events(log) if e.get("event") == "start"]
        assert starts and all(e["deepspeed"].startswith("0.19") for e in starts), starts


def test_the_second_job_continues_from_the_checkpoint_saved_on_the_signal(story):
    stopped = next(r for r in scenario.records_of(story, "job_stopped") if r["attempt"] == 1)
    assert stopped["reason"] == "signal_saved", stopped
    assert 5 <= stopped["step"] < STEPS
    first2 = next(r for r in scenario.records_of(story, "first_step") if r["attempt"] == 2)
    assert first2["loaded_step"] == stopped["step"] and first2["step"] == stopped["step"] + 1, (first2, stopped)
    assert scenario.records_of(story, "finished")[0]["step"] == STEPS
    assert [r["attempt"] for r in scenario.records_of(story, "submit_intent")] == [1, 2]


def test_losses_and_final_state_equal_the_single_process_reference(story):
    from tests.megatron_patch.conftest import max_diff
    sc, root = story["sc"], story["root"]
    ref_losses = json.loads((root / "ref" / "losses.json").read_text())
    seen: set[int] = set()
    for attempt in (1, 2):
        log = Path(next(r for r in story["records"] if r["kind"] == "submitted" and r["attempt"] == attempt)["log"])
        for e in (e for e in scenario.step_events(log) if e.get("event") == "step"):
            assert abs(e["loss"] - ref_losses[e["step"] - 1]) < 1e-5, (attempt, e)
            assert e["consumed_samples"] == e["step"] * scenario.GBS
            seen.add(e["step"])
    assert seen == set(range(1, STEPS + 1))
    final = latest_complete(sc.save)
    assert final is not None and read_manifest(final)["step"] == STEPS
    diff = max_diff(final, root / "ref" / f"ref_step_{STEPS}.pt")
    print(f"\nDeepSpeed, {STEPS} steps in 2 jobs: max |delta| vs the single-process reference {diff}")
    assert diff["param"] <= PARAM_TOL
    assert diff["exp_avg"] <= MOMENT_TOL and diff["exp_avg_sq"] <= MOMENT_TOL
    one_less = max_diff(final, root / "ref" / f"ref_step_{STEPS - 1}.pt")  # negative control: a step apart
    assert one_less["param"] > 100 * PARAM_TOL, one_less


# ----------------------------------------------------------------------------------------------- runtime auto
AUTO_STEPS = 60  # the first job's ranks are paused after its first step: the rest leaves the grow steps to act on


@pytest.fixture(scope="module")
def auto_story(slurm_cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``--runtime auto --min-gain 1%``: with one A100 idle megatron_patch's heterogeneous plan (1 A100 + 1 V100) is
    3.5 % ahead of DeepSpeed's best (tests/controller/test_deepspeed_run.py), so the first job is megatron_patch's.
    A blocker ends: on 2 A100 DeepSpeed's plan is as fast as megatron_patch's, so the bigger job the controller
    starts beside the running one is DeepSpeed's, and it loads the checkpoint megatron_patch saved on SIGUSR1."""
    root = tmp_path_factory.mktemp("auto-run")
    data, archive = scenario.build_inputs(tmp_path_factory, root)
    reference = scenario.start_reference(root, data, AUTO_STEPS)
    sc = scenario.Scenario(slurm_cluster, root, data, archive, steps=AUTO_STEPS,
                  extra_args=["--runtime", "auto", "--min-gain", "1%"])
    with scenario.cleaned_up(sc, reference):
        sc.blocker("a100-1", 3)
        b_a100 = sc.blocker("a100-2", 4)
        sc.start_controller()
        sc.wait_for("the first step", scenario.kind("first_step", attempt=1), timeout=180)
        ranks.pause(sc.plan_file(1))
        sc.slurm("scancel", b_a100)
        sc.wait_for("the bigger job submitted", scenario.kind("grow_submitted"), timeout=120)
        sc.wait_for("the old job asked to hand over", scenario.kind("signal_sent", reason="resize"), timeout=240)
        ranks.resume(sc.plan_file(1), once_pending=signal.SIGUSR1)
        status = scenario.finish(sc, reference)
        return {"sc": sc, "records": sc.records(), "status": status, "root": root}


def test_auto_moves_from_megatron_patch_to_deepspeed_through_the_checkpoint(auto_story):
    print("\n" + auto_story["status"].stdout)
    sc, records = auto_story["sc"], auto_story["records"]
    plans = scenario.records_of(auto_story, "plan")
    assert [p["runtime"] for p in plans] == ["megatron_patch", "deepspeed"], plans
    assert plans[0]["gpus"] == {"a100": 1, "v100": 1} and plans[1]["gpus"] == {"a100": 2}
    assert all("min_gain 1 %" in p["runtime_reason"] for p in plans), plans
    for attempt, module in ((1, "megatron_patch.launch"), (2, "megatron_patch.ds_runtime.launch")):
        scripts = sorted((sc.run_dir / "scripts").glob(f"attempt-{attempt:03d}*.sbatch"))  # a bundle: one per partition
        assert len(scripts) == (2 if attempt == 1 else 1), scripts
        assert all(f"-m {module} " in script.read_text() for script in scripts), scripts
    stopped = next(r for r in scenario.records_of(auto_story, "job_stopped") if r["attempt"] == 1)
    first2 = next(r for r in scenario.records_of(auto_story, "first_step") if r["attempt"] == 2)
    assert stopped["reason"] == "resize" and first2["loaded_step"] == stopped["step"], (stopped, first2)
    grow = next(r for r in records if r["kind"] == "grow_submitted")
    assert grow["next_attempt"] == 2
    events2 = scenario.step_events(Path(grow["log"]))
    assert [e["runtime"] for e in events2 if e.get("event") == "start"] == ["deepspeed", "deepspeed"]
    for rank in (0, 1):  # each rank waited for the gate before loading: megatron_patch's job was gone by then
        mine = [e["event"] for e in events2 if e.get("rank") == rank and e.get("event") in ("waiting", "go", "loaded")]
        assert mine == ["waiting", "go", "loaded"], (rank, mine)
    ref_losses = json.loads((auto_story["root"] / "ref" / "losses.json").read_text())
    for e in (e for e in events2 if e.get("event") == "step"):
        assert abs(e["loss"] - ref_losses[e["step"] - 1]) < 1e-5, e
    from tests.megatron_patch.conftest import max_diff
    final = latest_complete(sc.save)
    assert final is not None and read_manifest(final)["step"] == AUTO_STEPS
    diff = max_diff(final, auto_story["root"] / "ref" / f"ref_step_{AUTO_STEPS}.pt")
    print(f"\nmegatron_patch (1 A100 + 1 V100) then DeepSpeed (2 A100), {AUTO_STEPS} steps: max |delta| vs the "
          f"single-process reference {diff}")
    assert diff["param"] <= PARAM_TOL
    assert diff["exp_avg"] <= MOMENT_TOL and diff["exp_avg_sq"] <= MOMENT_TOL
