"""Resident ranks on the real local Slurm cluster: the surviving rank of a drained or downed node's job keeps its
process (``sailor-hpc run --resident-ranks``; ``sailor_hpc.controller.job_agent``).

local-lab with one GPU per A100 node (a 2-GPU plan spans both A100 nodes), blockers on every V100:

1. the run starts on a100-1 + a100-2, one job, one ``srun`` step per node;
2. ``drain`` of a100-2: the controller asks for a checkpoint (SIGUSR1), both ranks save and hold, the job's agent
   re-plans on a100-1, releases a100-2, and a100-1's rank goes on under the 1-GPU plan in the same process,
   its layers from its own memory;
3. ``resume``: a bigger job is submitted beside it and takes over (a resize: the old job's ranks save and leave);
4. ``down`` of a100-2: Slurm ends that node's step, a100-1's rank sees its peer's connection close, holds, and
   goes on under the 1-GPU plan in the same process from the newest checkpoint.

Checked: both changes are in place (no new job) and resident (no new step: sacct shows one step per node of
each job), a100-1's rank has the same PID before and after each change, and the final parameters equal a
single-process reference run of the same steps (<= 1e-6), every step's loss the reference's.
"""
from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from sailor_hpc.core.checkpoint import latest_complete, read_manifest
from tests.controller import scenario as story_kit
from tests.controller.scenario import Scenario, kind, step_events
from tests.slurm import ranks

STEPS = 100


@pytest.fixture(scope="module")
def story(slurm_cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp("resident")
    data, archive = story_kit.build_inputs(tmp_path_factory, root)
    reference = story_kit.start_reference(root, data, STEPS)
    sc = Scenario(slurm_cluster, root, data, archive, steps=STEPS, site=story_kit.one_gpu_a100_site(root),
                  extra_args=["--restart-cost", "0", "--resident-ranks"])
    with story_kit.cleaned_up(sc, reference):
        sc.blocker("v100-1", 8)
        sc.blocker("v100-2", 8)
        sc.start_controller()
        sc.wait_for("the first step", kind("first_step", attempt=1))
        sc.wait_for("a checkpoint", lambda r: r["kind"] == "checkpoint" and r["step"] >= sc.save_interval)
        sc.set_node("a100-2", "drain")
        sc.wait_for("the first step after the drain", lambda r: r["kind"] == "recovery" and r.get("in_place"))
        sc.wait_for("the in-place plan", kind("in_place", attempt=1))
        inplace_plan = sc.plan_file(1)  # resident ranks keep the command line they started with
        sc.set_node("a100-2", "resume")
        sc.wait_for("the bigger job submitted", kind("grow_submitted"))
        ranks.pause(inplace_plan)
        sc.wait_for("the old job asked to hand over", kind("signal_sent", reason="resize"))
        ranks.resume(inplace_plan, once_pending=signal.SIGUSR1)
        sc.wait_for("the grown job's first step journaled", kind("first_step", attempt=2))
        last = sc.records()[-1]["seq"]
        sc.wait_for("a checkpoint of the grown job",
                    lambda r: r["kind"] == "checkpoint" and r["seq"] > last and r.get("attempt") == 2)
        sc.set_node("a100-2", "down")
        sc.wait_for("the first step after the node went down",
                    lambda r: r["kind"] == "recovery" and r.get("in_place") and r["attempt"] == 2)
        status = story_kit.finish(sc, reference)
        records = sc.records()
        jobs = [r["job_id"] for r in records if r["kind"] == "submitted"]
        sacct = {j: slurm_cluster.sacct_once(["-n", "-P", "-j", j, "-o", "JobID,State,NodeList"],
                                             lambda out: "RUNNING" not in out and "PENDING" not in out) for j in jobs}
        logs = {r["attempt"]: Path(r["log"]) for r in records if r["kind"] == "submitted"}
        return {"records": records, "status": status, "sacct": sacct, "logs": logs, "sc": sc, "root": root}


_records = story_kit.records_of


def test_drain_and_down_keep_the_surviving_rank_in_its_process(story):
    print("\n" + story["status"].stdout)
    drain, down = _records(story, "in_place")
    assert drain["attempt"] == 1 and drain["resident"] and drain["released"] == ["a100-2"], drain
    assert down["attempt"] == 2 and down["resident"] and down["nodes"] == ["a100-1"], down
    assert not _records(story, "in_place_refused")
    for log in story["logs"].values():
        starts = [e for e in step_events(log) if e.get("event") == "start"]
        survivor = [e for e in starts if e["partition"] == "a100" and e.get("epoch") is not None]
        by_epoch = {e["epoch"]: e for e in survivor if e["rank"] == 0}
        assert set(by_epoch) == {0, 1}, starts
        # rank 0 of both plans: one process, before and after the change
        assert by_epoch[0]["pid"] == by_epoch[1]["pid"], by_epoch
        assert by_epoch[1]["world_size"] == 1 and by_epoch[0]["world_size"] == 2
    for change in (drain, down):
        rec = next(r for r in _records(story, "recovery") if r.get("in_place") and r["seq"] > change["seq"])
        assert rec["new_job"] is False
        print(f"{rec['trigger']}: ranks idle {rec['ranks_idle_s']:.2f} s, in the same processes")


def test_sacct_shows_one_step_per_node_and_no_new_step(story):
    for job, text in story["sacct"].items():
        print(f"\nsacct -j {job}:\n{text}")
        steps = [line.split("|") for line in text.splitlines() if line.split("|")[0].split(".")[-1].isdigit()
                 and "." in line.split("|")[0]]
        assert len(steps) == 2 and {s[2] for s in steps} == {"a100-1", "a100-2"}, text


def test_final_parameters_equal_the_uninterrupted_reference(story):
    from tests.megatron_patch.conftest import max_diff
    final = latest_complete(story["sc"].save)
    assert final is not None and read_manifest(final)["step"] == STEPS
    diff = max_diff(final, story["root"] / "ref" / f"ref_step_{STEPS}.pt")
    print(f"\nafter {STEPS} steps, 2 jobs, 2 resident changes: max |delta| vs reference {diff}")
    assert diff["param"] <= 1e-6
    ref_losses = json.loads((story["root"] / "ref" / "losses.json").read_text())
    for log in story["logs"].values():
        for e in step_events(log):
            if e.get("event") == "step":
                assert abs(e["loss"] - ref_losses[e["step"] - 1]) < 1e-5, e
