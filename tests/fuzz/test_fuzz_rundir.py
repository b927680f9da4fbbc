"""Run directories: one made as ``sailor-hpc run`` makes it (``RunDir.create`` with a ``RunSpec``, a journal
written by ``Journal.append``), its ``run.json`` or ``journal.jsonl`` mutated, through the readers the
controller and ``run --resume`` / ``run status`` use: ``RunDir.existing(...).spec()``, ``read_journal`` and
the writer's own opening (``Journal``, which cuts a torn last line and nothing else)."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import example, given, settings
from hypothesis import strategies as st

from sailor_hpc.controller.journal import Journal, read_journal
from sailor_hpc.controller.records import ControllerStarted, NodeLost, PlanChosen, RunStarted, SubmitIntent, Submitted
from sailor_hpc.controller.spec import RunSpec
from sailor_hpc.controller.state import InconsistentJournal, RunDir, job_name
from tests.data import LOCAL_LAB
from tests.fuzz.harness import Doc, count, examples, loads_or_refuses, mutated_bytes, mutated_doc, scratch


def _template() -> dict[str, bytes]:
    """``run.json`` and ``journal.jsonl`` of a run that planned, submitted a job and saw it lose a node."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = RunSpec.of(run_id="feed01", site=str(LOCAL_LAB), model="tiny-gpt", objective="throughput",
                       data=f"{tmp}/d", save=f"{tmp}/ckpt", steps=60, gbs=64, time_limit="1:00:00",
                       train_args=("--lr=1e-4",))
        rd = RunDir.create(Path(tmp) / "run", spec)
        clock = iter(range(100, 200))
        j = Journal(rd.journal_file, clock=lambda: float(next(clock)))
        j.append(RunStarted(run_id="feed01"))
        j.append(PlanChosen(reason="start", available={"a100": 1, "v100": 8}, gpus={"a100": 1}, throughput=26.4))
        j.append(SubmitIntent(attempt=1, job_name=job_name("feed01", 1), plan_file="p", script="s",
                              reason="start", gpus={"a100": 1}, throughput=26.4, cost_per_hour=1.5))
        j.append(Submitted(attempt=1, job_id="13", log="/l"))
        j.append(NodeLost(attempt=1, job_id="13", nodes={"a100-1": "down"}))
        return {p.name: p.read_bytes() for p in (rd.spec_file, rd.journal_file)}


TEMPLATE = _template()
SPEC_DOC: Doc = json.loads(TEMPLATE["run.json"])
RECORDS: list[Doc] = [json.loads(line) for line in TEMPLATE["journal.jsonl"].splitlines()]


def _jsonl(records: Doc) -> bytes:
    """Records as journal lines (a mutated "record list" that is no list becomes one line)."""
    lines = records if isinstance(records, list) else [records]
    return b"".join(json.dumps(r).encode() + b"\n" for r in lines)


spec_files = st.one_of(mutated_doc(SPEC_DOC).map(lambda d: json.dumps(d, indent=1).encode()),
                       mutated_bytes(TEMPLATE["run.json"]))
journal_files = st.one_of(mutated_doc(RECORDS).map(_jsonl), mutated_bytes(TEMPLATE["journal.jsonl"]))


@settings(max_examples=examples(200))
@given(spec_files)
@example(json.dumps({**SPEC_DOC, "extra_sbatch": None}).encode())  # was a TypeError
@example(json.dumps({**SPEC_DOC, "run_id": 7}).encode())  # was an AttributeError
def test_run_spec_loads_or_names_the_file(data: bytes) -> None:
    count("run.json")
    with scratch({**TEMPLATE, "run.json": data}) as root, loads_or_refuses("run.json", root / "run.json"):
        RunDir.existing(root).spec().to_dict()


@settings(max_examples=examples(200))
@given(journal_files)
@example(_jsonl([*RECORDS[:-1], {**RECORDS[-1], "seq": "4"}]))  # was a TypeError in the writer's next seq
@example(TEMPLATE["journal.jsonl"].replace(b"feed01", b"feed\xff1", 1))  # was a UnicodeDecodeError
def test_journal_loads_or_names_the_file(data: bytes) -> None:
    count("journal.jsonl")
    with scratch({**TEMPLATE, "journal.jsonl": data}) as root, loads_or_refuses("journal.jsonl", root / "journal.jsonl"):
        assert RunDir(root).records() == read_journal(root / "journal.jsonl")
    count("journal.jsonl (writer)")
    with scratch({**TEMPLATE, "journal.jsonl": data}, read_only=False) as root:
        rd = RunDir(root)
        opened = False
        with loads_or_refuses("journal.jsonl (writer)", rd.journal_file):
            journal = rd.journal()
            opened = True
            # the writer keeps the complete lines and cuts only a torn last one: nothing half-written stays
            kept = rd.journal_file.read_bytes()
            assert kept == data[:data.rfind(b"\n") + 1] and journal.repaired == (kept != data)
            journal.append(ControllerStarted(resumed=True))
            assert read_journal(rd.journal_file)[:-1] == journal.records[:-1]
        if not opened:
            assert rd.journal_file.read_bytes() == data  # a refused journal is left as it was


@settings(max_examples=examples(200))
@given(journal_files)
@example(_jsonl([*RECORDS, {**RECORDS[-1], "seq": 5, "attempt": 2}]))  # an attempt never intended: was a KeyError
@example(_jsonl([*RECORDS[:-1], {**RECORDS[-1], "nodes": ["a100-1"]}]))  # nodes as a list: was a ValueError
@example(_jsonl([*RECORDS[:3], {**RECORDS[3], "attempt": None}, *RECORDS[4:]]))  # was an AssertionError
def test_journal_replays_or_names_the_file_and_line(data: bytes) -> None:
    """What ``run --resume`` and ``run status`` fold: the state, or a refusal naming the journal and the line."""
    count("journal.jsonl (fold)")
    with scratch({**TEMPLATE, "journal.jsonl": data}) as root, loads_or_refuses("journal.jsonl (fold)",
                                                                              root / "journal.jsonl"):
        try:
            RunDir(root).state()
        except InconsistentJournal as exc:
            assert exc.field is not None and exc.field.startswith("line ") and exc.fix, exc
            raise
