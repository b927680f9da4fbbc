"""The journal (atomic appends, torn last line), the state folded from it, the run spec and directory."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sailor_hpc.controller.journal import Journal, read_journal
from sailor_hpc.controller.records import (
    INLINE,
    Backoff,
    CheckpointSeen,
    ControllerStarted,
    Failure,
    FirstStep,
    GrowCancelled,
    GrowRunning,
    GrowSubmitted,
    InPlaceStep,
    JobGone,
    JobRunning,
    JobStopped,
    NodeLost,
    PlanChosen,
    RunStarted,
    SignalSent,
    SubmitIntent,
    Submitted,
    encode,
)
from sailor_hpc.controller.spec import RunSpec
from sailor_hpc.controller.state import RunDir, Trigger, fold, job_name
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.runtime_events import InPlace

REPO = Path(__file__).resolve().parents[2]


def spec(**kw) -> RunSpec:
    base = dict(run_id="r1", site="/site.toml", model="tiny-gpt", objective="throughput", data="/data", save="/ckpt",
                steps=60, gbs=64)
    return RunSpec.of(**{**base, **kw})


def test_appends_survive_a_torn_last_line(tmp_path: Path):
    path = tmp_path / "journal.jsonl"
    j = Journal(path, clock=lambda: 100.0)
    j.append(RunStarted(run_id="r1"))
    j.append(PlanChosen(reason="start", available={"a100": 1}, gpus={"a100": 1}, throughput=1.0))
    with open(path, "a") as fh:  # a controller killed in the middle of a write
        fh.write('{"seq": 2, "t": 101.0, "kind": "submit_int')
    assert [r.kind for r in read_journal(path)] == ["run_started", "plan"]  # readers skip the torn tail
    j2 = Journal(path, clock=lambda: 102.0)  # the next writer cuts it off and continues the sequence
    assert j2.repaired
    j2.append(ControllerStarted(resumed=True))
    recs = read_journal(path)
    assert [(r.seq, r.kind) for r in recs] == [(0, "run_started"), (1, "plan"), (2, "controller_started")]
    assert path.read_text().endswith("\n") and len(path.read_text().splitlines()) == 3


def test_a_corrupted_record_names_the_file_and_line(tmp_path: Path):
    path = tmp_path / "journal.jsonl"
    path.write_text('{"seq": 0, "t": 1, "kind": "run_started", "run_id": "r1"}\nnot json\n{"seq": 2, "t": 1, "kind": "x"}\n')
    with pytest.raises(SailorError) as err:
        read_journal(path)
    assert err.value.file == str(path) and "line 2" in err.value.message


def test_concurrent_reader_never_sees_half_a_record(tmp_path: Path):
    """A writer process appends 300 records while this process reads: every read parses completely."""
    path = tmp_path / "journal.jsonl"
    code = ("import sys; from sailor_hpc.controller.journal import Journal\n"
            "j = Journal(sys.argv[1])\n"
            "from sailor_hpc.controller.records import CheckpointSeen\n"
            "for i in range(300): j.append(CheckpointSeen(step=i, path='x' * 5000))\n")
    writer = subprocess.Popen([sys.executable, "-c", code, str(path)], cwd=REPO)
    counts = []
    while writer.poll() is None:
        recs = read_journal(path)
        assert [r.step for r in recs] == list(range(len(recs)))
        counts.append(len(recs))
    assert writer.returncode == 0
    assert len(read_journal(path)) == 300 and any(0 < c < 300 for c in counts)


def _story(j: Journal) -> None:
    j.append(RunStarted(run_id="r1"))
    j.append(ControllerStarted(resumed=False))
    j.append(PlanChosen(reason="start", available={"a100": 1, "v100": 8}, gpus={"a100": 1, "v100": 1}, throughput=26.0))
    j.append(SubmitIntent(attempt=1, job_name=job_name("r1", 1), plan_file="p1", script="s1", reason="start",
             gpus={"a100": 1, "v100": 1}, throughput=26.0, cost_per_hour=1.5))
    j.append(Submitted(attempt=1, job_id="13", log="/logs/13.out"))
    j.append(JobRunning(attempt=1, job_id="13", nodes=["a100-1", "v100-1"]))
    j.append(FirstStep(attempt=1, job_id="13", step=1, loaded_step=0))
    j.append(CheckpointSeen(attempt=1, step=10, consumed_samples=640, path="/ckpt/step_00000010"))
    j.append(NodeLost(attempt=1, job_id="13", nodes={"a100-1": "down"}))


def test_fold_tells_where_the_run_stands(tmp_path: Path):
    t = iter(range(1000, 2000))
    j = Journal(tmp_path / "journal.jsonl", clock=lambda: float(next(t)))
    _story(j)
    st = fold(read_journal(j.path))
    cur = st.current
    assert cur is not None and cur.number == 1 and cur.job_id == "13" and cur.nodes == ["a100-1", "v100-1"]
    assert cur.lost_nodes == {"a100-1": "down"} and st.trigger == Trigger("node_lost", 1008.0)
    assert st.checkpoint is not None and st.checkpoint.step == 10 and st.baseline == {"a100": 1, "v100": 8}
    j.append(JobStopped(attempt=1, job_id="13", state="PENDING", reason="node_lost"))
    j.append(JobGone(attempt=1, job_id="13", state="CANCELLED"))
    st = fold(read_journal(j.path))
    assert st.current is None and st.trigger == Trigger("node_lost", 1008.0)  # the first change is what counts
    j.append(SubmitIntent(attempt=2, job_name=job_name("r1", 2), plan_file="p2", script="s2", reason="node_lost",
             trigger="node_lost", trigger_t=1008.0, gpus={"v100": 2}, throughput=13.8, cost_per_hour=1.0))
    st = fold(read_journal(j.path))
    assert st.current.number == 2 and st.current.job_id is None  # the intent is known before sbatch answers
    assert st.trigger is None and st.restarts == 1
    # a job that fails before its first step counts; the next first step resets the count
    j.append(Submitted(attempt=2, job_id="15", log="/logs/15.out"))
    j.append(JobGone(attempt=2, job_id="15", state="FAILED"))
    j.append(Failure(attempt=2, reason="failed (FAILED)"))
    j.append(Backoff(seconds=30, until=5000.0))
    st = fold(read_journal(j.path))
    assert st.failures_in_a_row == 1 and st.backoff_until == 5000.0 and st.current is None


def test_the_running_controller_and_a_resumed_one_agree(tmp_path: Path):
    """apply() record by record (the live controller) == fold() of the file (a resumed one)."""
    from sailor_hpc.controller.state import RunState, apply
    j = Journal(tmp_path / "journal.jsonl", clock=lambda: 1.0)
    live = RunState()
    _story(j)
    for rec in j.records:
        apply(live, rec)
    assert live == fold(read_journal(j.path))


def test_spec_round_trip_and_refusals(tmp_path: Path):
    s = spec(train_args=("--adam-eps", "1e-5"), max_gpus=2)
    s.write(tmp_path / "run.json")
    assert RunSpec.read(tmp_path / "run.json") == s
    data = json.loads((tmp_path / "run.json").read_text())
    (tmp_path / "bad.json").write_text(json.dumps({**data, "colour": "red"}))
    with pytest.raises(SailorError, match="unknown keys"):
        RunSpec.read(tmp_path / "bad.json")
    (tmp_path / "bad.json").write_text(json.dumps({k: v for k, v in data.items() if k != "steps"}))
    with pytest.raises(SailorError, match="missing keys"):
        RunSpec.read(tmp_path / "bad.json")
    with pytest.raises(SailorError) as err:
        spec(train_args=("--steps=5",))
    assert err.value.field == "--train-arg"
    with pytest.raises(SailorError):
        spec(objective="speed")
    with pytest.raises(SailorError):
        spec(steps=0)


def test_run_dir_is_created_once_and_locked_once(tmp_path: Path):
    rd = RunDir.create(tmp_path / "run", spec())
    with pytest.raises(SailorError, match="already holds a controlled run"):
        RunDir.create(tmp_path / "run", spec())
    with pytest.raises(SailorError, match="not a run directory"):
        RunDir.existing(tmp_path)
    assert not rd.controller_alive()
    code = ("import sys, time; from sailor_hpc.controller.state import RunDir\n"
            "with RunDir(sys.argv[1]).lock():\n    print('locked', flush=True); time.sleep(30)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(rd.path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert rd.controller_alive()
        with pytest.raises(SailorError, match="another controller is running this run"):
            with rd.lock():
                pass
    finally:
        holder.kill()
        holder.wait()
    with rd.lock():  # the kernel released the killed holder's lock
        pass


def test_restarts_that_advance_the_checkpoint_do_not_use_up_the_limit(tmp_path: Path):
    """A long run that saves on every time limit keeps going; jobs that fail without progress count."""
    j = Journal(tmp_path / "journal.jsonl", clock=lambda: 1.0)

    def attempt(n: int, reason: str, checkpoint: int | None) -> None:
        j.append(SubmitIntent(attempt=n, job_name=job_name("r1", n), plan_file=f"p{n}", script=f"s{n}",
                 reason=reason, gpus={"v100": 2}, throughput=1.0, cost_per_hour=1.0))
        j.append(Submitted(attempt=n, job_id=str(10 + n), log="/l"))
        if checkpoint is not None:
            j.append(CheckpointSeen(attempt=n, step=checkpoint, consumed_samples=checkpoint * 8, path=f"/ck/{checkpoint}"))
        j.append(JobGone(attempt=n, job_id=str(10 + n), state="COMPLETED"))

    attempt(1, "start", 50)
    for n in range(2, 15):  # 13 time limits, each saved a newer checkpoint
        attempt(n, "signal_saved", 50 * n)
    st = fold(read_journal(j.path))
    assert st.restarts == 13 and st.restarts_without_progress == 0
    attempt(15, "failed (FAILED)", None)
    attempt(16, "idle_gpus", None)  # a resize is a choice, not a restart
    attempt(17, "failed (FAILED)", None)
    st = fold(read_journal(j.path))
    assert st.restarts == 15 and st.restarts_without_progress == 2
    # a checkpoint noticed only after its job ended (saved on Slurm's SIGTERM) is still that job's progress
    j.append(CheckpointSeen(attempt=None, step=999, consumed_samples=1, path="/ck/999"))
    assert fold(read_journal(j.path)).restarts_without_progress == 0


def test_fold_of_an_in_place_step_and_a_grown_job(tmp_path: Path):
    """What a resumed controller knows: the job re-planned in place (new plan, node handled, stop cleared),
    then a bigger job beside it that became the run's attempt only once the old one was gone."""
    j = Journal(tmp_path / "journal.jsonl", clock=lambda: 10.0)
    j.append(SubmitIntent(attempt=1, job_name=job_name("r1", 1), plan_file="p1", script="s1", reason="start",
             gpus={"a100": 2}, throughput=2.0, cost_per_hour=2.0))
    j.append(Submitted(attempt=1, job_id="7", log="l7"))
    j.append(NodeLost(attempt=1, nodes={"a100-2": "draining"}))
    j.append(SignalSent(attempt=1, job_id="7", signal="USR1", reason="node draining"))
    j.append(InPlaceStep(attempt=1, change=InPlace(job_id="7", step_index=1, rc=75, t_step_end=9.0, t_ready=9.5,
             lost={"a100-2": "draining"}, released=["a100-2"], refused=[], plan_file="p1.step-1", nodes=["a100-1"],
             gpus={"a100": 1}, throughput=1.0, cost_per_hour=1.0)))
    mid = fold(j.records)
    att = mid.attempt(1)
    assert (att.plan_file, att.gpus, att.nodes, att.stop, att.lost_nodes) == ("p1.step-1", {"a100": 1}, ["a100-1"], None, {})
    assert att.released == {"a100-2": "draining"} and mid.trigger is None and mid.current is att
    j.append(GrowSubmitted(attempt=1, next_attempt=2, job_id="8", job_name=job_name("r1", 2), log="l8",
             plan_file="p2", script="s2", trigger_t=10.0, gpus={"a100": 2}, throughput=2.0, cost_per_hour=2.0))
    j.append(GrowRunning(attempt=1, job_id="8", nodes=["a100-1", "a100-2"]))
    assert fold(j.records).attempt(1).waits_for_successor and len(fold(j.records).attempts) == 1
    j.append(JobGone(attempt=1, job_id="7", state="CANCELLED"))
    j.append(SubmitIntent(attempt=2, job_name=job_name("r1", 2), plan_file="p2", script="s2", reason="idle_gpus",
             handover_from=1, gpus={"a100": 2}, throughput=2.0, cost_per_hour=2.0))
    j.append(Submitted(attempt=2, job_id="8", log="l8", submitted_t=5.0))
    j.append(JobRunning(attempt=2, job_id="8", since=6.0))
    end = fold(j.records)
    assert end.current is end.attempt(2) and end.attempt(2).handover_from == 1
    assert (end.attempt(2).submitted_t, end.attempt(2).running_t) == (5.0, 6.0)
    assert end.restarts == 0  # growing is a choice, not a restart
    j.append(GrowCancelled(attempt=1, job_id="8", reason="x"))  # (a cancelled successor is no longer awaited)
    assert not fold(j.records).attempt(1).waits_for_successor


