"""The co-scheduler on two real local Slurm clusters: drop a pending cluster, lose one, grow back.

One run of tiny-gpt (3 CPU ranks, global batch 8) whose preferred plan crosses ``lab`` and ``lab2``
(pipeline across the clusters, data parallelism across them), told by the co-scheduler's events:

1. A blocker holds every GPU of lab2: lab2's job stays pending past the bound, the group is cancelled and
   the run re-planned on lab alone (same plan shape, all ranks in lab).
2. The blocker ends: lab2 has idle GPUs again; once the lab-only group saved a checkpoint, it is asked to
   checkpoint and stop, and the run continues across both clusters (growth).
3. lab2's job is cancelled mid-run (a lost cluster): the group is cancelled, the run continues on lab from
   the newest complete checkpoint, and comes back across both clusters.

Then: the final parameters equal a single-process reference of the same steps, and every step's loss is the
reference's (no sample lost or repeated across the five groups).
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sailor_hpc.controller.cosched import CoScheduler, idle_by_node, planner_plan_for
from sailor_hpc.controller.spec import RunSpec
from sailor_hpc.core.archive import EMBEDDED_ARCHIVE, read_archive
from sailor_hpc.core.checkpoint import latest_complete, read_manifest
from sailor_hpc.jobs.render import plan_clusters
from tests.controller.scenario import step_events
from tests.data.tiny_archive import write_tiny_archive
from tests.jobs.conftest import REPO, cross_plan, two_lab_site
from tests.megatron_patch.conftest import ADAM, python

pytestmark = pytest.mark.slurm

STEPS = 40
PARAM_TOL = MOMENT_TOL = 5e-6  # fp32 summation order changes with the plans a run went through (test_resize_cluster.py)


@pytest.fixture(scope="module")
def story(slurm_two_clusters, tmp_path_factory: pytest.TempPathFactory, job_env_two) -> dict[str, Any]:
    pytest.importorskip("megatron.core")
    lab, lab2 = slurm_two_clusters
    root = tmp_path_factory.mktemp("cosched")
    data = str(root / "data" / "shipped")
    assert python("-m", "megatron_patch.data", data).returncode == 0
    ref = python("-m", "megatron_patch.reference", "--model", "tiny-gpt", "--data", data, "--global-batch", "8",
                 "--steps", str(STEPS), "--snapshots", str(STEPS), "--out", str(root / "ref"), *ADAM)
    assert ref.returncode == 0, ref.stderr[-3000:]
    site = two_lab_site(lab.lab, lab2.lab)
    plans = {("lab", "lab2"): cross_plan(site, "a100", "a100_lab2"), ("lab",): cross_plan(site, "a100", "a100")}
    blocker = lab2.sbatch(["-p", "a100_lab2", "-N", "2", "--gres=gpu:a100:4", "-o", "/dev/null", "--wrap", "sleep 600"])
    deadline = time.monotonic() + 30
    while lab2.job_states(blocker) != ["RUNNING"]:  # holding lab2's GPUs before the run's first group comes
        assert time.monotonic() < deadline, lab2.job_states(blocker)
        time.sleep(0.1)
    sched = CoScheduler(site=site, plan_for=lambda cs: plans[cs], directory=root / "run", save=root / "ckpt",
                        data=data, steps=STEPS, env=job_env_two, train_args=[*ADAM, "--save-interval", "1"],
                        pending_bound_s=4.0, rejoin_after_s=2.0, poll_s=0.3)
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["groups"] = sched.run()
        except Exception as exc:  # noqa: BLE001 - reported by the test below
            out["error"] = exc

    def wait_for(pred, what: str, timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hit = next((e for e in sched.events if pred(e)), None)
            if hit is not None:
                return hit
            assert "error" not in out, out["error"]
            time.sleep(0.2)
        raise AssertionError(f"no {what} after {timeout} s: {sched.events}")

    def saved_after(start: int) -> bool:
        ck = latest_complete(root / "ckpt", deep=False)
        return ck is not None and read_manifest(ck)["step"] > start

    t0 = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        g2 = wait_for(lambda e: e["kind"] == "submitted" and e["attempt"] == 2, "group on lab alone")
        wait_for(lambda e: e["kind"] == "all_running" and e["attempt"] == 2, "lab alone running")
        while not saved_after(g2["start_step"]):
            time.sleep(0.2)
        lab2.run(["scancel", blocker], check=True)
        g3 = wait_for(lambda e: e["kind"] == "submitted" and e["attempt"] == 3, "group across both again")
        wait_for(lambda e: e["kind"] == "all_running" and e["attempt"] == 3, "both running")
        while not saved_after(g3["start_step"]):
            time.sleep(0.2)
        lab2.run(["scancel", g3["jobs"]["lab2"]], check=True)
        thread.join(timeout=240)
        assert not thread.is_alive(), sched.events
    finally:
        if thread.is_alive():  # do not leave jobs behind a failed test
            lab2.run(["scancel", blocker])
    out.update(events=sched.events, root=root, seconds=time.monotonic() - t0, directory=root / "run")
    return out


@pytest.fixture(scope="module")
def job_env_two(slurm_two_clusters, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    lab, _ = slurm_two_clusters
    env = dict(lab.env)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["SAILOR_HPC_STATE_DIR"] = str(tmp_path_factory.mktemp("records"))
    return env


def _kinds(story: dict[str, Any]) -> list[tuple[str, int, Any]]:
    return [(e["kind"], e["attempt"], e.get("clusters")) for e in story["events"]]


def test_drops_the_pending_cluster_loses_one_and_grows_back(story):
    assert "error" not in story, story.get("error")
    print(f"\n{story['groups']} groups in {story['seconds']:.0f} s:")
    for e in story["events"]:
        print("  ", json.dumps({k: v for k, v in e.items() if k != "t"}))
    k = _kinds(story)
    assert ("dropped", 1, ["lab2"]) in k and ("submitted", 2, ["lab"]) in k
    assert ("rejoin", 2, ["lab2"]) in k and ("submitted", 3, ["lab", "lab2"]) in k
    assert ("lost", 3, ["lab2"]) in k and ("submitted", 4, ["lab"]) in k
    assert ("rejoin", 4, ["lab2"]) in k and ("submitted", 5, ["lab", "lab2"]) in k
    assert k[-1] == ("finished", 5, None) and story["groups"] == 5


def test_every_group_resumes_from_the_newest_checkpoint_and_matches_the_reference(story):
    from tests.megatron_patch.conftest import max_diff
    assert "error" not in story, story.get("error")
    root = story["root"]
    ref_losses = json.loads((root / "ref" / "losses.json").read_text())
    seen: set[int] = set()
    for sub in (e for e in story["events"] if e["kind"] == "submitted"):
        events = [e for log in Path(story["directory"]).glob(f"sailor-geo-{sub['attempt']}-*.out") for e in step_events(log)]
        steps = sorted({e["step"] for e in events if e["event"] == "step"})
        # the runtime's own log: it loaded the newest complete checkpoint there was at submission, and went on
        assert {e["step"] for e in events if e["event"] == "loaded"} == ({sub["start_step"]} if sub["start_step"] else set())
        assert not steps or steps == list(range(sub["start_step"] + 1, steps[-1] + 1)), (sub, steps)
        for e in (e for e in events if e["event"] == "step"):
            assert abs(e["loss"] - ref_losses[e["step"] - 1]) < 1e-5, (sub["attempt"], e)
        seen |= set(steps)
    assert seen == set(range(1, STEPS + 1))
    assert all(e["start_step"] > 0 for e in story["events"] if e["kind"] == "submitted" and e["attempt"] >= 3)
    final = latest_complete(root / "ckpt")
    assert final is not None and read_manifest(final)["step"] == STEPS
    diff = max_diff(final, root / "ref" / f"ref_step_{STEPS}.pt")
    print(f"\nafter {STEPS} steps in 5 groups: max |delta| vs reference {diff}")
    assert diff["param"] <= PARAM_TOL and diff["exp_avg"] <= MOMENT_TOL and diff["exp_avg_sq"] <= MOMENT_TOL


def test_the_planner_plans_only_on_the_clusters_it_is_given(story, slurm_two_clusters, job_env_two, tmp_path):
    """``planner_plan_for``: idle GPUs read through each cluster's own SLURM_CONF, then the controller's planner
    on those clusters' partitions only (runs after the story: every GPU is idle again)."""
    lab, lab2 = slurm_two_clusters
    site = two_lab_site(lab.lab, lab2.lab)
    idle = idle_by_node(site, ["lab", "lab2"], job_env_two)
    # the fake nodes of start.sh: a100-1 and a100-2 with 4 GPUs each, in both clusters (same names)
    assert idle == {"a100": {"a100-1": 4, "a100-2": 4}, "a100_lab2": {"a100-1": 4, "a100-2": 4}}
    spec = RunSpec(run_id="geo", site="<two local clusters>", model="tiny-gpt", objective="throughput", data="/d",
                   save="/s", steps=1, gbs=8)
    archive = read_archive(write_tiny_archive(tmp_path / "tiny.h5"), EMBEDDED_ARCHIVE)
    plan_for = planner_plan_for(spec, site, archive, job_env_two)
    for clusters in (("lab",), ("lab2",), ("lab", "lab2")):
        used = plan_clusters(plan_for(clusters), site)
        print(f"\nplan on {clusters}: clusters {used}")
        assert used and set(used) <= set(clusters)
