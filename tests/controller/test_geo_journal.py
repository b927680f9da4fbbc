"""A run across clusters in the journal: the controller's group records folded into groups and clusters that left,
their story lines, re-planning with the chains of ``geo_search`` on a site of several clusters, and growing
back only when the controller's min-gain policy says so."""
from __future__ import annotations

from pathlib import Path

import pytest

from planner.geo import geo_search
from sailor_hpc.controller import Controller
from sailor_hpc.controller.journal import Journal, Kind, read_journal
from sailor_hpc.controller.planning import plan_on
from sailor_hpc.controller.records import (
    ClusterDropped,
    ClusterLost,
    GroupIntent,
    GroupRecovered,
    GroupRunning,
    GroupStopped,
    GroupSubmitted,
    RegrowDecision,
    Regrown,
    RunStarted,
)
from sailor_hpc.controller.spec import RunSpec
from sailor_hpc.controller.state import RESIZE_REASON, InconsistentJournal, RunDir, fold
from sailor_hpc.controller.story import attempt_rows, describe
from sailor_hpc.core.archive import EMBEDDED_ARCHIVE, read_archive
from sailor_hpc.core.placement import place_plan
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from sailor_hpc.core.site import load_site
from sailor_hpc.core.toml_writer import dump_toml
from simulator import SimOptions, simulate
from tests.data.tiny_archive import write_tiny_archive
from tests.jobs.conftest import A100, cross_plan, two_lab_doc, two_lab_site


def _geo_story(j: Journal) -> None:
    """The group records of test_cosched_clusters.py's first three groups, as the controller journals them."""
    j.append(RunStarted(run_id="g1"))
    j.append(GroupSubmitted(group=1, jobs={"lab": "11", "lab2": "7"}, clusters=["lab", "lab2"], start_step=0,
             plan_file="/run/plan.1.json"))
    j.append(ClusterDropped(group=1, clusters=["lab2"], reason="pending"))
    j.append(GroupStopped(group=1, reason="pending", states={"lab": "CANCELLED", "lab2": "CANCELLED"}))
    j.append(GroupSubmitted(group=2, jobs={"lab": "12"}, clusters=["lab"], start_step=0,
             plan_file="/run/plan.2.json"))
    j.append(GroupRunning(group=2))
    j.append(GroupRecovered(group=2, trigger="cluster_dropped", trigger_t=102.0, recovery_s=4.0))
    j.append(RegrowDecision(group=2, clusters=["lab2"], resize=True, gain=0.4, keep=10.0, move=7.0,
             reason="gain 40.0% >= 10%"))
    j.append(Regrown(group=2, clusters=["lab2"], step=6))
    j.append(GroupStopped(group=2, reason="rejoin"))
    j.append(GroupSubmitted(group=3, jobs={"lab": "13", "lab2": "8"}, clusters=["lab", "lab2"], start_step=6,
             plan_file="/run/plan.3.json"))


def test_fold_tells_the_groups_and_the_clusters_that_left(tmp_path: Path):
    j = Journal(tmp_path / "journal.jsonl", clock=iter(range(100, 200)).__next__)
    _geo_story(j)
    state = fold(read_journal(j.path))
    assert [(g.number, g.clusters, g.start_step, g.end) for g in state.attempts] == [
        (1, ["lab", "lab2"], 0, "pending"), (2, ["lab"], 0, "rejoin"), (3, ["lab", "lab2"], 6, None)]
    assert all(a.across for a in state.attempts)  # the group records fold into the one kind of attempt
    assert state.current is state.attempts[-1] and state.current.jobs == {"lab": "13", "lab2": "8"}
    assert state.attempts[1].running_t == 105.0
    # why each group was submitted: a dropped cluster is a restart, a cluster back (regrown) a resize
    assert [a.reason for a in state.attempts] == ["start", "cluster_dropped", RESIZE_REASON] and state.restarts == 1
    assert state.left == {}  # lab2 left at t=102 and came back at t=108

    j.append(ClusterLost(group=3, clusters=["lab2"], states={"lab2": "CANCELLED"}))
    j.append(GroupStopped(group=3, reason="cluster lost"))
    state = fold(read_journal(j.path))
    assert state.left == {"lab2": 111.0} and state.current is None
    # one table for the attempts of any run: the group's jobs, why it was submitted, how it ended
    assert attempt_rows(state)[-1] == (3, "lab 13, lab2 8", "-", "-", RESIZE_REASON, 6, "-", "-", "cluster lost")
    # a group's recovery is the run's, as a job's is: what the restart-cost policy reads
    assert state.attempts[1].recovery is not None and state.attempts[1].recovery.trigger == "cluster_dropped"
    assert state.restart_costs == [4.0] and attempt_rows(state)[1][6] == "4.0"


def test_every_geo_record_has_a_story_line(tmp_path: Path):
    j = Journal(tmp_path / "journal.jsonl")
    _geo_story(j)
    lines = [describe(r) for r in j.records]
    assert lines[1] == "group 1: jobs lab 11, lab2 7 submitted (from step 0)"
    assert "lab2 pending past the bound: dropped" in lines[2]
    assert lines[6] == "group 2: recovered from cluster_dropped in 4.0 s"
    assert lines[7] == "group 2: grow back across lab2: gain 40.0% >= 10%"
    assert all(line not in {str(k) for k in Kind} for line in lines)  # none fell through to the bare kind


