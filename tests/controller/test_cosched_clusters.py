"""``sailor-hpc run`` on two real local Slurm clusters: drop a pending cluster, lose one, grow back, resume.

One run of tiny-gpt (CPU ranks, global batch 8) whose preferred plan crosses ``lab`` and ``lab2``
(pipeline across the clusters, data parallelism across them), driven by the :class:`Controller` (what
``sailor-hpc run`` calls for a site of several clusters) from a run directory, with fixed plans (the
planner's own choice is tested below), told by the run's journal:

1. A blocker holds every GPU of lab2: lab2's job stays pending past the bound (``--grow-timeout``), the group
   is cancelled and the run re-planned on lab alone (one pipeline of 2 ranks).
2. The blocker ends: lab2 has idle GPUs again; once the lab-only group saved a checkpoint, the min-gain policy
   judges the plan across both (35 % more samples/s, simulated as megatron_patch) worth it, the group
   checkpoints and stops, and the run continues across both clusters (growth).
3. The controller is killed once that group runs; ``--resume`` (a new Controller on the run directory) adopts
   the running jobs.
4. lab2's job is cancelled mid-run by a Slurm operator (a lost cluster; the run's own user cancelling it would
   stop the run): the group is cancelled, the run continues on lab from
   the newest complete checkpoint, and comes back across both clusters.

Then: ``sailor-hpc run status`` tells it, the final parameters equal a single-process reference of the same
steps, and every step's loss is the reference's (no sample lost or repeated across the five groups).
"""
from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from click.testing import CliRunner

from sailor_hpc.cli.app import main
from sailor_hpc.controller import Controller
from sailor_hpc.controller.groups import idle_by_node, planner_plan_for
from sailor_hpc.controller.records import GroupRecovered, Record
from sailor_hpc.controller.spec import RunSpec, new_run_id
from sailor_hpc.controller.state import RESIZE_REASON, RunDir
from sailor_hpc.core.archive import EMBEDDED_ARCHIVE, read_archive
from sailor_hpc.core.checkpoint import latest_complete, read_manifest
from sailor_hpc.core.placement import place_plan
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from sailor_hpc.core.site import load_site
from sailor_hpc.core.toml_writer import dump_toml
from sailor_hpc.jobs.render import plan_clusters, site_cluster
from sailor_hpc.slurm.handle import SlurmCluster
from tests.controller.scenario import step_events, wire
from tests.data.tiny_archive import write_tiny_archive
from tests.jobs.conftest import A100, cross_plan, two_lab_doc, two_lab_site
from tests.megatron_patch.conftest import ADAM, python
from tests.shared_inputs import shipped_dataset

pytestmark = pytest.mark.slurm

STEPS = 40
PARAM_TOL = MOMENT_TOL = 5e-6  # fp32 summation order changes with the plans a run went through (test_resize_cluster.py)


class Killed(BaseException):
    """The controller dies here: nothing more is journaled, the lock is released, its jobs keep running."""


