"""The one JSON -> dataclass reader behind journal records, runtime events and run.json: each rule against
values written out by hand, the three readers' classes through a JSON round trip, and what each reader says
when a file does not fit."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, make_dataclass
from pathlib import Path
from typing import Any

import pytest

from sailor_hpc.controller.journal import read_journal
from sailor_hpc.controller.records import IdleGpus, PlanChosen, RecoveryMeasured, decode, encode
from sailor_hpc.controller.spec import RunSpec
from sailor_hpc.core.errors import EXIT_BAD_INPUT, SailorError
from sailor_hpc.core.runtime_events import InPlace, Stepped, decode_event, encode_event
from sailor_hpc.core.typed_json import Mismatch, from_json, hint_text

WRONG = "does not fit"


def value_as(value: Any, hint: Any, finite: bool = False) -> Any:
    """``value`` read as a one-field dataclass's ``hint`` says, or WRONG (with the field named)."""
    probe = make_dataclass("Probe", [("v", hint)], frozen=True)
    try:
        return from_json(probe, {"v": value}, finite=finite).v
    except Mismatch as exc:
        assert exc.problem == "type" and exc.field == "v" and exc.value is value
        return WRONG


@pytest.mark.parametrize("hint, value, expected", [
    # a float field takes an int (a journal's t, a runtime's "t": 9, run.json's "poll_s": 2)
    (float, 9, 9.0), (float, 2.5, 2.5), (float | None, 3, 3.0), (float | None, None, None),
    (float, "2", WRONG), (float, 10**400, WRONG),  # too large for a float: refused, not an OverflowError
    # JSON's true is no number, and a number is no bool
    (int, True, WRONG), (float, False, WRONG), (bool, 1, WRONG), (bool, False, False), (bool | None, None, None),
    # an int field takes no fraction (a step, an attempt)
    (int, 3, 3), (int, 3.0, WRONG), (int | None, None, None), (int | None, "3", WRONG),
    (str, "13", "13"), (str, 13, WRONG), (str, None, WRONG),
    # containers, item by item (records' Gpus and IdleGpus.change, the in-place event's nodes and lost)
    (dict[str, int], {"a100": 2}, {"a100": 2}), (dict[str, int], {"a100": "2"}, WRONG), (dict[str, int], [], WRONG),
    (dict[str, list[int]], {"a100": [2, 3]}, {"a100": [2, 3]}), (dict[str, list[int]], {"a100": [2, None]}, WRONG),
    (list[str], ["a100-1"], ["a100-1"]), (list[str], [["a100-1"]], WRONG), (list[str], {"a": "b"}, WRONG),
    (dict[str, float], {"a": 1}, {"a": 1.0}),
    # run.json's train_args: a JSON list read as the frozen spec's tuple
    (tuple[str, ...], ["--lr=1e-4"], ("--lr=1e-4",)), (tuple[str, ...], [], ()), (tuple[str, ...], [1], WRONG),
    (tuple[str, ...], "--lr", WRONG), (tuple[str, str], ["a", "b"], WRONG),  # only the sequence form
    # records' spec and decision payloads: whatever JSON holds
    (dict[str, Any] | None, {"x": [1, {"y": None}]}, {"x": [1, {"y": None}]}), (Any, True, True),
])
def test_a_value_is_read_as_its_hint_says(hint: Any, value: Any, expected: Any) -> None:
    got = value_as(value, hint)
    assert got == expected and type(got) is type(expected)


def test_finite_refuses_nan_and_infinity_only_where_asked() -> None:
    """A diverged loss is a measured NaN (the runtime and journal keep it); a NaN knob in run.json is refused."""
    for bad in (float("nan"), float("inf"), -float("inf")):
        assert value_as(bad, float | None, finite=True) is WRONG
        got = value_as(bad, float)
        assert math.isnan(got) if math.isnan(bad) else got == bad
    assert value_as(1e308, float, finite=True) == 1e308
    assert value_as({"a": float("inf")}, dict[str, float], finite=True) is WRONG


