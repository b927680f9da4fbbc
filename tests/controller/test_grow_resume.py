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
from sailor_hpc.controller.state import fold, job_name
from sailor_hpc.core.checkpoint import publish, start_tmp, step_dir, write_file
from tests.controller.scenario import GBS, started_run


def _save(root: Path, step: int) -> None:
    """A complete checkpoint of ``step`` as the runtime publishes one (one file, the manifest, the rename)."""
    tmp = start_tmp(root, step)
    entry = write_file(tmp / "rank0.bin", b"x" * 16)
    publish(tmp, {"step": step, "consumed_samples": step * GBS, "files": {"rank0.bin": entry},
                  "params": {"w": {"file": "rank0.bin", "shape": [4]}}})


def test_the_grown_jobs_checkpoint_is_its_own_after_a_resume(tmp_path: Path) -> None:
    rd, j = started_run(tmp_path, steps=100)
    spec = rd.spec()
    j.append("submitted", attempt=1, job_id="7", log=str(tmp_path / "l7"))
    j.append("job_running", attempt=1, job_id="7", since=1.0)
    j.append("grow_submitted", attempt=1, next_attempt=2, job_id="8", job_name=job_name(spec.run_id, 2),
             log=str(tmp_path / "l8"), plan_file="p2", script="s2", trigger_t=2.0, gpus={"v100": 2},
             throughput=2.0, cost_per_hour=1.0)
    j.append("grow_running", attempt=1, job_id="8", nodes=["v100-1", "v100-2"])
    j.append("signal_sent", attempt=1, job_id="7", signal="USR1", reason="resize")
    _save(Path(spec.save), 40)
    j.append("checkpoint", attempt=1, step=40, consumed_samples=40 * GBS, path=str(step_dir(spec.save, 40)))
    j.append("gate_opened", attempt=1, next_attempt=2, job_id="8")
    assert fold(j.records).attempt(1).successor_loading
    _save(Path(spec.save), 45)  # the bigger job's first save, while no controller ran

    ctl = Controller(rd)
    with rd.lock():
        ctl.begin()
        old = ctl.state.current
        assert old is not None and old.number == 1
        ctl._checkpoint(old)  # what watching the old job does first
        assert ctl.state.checkpoint["step"] == 40  # type: ignore[index]
        assert ctl._open_gate_early(old, None)  # open already: no second gate_opened
        ctl.note("job_gone", attempt=1, job_id="7", state="CANCELLED")
        ctl.start_next()  # the handover: the bigger job becomes the run's attempt
        new = ctl.state.current
        assert new is not None and new.number == 2 and new.handover_from == 1
        ctl._checkpoint(new)
    records = rd.records()
    assert [(r["attempt"], r["step"]) for r in records if r["kind"] == "checkpoint"] == [(1, 40), (2, 45)]
    assert len([r for r in records if r["kind"] == "gate_opened"]) == 1
    assert rd.gate_file(2).read_text() == "go\n"
    end = fold(records)
    assert end.attempt(2).advanced and end.restarts == 0
