"""Profile archive (HDF5): the tests' tiny-gpt archive (``tests/data/tiny_archive.py``) plus an overhead table,
a network fit and a point with its spread, mutated through h5py (entries deleted, moved or replaced by
datasets of the wrong shape or dtype, attributes of the wrong type, groups where datasets belong) or byte by
byte, through ``read_archive`` (what ``open_archive`` reads every archive with)."""
from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sailor_hpc.core.archive import (
    ComputeEntry,
    NetworkEntry,
    OverheadEntry,
    PointSpread,
    make_provenance,
    read_archive,
    write_entries,
)
from sailor_hpc.core.network import NetworkFit
from tests.data.tiny_archive import write_tiny_archive
from tests.fuzz.harness import count, examples, loads_or_refuses, mutated_bytes, scratch


def _template() -> bytes:
    """The archive every example starts from: every kind of entry the readers know."""
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_archive(Path(tmp) / "tiny.h5")
        prov = make_provenance("fuzz template")
        times = np.full((6, 3), 1e-3)
        write_entries(path, [
            OverheadEntry("A100-40", {1: 1.5e9, 2: 1.6e9}, prov),
            NetworkEntry("local-lab", "inter", "a100", "a100", 2, NetworkFit(coeffs=(-0.01, 0.2, 2.1), max_gbps=3.7),
                         prov),
            ComputeEntry("tiny-gpt", "A100-40", 8, 1, times, prov, spread=PointSpread(times * 0.1, (0.01, 0.02), 5)),
            ComputeEntry("tiny-gpt", "V100-16", 8, 4, times * np.nan, prov, status="failed", reason="OOM"),
        ])
        return path.read_bytes()


TEMPLATE = _template()


def _names() -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "a.h5"
        path.write_bytes(TEMPLATE)
        with h5py.File(path, "r") as h5:
            names = ["/"]
            h5.visit(lambda name: names.append(f"/{name}"))
            return names


NAMES = _names()
ATTRS = ("format", "version", "dtype", "status", "reason", "provenance", "flag", "spread", "model_spread",
         "repetitions", "kind", "senders", "max_gbps", "min_bytes", "max_bytes", "a", "b", "columns")
#: attribute values of the wrong type or range
attr_values = st.sampled_from([
    "", "é", "{not json", "[]", "null", b"\xff\xfe", 0, -1, 2**40, 1.5, math.nan, math.inf, -math.inf, True,
    np.zeros(3), np.array([1, 2]), np.full((6, 3), -1.0), np.array(["a", "b"], dtype=h5py.string_dtype()),
])
#: datasets that are not what the archive holds there
dataset_values = st.sampled_from([
    np.zeros((0, 3)), np.zeros((6, 2)), np.full((6, 3), np.nan), np.full((6, 3), -1.0), np.zeros(3), np.zeros((2, 2)),
    np.full((6, 4), np.inf), np.array([[1.0, 0.0], [1.0, 5.0]]), np.array([[0.5, 1e9]]), np.array(3.0),
    np.array(["x", "y"], dtype=h5py.string_dtype()), np.zeros((6, 3), dtype=np.int8), np.zeros((1, 3, 2)),
])
child_names = st.sampled_from(["x", "mbs0_tp1", "mbs1_tp1_fp64", "mbs1_tp1_bf16", "tp0", "tp1", "tp2x", "A100-40",
                               "inter:a:b:0", "é"])

#: one h5py edit: (operation, object, argument)
edits = st.one_of(
    st.tuples(st.just("delete"), st.sampled_from(NAMES[1:]), st.none()),
    st.tuples(st.just("set_attr"), st.sampled_from(NAMES), st.tuples(st.sampled_from(ATTRS), attr_values)),
    st.tuples(st.just("del_attr"), st.sampled_from(NAMES), st.sampled_from(ATTRS)),
    st.tuples(st.just("replace"), st.sampled_from(NAMES[1:]), dataset_values),
    st.tuples(st.just("to_group"), st.sampled_from(NAMES[1:]), st.none()),
    st.tuples(st.just("move"), st.sampled_from(NAMES[1:]), child_names),
    st.tuples(st.just("add"), st.sampled_from(NAMES), st.tuples(child_names, st.one_of(st.none(), dataset_values))),
)


def _edit(h5: h5py.File, op: str, name: str, arg: Any) -> None:
    """Apply one edit (skipped where an earlier edit removed its object)."""
    if name not in h5:
        return
    obj = h5[name]
    parent = obj.parent
    base = name.rsplit("/", 1)[-1]
    if op == "delete":
        del h5[name]
    elif op == "set_attr":
        obj.attrs[arg[0]] = arg[1]
    elif op == "del_attr" and arg in obj.attrs:
        del obj.attrs[arg]
    elif op == "replace":
        del h5[name]
        parent.create_dataset(base, data=arg)
    elif op == "to_group":
        del h5[name]
        parent.create_group(base)
    elif op == "move" and f"{parent.name.rstrip('/')}/{arg}" not in h5:
        h5.move(name, f"{parent.name.rstrip('/')}/{arg}")
    elif op == "add" and isinstance(obj, h5py.Group) and arg[0] not in obj:
        if arg[1] is None:
            obj.create_group(arg[0])
        else:
            obj.create_dataset(arg[0], data=arg[1])


def _check_read(loader: str, data: bytes | None, edit_list: list[tuple[str, str, Any]]) -> None:
    count(loader)
    with tempfile.TemporaryDirectory() as tmp:  # edited first: scratch() then holds the result
        path = Path(tmp) / "profiles.h5"
        path.write_bytes(TEMPLATE if data is None else data)
        if edit_list:
            with h5py.File(path, "r+") as h5:
                for op, name, arg in edit_list:
                    _edit(h5, op, name, arg)
        edited = path.read_bytes()
    with scratch({"profiles.h5": edited}) as root, loads_or_refuses(loader, root / "profiles.h5"):
        list(read_archive(root / "profiles.h5").entries())


@settings(max_examples=examples(150))
@given(st.lists(edits, min_size=1, max_size=3))
def test_archive_edited_loads_or_names_the_file(edit_list: list[tuple[str, str, Any]]) -> None:
    _check_read("profile archive", None, edit_list)


def _bad_heap(data: bytes, n: int) -> bytes:
    """``data`` with the signature of its ``n``-th local heap (where a group keeps its members' names) broken."""
    at = -1
    for _ in range(n + 1):
        at = data.index(b"HEAP", at + 1)
    return data[:at] + b"I" + data[at + 1:]


@settings(max_examples=examples(100))
@given(mutated_bytes(TEMPLATE))
def test_archive_bytes_load_or_name_the_file(data: bytes) -> None:
    _check_read("profile archive (bytes)", data, [])


def test_archive_dangling_link_names_the_file() -> None:
    """Found by the fuzz: h5py gives None for a link it cannot follow, whose .name was an AttributeError."""
    with scratch({"profiles.h5": TEMPLATE}, read_only=False) as root:
        with h5py.File(root / "profiles.h5", "r+") as h5:
            h5["/compute/tiny-gpt/A100-40/x"] = h5py.SoftLink("/nowhere")
        with loads_or_refuses("profile archive", root / "profiles.h5"):
            read_archive(root / "profiles.h5")


def test_archive_bad_local_heap_names_the_file() -> None:
    """Found by the fuzz: h5py's RuntimeError on damaged group metadata (a bad local heap) escaped."""
    with scratch({"profiles.h5": _bad_heap(TEMPLATE, 1)}) as root, \
            loads_or_refuses("profile archive", root / "profiles.h5"):
        read_archive(root / "profiles.h5")
