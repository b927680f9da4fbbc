"""Jobs that can start, on the real local Slurm cluster (local-lab with one GPU per A100 node, every V100 held by
blockers, so a 2-GPU plan spans both A100 nodes).

- A node goes DOWN while the run's job pends: Slurm says the job waits for nodes that are down ("Nodes required
  for job are DOWN, DRAINED ..."), which does not clear soon. The controller cancels it and re-plans on what is
  free: one A100 (a100-1 still shows 4 idle GPUs in Slurm, but a job's two nodes are two nodes), and the new job
  excludes the down node. Every job pends 15 s first (``--begin``), so the node goes down while it pends.
- The node holding the job's batch script drains: the job re-plans in place on the other node, Slurm refuses to
  release the batch node ("Invalid node name specified"), so the job ends and the next job runs without it.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from sailor_hpc.core.checkpoint import newest_step
from sailor_hpc.core.plan_io import load_plan
from tests.controller import scenario as story_kit
from tests.controller.scenario import Scenario, kind
from tests.slurm import ranks

pytestmark = pytest.mark.slurm


def scenario(slurm_cluster, tmp_path_factory: pytest.TempPathFactory, name: str, steps: int,
             extra: list[str]) -> Scenario:
    pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp(name)
    data, archive = story_kit.build_inputs(tmp_path_factory, root)
    return Scenario(slurm_cluster, root, data, archive, steps=steps, site=story_kit.one_gpu_a100_site(root),
                    extra_args=["--restart-cost", "0", *extra])


def script_of(sc: Scenario, attempt: int) -> str:
    """The job script the attempt was submitted with."""
    return Path(next(r for r in sc.records() if r["kind"] == "submit_intent" and r["attempt"] == attempt)["script"]).read_text()


def test_a_job_pending_on_a_down_node_is_replanned_on_what_is_free(slurm_cluster, tmp_path_factory):
    sc = scenario(slurm_cluster, tmp_path_factory, "stuck", 10, ["--extra-sbatch=--begin=now+15"])
    with story_kit.cleaned_up(sc, NO_REFERENCE):
        sc.blocker("v100-1", 8)
        sc.blocker("v100-2", 8)
        sc.start_controller()
        first = sc.wait_for("the first job submitted", kind("submitted", attempt=1))
        plan1 = next(r for r in sc.records() if r["kind"] == "plan")
        assert plan1["gpus"] == {"a100": 2}, plan1  # both A100 nodes idle: one GPU on each
        down_t = sc.set_node("a100-2", "down")
        moved = sc.wait_for("the pending job re-planned", kind("decision", action="replan", attempt=1), timeout=90)
        assert sc.wait_exit(timeout=240) == 0, sc.controller_output()
        records = sc.records()
        status = slurm_cluster.run(["sailor-hpc", "run", "status", str(sc.run_dir)], env=sc.env).stdout
    print("\n" + status)
    assert "Nodes required for job are DOWN" in moved["reason"] or "ReqNodeNotAvail" in moved["reason"], moved
    print(f"\nnode down -> pending job re-planned after {moved['t'] - down_t:.1f} s (15 s of it: --begin)")
    gone = next(r for r in records if r["kind"] == "job_gone" and r.get("attempt") == 1)
    assert gone["job_id"] == first["job_id"] and gone["state"] == "CANCELLED"
    plans = [r["gpus"] for r in records if r["kind"] == "plan"]
    assert plans == [{"a100": 2}, {"a100": 1}], plans  # a100-1's 4 Slurm GPUs are one node, not two
    assert "#SBATCH --exclude=a100-2" in script_of(sc, 2)
    running = next(r for r in records if r["kind"] == "job_running" and r["attempt"] == 2)
    assert running["nodes"] == ["a100-1"]
    assert newest_step(sc.save) == 10


def test_a_batch_node_slurm_will_not_release_is_left_by_a_new_job(slurm_cluster, tmp_path_factory):
    sc = scenario(slurm_cluster, tmp_path_factory, "batchnode", 30, [])
    with story_kit.cleaned_up(sc, NO_REFERENCE):
        sc.blocker("v100-1", 8)
        sc.blocker("v100-2", 8)
        sc.start_controller()
        first = sc.wait_for("the first job running", kind("job_running", attempt=1))
        assert first["nodes"] == ["a100-1", "a100-2"], first
        sc.wait_for("a checkpoint", lambda r: r["kind"] == "checkpoint" and r["step"] >= sc.save_interval)
        batch = slurm_cluster.run(["squeue", "-h", "-j", first["job_id"], "-o", "%B"]).stdout.strip()
        other = "a100-2" if batch == "a100-1" else "a100-1"
        sc.set_node(batch, "drain")
        refused = sc.wait_for("the in-place step refused", kind("in_place_refused", attempt=1), timeout=120)
        assert sc.wait_exit(timeout=300) == 0, sc.controller_output()
        records = sc.records()
    assert f"Slurm refused to release {batch}" in refused["reason"] and "Invalid node name" in refused["reason"]
    assert not [r for r in records if r["kind"] == "in_place"]  # no step went on holding the drained node
    plans = [r["gpus"] for r in records if r["kind"] == "plan"]
    assert plans == [{"a100": 2}, {"a100": 1}], plans
    assert f"#SBATCH --exclude={batch}" in script_of(sc, 2)
    running = next(r for r in records if r["kind"] == "job_running" and r["attempt"] == 2)
    assert running["nodes"] == [other]
    assert newest_step(sc.save) == 30


class _NoReference:
    """:func:`cleaned_up` without a reference run: these stories check where jobs run, not the parameters."""

    def poll(self) -> int:
        return 0

    def kill(self) -> None:
        pass


NO_REFERENCE: Any = _NoReference()


def test_a_bigger_job_that_timed_out_is_not_retried_until_the_queue_changes(slurm_cluster, tmp_path_factory):
    """Every job pends 12 s first (``--begin``), longer than ``--grow-timeout`` 4 s: each bigger job times out.
    Before, it was submitted again as soon as the idle GPUs dipped and came back; now once per state of the
    queue (the idle GPUs per node it timed out on)."""
    pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp("growtimeout")
    data, archive = story_kit.build_inputs(tmp_path_factory, root)
    sc = Scenario(slurm_cluster, root, data, archive, steps=2000,
                  extra_args=["--extra-sbatch=--begin=now+12", "--grow-timeout", "4", "--restart-cost", "0"])
    with story_kit.cleaned_up(sc, NO_REFERENCE):
        sc.blocker("a100-1", 4)
        a100_2 = sc.blocker("a100-2", 4)
        sc.start_controller()
        sc.wait_for("the first step", kind("first_step", attempt=1), timeout=120)
        # what is checked is the controller's, not training's: the ranks wait stopped, their cores left to other tests
        ranks.pause(sc.plan_file(1))
        slurm_cluster.run(["scancel", sc.blockers[0]])  # 4 A100 idle on a100-1: a bigger plan
        sc.wait_for("the bigger job cancelled", kind("grow_cancelled", attempt=1), timeout=60)
        # the queue dips and comes back as it was (before, the same bigger job was then submitted again at once)
        dip = slurm_cluster.sbatch(["-p", "a100", "-w", "a100-1", "--gres=gpu:a100:1", "-o", "/dev/null",
                                    "--wrap", "sleep 4"])
        slurm_cluster.wait_job(dip, timeout=60)
        sc.wait_for("the queue it timed out on, seen again", lambda r: r["kind"] == "baseline" and "timed out" in
                    (r.get("note") or ""), timeout=30)
        time.sleep(5)
        quiet = len([r for r in sc.records() if r["kind"] == "grow_submitted"])
        last_seq = sc.records()[-1]["seq"]
        slurm_cluster.run(["scancel", a100_2])  # the queue changes: a bigger job is tried again
        sc.wait_for("a second bigger job", lambda r: r["kind"] == "grow_submitted" and r["seq"] > last_seq, timeout=60)
        records = sc.records()
        ranks.resume(sc.plan_file(1))
    assert quiet == 1, [r for r in records if r["kind"].startswith("grow")]
    # both tries are the same next attempt; each has its own plan and script, holding what its record says (a
    # plan file rewritten by the second try left the controller counting the first try's ranks: a grow to a
    # smaller plan then waited its whole time-out)
    tries = [r for r in records if r["kind"] == "grow_submitted"]
    assert len({r["next_attempt"] for r in tries}) == 1 and len({r["plan_file"] for r in tries}) == 2, tries
    assert len({r["script"] for r in tries}) == 2, tries
    for r in tries:
        assert load_plan(r["plan_file"], validate=False).gpus_by_partition() == r["gpus"], r
    cancelled = [r for r in records if r["kind"] == "grow_cancelled"][0]
    assert cancelled["queue"]["a100"]["a100-1"] == 4 and cancelled["queue"]["a100"]["a100-2"] == 0, cancelled
    print("\n" + "\n".join(f"{r['kind']}: {r.get('reason') or r.get('note') or r.get('gpus') or ''}" for r in records
                            if r["kind"] in ("grow_submitted", "grow_cancelled", "baseline")))