@dataclass(frozen=True)
class Job:
    job_id: str
    attempt: int
    nodes: list[str] = field(default_factory=list)
    since: float | None = None


def test_unknown_then_missing_then_type_each_named() -> None:
    assert from_json(Job, {"job_id": "7", "attempt": 1}) == Job("7", 1)  # defaults fill what the line lacks
    assert from_json(Job, {"kind": "x", "job_id": "7", "attempt": 1}, skip=("kind",)) == Job("7", 1)
    with pytest.raises(Mismatch) as err:
        from_json(Job, {"zeta": 1, "alpha": 2, "attempt": "one"})
    assert (err.value.problem, err.value.names, err.value.field) == ("unknown", ["alpha", "zeta"], "alpha")
    assert err.value.message == "unknown field(s) 'alpha', 'zeta'"
    with pytest.raises(Mismatch) as err:
        from_json(Job, {"since": "x"})
    assert (err.value.problem, err.value.names) == ("missing", ["job_id", "attempt"])  # in field order
    assert err.value.message == "field 'job_id' is missing"
    with pytest.raises(Mismatch) as err:
        from_json(Job, {"job_id": "7", "attempt": 1, "nodes": ["a", 2], "since": "x"})
    assert (err.value.problem, err.value.field, err.value.expected, err.value.value) == ("type", "nodes", "list[str]",
                                                                                        ["a", 2])
    assert err.value.message == "field 'nodes' must be list[str], got ['a', 2]"
    assert isinstance(err.value, SailorError) and err.value.exit_code == EXIT_BAD_INPUT  # uncaught: still exit 2
    # the runtime's lines carry details for people beside the fields a reader needs
    assert from_json(Job, {"job_id": "7", "attempt": 1, "host": "n1"}, ignore_unknown=True) == Job("7", 1)


def test_hint_text() -> None:
    assert [hint_text(h) for h in (str, int | None, dict[str, int], tuple[str, ...], dict[str, Any] | None)] == [
        "str", "int | None", "dict[str, int]", "tuple[str, ...]", "dict[str, Any] | None"]
    assert hint_text(float | None, finite=True) == "finite float | None"


# ---------------------------------------------------------------------------------------- the three readers

def test_the_readers_classes_round_trip_through_json() -> None:
    """One case of each reader, written as its writer writes it and read back equal."""
    plan = PlanChosen(seq=3, t=10.5, reason="start", available={"a100": 4}, gpus={"a100": 2}, throughput=2.5,
                      expected_start_s=float("inf"))  # no finite rule in the journal: an unbounded estimate
    idle = IdleGpus(seq=4, t=11.0, attempt=1, change={"a100": [2, 4]}, available={"a100": 4})
    for rec in (plan, idle):
        assert decode(json.loads(json.dumps(encode(rec)))) == rec
    change = InPlace(job_id="7", step_index=1, rc=137, t_step_end=1.0, t_ready=2.0, lost={"a100-2": "down"},
                     released=["a100-2"], refused=[], plan_file="p.json", nodes=["a100-1"], gpus={"a100": 1},
                     throughput=2.5, cost_per_hour=1.0)
    assert decode_event(json.loads(encode_event(change))) == change
    nan_loss = decode_event({"event": "step", "step": 3, "loss": float("nan"), "t": 9, "rank": 0})
    assert isinstance(nan_loss, Stepped) and math.isnan(nan_loss.loss or 0.0) and nan_loss.t == 9.0
    spec = RunSpec.of(run_id="feed01", site="/s", model="tiny-gpt", objective="throughput", data="/d", save="/c",
                   steps=60, gbs=64, train_args=("--lr=1e-4",), max_gpus=3)
    assert RunSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert RunSpec.from_dict({**spec.to_dict(), "poll_s": 2}).control.poll_s == 2.0


