"""Site configs: shipped files, round trip, and one test per validation error."""
from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.site import load_site, load_site_dict, parse_walltime
from tests.data import SITE_CONFIGS


def test_shipped_sites_validate_and_have_the_fixed_shapes() -> None:
    sites = {p.stem: load_site(p) for p in SITE_CONFIGS.glob("*.toml")}
    assert {"clariden", "mit-mixed", "a100-v100", "local-lab"} <= set(sites)
    av = sites["a100-v100"]
    assert [(p.name, p.gpu_type, p.nodes, p.gpus_per_node) for p in av.partitions] == [
        ("a100", "A100-40", 64, 4), ("v100", "V100-16", 64, 4)]
    assert sum(p.total_gpus for p in av.partitions) == 512
    lab = sites["local-lab"]
    assert [(p.name, p.gpu_type, p.gres, p.nodes, p.gpus_per_node) for p in lab.partitions] == [
        ("a100", "A100-40", "gpu:a100", 2, 4), ("v100", "V100-16", "gpu:v100", 2, 8)]
    assert {p.gpu_type for p in sites["mit-mixed"].partitions} == {"Titan-RTX", "RTX-2080", "RTX-3090"}
    assert {p.gpu_type for p in sites["clariden"].partitions} == {"GH-96"}
    assert all(p.inter_node and p.intra_node for name, s in sites.items() if name != "laptop" for p in s.partitions)
    # the laptop site is a template: its one node's link is measured (profile --local --write-site)
    laptop = sites["laptop"]
    assert [(p.nodes, p.gpus_per_node, p.intra_node, p.inter_node) for p in laptop.partitions] == [(1, 2, None, None)]


def test_round_trip_through_the_document_form() -> None:
    for path in SITE_CONFIGS.glob("*.toml"):
        site = load_site(path)
        again = load_site_dict(site.to_dict(), source=path)
        assert again.partitions == site.partitions
        assert again.gpu_types == site.gpu_types
        assert again.slurm == site.slurm and again.prelude == site.prelude and again.between == site.between


def test_site_fits_evaluate_like_sailors_published_quadratics() -> None:
    """Inside the measured range our fit is Sailor's quadratic, capped at the highest bandwidth observed."""
    import json
    import math

    from tests.data import SAILOR_DATA

    raw = json.loads((SAILOR_DATA / "network" / "network_coeffs_all_homo.json").read_text())
    site = load_site(SITE_CONFIGS / "clariden.toml")
    for k in (1, 2, 4):
        (a, b, c), max_bps = raw["inter"]["GH-96"][str(k)]
        fit = site.inter_node_fit("normal", "normal", k)
        for nbytes in (2**17, 8_388_608, 96_083_456, 2**29):
            u = math.log2(nbytes / 1e6)
            expected = min((a * u * u + b * u + c) * 1e9, max_bps)
            assert fit.fitted_bandwidth(nbytes) == pytest.approx(expected, rel=1e-4)
            if nbytes >= 8_388_608:  # where the quadratic rises with size, the effective rate is the fit's
                assert fit.bandwidth(nbytes) == pytest.approx(expected, rel=1e-4)
    # sailor_model.md §3.6: GH-96 k=1 carries a 96 MB gradient bucket at about 22.96 GB/s
    assert site.inter_node_fit("normal", "normal", 1).bandwidth(96_083_456) / 1e9 == pytest.approx(22.96, rel=2e-3)


def test_fits_are_clamped_to_their_measured_range() -> None:
    site = load_site(SITE_CONFIGS / "a100-v100.toml")
    fit = site.inter_node_fit("a100", "a100", 1)
    assert fit.bandwidth(1e15) == fit.bandwidth(2**30)  # outside the range: the edge value, never a negative quadratic
    assert fit.transfer_time(1.0) == fit.transfer_time(2**16)  # below it: the smallest message's time
    assert all(fit.bandwidth(10.0**e) > 0 for e in range(0, 16))
    assert fit.transfer_time(0) == 0.0


def test_a_smaller_message_never_takes_longer() -> None:
    """Clariden's GH-96 quadratic is negative below ~100 kB; taken literally (floored at 1 MB/s) a 20 kB
    tied-embedding gradient took 20 ms, longer than a 64 MB one. Times must not decrease with size."""
    site = load_site(SITE_CONFIGS / "clariden.toml")
    for k in (1, 2, 4):
        fit = site.inter_node_fit("normal", "normal", k)
        sizes = [2.0 ** (e / 4) for e in range(0, 4 * 32)]
        times = [fit.transfer_time(x) for x in sizes]
        assert all(a <= b * (1 + 1e-12) for a, b in zip(times, times[1:]))
        assert fit.transfer_time(20_480) < 1e-4  # tens of microseconds: latency-bound, not 20 ms
        assert fit.transfer_time(20_480) <= fit.transfer_time(64e6) / 10


