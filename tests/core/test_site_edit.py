"""Site files written back as edits (tomlkit round trip): what the user wrote stays as they wrote it, only
changed fields change, each change is reported, and the file loads to the site that was written."""
from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from sailor_hpc.core.network import LinkTable, NetworkFit
from sailor_hpc.core.site import Site, load_site
from sailor_hpc.core.site_edit import archive_text, load_site_text, write_site_edit

# a site as a person keeps it: comments everywhere, an alias as the partition's gpu_type, a rounded memory,
# quoted table names, defaults left out, keys in their own order
USER_SITE = '''\
# our lab: measured by hand, 2024
name = "lab"            # used in job names
schema_version = 1

[gpu_types."A100-40"]   # the big ones
memory_gib = 39.43      # what torch can allocate
aliases = ["a100"]

[gpu_types."V100-16"]
memory_gib = 16

[profiles]
archive = ""            # filled by sailor-hpc profile

[[partitions]]
name = "big"
gpu_type = "a100"       # an alias, on purpose
nodes = 2
gpus_per_node = 4
cost_per_gpu_hour = 2.5 # from the price list
[partitions.network.inter_node]
"1" = { constant_gbps = 12.5 }   # vendor figure

[[partitions]]
name = "old"
gpu_type = "V100-16"
nodes = 1
gpus_per_node = 8
'''

MEASURED = NetworkFit(coeffs=(0.8081853212345678, 16.40103598, 32.98046678), max_gbps=248.87621)


def _measured(site: Site, archive: Path, rename: bool) -> Site:
    """What profile --write-site writes: a measured intra-node fit on each partition, the archive, and
    (a CPU sweep) the GPU types under cpu- names without their aliases."""
    def name(n: str) -> str:
        return f"cpu-{n}" if rename else n
    types = {name(n): dataclasses.replace(g, name=name(n), aliases=() if rename else g.aliases)
             for n, g in site.gpu_types.items()}
    parts = tuple(dataclasses.replace(p, gpu_type=name(p.gpu_type), intra_node=LinkTable({2: MEASURED}))
                  for p in site.partitions)
    return dataclasses.replace(site, gpu_types=types, partitions=parts, archive=str(archive))


def _comments(text: str) -> list[str]:
    return [line[line.index("#"):] for line in text.splitlines() if "#" in line]


def test_an_edit_keeps_comments_names_order_and_rounding(tmp_path: Path) -> None:
    source = tmp_path / "lab.toml"
    source.write_text(USER_SITE)
    site = load_site(source)
    new = _measured(site, tmp_path / "profiles.h5", rename=True)
    target = tmp_path / "lab-measured.toml"
    changes = write_site_edit(target, USER_SITE, load_site_text(USER_SITE, target), new,
                              renamed_gpu_types={"A100-40": "cpu-A100-40", "V100-16": "cpu-V100-16"})
    text = target.read_text()
    # the file loads to the site that was written, field for field
    assert load_site(target).to_dict() == new.to_dict()
    # every comment survives, in its order; the untouched lines are byte for byte the user's
    assert _comments(text) == _comments(USER_SITE)
    for line in ('name = "lab"            # used in job names', "memory_gib = 39.43      # what torch can allocate",
                 "cost_per_gpu_hour = 2.5 # from the price list", '"1" = { constant_gbps = 12.5 }   # vendor figure'):
        assert line in text.splitlines()
    # names kept: the site's, and the header quoting of the renamed tables
    assert '[gpu_types."cpu-A100-40"]   # the big ones' in text and "cpu-" not in tomllib.loads(text)["name"]
    # order: the keys of the top table and of the first partition as the user had them
    doc = tomllib.loads(text)
    assert list(doc) == ["name", "schema_version", "gpu_types", "profiles", "partitions"]
    assert list(doc["partitions"][0])[:5] == ["name", "gpu_type", "nodes", "gpus_per_node", "cost_per_gpu_hour"]
    # the archive next to the file is written relative to it
    assert doc["profiles"]["archive"] == "profiles.h5"
    # every change is named, with the value before and after; nothing unchanged is listed
    assert {c.field: (c.old, c.new) for c in changes} == {
        "gpu_types.A100-40 (renamed)": ("A100-40", "cpu-A100-40"),
        "gpu_types.V100-16 (renamed)": ("V100-16", "cpu-V100-16"),
        "gpu_types.cpu-A100-40.aliases": (["a100"], []),
        "gpu_types.cpu-A100-40.dtypes": (None, ["fp32", "bf16", "fp16"]),  # its new name implies no bf16
        "profiles.archive": ("", "profiles.h5"),
        "partitions[big].gpu_type": ("A100-40", "cpu-A100-40"),
        'partitions[big].network.intra_node."2"': (None, MEASURED.to_dict()),
        "partitions[old].gpu_type": ("V100-16", "cpu-V100-16"),
        'partitions[old].network.intra_node."2"': (None, MEASURED.to_dict()),
    }
    # a measured fit is written with every digit the archive holds: the site's fit is the archive's
    assert load_site(target).intra_node_fit("big", 2) == MEASURED