def test_a_journal_line_that_does_not_fit_names_file_line_and_field(tmp_path: Path) -> None:
    line = encode(RecoveryMeasured(seq=1, t=1.0, attempt=1, trigger=None, trigger_t=None, first_step_t=1.0,
                                   downtime_s=1.0, recovery_s=1.0, queue_wait_s=None, ranks_idle_s=None, new_job=True))
    cases = [({**line, "step": 1.5}, "the 'recovery' record's field 'step' must be int | None, got 1.5"),
             ({**line, "downtime_s": 10**400}, "the 'recovery' record's field 'downtime_s' must be float, got 1000"),
             ({k: v for k, v in line.items() if k != "new_job"}, "the 'recovery' record has no field 'new_job'"),
             ({**line, "newjob": True}, "the 'recovery' record has unknown field(s) 'newjob'")]
    for bad, says in cases:
        path = tmp_path / "journal.jsonl"
        path.write_text(json.dumps(bad) + "\n")
        with pytest.raises(SailorError) as err:
            read_journal(path)
        assert (err.value.file, err.value.field) == (str(path), "line 1") and err.value.fix, err.value
        assert err.value.message.startswith("line 1: " + says), err.value


def test_a_runtime_line_that_does_not_fit_names_source_event_and_field() -> None:
    """Items of the in-place event's containers are checked too: a node's state is text, a partition's GPUs a
    count (what ``sailor_hpc.controller.inplace`` prints)."""
    fields = json.loads(encode_event(InPlace(job_id="7", step_index=1, rc=137, t_step_end=1.0, t_ready=2.0,
                                             lost={"a100-2": "down"}, released=[], refused=[], plan_file="p",
                                             nodes=["a100-1"], gpus={"a100": 1}, throughput=2.5, cost_per_hour=1.0)))
    cases = [({**fields, "gpus": {"a100": "1"}}, "gpus", "field 'gpus' must be dict[str, int], got {'a100': '1'}"),
             ({**fields, "lost": {"a100-2": 0}}, "lost", "field 'lost' must be dict[str, str]"),
             ({"event": "step", "stepp": 4}, "step", "the runtime's 'step' event: field 'step' is missing"),
             ({"event": "saved", "step": 2, "seconds": True}, "seconds", "field 'seconds' must be float | None")]
    for bad, name, says in cases:
        with pytest.raises(SailorError) as err:
            decode_event(bad, source="job.out")
        assert (err.value.file, err.value.field) == ("job.out", name) and err.value.fix and says in err.value.message


@pytest.mark.parametrize("edit, name, says", [
    ({"poll_s": float("nan")}, "poll_s", "must be finite float, got nan"),
    ({"max_cost_per_hour": float("inf")}, "max_cost_per_hour", "must be finite float | None, got inf"),
    ({"backoff_s": 10**400}, "backoff_s", "must be finite float"),
    ({"train_args": ["--lr", 1]}, "train_args", "must be tuple[str, ...], got ['--lr', 1]"),
    ({"steps": True}, "steps", "must be int, got True"),
    ({"colour": "red", "accent": 1}, "accent", "unknown keys ['accent', 'colour']"),
    ({"gbs": None, "steps": 1.5}, "steps", "must be int, got 1.5"),  # the first in field order
])
def test_a_run_json_that_does_not_fit_names_file_and_field(edit: dict[str, Any], name: str, says: str) -> None:
    spec = RunSpec.of(run_id="feed01", site="/s", model="tiny-gpt", objective="throughput", data="/d", save="/c",
                   steps=60, gbs=64).to_dict()
    with pytest.raises(SailorError) as err:
        RunSpec.from_dict({**spec, **edit}, source="run.json")
    assert (err.value.file, err.value.field) == ("run.json", name) and says in err.value.message, err.value
    missing = {k: v for k, v in spec.items() if k not in ("steps", "gbs")}
    with pytest.raises(SailorError) as err:
        RunSpec.from_dict(missing, source="run.json")
    assert (err.value.field, err.value.message) == ("gbs", "missing keys ['gbs', 'steps']")
