"""Resident ranks of a mixed-GPU plan on the real local Slurm cluster: a drain and a node loss recovered in place,
the surviving ranks in their processes (``sailor-hpc run --resident-ranks``; ``sailor_hpc.controller.job_agent``).

local-lab with one GPU per node in both partitions; a blocker holds a100-2. Slurm ends a whole het job when one
of its nodes goes down, so the controller runs the mixed plan as a *bundle*: one plain ``--no-kill`` job per
partition, submitted together, one rendezvous, one resident folder.

1. the run starts on a100-1 + v100-1 + v100-2 (1 A100 + a 2-stage V100 pipeline): a bundle of an A100 job and a
   V100 job, one ``srun`` step per node;
2. ``drain`` of v100-2: the controller asks for a checkpoint (SIGUSR1, to both jobs), every rank saves and holds,
   the A100 job's agent re-plans on a100-1 + v100-1, releases v100-2 from the V100 job, and both surviving ranks
   go on under the new plan in their processes;
3. ``resume``: a bigger bundle is submitted beside it and takes over (a resize: the old ranks save and leave);
4. ``down`` of v100-2: Slurm ends that node's step only (the V100 job lives on, on v100-1), the ranks still
   running see their peer's connection close, hold, and go on under the 2-GPU plan in their processes;
5. ``down`` of v100-1, the V100 job's batch node: Slurm ends that job (FAILED), its agent with it; its rank's
   SIGTERM makes every rank save (the A100 job's agent is held back meanwhile, so the controller sees that
   checkpoint first and must not end the bundle on it); the A100 job's agent learns the end from Slurm, takes
   the job's nodes as lost, and the A100 rank goes on alone under a 1-GPU plan in its process.

Checked: both changes are in place (no new job) and resident (no new step: sacct shows one step per node of each
job), the surviving ranks have the same PIDs before and after each change, and the final parameters equal a
single-process reference run of the same steps (<= 1e-6), every step's loss the reference's.
"""
from __future__ import annotations

import json
import os
import signal
import time
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
    sc = Scenario(slurm_cluster, root, data, archive, steps=STEPS, site=story_kit.one_gpu_site(root),
                  extra_args=["--restart-cost", "0", "--min-gain", "1%", "--max-gpus", "3", "--resident-ranks"])
    with story_kit.cleaned_up(sc, reference):
        sc.blocker("a100-2", 4)
        sc.start_controller()
        sc.wait_for("the first step", kind("first_step", attempt=1))
        sc.wait_for("a checkpoint", lambda r: r["kind"] == "checkpoint" and r["step"] >= sc.save_interval)
        sc.set_node("v100-2", "drain")
        sc.wait_for("the first step after the drain", lambda r: r["kind"] == "recovery" and r.get("in_place"))
        sc.wait_for("the in-place plan", kind("in_place", attempt=1))
        inplace_plan = sc.plan_file(1)  # resident ranks keep the command line they started with
        sc.set_node("v100-2", "resume")
        sc.wait_for("the bigger bundle submitted", kind("grow_submitted"))
        ranks.pause(inplace_plan)
        sc.wait_for("the old bundle asked to hand over", kind("signal_sent", reason="resize"))
        ranks.resume(inplace_plan, once_pending=signal.SIGUSR1)
        sc.wait_for("the grown bundle's first step journaled", kind("first_step", attempt=2))
        last = sc.records()[-1]["seq"]
        sc.wait_for("a checkpoint of the grown bundle",
                    lambda r: r["kind"] == "checkpoint" and r["seq"] > last and r.get("attempt") == 2)
        sc.set_node("v100-2", "down")
        sc.wait_for("the first step after the node went down",
                    lambda r: r["kind"] == "recovery" and r.get("in_place") and r["attempt"] == 2)
        last = sc.records()[-1]["seq"]
        # slurmd's SIGTERM to the V100 job makes every rank save and hold: with the lead's agent held back, the
        # controller sees that checkpoint before the agent's answer, and must wait for it rather than end the job
        lead = ranks.agent_pids(sc.plan_file(2), part=0)
        assert len(lead) == 1, lead
        os.kill(lead[0], signal.SIGSTOP)
        try:
            sc.set_node("v100-1", "down")
            sc.wait_for("the checkpoint saved on Slurm's SIGTERM",
                        lambda r: r["kind"] == "checkpoint" and r["seq"] > last)
            time.sleep(4 * sc.poll_s)  # the controller's next looks at it
        finally:
            os.kill(lead[0], signal.SIGCONT)
        sc.wait_for("the first step after the V100 job's batch node went down",
                    lambda r: r["kind"] == "recovery" and r.get("in_place") and r["attempt"] == 2 and r["seq"] > last)
        status = story_kit.finish(sc, reference)
        records = sc.records()
        bundles = [r["job_id"] for r in records if r["kind"] == "submitted"]
        sacct = {j: slurm_cluster.sacct_once(["-n", "-P", "-j", j, "-o", "JobID,State,NodeList"],
                                             lambda out: "RUNNING" not in out and "PENDING" not in out) for j in bundles}
        logs = {r["attempt"]: Path(r["log"]) for r in records if r["kind"] == "submitted"}
        return {"records": records, "status": status, "sacct": sacct, "logs": logs, "sc": sc, "root": root}