def _without_partition_links(site):
    return dataclasses.replace(site, links=dataclasses.replace(site.links, partitions={}))


def test_cross_partition_link_defaults_to_the_slower_network() -> None:
    site = _without_partition_links(load_site(SITE_CONFIGS / "a100-v100.toml"))  # no measured link
    mixed = site.inter_node_fit("a100", "v100", 4)
    assert mixed == site.inter_node_fit("v100", "v100", 4)  # V100's network peaks lower


def test_walltime_formats() -> None:
    assert parse_walltime("1-00:00:00") == 86400
    assert parse_walltime("12:30:00") == 45000
    assert parse_walltime("90") == 5400


def _broken(path: Path, old: str, new: str) -> Path:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))
    return path


def _extra_sbatch(*options: object) -> tuple[str, str]:
    """(old, new) that give local-lab.toml's [slurm] section ``extra_sbatch = [options]``."""
    return 'constraint = ""', 'constraint = ""\nextra_sbatch = ' + json.dumps(list(options))


# the a100 partition's single-sender inter-node fit in local-lab.toml, the line the network cases break
A100_INTER_1 = '"1" = { coeffs = [-0.0024414231124647644, 0.1408627339370467, 1.116822757126346], max_gbps = 2.4204 }'


@pytest.mark.parametrize("old,new,field,words", [
    ("gpus_per_node = 4", "gpus_per_nod = 4", "partitions[0].gpus_per_node", "rename 'gpus_per_nod'"),
    ("gpus_per_node = 4", "gpus_per_node = 0", "partitions[0].gpus_per_node", "positive"),
    ("gpus_per_node = 4", 'gpus_per_node = "four"', "partitions[0].gpus_per_node", "integer"),
    ('gpu_type = "A100-40"', 'gpu_type = "H100-80"', "partitions[0].gpu_type", "not declared"),
    ('name = "v100"', 'name = "a100"', "partitions[1].name", "declared twice"),
    ('max_walltime = "1-00:00:00"', 'max_walltime = "tomorrow"', "partitions[0].max_walltime", "Slurm time"),
    ('gres = "gpu:a100"', 'gres = "gpu:a100; rm -rf /"', "partitions[0].gres", "gres"),
    ("max_nodes_per_job = 2", "max_nodes_per_job = 3", "partitions[0].max_nodes_per_job", "exceeds"),
    ("schema_version = 1", "schema_version = 7", "schema_version", "not supported"),
    (A100_INTER_1,
     '"1" = { coeffs = [1.0, 2.0] }', "partitions[0].network.inter_node.1.coeffs", "three numbers"),
    (A100_INTER_1,
     '"1" = { max_gbps = 2.0 }', "partitions[0].network.inter_node.1", "exactly one of"),
    (A100_INTER_1,
     '"x" = { constant_gbps = 2.0 }', "partitions[0].network.inter_node.x", "number of GPUs"),
    ("memory_gib = 16", "memory_gib = -1", "gpu_types.V100-16.memory_gib", "positive"),
    ("cost_per_gpu_hour = 0.5", "cost_per_gpu_hour = -0.5", "partitions[1].cost_per_gpu_hour", ">= 0"),
    ("cost_per_gpu_hour = 0.5", "cost_per_gpu_hour = 0.5\nreplica_jitter = 1.3", "partitions[1].replica_jitter",
     "fraction"),
    # NaN compares false with every bound: finiteness is checked on its own
    ("cost_per_gpu_hour = 0.5", "cost_per_gpu_hour = nan", "partitions[1].cost_per_gpu_hour", "finite"),
    ("memory_gib = 16", "memory_gib = inf", "gpu_types.V100-16.memory_gib", "finite"),
    (A100_INTER_1,
     '"1" = { constant_gbps = 2.0, range_bytes = ["a", "b"] }', "partitions[0].network.inter_node.1.range_bytes",
     "[min, max]"),
    (A100_INTER_1,
     '"²" = { constant_gbps = 2.0 }', "partitions[0].network.inter_node.²", "number of GPUs"),
    (A100_INTER_1,
     '"1" = { coeffs = [0.0, 0.0, 0.0] }', "partitions[0].network.inter_node.1.coeffs", "no positive bandwidth"),
    # a GPU type names HDF5 groups of the shared archive: a '/' would nest them
    ('[gpu_types."V100-16"]', '[gpu_types."V100/16"]', "gpu_types.V100/16", "not a valid GPU type name"),
    ('name = "local-lab"', 'name = "lab/x"', "name", "not a valid site name"),
    # [slurm] values reach every job's #SBATCH lines: checked at load with the job header's rules
    ('account = ""', 'account = "proj;touch x"', "slurm.account", "not a valid Slurm name"),
    ('qos = ""', 'qos = "normal\\n#SBATCH --partition=v100"', "slurm.qos", "control characters"),
    ('constraint = ""', 'constraint = "ib nvlink"', "slurm.constraint", "constraint expression"),
    (*_extra_sbatch("--gres=gpu:v100:8"), "slurm.extra_sbatch[0]", "--gres cannot be added"),
    (*_extra_sbatch("--mail-type=END", "--parti=v100"), "slurm.extra_sbatch[1]", "sbatch reads it as --partition"),
    (*_extra_sbatch("-N 2"), "slurm.extra_sbatch[0]", "-N is --nodes"),
    (*_extra_sbatch("--comment=a b"), "slurm.extra_sbatch[0]", "plain value"),
    (*_extra_sbatch(3), "slurm.extra_sbatch[0]", "must be a string"),
    # a name a GPU type answers to must mean one type (Site.gpu takes the first that answers)
    ('aliases = ["v100", "V100"]', 'aliases = ["v100", "A100-40"]', "gpu_types.V100-16.aliases",
     "already the name of GPU type 'A100-40'"),
    ('aliases = ["v100", "V100"]', 'aliases = ["v100", "a100"]', "gpu_types.V100-16.aliases",
     "already an alias of GPU type 'A100-40'"),
])
def test_every_validation_error_names_file_field_and_problem(lab_site: Path, old: str, new: str, field: str,
                                                             words: str) -> None:
    _broken(lab_site, old, new)
    with pytest.raises(SailorError) as info:
        load_site(lab_site)
    err = info.value
    assert err.file == str(lab_site)
    assert err.field == field
    assert words in str(err)