def test_time_min_must_be_a_time_within_the_limit():
    assert spec(time_min="00:05:00", time_limit="00:10:00").job.time_min == "00:05:00"
    for bad in (dict(time_min="00:20:00", time_limit="00:10:00"), dict(time_min="soon")):
        with pytest.raises(SailorError) as err:
            spec(**bad)
        assert err.value.field == "--time-min", err.value


def test_an_inconsistent_journal_is_refused_naming_file_line_and_fix(tmp_path: Path):
    """Well-formed records that do not fit together (a job id for an attempt never intended) are refused by
    ``run status`` and ``--resume`` alike: exit 2 naming the journal, the line and the fix, no traceback; a
    journal the controller wrote itself (today's records) replays."""
    rd = RunDir.create(tmp_path / "run", spec(site=str(REPO / "site_configs" / "local-lab.toml")))
    j = Journal(rd.journal_file, clock=lambda: 100.0)
    j.append(RunStarted(run_id="r1"))
    j.append(SubmitIntent(attempt=1, job_name=job_name("r1", 1), plan_file="p", script="s", reason="start",
             gpus={"v100": 1}, throughput=1.0, cost_per_hour=0.5))
    j.append(Submitted(attempt=1, job_id="7", log="/l"))
    j.append(NodeLost(attempt=1, job_id="7", nodes={"v100-1": "draining"}))
    assert rd.state().attempt(1).lost_nodes == {"v100-1": "draining"}  # today's journal replays
    with open(rd.journal_file, "a") as fh:
        fh.write("\n")  # a blank line: lines are counted in the file, not records
        fh.write(json.dumps({"seq": 4, "t": 101.0, "kind": "submitted", "attempt": 2, "job_id": "8", "log": "/l"}) + "\n")
    with pytest.raises(SailorError) as exc:
        rd.state()
    assert exc.value.file == str(rd.journal_file) and exc.value.field == "line 6" and "attempt 2" in str(exc.value)
    for args in (["run", "status", str(rd.path)], ["run", "--resume", str(rd.path)]):
        proc = subprocess.run([sys.executable, "-m", "sailor_hpc.cli", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert f"{rd.journal_file}: line 6: " in proc.stderr and "fix: the journal was edited" in proc.stderr


DATA = Path(__file__).parent / "data"
#: journals the story tests (resize, in place, co-scheduled across clusters) wrote with the untyped records of
#: commit 72435c8, and what that commit's fold and story made of them (tests/controller/data/README.md)
OLD_JOURNALS = sorted(DATA.glob("*.jsonl"))


@pytest.mark.parametrize("journal", OLD_JOURNALS, ids=[p.stem for p in OLD_JOURNALS])
def test_a_journal_of_the_untyped_records_replays_to_the_same_state_and_story(journal: Path):
    from sailor_hpc.controller.story import attempt_rows, change_rows, describe
    expected = json.loads(journal.with_suffix(".expected.json").read_text())
    records = read_journal(journal)
    st = fold(records, source=journal)
    got = {
        "story": [describe(r) for r in records],
        "attempt_rows": [list(map(str, r)) for r in attempt_rows(st)],
        "change_rows": [list(map(str, r)) for r in change_rows(st)],
        "checkpoint_step": st.checkpoint.step if st.checkpoint else None,
        "finished_step": st.finished.step if st.finished else None,
        "gave_up": st.gave_up, "restarts": st.restarts, "run_id": st.run_id,
        "controller_starts": st.controller_starts, "left": sorted(st.left),
        "recoveries": [[r.trigger, r.in_place, r.recovery_s] for r in st.recoveries],
    }
    assert got == expected
    # the codec writes each record back as the line it read, plus the fields that line left at their default
    for line, rec in zip((ln for ln in journal.read_text().splitlines() if ln.strip()), records, strict=True):
        written, again = json.loads(line), encode(rec)
        inline = INLINE.get(type(rec))  # an event written field by field beside the record's own (its defaults too)
        defaults = {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
                    for obj in (rec, *((getattr(rec, inline),) if inline else ())) for f in dataclasses.fields(obj)}
        assert again == {**{k: defaults[k] for k in again.keys() - written.keys()}, **written}


def _edited(tmp_path: Path, edit) -> tuple[Path, int]:
    """The resize story's journal with its first ``submitted`` record edited."""
    lines = (DATA / "resize.jsonl").read_text().splitlines()
    i = next(i for i, ln in enumerate(lines) if json.loads(ln)["kind"] == "submitted")
    lines[i] = json.dumps(edit(json.loads(lines[i])))
    path = tmp_path / "journal.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, i + 1


@pytest.mark.parametrize("edit, says", [
    (lambda r: {**{k: v for k, v in r.items() if k != "job_id"}, "jobid": r["job_id"]},
     "unknown field(s) 'jobid'"),
    (lambda r: {k: v for k, v in r.items() if k != "log"}, "has no field 'log'"),
    (lambda r: {**r, "job_id": 13}, "field 'job_id' must be str, got 13"),
    (lambda r: {**r, "kind": "submited"}, "unknown record kind 'submited'"),
])
def test_an_edited_journal_is_refused_naming_file_line_and_field(tmp_path: Path, edit, says: str):
    path, line = _edited(tmp_path, edit)
    for read in (read_journal, lambda p: RunDir(p.parent).state(), Journal):
        with pytest.raises(SailorError) as err:
            read(path)
        assert err.value.file == str(path) and err.value.field == f"line {line}", err.value
        assert says in err.value.message and err.value.fix, err.value


def test_a_time_too_large_for_a_float_is_refused_not_a_traceback(tmp_path: Path):
    path, line = _edited(tmp_path, lambda r: {**r, "t": 10 ** 400})
    with pytest.raises(SailorError) as err:
        read_journal(path)
    assert err.value.file == str(path) and err.value.field == "t" and f"line {line}" in err.value.message
