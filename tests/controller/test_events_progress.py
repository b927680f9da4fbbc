"""Detecting allocation changes from Slurm's node states and job rows, and reading the training's log."""
from __future__ import annotations

import json
from pathlib import Path

from sailor_hpc.controller.events import (
    draining_only,
    free_for_run,
    idle_increase,
    is_lost,
    lost_nodes,
    own_gpus,
    trains,
    without_ended_jobs,
)
from sailor_hpc.controller.progress import LogTail
from sailor_hpc.core.plan import plan_from_dict
from sailor_hpc.slurm.status import ComponentStatus, JobStatus
from tests.jobs.conftest import PLANS


def test_lost_node_states():
    # sinfo long states (and their short forms): these nodes kill, requeue or must give up their jobs
    for state in ("down", "down*", "drained", "draining", "drng", "drained*", "fail", "failing", "idle*",
                  "allocated*", "maint", "reboot_issued", "powering_down", "unknown", "inval"):
        assert is_lost(state), state
    # busy, planned for another job, reserved or finishing a job: still there
    for state in ("idle", "mixed", "mixed-", "allocated", "completing", "planned", "reserved", "mix", "alloc"):
        assert not is_lost(state), state
    assert lost_nodes(["a100-1", "v100-1"], {"a100-1": "down", "a100-2": "down"}, {}) == {"a100-1": "down"}
    assert lost_nodes(["a100-1"], {"a100-1": "down"}, {"a100-1": "down"}) == {}  # reported once
    assert draining_only({"a": "draining"}) and not draining_only({"a": "draining", "b": "down"})
    assert not draining_only({})


def test_free_gpus_for_the_run_count_its_own_job():
    plan = plan_from_dict(PLANS["het-mixed"])  # components: v100 x1 node of 2, a100 x1 node of 3, a100 x1 node of 1
    job = JobStatus("12", [ComponentStatus("12+0", "v100", "RUNNING", "v100-1"),
                           ComponentStatus("12+1", "a100", "RUNNING", "a100-1"),
                           ComponentStatus("12+2", "a100", "RUNNING", "a100-2")], "RUNNING")
    hosts = {"v100-1": ["v100-1"], "a100-1": ["a100-1"], "a100-2": ["a100-2"]}
    own = own_gpus(plan, job, hosts)
    assert own == {"v100": {"v100-1": 2}, "a100": {"a100-1": 3, "a100-2": 1}}
    idle = {"a100": {"a100-1": 1, "a100-2": 3}, "v100": {"v100-1": 6, "v100-2": 8}}
    free = free_for_run(idle, own, unusable={}, lost={})
    assert free == {"a100": {"a100-1": 4, "a100-2": 4}, "v100": {"v100-1": 8, "v100-2": 8}}
    # a lost node gives nothing back, an unusable idle node offers nothing
    free = free_for_run(idle, own, unusable={"v100-2": "drained"}, lost={"a100-2": "down"})
    assert free == {"a100": {"a100-1": 4, "a100-2": 3}, "v100": {"v100-1": 8}}
    assert idle_increase({"a100": 1, "v100": 8}, {"a100": 1, "v100": 16}) == {"v100": (8, 16)}
    assert idle_increase({"a100": 1}, {"a100": 0, "v100": 2}) == {"v100": (0, 2)}


def _bundle(*states: str) -> JobStatus:
    comps = [ComponentStatus(str(12 + i), "a100" if i == 0 else "v100", s, f"n{i}") for i, s in enumerate(states)]
    return JobStatus(",".join(c.job_id for c in comps), comps, "RUNNING")


def test_a_bundle_trains_while_its_lead_job_runs():
    assert trains(_bundle("RUNNING", "RUNNING"))
    # a job Slurm ended (its batch node lost): the lead's agent re-plans without it, or ends the bundle
    assert trains(_bundle("RUNNING", "NODE_FAIL")) and trains(_bundle("RUNNING", "FAILED"))
    assert not trains(_bundle("COMPLETED", "RUNNING"))  # the lead ended: nobody answers for the others
    assert not trains(_bundle("RUNNING", "PENDING"))  # not started together yet
    assert not trains(_bundle("COMPLETING", "RUNNING"))
    # a job alone, or a het job: every component
    assert not trains(JobStatus("12", [ComponentStatus("12+0", "a100", "RUNNING", "n0"),
                                       ComponentStatus("12+1", "v100", "FAILED", "n1")], "FAILED"))
    # the ended job's nodes are not the run's any more
    plan = plan_from_dict(PLANS["het-mixed"])
    job = JobStatus("12,13,14", [ComponentStatus("12", "v100", "RUNNING", "v100-1"),
                                 ComponentStatus("13", "a100", "NODE_FAIL", "a100-1"),
                                 ComponentStatus("14", "a100", "RUNNING", "a100-2")], "RUNNING")
    hosts = {"v100-1": ["v100-1"], "a100-1": ["a100-1"], "a100-2": ["a100-2"]}
    assert own_gpus(plan, job, hosts) == {"v100": {"v100-1": 2}, "a100": {"a100-2": 1}}