_records = story_kit.records_of


def _starts(story: dict[str, Any], attempt: int) -> list[dict[str, Any]]:
    """The resident ranks' start events of an attempt's bundle, from every job's log (they lie side by side)."""
    bundle = next(r["job_id"] for r in _records(story, "submitted") if r["attempt"] == attempt)
    folder = story["logs"][attempt].parent
    return [e for j in bundle.split(",") for log in folder.glob(f"*-{j}.out") for e in step_events(log)
            if e.get("event") == "start" and e.get("epoch") is not None]


def test_every_attempt_is_a_bundle_of_one_job_per_partition(story):
    print("\n" + story["status"].stdout)
    for r in _records(story, "submitted"):
        assert len(r["job_id"].split(",")) == 2, r


def test_drain_and_down_keep_the_surviving_ranks_in_their_processes(story):
    drain, down, batch = _records(story, "in_place")
    assert drain["attempt"] == 1 and drain["resident"] and drain["released"] == ["v100-2"], drain
    assert down["attempt"] == 2 and down["resident"] and down["nodes"] == ["a100-1", "v100-1"], down
    assert down["gpus"] == {"a100": 1, "v100": 1}, down
    # the V100 job ended with its batch node: its nodes are lost, the A100 job goes on alone
    assert batch["attempt"] == 2 and batch["resident"] and batch["nodes"] == ["a100-1"], batch
    assert batch["gpus"] == {"a100": 1} and "v100-1" in batch["lost"], batch
    assert not _records(story, "in_place_refused")
    assert [r["attempt"] for r in _records(story, "submitted")] == [1, 2]  # no new bundle after the batch node
    # the run's jobs ended as the A100 job did: the V100 job's NODE_FAIL was answered in place
    assert [r["state"] for r in _records(story, "job_gone") if r["attempt"] == 2] == ["COMPLETED"]
    for change, partitions in ((drain, {"a100", "v100"}), (down, {"a100", "v100"}), (batch, {"a100"})):
        starts = _starts(story, change["attempt"])
        before = {e["pid"] for e in starts if e["epoch"] == 0}
        after = [e for e in starts if e["epoch"] == change["step_index"]]
        # the ranks of the new plan: processes of the old plan, not new ones
        assert len(before) == 3 and len(after) == len(partitions) and {e["pid"] for e in after} <= before, starts
        assert {e["partition"] for e in after} == partitions, after
        rec = next(r for r in _records(story, "recovery") if r.get("in_place") and r["seq"] > change["seq"])
        assert rec["new_job"] is False
        print(f"{rec['trigger']}: ranks idle {rec['ranks_idle_s']:.2f} s, in the same processes")


def test_sacct_shows_one_step_per_node_and_no_new_step(story):
    for bundle, text in story["sacct"].items():
        print(f"\nsacct -j {bundle}:\n{text}")
        steps = [line.split("|") for line in text.splitlines() if "." in line.split("|")[0]
                 and line.split("|")[0].split(".")[-1].isdigit()]
        assert sorted(s[2] for s in steps) == ["a100-1", "v100-1", "v100-2"], text


def test_final_parameters_equal_the_uninterrupted_reference(story):
    from tests.megatron_patch.conftest import max_diff
    final = latest_complete(story["sc"].save)
    assert final is not None and read_manifest(final)["step"] == STEPS
    diff = max_diff(final, story["root"] / "ref" / f"ref_step_{STEPS}.pt")
    print(f"\nafter {STEPS} steps, 2 bundles, 3 resident changes: max |delta| vs reference {diff}")
    assert diff["param"] <= 1e-6
    ref_losses = json.loads((story["root"] / "ref" / "losses.json").read_text())
    for log in story["logs"].values():
        for e in step_events(log):
            if e.get("event") == "step":
                assert abs(e["loss"] - ref_losses[e["step"] - 1]) < 1e-5, e