def test_writing_the_same_site_changes_nothing(tmp_path: Path) -> None:
    source = tmp_path / "lab.toml"
    source.write_text(USER_SITE)
    site = load_site(source)
    assert write_site_edit(source, USER_SITE, site, site) == ()
    assert source.read_text() == USER_SITE  # byte for byte, the alias and 39.43 included


def test_a_changed_value_keeps_its_comment_added_ones_append_removed_ones_go(tmp_path: Path) -> None:
    source = tmp_path / "lab.toml"
    source.write_text(USER_SITE)
    site = load_site(source)
    big = dataclasses.replace(site.partitions[0], cost_per_gpu_hour=3.0, inter_node=None)
    types = {**site.gpu_types, "V100-16": dataclasses.replace(site.gpu_types["V100-16"], aliases=("v100",))}
    new = dataclasses.replace(site, partitions=(big, site.partitions[1]), gpu_types=types)
    changes = write_site_edit(source, USER_SITE, site, new)
    text = source.read_text()
    assert "cost_per_gpu_hour = 3.0 # from the price list" in text.splitlines()
    assert "vendor figure" not in text and "inter_node" not in text  # the removed table, its comment with it
    assert '[gpu_types."V100-16"]\nmemory_gib = 16\naliases = ["v100"]\n' in text
    assert [c.describe() for c in changes] == [
        'gpu_types.V100-16.aliases: [] -> ["v100"]', "partitions[big].cost_per_gpu_hour: 2.5 -> 3",
        'partitions[big].network.inter_node."1": {constant_gbps = 12.5} -> (absent)']
    assert load_site(source).to_dict() == new.to_dict()


def test_an_edit_that_would_not_load_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    """Taking away the alias the file's partition names its GPU type by would leave a file that does not
    load: the write refuses, and the file stays as it was."""
    source = tmp_path / "lab.toml"
    source.write_text(USER_SITE)
    site = load_site(source)
    types = {**site.gpu_types, "A100-40": dataclasses.replace(site.gpu_types["A100-40"], aliases=())}
    with pytest.raises(RuntimeError, match="GPU type 'a100' is not declared.*nothing was written"):
        write_site_edit(source, USER_SITE, site, dataclasses.replace(site, gpu_types=types))
    assert source.read_text() == USER_SITE


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_the_archive_is_relative_to_the_site_only_inside_its_folder(tmp_path: Path, where: str) -> None:
    folder = tmp_path / "site"
    folder.mkdir()
    archive = folder / "p" / "a.h5" if where == "inside" else tmp_path / "elsewhere" / "a.h5"
    assert archive_text(str(archive), folder / "s.toml") == ("p/a.h5" if where == "inside" else str(archive))


def test_a_relative_archive_keeps_its_meaning_when_written_elsewhere(tmp_path: Path) -> None:
    """The source says archive = "profiles.h5" (next to it); written into another folder, the site must still
    name that file, so the value changes to where it is from there."""
    (tmp_path / "a").mkdir()
    source = tmp_path / "a" / "lab.toml"
    text = USER_SITE.replace('archive = ""', 'archive = "profiles.h5"')
    source.write_text(text)
    site = load_site(source)
    target = tmp_path / "b" / "lab.toml"
    changes = write_site_edit(target, text, load_site_text(text, target), site)
    assert load_site(target).archive == site.archive == str(tmp_path / "a" / "profiles.h5")
    assert [(c.field, c.new) for c in changes] == [("profiles.archive", str(tmp_path / "a" / "profiles.h5"))]