def test_log_tail_reads_json_lines_as_they_come(tmp_path: Path):
    log = tmp_path / "job.out"
    tail = LogTail(log)
    assert tail.poll() == []  # not written yet
    recs = [{"event": "start", "rank": 0}, {"event": "loaded", "step": 10, "consumed_samples": 640},
            {"event": "step", "step": 11, "loss": 5.5, "consumed_samples": 704}]
    text = "srun: warning: something\n" + "".join(json.dumps(r) + "\n" for r in recs)
    cut = len(text) - 20
    log.write_text(text[:cut])  # the last line half written
    got = tail.poll()
    assert [e.name for e in got] == ["start", "loaded"] and tail.progress.first_step is None
    with open(log, "a") as fh:
        fh.write(text[cut:] + "error: bad plan\n" + json.dumps({"event": "signal", "step": 12}) + "\n")
        fh.write(json.dumps({"event": "saved", "step": 12}) + "\n")
    got = tail.poll()
    p = tail.progress
    assert [e.name for e in got] == ["step", "signal", "saved"]
    assert (p.loaded_step, p.loaded_consumed, p.first_step, p.last_step) == (10, 640, 11, 11)
    assert p.signal_step == 12 and p.saved_steps == [12] and p.losses == {11: 5.5} and p.errors == ["error: bad plan"]


def test_a_requeued_job_starts_a_new_account(tmp_path: Path):
    """Slurm restarted the job in the same log (a requeue while no controller watched): old signal forgotten."""
    log = tmp_path / "job.out"
    first = [{"event": "start"}, {"event": "step", "step": 1, "loss": 1.0}, {"event": "signal", "step": 1},
             {"event": "saved", "step": 1}, {"event": "start"}, {"event": "start"}, {"event": "loaded", "step": 1},
             {"event": "step", "step": 2, "loss": 0.9}]
    log.write_text("".join(json.dumps(r) + "\n" for r in first))
    tail = LogTail(log)
    tail.poll()
    p = tail.progress
    assert (p.signal_step, p.loaded_step, p.first_step, p.last_step, p.saved_steps) == (None, 1, 2, 2, [])


def test_a_slow_saver_gets_the_time_its_saves_take_before_it_is_cancelled(tmp_path: Path):
    from sailor_hpc.controller.one_job import STOP_MARGIN, STOP_TIMEOUT_S, _stop_timeout

    log = tmp_path / "job.out"
    recs = [{"event": "step", "step": 1, "iter_s": 2.0, "rank": 0}, {"event": "step", "step": 1, "iter_s": 3.0, "rank": 1},
            {"event": "saved", "step": 1, "seconds": 40.0}]
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    tail = LogTail(log)
    tail.poll()
    assert tail.progress.stop_needs_s == 43.0
    assert _stop_timeout(tail) == STOP_TIMEOUT_S  # small model: the floor
    with open(log, "a") as fh:
        fh.write(json.dumps({"event": "saved", "step": 2, "seconds": 400.0}) + "\n")  # a large model's save
    tail.poll()
    assert _stop_timeout(tail) == STOP_MARGIN * 403.0 > STOP_TIMEOUT_S
    assert _stop_timeout(None) == STOP_TIMEOUT_S


def test_runtime_events_round_trip_and_a_renamed_field_is_named(tmp_path: Path):
    """The runtime's lines decode to the event types the controller dispatches on; the in-place step's own
    events go through the same codec; a line naming an event without a field it needs is kept as malformed
    (its message names the field), never read as None."""
    from sailor_hpc.core.runtime_events import InPlace, Stepped, decode_event, encode_event

    change = InPlace(job_id="7", step_index=1, rc=137, t_step_end=1.0, t_ready=2.0, lost={"a100-2": "down"},
                     released=[], refused=[], plan_file="p.step-1.json", nodes=["a100-1"], gpus={"a100": 1},
                     throughput=2.5, cost_per_hour=1.0, was_gpus={"a100": 2})
    assert decode_event(json.loads(encode_event(change))) == change
    assert decode_event({"event": "ready", "rank": 0}) is None  # for people only
    log = tmp_path / "job.out"
    log.write_text(json.dumps({"event": "step", "step": 3, "loss": 1, "iter_s": 0.5, "t": 9}) + "\n"
                   + json.dumps({"event": "step", "stepp": 4}) + "\n" + encode_event(change) + "\n")
    tail = LogTail(log)
    got = tail.poll()
    assert got == [Stepped(step=3, loss=1.0, iter_s=0.5, t=9.0), change]
    assert len(tail.malformed) == 1 and "field 'step' is missing" in tail.malformed[0] and str(log) in tail.malformed[0]
    assert tail.progress.last_step is None and tail.progress.before_t == 9.0  # the in-place step: a new account


def test_a_bundle_that_went_on_without_a_job_ends_in_the_state_of_the_others():
    done = JobStatus("12,13", [ComponentStatus("12", "a100", "COMPLETED", "a100-1"),
                               ComponentStatus("13", "v100", "NODE_FAIL", "v100-[1-2]")], "NODE_FAIL")
    assert without_ended_jobs(done, {"v100-1": "down", "v100-2": "gone from the job"}).state == "COMPLETED"
    # a job with a node the run did not lose (cancelled by someone): its state stays the bundle's
    assert without_ended_jobs(done, {"v100-1": "down"}).state == "NODE_FAIL"
    cancelled = JobStatus("12,13", [ComponentStatus("12", "a100", "FAILED", "a100-1"),
                                    ComponentStatus("13", "v100", "CANCELLED", "v100-1")], "FAILED")
    assert without_ended_jobs(cancelled, {}).state == "FAILED"
    alone = JobStatus("12", [ComponentStatus("12", "a100", "NODE_FAIL", "a100-1")], "NODE_FAIL")
    assert without_ended_jobs(alone, {"a100-1": "down"}) is alone