def _kill_when_group_runs(geo: Controller, group: int) -> None:
    """Raise Killed inside the controller once ``group`` (one that answers a change) runs whole and its recovery
    is journaled."""
    note = geo.ctx.note

    def dying(rec: Record) -> Record:
        rec = note(rec)
        if isinstance(rec, GroupRecovered) and rec.group == group:
            raise Killed
        return rec

    geo.ctx.note = dying  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def story(slurm_two_clusters, tmp_path_factory: pytest.TempPathFactory, job_env_two) -> dict[str, Any]:
    pytest.importorskip("megatron.core")
    lab, lab2 = slurm_two_clusters
    root = tmp_path_factory.mktemp("cosched")
    data = shipped_dataset(tmp_path_factory)
    ref = python("-m", "megatron_patch.reference", "--model", "tiny-gpt", "--data", data, "--global-batch", "8",
                 "--steps", str(STEPS), "--snapshots", str(STEPS), "--out", str(root / "ref"), *ADAM)
    assert ref.returncode == 0, ref.stderr[-3000:]
    site_file = root / "two-labs.toml"  # a fast link: the plan across both clusters is the faster one
    site_file.write_text(dump_toml(two_lab_doc(lab.lab, lab2.lab, gbps=100.0)))
    site = load_site(site_file)
    one_pipe = Plan("tiny-gpt", 8, (Pipeline(2, 4, (Stage(0, 2, 1, A100, "a100"), Stage(3, 5, 1, A100, "a100"))),))
    plans = {("lab", "lab2"): cross_plan(site, "a100", "a100_lab2"), ("lab",): place_plan(one_pipe, site)}
    # the simulated A100s finish what is left of the run in seconds, so any real restart would rightly cost more
    # than growing gains: a free restart lets the policy judge on the throughputs alone
    spec = RunSpec.of(run_id=new_run_id(), site=str(site_file), model="tiny-gpt", objective="throughput", data=data,
                   save=str(root / "ckpt"), steps=STEPS, gbs=8, profiles=str(write_tiny_archive(root / "tiny.h5")),
                   grow_timeout_s=4.0, replan_interval_s=2.0, poll_s=0.3, save_interval=1, restart_cost_s=0.0,
                   train_args=tuple(ADAM))
    rundir = RunDir.create(root / "run", spec)
    blocker = lab2.sbatch(["-p", "a100_lab2", "-N", "2", "--gres=gpu:a100:4", "-o", "/dev/null", "--wrap", "sleep 600"])
    deadline = time.monotonic() + 30
    while lab2.job_states(blocker) != ["RUNNING"]:  # holding lab2's GPUs before the run's first group comes
        assert time.monotonic() < deadline, lab2.job_states(blocker)
        time.sleep(0.1)
    out: dict[str, Any] = {"exits": []}

    def start(kill_at: int | None = None) -> threading.Thread:
        geo = Controller(rundir, job_env_two, plan_for=lambda cs: plans[cs])
        if kill_at is not None:
            _kill_when_group_runs(geo, kill_at)

        def run() -> None:
            try:
                out["exits"].append(geo.run())
            except Killed:
                out["exits"].append("killed")
            except Exception as exc:  # noqa: BLE001 - reported by the test below
                out["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def wait_for(kind: str, group: int, timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hit = next((r for r in wire(rundir.records()) if r["kind"] == kind and r.get("group") == group), None)
            if hit is not None:
                return hit
            assert "error" not in out, out["error"]
            time.sleep(0.2)
        raise AssertionError(f"no {kind} of group {group} after {timeout} s: {wire(rundir.records())}")

    def saved_after(start: int) -> bool:
        ck = latest_complete(root / "ckpt", deep=False)
        return ck is not None and read_manifest(ck)["step"] > start

    t0 = time.monotonic()
    thread = start(kill_at=3)
    try:
        g2 = wait_for("group_submitted", 2)
        wait_for("group_running", 2)
        while not saved_after(g2["start_step"]):
            time.sleep(0.2)
        lab2.run(["scancel", blocker], check=True)
        g3 = wait_for("group_submitted", 3)
        thread.join(timeout=120)  # killed once group 3 runs
        assert out["exits"] == ["killed"], out
        thread = start()  # sailor-hpc run --resume
        wait_for("group_adopted", 3)
        while not saved_after(g3["start_step"]):
            time.sleep(0.2)
        # an operator (not the run's user: whose own scancel would stop the run) cancels lab2's job: lost
        assert lab2.as_operator(["scancel", g3["jobs"]["lab2"]]).returncode == 0
        thread.join(timeout=240)
        assert not thread.is_alive(), wire(rundir.records())
    finally:
        if thread.is_alive():  # do not leave jobs behind a failed test
            lab2.run(["scancel", blocker])
    out.update(records=wire(rundir.records()), root=root, seconds=time.monotonic() - t0, rundir=rundir)
    return out


def _kinds(story: dict[str, Any]) -> list[tuple[str, int, Any]]:
    return [(r["kind"], r["group"], r.get("clusters")) for r in story["records"] if "group" in r]


def test_drops_the_pending_cluster_loses_one_grows_back_and_resumes(story):
    assert "error" not in story, story.get("error")
    print(f"\n{len(story['records'])} journal records in {story['seconds']:.0f} s:")
    for r in story["records"]:
        print("  ", json.dumps({k: v for k, v in r.items() if k not in ("t", "spec")}))
    k = _kinds(story)
    assert ("cluster_dropped", 1, ["lab2"]) in k and ("group_submitted", 2, ["lab"]) in k
    assert ("regrow_decision", 2, ["lab2"]) in k and ("regrown", 2, ["lab2"]) in k
    assert ("group_submitted", 3, ["lab", "lab2"]) in k and ("group_adopted", 3, None) in k
    assert ("cluster_lost", 3, ["lab2"]) in k and ("group_submitted", 4, ["lab"]) in k
    assert ("regrown", 4, ["lab2"]) in k and ("group_submitted", 5, ["lab", "lab2"]) in k
    assert k[-1] == ("finished", 5, None) and story["exits"] == ["killed", 0]
    assert not any(r["kind"] == "group_submitted" and r["group"] == 3 for r in story["records"][
        next(i for i, r in enumerate(story["records"]) if r["kind"] == "group_adopted"):])  # adopted, not resubmitted
    # the policy's verdict: the plan across both clusters simulates 35 % faster than the lab-only one (as megatron_patch)
    grows = [r for r in story["records"] if r["kind"] == "regrow_decision"]
    assert all(r["resize"] and r["gain"] == pytest.approx(48.00 / 35.47 - 1, abs=0.005) for r in grows), grows
    recovered = [r["trigger"] for r in story["records"] if r["kind"] == "group_recovered"]
    assert recovered == ["cluster_dropped", RESIZE_REASON, "cluster_lost", RESIZE_REASON]

    status = CliRunner().invoke(main, ["run", "status", str(story["rundir"].path), "--json"])
    assert status.exit_code == 0, status.output
    doc = json.loads(status.output)
    assert doc["phase"] == "finished" and [g["attempt"] for g in doc["attempts"]] == [1, 2, 3, 4, 5]
    assert [g["end"] for g in doc["attempts"][:4]] == ["pending", "rejoin", "cluster lost", "rejoin"]
    # each group's plan and simulated samples/s, as the policy scored it (48.00 across both, 35.47 on lab)
    assert [g["samples/s (sim)"] for g in doc["attempts"]] == ["48.00", "35.47", "48.00", "35.47", "48.00"], doc
    assert [g["recovery s"] != "-" for g in doc["attempts"]] == [False, True, True, True, True]
    text = CliRunner().invoke(main, ["run", "status", str(story["rundir"].path)]).output
    assert "group 3: found its jobs" in text and "lab2 pending past the bound: dropped" in text


def test_every_group_resumes_from_the_newest_checkpoint_and_matches_the_reference(story):
    from tests.megatron_patch.conftest import max_diff
    assert "error" not in story, story.get("error")
    root = story["root"]
    ref_losses = json.loads((root / "ref" / "losses.json").read_text())
    seen: set[int] = set()
    for sub in (r for r in story["records"] if r["kind"] == "group_submitted"):
        logs = [log for c, job in sub["jobs"].items()  # job ids are per cluster: the name tells them apart
                for log in story["rundir"].logs.glob(f"sailor-*-{sub['group']:03d}-{c}-{job}.out")]
        events = [e for log in logs for e in step_events(log)]
        steps = sorted({e["step"] for e in events if e["event"] == "step"})
        # the runtime's own log: it loaded the newest complete checkpoint there was at submission, and went on
        assert {e["step"] for e in events if e["event"] == "loaded"} == ({sub["start_step"]} if sub["start_step"] else set())
        assert not steps or steps == list(range(sub["start_step"] + 1, steps[-1] + 1)), (sub, steps)
        for e in (e for e in events if e["event"] == "step"):
            assert abs(e["loss"] - ref_losses[e["step"] - 1]) < 1e-5, (sub["group"], e)
        seen |= set(steps)
    assert seen == set(range(1, STEPS + 1))
    assert all(r["start_step"] > 0 for r in story["records"] if r["kind"] == "group_submitted" and r["group"] >= 3)
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
    def cluster(name: str) -> SlurmCluster:
        return site_cluster(site, name, job_env_two)

    idle = idle_by_node(site, [cluster("lab"), cluster("lab2")])
    # the fake nodes of start.sh: a100-1 and a100-2 with 4 GPUs each, in both clusters (same names)
    assert idle == {"a100": {"a100-1": 4, "a100-2": 4}, "a100_lab2": {"a100-1": 4, "a100-2": 4}}
    spec = RunSpec.of(run_id="geo", site="<two local clusters>", model="tiny-gpt", objective="throughput", data="/d",
                   save="/s", steps=1, gbs=8)
    archive = read_archive(write_tiny_archive(tmp_path / "tiny.h5"), EMBEDDED_ARCHIVE)
    plan_for = planner_plan_for(spec, site, archive, cluster)
    for clusters in (("lab",), ("lab2",), ("lab", "lab2")):
        used = plan_clusters(plan_for(clusters), site)
        print(f"\nplan on {clusters}: clusters {used}")
        assert used and set(used) <= set(clusters)