def test_a_group_is_known_from_its_intent_and_completed_by_its_submission(tmp_path: Path):
    """The intent makes the group current before any sbatch (a kill or an outage may cut it short there: its
    jobs are then found by name); its submission fills in the same group, not a second one."""
    j = Journal(tmp_path / "journal.jsonl", clock=iter(range(100, 200)).__next__)
    j.append(RunStarted(run_id="g1"))
    names = {"lab": "sailor-g1-001-lab", "lab2": "sailor-g1-001-lab2"}
    j.append(GroupIntent(group=1, job_names=names, start_step=0, plan_file="/run/plan.1.json"))
    cur = fold(read_journal(j.path)).current
    assert cur is not None and (cur.number, cur.clusters, cur.jobs, cur.job_names) == (1, ["lab", "lab2"], {}, names)
    assert describe(j.records[-1]) == "group 1: submitting sailor-g1-001-lab, sailor-g1-001-lab2 (from step 0)"
    j.append(GroupSubmitted(group=1, jobs={"lab": "11", "lab2": "7"}, clusters=["lab", "lab2"], start_step=0,
             plan_file="/run/plan.1.json"))
    state = fold(read_journal(j.path))
    assert len(state.attempts) == 1 and state.attempts[0].jobs == {"lab": "11", "lab2": "7"}
    assert state.attempts[0].job_names == names and state.attempts[0].submitted_t == 102.0


def test_a_groups_plan_and_score_show_in_the_attempt_table(tmp_path: Path):
    j = Journal(tmp_path / "journal.jsonl")
    j.append(GroupIntent(group=1, job_names={"lab": "n1", "lab2": "n2"}, start_step=0, plan_file="/run/plan.1.json",
                         gpus={"a100": 4, "a100_lab2": 4}, throughput=48.0, cost_per_hour=12.0))
    row = attempt_rows(fold(j.records))[0]
    assert row[2:5] == ("4 a100+4 a100_lab2", "48.00", "start") and row[-1] == "queued"
    assert describe(j.records[0]) == "group 1: submitting n1, n2 (4 a100+4 a100_lab2, 48.00 samples/s (sim), from step 0)"


def test_a_record_of_an_unknown_group_is_refused(tmp_path: Path):
    j = Journal(tmp_path / "journal.jsonl")
    j.append(GroupRunning(group=4))
    with pytest.raises(InconsistentJournal, match="group 4"):  # exit 2 naming the line, not a traceback
        fold(j.records, source=j.path, lines=j.lines)


def test_replanning_on_several_clusters_uses_the_chains_of_geo_search(tmp_path: Path):
    """plan_on (what the controller re-plans a group with) returns geo_search's best on a two-cluster site, which
    ranks partition-local plans and chains across the clusters together."""
    site = two_lab_site(tmp_path / "lab", tmp_path / "lab2")
    archive = read_archive(write_tiny_archive(tmp_path / "tiny.h5"), EMBEDDED_ARCHIVE)
    spec = RunSpec.of(run_id="g", site="<two>", model="tiny-gpt", objective="throughput", data="/d", save="/s", steps=1,
                   gbs=8)
    free = {"a100": {"a100-1": 4, "a100-2": 4}, "a100_lab2": {"a100-1": 4, "a100-2": 4}}
    planned = plan_on(spec, site, archive, free)
    best = geo_search(site, archive, spec.planning.request({"a100": 8, "a100_lab2": 8})).candidates[0]
    assert planned.plan.pipelines == best.plan.pipelines
    assert planned.score.throughput == pytest.approx(best.result.throughput_samples_per_s)


@pytest.mark.parametrize("restart_cost_s", [None, 0.0])
def test_growing_back_must_pay_for_its_restart(tmp_path: Path, restart_cost_s: float | None):
    """The regrow gate is the controller's min-gain policy: 320 samples left, the plan across both clusters
    35 % faster than the lab-only one; a free restart pays, the default 60 s one does not."""
    site_file = tmp_path / "two.toml"
    site_file.write_text(dump_toml(two_lab_doc(tmp_path / "lab", tmp_path / "lab2", gbps=100.0)))
    site = load_site(site_file)
    archive = write_tiny_archive(tmp_path / "tiny.h5")
    spec = RunSpec.of(run_id="g", site=str(site_file), model="tiny-gpt", objective="throughput", data="/d",
                   save=str(tmp_path / "ckpt"), steps=40, gbs=8, profiles=str(archive), restart_cost_s=restart_cost_s)
    lab = place_plan(Plan("tiny-gpt", 8, (Pipeline(2, 4, (Stage(0, 2, 1, A100, "a100"), Stage(3, 5, 1, A100, "a100"))),)),
                     site)
    both = cross_plan(site, "a100", "a100_lab2")
    geo = Controller(RunDir.create(tmp_path / "run", spec), {}, plan_for=lambda cs: {("lab", "lab2"): both}[cs])
    geo.ctx.journal = geo.ctx.rundir.journal()
    lab.save(tmp_path / "plan.1.json")
    geo.ctx.note(GroupSubmitted(group=1, jobs={"lab": "1"}, clusters=["lab"], start_step=0,
                            plan_file=str(tmp_path / "plan.1.json")))
    grows = geo.attempts._worth_regrowing(geo.state.attempts[0], ("lab2",))
    # scored as the planner scores plans: as megatron_patch, which runs them (not Sailor's measured runtime)
    sims = {name: simulate(p, site, read_archive(archive, EMBEDDED_ARCHIVE),
                           options=SimOptions(runtime="megatron_patch")).throughput_samples_per_s
            for name, p in (("lab", lab), ("both", both))}
    keep, move = 320 / sims["lab"], (restart_cost_s if restart_cost_s is not None else 60.0) + 320 / sims["both"]
    rec = geo.ctx.journal.records[-1]
    assert isinstance(rec, RegrowDecision) and rec.clusters == ["lab2"]
    assert rec.gain == pytest.approx(keep / move - 1) and grows == rec.resize == (keep / move - 1 >= 0.10)
    assert grows == (restart_cost_s == 0.0)