def test_missing_required_field_and_file_and_syntax(lab_site: Path, tmp_path: Path) -> None:
    _broken(lab_site, "nodes = 2\n", "\n")
    with pytest.raises(SailorError, match=r"partitions\[0\]\.nodes: is missing"):
        load_site(lab_site)
    with pytest.raises(SailorError, match="file not found"):
        load_site(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = [unclosed")
    with pytest.raises(SailorError, match="not valid TOML"):
        load_site(bad)
    bad.write_bytes(b"name = \"\xff\"")
    with pytest.raises(SailorError, match="is not UTF-8"):
        load_site(bad)
    with pytest.raises(SailorError, match="cannot be read"):
        load_site(tmp_path)  # a folder


def test_between_partitions_must_be_names(lab_site: Path) -> None:
    text = lab_site.read_text() + '\n[[network.between]]\npartitions = [["a100"], ["v100"]]\n' \
        '[network.between.links]\n"1" = { constant_gbps = 1.0 }\n'
    lab_site.write_text(text)
    with pytest.raises(SailorError) as info:
        load_site(lab_site)
    assert info.value.field == "network.between[0].partitions" and "two different declared partitions" in str(info.value)


def test_relative_archive_path_resolves_next_to_the_site(lab_site: Path) -> None:
    _broken(lab_site, 'archive = ""', 'archive = "profiles/shared.h5"')
    site = load_site(lab_site)
    assert site.archive == str(lab_site.parent / "profiles" / "shared.h5")


def test_gpu_lookup_by_alias_and_unknown() -> None:
    data = tomllib.loads((SITE_CONFIGS / "local-lab.toml").read_text())
    site = load_site_dict(data, source="x.toml")
    assert site.gpu("a100").name == "A100-40"
    with pytest.raises(SailorError, match="unknown GPU type"):
        site.gpu("MI250")
    with pytest.raises(SailorError, match="no partition 'gpu'"):
        site.partition("gpu")


def test_site_validate_reports_a_bad_slurm_value_with_file_field_and_fix(lab_site: Path) -> None:
    """A forbidden extra option is the site file's error, found by `site validate`, not by the first render."""
    from click.testing import CliRunner

    from sailor_hpc.cli import main

    _broken(lab_site, 'constraint = ""', 'constraint = ""\nextra_sbatch = ["--ntasks-per-n=2"]')
    res = CliRunner().invoke(main, ["site", "validate", str(lab_site)])
    assert res.exit_code == 2, res.output
    assert f"{lab_site}: slurm.extra_sbatch[0]: --ntasks-per-n (sbatch reads it as --ntasks-per-node)" in res.output
    assert "(fix: change the plan or the site's partitions instead)" in res.output


def test_gpu_aliases_may_repeat_within_a_type_and_name_partitions() -> None:
    """Not collisions: a type listing its own name or an alias twice, and a partition named like the alias of
    its GPU type (local-lab's "a100"): partitions and GPU types are looked up apart (Site.partition, Site.gpu)."""
    data = tomllib.loads((SITE_CONFIGS / "local-lab.toml").read_text())
    data["gpu_types"]["A100-40"]["aliases"] = ["a100", "A100-40", "a100"]
    site = load_site_dict(data, source="x.toml")
    assert site.gpu("a100").name == "A100-40" and site.partition("a100").gpu_type == "A100-40"
