"""Precisions: which GPU types train in which dtype, and profiles kept apart per dtype in the archive."""
from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from sailor_hpc.core.archive import ComputeEntry, read_archive, write_entries
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.precision import default_dtypes
from sailor_hpc.core.site import load_site_dict


@pytest.mark.parametrize("gpu, bf16", [("A100-40", True), ("A100-80", True), ("GH-96", True), ("H100-80", True),
                                       ("RTX-3090", True), ("L40S", True), ("V100-16", False), ("V100-32", False),
                                       ("Titan-RTX", False), ("RTX-2080", False), ("T4", False)])
def test_bf16_needs_ampere_or_newer(gpu: str, bf16: bool) -> None:
    assert ("bf16" in default_dtypes(gpu)) is bf16
    assert {"fp32", "fp16"} <= set(default_dtypes(gpu))


def _site(dtypes: object) -> dict:
    return {"name": "s", "gpu_types": {"X1": {"memory_gib": 10, "dtypes": dtypes}},
            "partitions": [{"name": "p", "gpu_type": "X1", "gres": "gpu:x", "nodes": 1, "gpus_per_node": 1,
                            "cost_per_gpu_hour": 1.0}]}


def test_site_may_declare_a_gpu_types_dtypes() -> None:
    site = load_site_dict(_site(["bf16", "fp32"]), source="s.toml")
    assert site.gpu("X1").dtypes == ("fp32", "bf16")  # canonical order
    assert site.to_dict()["gpu_types"]["X1"]["dtypes"] == ["fp32", "bf16"]  # written only where not the default
    assert "dtypes" not in load_site_dict(_site(["fp16", "fp32"]), source="s.toml").to_dict()["gpu_types"]["X1"]
    with pytest.raises(SailorError) as info:
        load_site_dict(_site(["fp32", "fp8"]), source="s.toml")
    assert info.value.field == "gpu_types.X1.dtypes" and "fp8" in info.value.message


def _entry(dtype: str, scale: float) -> ComputeEntry:
    return ComputeEntry("tiny-gpt", "A100-40", 1, 1, np.full((6, 3), scale), {"source": "test"}, dtype=dtype)


def test_each_dtype_is_its_own_profile(tmp_path: Path) -> None:
    path = tmp_path / "a.h5"
    write_entries(path, [_entry("fp32", 2.0), _entry("bf16", 1.0)])
    with h5py.File(path, "r") as h5:
        assert sorted(h5["compute/tiny-gpt/A100-40"]) == ["mbs1_tp1", "mbs1_tp1_bf16"]
    a = read_archive(path)
    assert a.dtypes("tiny-gpt", "A100-40") == ["bf16", "fp32"]
    assert a.compute_points("tiny-gpt", "A100-40", "bf16")[(1, 1)].times[0, 0] == 1.0
    assert a.compute_points("tiny-gpt", "A100-40")[(1, 1)].times[0, 0] == 2.0
    with pytest.raises(SailorError) as info:
        a.compute_points("tiny-gpt", "A100-40", "fp16")
    assert "profiled in bf16, fp32, not fp16" in info.value.message and "--dtype fp16" in info.value.fix


def test_a_points_name_and_dtype_must_agree(tmp_path: Path) -> None:
    path = tmp_path / "a.h5"
    write_entries(path, [_entry("fp32", 2.0)])
    with h5py.File(path, "r+") as h5:  # an archive written before dtype suffixes: the attribute decides
        h5["compute/tiny-gpt/A100-40/mbs1_tp1"].attrs["dtype"] = "bf16"
    assert read_archive(path).dtypes("tiny-gpt", "A100-40") == ["bf16"]
    with h5py.File(path, "r+") as h5:
        h5.move("compute/tiny-gpt/A100-40/mbs1_tp1", "compute/tiny-gpt/A100-40/mbs1_tp1_fp16")
    with pytest.raises(SailorError, match="is named for fp16 but holds bf16 times"):
        read_archive(path)
