"""The site's ``[environment.container]``: what loads, what is refused (file, field, fix), and its round trip."""
from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from sailor_hpc.cli import main
from sailor_hpc.core.container import Container, Mount
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.site import load_site, load_site_dict
from sailor_hpc.core.toml_writer import dump_toml
from tests.data import SITE_CONFIGS

LOCAL_LAB = SITE_CONFIGS / "local-lab.toml"


def with_container(container: dict[str, Any]) -> dict[str, Any]:
    doc = tomllib.loads(LOCAL_LAB.read_text())
    doc["environment"]["container"] = container
    return doc


def test_each_runtime_loads_with_its_kind_of_image(tmp_path: Path) -> None:
    sif, folder = tmp_path / "pytorch.sif", tmp_path / "image"
    sif.write_bytes(b"SIF")
    folder.mkdir()
    site_file = tmp_path / "site.toml"
    cases = [
        ({"runtime": "apptainer", "image": str(sif), "mounts": ["/scratch:/scratch"]},
         Container("apptainer", str(sif), (Mount("/scratch", "/scratch"),))),
        ({"runtime": "singularity", "image": "docker://nvcr.io/nvidia/pytorch:24.05-py3"},
         Container("singularity", "docker://nvcr.io/nvidia/pytorch:24.05-py3")),
        ({"runtime": "pyxis", "image": "nvcr.io#nvidia/pytorch:24.05-py3", "mounts": ["/a:/b", "/c:/d"]},
         Container("pyxis", "nvcr.io#nvidia/pytorch:24.05-py3", (Mount("/a", "/b"), Mount("/c", "/d")))),
        # a relative image is relative to the site file, as the archive is
        ({"runtime": "charliecloud", "image": "image"}, Container("charliecloud", str(folder))),
    ]
    for table, want in cases:
        assert load_site_dict(with_container(table), source=site_file).container == want
    assert load_site(LOCAL_LAB).container is None  # no table: the nodes' own system


@pytest.mark.parametrize(("table", "field", "words"), [
    ({"runtime": "docker", "image": "x"}, "environment.container.runtime", ["apptainer, singularity, pyxis, charliecloud"]),
    ({"image": "x"}, "environment.container.runtime", ["is missing"]),
    ({"runtime": "apptainer"}, "environment.container.image", ["is missing"]),
    ({"runtime": "apptainer", "image": "/nowhere/pytorch.sif"}, "environment.container.image",
     ["/nowhere/pytorch.sif", "does not exist", "build or copy"]),
    ({"runtime": "charliecloud", "image": "/nowhere/img"}, "environment.container.image", ["does not exist"]),
    ({"runtime": "pyxis", "image": "/nowhere/pytorch.sqsh"}, "environment.container.image", ["does not exist"]),
    ({"runtime": "pyxis", "image": "  "}, "environment.container.image", ["is not an image"]),
    ({"runtime": "pyxis", "image": "ubuntu", "mounts": ["/scratch"]}, "environment.container.mounts[0]", ['"SRC:DST"']),
    ({"runtime": "pyxis", "image": "ubuntu", "mounts": ["/a:/b", "scratch:/scratch"]},
     "environment.container.mounts[1]", ["absolute"]),
    ({"runtime": "pyxis", "image": "ubuntu", "mounts": ["/a,/b:/c"]}, "environment.container.mounts[0]", ['","']),
    ({"runtime": "pyxis", "image": "ubuntu", "mounts": ["/a:/b:ro"]}, "environment.container.mounts[0]", ["SRC:DST"]),
    ({"runtime": "pyxis", "image": "ubuntu", "mounts": [3]}, "environment.container.mounts[0]", ["SRC:DST"]),
    ({"runtime": "pyxis", "image": "ubuntu", "mount": ["/a:/b"]}, "environment.container.mount", ["did you mean 'mounts'"]),
])
def test_a_bad_container_is_refused_naming_file_field_and_fix(table: dict[str, Any], field: str, words: list[str]) -> None:
    with pytest.raises(SailorError) as err:
        load_site_dict(with_container(table), source="site.toml")
    assert err.value.file == "site.toml" and err.value.field == field, err.value
    assert err.value.fix, err.value
    for w in words:
        assert w in str(err.value), err.value


def test_site_validate_exits_2_on_a_bad_container(tmp_path: Path) -> None:
    path = tmp_path / "site.toml"
    path.write_text(dump_toml(with_container({"runtime": "podman", "image": "x"})))
    res = CliRunner().invoke(main, ["site", "validate", str(path)])
    assert res.exit_code == 2
    assert f"{path}: environment.container.runtime: 'podman'" in res.output and "fix: use one of" in res.output


def test_the_container_round_trips_through_the_document_form(tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    site = load_site_dict(with_container({"runtime": "charliecloud", "image": "img", "mounts": ["/x:/y"]}),
                          source=tmp_path / "site.toml")
    doc = site.to_dict()
    assert doc["environment"]["container"] == {"runtime": "charliecloud", "image": str(tmp_path / "img"),
                                               "mounts": ["/x:/y"]}
    assert load_site_dict(doc, source=tmp_path / "elsewhere" / "site.toml").container == site.container
