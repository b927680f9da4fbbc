"""A controller killed after a bigger job's gate opened, resumed before the handover.

The journal ends as the grow-without-a-gap path leaves it in between: the old job saved on the resize
signal (step 40), its ranks are gone, and the gate opened; the bigger job then saved step 45 while no
controller ran. The resumed controller first watches the old job (it is still the run's attempt). It must
not credit step 45 to it: the checkpoint is the bigger job's, journaled once that job is the run's
attempt, as the running controller does. No Slurm is needed: the checkpoint scan, the gate and the
handover are journal and file work.
"""
from __future__ import annotations

from pathlib import Path

from sailor_hpc.controller import Controller
from sailor_hpc.controller.one_job import OneJob
from sailor_hpc.controller.progress import LogTail
from sailor_hpc.controller.records import (
    CheckpointSeen,
    FirstStep,
    GateOpened,
    GrowRunning,
    GrowSubmitted,
    JobGone,
    JobRunning,
    RecoveryMeasured,
    SignalSent,
    SubmitIntent,
    Submitted,
)
from sailor_hpc.controller.state import fold, job_name
from sailor_hpc.core.checkpoint import publish, start_tmp, step_dir, write_file
from sailor_hpc.core.runtime_events import Loaded, Started, Stepped, encode_event
from tests.controller.scenario import GBS, started_run, wire


def one_job(ctl: Controller) -> OneJob:
    """The controller's attempts on this one-cluster site."""
    assert isinstance(ctl.attempts, OneJob)
    return ctl.attempts


def _save(root: Path, step: int) -> None:
    """A complete checkpoint of ``step`` as the runtime publishes one (one file, the manifest, the rename)."""
    tmp = start_tmp(root, step)
    entry = write_file(tmp / "rank0.bin", b"x" * 16)
    publish(tmp, {"step": step, "consumed_samples": step * GBS, "files": {"rank0.bin": entry},
                  "params": {"w": {"file": "rank0.bin", "shape": [4]}}})


def test_the_grown_jobs_checkpoint_is_its_own_after_a_resume(tmp_path: Path) -> None:
    rd, j = started_run(tmp_path, steps=100)
    spec = rd.spec()
    j.append(Submitted(attempt=1, job_id="7", log=str(tmp_path / "l7")))
    j.append(JobRunning(attempt=1, job_id="7", since=1.0))
    j.append(GrowSubmitted(attempt=1, next_attempt=2, job_id="8", job_name=job_name(spec.run_id, 2),
             log=str(tmp_path / "l8"), plan_file="p2", script="s2", trigger_t=2.0, gpus={"v100": 2},
             throughput=2.0, cost_per_hour=1.0))
    j.append(GrowRunning(attempt=1, job_id="8", nodes=["v100-1", "v100-2"]))
    j.append(SignalSent(attempt=1, job_id="7", signal="USR1", reason="resize"))
    _save(Path(spec.job.save), 40)
    j.append(CheckpointSeen(attempt=1, step=40, consumed_samples=40 * GBS, path=str(step_dir(spec.job.save, 40))))
    j.append(GateOpened(attempt=1, next_attempt=2, job_id="8"))
    assert fold(j.records).attempt(1).successor_loading
    _save(Path(spec.job.save), 45)  # the bigger job's first save, while no controller ran

    ctl = Controller(rd)
    with rd.lock():
        ctl.ctx.begin()
        old = ctl.state.current
        assert old is not None and old.number == 1
        ctl.ctx.checkpoint(old)  # what watching the old job does first
        assert ctl.state.checkpoint is not None and ctl.state.checkpoint.step == 40
        assert one_job(ctl).grower.open_gate_early(old, None)  # open already: no second gate_opened
        ctl.ctx.note(JobGone(attempt=1, job_id="7", state="CANCELLED"))
        one_job(ctl).start()  # the handover: the bigger job becomes the run's attempt
        new = ctl.state.current
        assert new is not None and new.number == 2 and new.handover_from == 1
        ctl.ctx.checkpoint(new)
    records = wire(rd.records())
    assert [(r["attempt"], r["step"]) for r in records if r["kind"] == "checkpoint"] == [(1, 40), (2, 45)]
    assert len([r for r in records if r["kind"] == "gate_opened"]) == 1
    assert rd.gate_file(2).read_text() == "go\n"
    end = fold(rd.records())
    assert end.attempt(2).advanced and end.restarts == 0


def test_a_controller_killed_between_first_step_and_recovery_journals_the_recovery_when_resumed(tmp_path: Path):
    """The first step of a job that answers a change and its recovery are two records; a kill between them
    leaves the first; the resumed controller (which reads the job's log from its start) adds the second,
    measured from the journaled first step, and only once."""
    rd, j = started_run(tmp_path, steps=100)
    spec = rd.spec()
    log = tmp_path / "l8"
    log.write_text("\n".join([encode_event(Started(rank=0)), encode_event(Loaded(step=40, consumed_samples=40 * GBS)),
                              encode_event(Stepped(step=41, t=130.0))]) + "\n")
    for rec in (Submitted(attempt=1, job_id="7", log=str(tmp_path / "l7")), JobGone(attempt=1, job_id="7", state="FAILED"),
                SubmitIntent(attempt=2, job_name=job_name(spec.run_id, 2), plan_file="p2", script="s2",
                             reason="node_lost", trigger="node_lost", trigger_t=100.0, gpus={"v100": 1},
                             throughput=1.0, cost_per_hour=0.5),
                Submitted(attempt=2, job_id="8", log=str(log)), JobRunning(attempt=2, job_id="8")):
        j.append(rec)
    first = j.append(FirstStep(attempt=2, job_id="8", step=41, loaded_step=40))  # ... and the controller dies
    ctl = Controller(rd)
    with rd.lock():
        ctl.ctx.begin()
        cur = ctl.state.current
        assert cur is not None and cur.recovery is None
        tail = LogTail(log)
        tail.poll()
        one_job(ctl).first_step(cur, tail)
        one_job(ctl).first_step(cur, tail)  # the next poll: nothing more
    recoveries = [r for r in rd.records() if isinstance(r, RecoveryMeasured)]
    assert [(r.attempt, r.trigger, r.first_step_t, r.downtime_s) for r in recoveries] == [
        (2, "node_lost", first.t, first.t - 100.0)]
    assert [r.kind for r in rd.records()].count("first_step") == 1
    assert fold(rd.records()).attempt(2).recovery is not None
