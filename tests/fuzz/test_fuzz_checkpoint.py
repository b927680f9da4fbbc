"""Checkpoints: a tiny real checkpoint (layer files written by ``checkpoint_io.write_layer``, published by the
protocol), its newest step's manifest or a layer file mutated, through ``ck.choose`` / ``ck.newest_usable``
(what ``--load`` and ``checkpoint export`` call) and ``CheckpointReader`` (what a rank reads tensors with)."""
from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megatron_patch.checkpoint_io import CheckpointReader, layer_file, write_layer
from sailor_hpc.core import checkpoint as ck
from tests.fuzz.harness import count, examples, loads_or_refuses, mutated_bytes, mutated_doc, scratch

SHAPE = (2, 3)
NEWEST = "step_00000002"
MANIFEST = f"{NEWEST}/{ck.MANIFEST}"
LAYER = f"{NEWEST}/{layer_file(1)}"


def _param(layer: int) -> str:
    return f"decoder.layers.{layer}.mlp.linear_fc2.weight"


def _entries(layer: int, step: int) -> dict[str, dict[str, torch.Tensor]]:
    t = torch.arange(6, dtype=torch.float32).reshape(SHAPE) + step
    return {_param(layer): {"param": t, "exp_avg": t / 2, "exp_avg_sq": t * t}}


def _write_step(root: Path, step: int) -> None:
    """A checkpoint as ``checkpoint_io.save`` writes one: a layer file per pipeline layer, then the manifest."""
    tmp = ck.start_tmp(root, step)
    files = {layer_file(layer): write_layer(tmp, layer, _entries(layer, step)) for layer in range(2)}
    params = {_param(layer): {"file": layer_file(layer), "shape": list(SHAPE)} for layer in range(2)}
    ck.publish(tmp, {"step": step, "consumed_samples": 8 * step, "adam_steps": step, "seed": 1, "files": files,
                     "params": params})


def _template() -> dict[str, bytes]:
    """Every file of a root with two good steps, by relative path (each example writes a copy)."""
    with tempfile.TemporaryDirectory() as tmp:
        for step in (1, 2):
            _write_step(Path(tmp), step)
        return {str(p.relative_to(tmp)): p.read_bytes() for p in sorted(Path(tmp).rglob("*")) if p.is_file()}


TEMPLATE = _template()
MANIFEST_DOC: dict[str, Any] = json.loads(TEMPLATE[MANIFEST])


def _resigned(files: dict[str, bytes]) -> dict[str, bytes]:
    """The newest manifest made to list its layer file as it now is, so that ``verify`` passes and the reader
    meets the damage itself (a file corrupt when written, or a load that skips the checksums)."""
    manifest = json.loads(files[MANIFEST])
    data = files[LAYER]
    manifest["files"][layer_file(1)].update(bytes=len(data), sha256=ck.sha256_bytes(data))
    return {**files, MANIFEST: json.dumps(manifest).encode()}


def _torch_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


_GOOD = _entries(1, 2)
_TENSOR = _GOOD[_param(1)]["param"]
#: layer files that unpickle but hold the wrong things: another parameter, a field missing, a wrong shape or
#: dtype, a list or a number where a tensor belongs
wrong_layers = st.sampled_from([
    {}, [], 3, {"other": _GOOD[_param(1)]}, {_param(1): {"param": _TENSOR}},
    {_param(1): {**_GOOD[_param(1)], "param": torch.zeros(3, 2)}},
    {_param(1): {**_GOOD[_param(1)], "exp_avg": torch.zeros(7)}},
    {_param(1): {**_GOOD[_param(1)], "param": _TENSOR.to(torch.int64)}},
    {_param(1): {**_GOOD[_param(1)], "param": [1.0, 2.0]}}, {_param(1): []},
]).map(_torch_bytes)

#: the newest step damaged: its manifest field by field or byte by byte, its layer file byte by byte (the
#: checksums left, or made to match), or its layer file replaced by a well-formed one of the wrong content
damaged_roots = st.one_of(
    mutated_doc(MANIFEST_DOC).map(lambda doc: {**TEMPLATE, MANIFEST: json.dumps(doc).encode()}),
    mutated_bytes(TEMPLATE[MANIFEST]).map(lambda data: {**TEMPLATE, MANIFEST: data}),
    st.tuples(mutated_bytes(TEMPLATE[LAYER]), st.booleans()).map(
        lambda c: _resigned({**TEMPLATE, LAYER: c[0]}) if c[1] else {**TEMPLATE, LAYER: c[0]}),
    wrong_layers.map(lambda data: _resigned({**TEMPLATE, LAYER: data})),
)


def _read_every_tensor(path: Path) -> None:
    """What a resuming rank reads: every parameter's fields, of the manifest's shape."""
    reader = CheckpointReader(str(path))
    for name in reader.names():
        for field, tensor in reader.tensors(name).items():
            assert list(tensor.shape) == reader.manifest["params"][name]["shape"], (name, field)


def _with_manifest(**changes: Any) -> dict[str, bytes]:
    return {**TEMPLATE, MANIFEST: json.dumps({**MANIFEST_DOC, **changes}).encode()}


@settings(max_examples=examples(250))
@given(damaged_roots)
# each of these was a traceback (AttributeError, TypeError, KeyError, torch's RuntimeError) or, the last two,
# a manifest pointing outside its directory and a tensor of the wrong shape silently accepted
@example(_with_manifest(files=[]))
@example(_with_manifest(params={_param(1): {"file": layer_file(1)}}))
@example(_with_manifest(files={**MANIFEST_DOC["files"], layer_file(1): "x"}))
@example(_resigned({**TEMPLATE, LAYER: b"not a zip"}))
@example(_with_manifest(files={f"../step_00000001/{layer_file(0)}": MANIFEST_DOC["files"][layer_file(0)]}))
@example(_resigned({**TEMPLATE, LAYER: _torch_bytes({_param(1): {**_GOOD[_param(1)], "param": torch.zeros(3, 2)}})}))
def test_checkpoint_loads_or_names_the_file(files: dict[str, bytes]) -> None:
    count("checkpoint")
    with scratch(files) as root:
        newest = root / NEWEST
        with loads_or_refuses("checkpoint", newest):  # an explicit step: it loads or is refused
            ck.choose(newest)
            _read_every_tensor(newest)
        # the root: the newest usable step, the damaged one named if it was passed over (never an exception)
        choice = ck.newest_usable(root)
        assert choice.path in (newest, root / "step_00000001")
        assert (choice.path == newest) == (not choice.skipped)
