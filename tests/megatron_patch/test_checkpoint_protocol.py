"""The checkpoint directory protocol on its own (torch-free): what counts as complete, what is refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sailor_hpc.core import checkpoint as ck


def make(root: Path, step: int, payload: bytes = b"x" * 1000) -> Path:
    """A checkpoint as the runtime writes one: files in the temporary dir, then manifest, then rename."""
    tmp = ck.start_tmp(root, step)
    files = {f"layer_{i:03d}.pt": ck.write_file(tmp / f"layer_{i:03d}.pt", payload + bytes([step, i]))
             for i in range(2)}
    params = {"w0": {"file": "layer_000.pt", "shape": [1]}, "w1": {"file": "layer_001.pt", "shape": [1]}}
    return ck.publish(tmp, {"step": step, "consumed_samples": 8 * step, "files": files, "params": params})


def test_latest_complete_is_the_newest_that_verifies(tmp_path: Path) -> None:
    for s in (1, 2, 3):
        make(tmp_path, s)
    assert ck.latest_complete(tmp_path) == ck.step_dir(tmp_path, 3)
    m = ck.read_manifest(ck.latest_complete(tmp_path))
    assert (m["step"], m["consumed_samples"], m["format"], m["version"]) == (3, 24, ck.FORMAT, ck.VERSION)


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "delete_file", "no_manifest", "bad_json",
                                    "other_format", "param_to_unlisted_file"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path, damage: str) -> None:
    make(tmp_path, 1)
    newest = make(tmp_path, 2)
    f = newest / "layer_001.pt"
    manifest = newest / ck.MANIFEST
    if damage == "flip_byte":  # same size: only the checksum can tell
        data = bytearray(f.read_bytes())
        data[10] ^= 0xFF
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[:500])
    elif damage == "delete_file":
        f.unlink()
    elif damage == "no_manifest":
        manifest.unlink()
    elif damage == "bad_json":
        manifest.write_text(manifest.read_text()[:40])
    elif damage == "other_format":
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format": "something-else"}))
    elif damage == "param_to_unlisted_file":
        m = json.loads(manifest.read_text())
        m["params"]["w1"]["file"] = "layer_009.pt"
        manifest.write_text(json.dumps(m))
    assert ck.latest_complete(tmp_path) == ck.step_dir(tmp_path, 1)
    with pytest.raises(ck.CheckpointError):
        ck.resolve(newest)  # an explicit step never falls back
    # the fallback names what it passed over and why (file and reason), for every caller to say
    choice = ck.choose(tmp_path)
    assert choice.path == ck.step_dir(tmp_path, 1)
    (skipped,) = choice.skipped
    assert skipped.path == newest
    named = "manifest.json" if damage in ("no_manifest", "bad_json", "other_format", "param_to_unlisted_file") \
        else "layer_001.pt"
    assert skipped.reason.startswith(f"{named}: "), skipped.reason
    (line,) = choice.warnings()
    assert str(newest) in line and "using step_00000001" in line


def test_nothing_passed_over_means_nothing_to_say(tmp_path: Path) -> None:
    make(tmp_path, 1)
    make(tmp_path, 2)
    assert ck.choose(tmp_path) == ck.Choice(ck.step_dir(tmp_path, 2), ())
    assert ck.choose(tmp_path).warnings() == []


def test_no_usable_checkpoint_names_the_unusable_ones(tmp_path: Path) -> None:
    only = make(tmp_path, 3)
    (only / "layer_000.pt").write_bytes(b"short")
    choice = ck.newest_usable(tmp_path)
    assert choice.path is None and [s.path for s in choice.skipped] == [only]
    assert choice.warnings() == [f"checkpoint {only} is unusable ({choice.skipped[0].reason}); "
                                 "no older checkpoint verifies"]
    with pytest.raises(ck.CheckpointError) as exc:
        ck.resolve(tmp_path)
    assert "1 unusable: step_00000003: layer_000.pt: size 5" in exc.value.message


def test_temporary_directories_are_never_candidates(tmp_path: Path) -> None:
    make(tmp_path, 1)
    tmp = ck.start_tmp(tmp_path, 5)  # a save that died before its rename, with everything in it
    (tmp / "layer_000.pt").write_bytes(b"y")
    (tmp / ck.MANIFEST).write_text(json.dumps({"format": ck.FORMAT, "version": ck.VERSION, "step": 5,
                                                "consumed_samples": 40, "files": {}, "params": {}}))
    assert ck.latest_complete(tmp_path) == ck.step_dir(tmp_path, 1)
    assert ck.resolve(tmp_path) == ck.step_dir(tmp_path, 1)
    assert not ck.start_tmp(tmp_path, 5).joinpath("layer_000.pt").exists()  # a new save starts clean


def test_no_complete_checkpoint_is_an_error_with_a_fix(tmp_path: Path) -> None:
    assert ck.latest_complete(tmp_path / "missing") is None
    with pytest.raises(ck.CheckpointError) as exc:
        ck.resolve(tmp_path)
    assert exc.value.fix


def test_saving_a_step_again_replaces_it_and_prune_keeps_the_newest(tmp_path: Path) -> None:
    for s in (1, 2, 3, 4):
        make(tmp_path, s)
    make(tmp_path, 4, payload=b"z" * 10)
    assert ck.verify(ck.step_dir(tmp_path, 4))["files"]["layer_000.pt"]["bytes"] == 12
    removed = ck.prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step_00000001", "step_00000002"]
    assert [p.name for p in ck.candidates(tmp_path)] == ["step_00000004", "step_00000003"]
