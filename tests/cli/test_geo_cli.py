"""The CLI on a site of several clusters: show, import Sailor's multi-zone setting, plan across zones."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sailor_hpc.core.site import load_site
from tests.cli.test_cli import cli
from tests.data import SITE_CONFIGS

GCP = str(SITE_CONFIGS / "gcp-multizone.toml")


def test_site_show_lists_clusters_and_links() -> None:
    out = cli("site", "show", GCP)
    assert out.returncode == 0
    assert "-M us-west1-b" in out.stdout and "us-central1-a - us-west1-b" in out.stdout
    # prices: the unit once, in the header; numbers in the cells
    links = out.stdout[out.stdout.index("cost/GB (USD)"):].splitlines()
    assert any(line.split()[-1] == "0.02" for line in links[2:])


def test_import_sailor_multizone(tmp_path: Path) -> None:
    out = cli("site", "import-sailor-multizone", "-o", str(tmp_path / "z.toml"), "--gpus-per-zone", "32")
    assert out.returncode == 0
    site = load_site(tmp_path / "z.toml")
    assert len(site.clusters) == 5 and all(p.total_gpus == 32 for p in site.partitions)
    bad = cli("site", "import-sailor-multizone", "-o", str(tmp_path / "y.toml"), "--gpus-per-zone", "30")
    assert bad.returncode == 2 and "multiple of 4" in bad.stderr and not (tmp_path / "y.toml").exists()


def test_plan_across_zones_reports_gpus_per_cluster_and_egress() -> None:
    avail = "a100-us-central1-a=8,a100-us-central1-b=8"
    out = cli("plan", "--site", GCP, "--model", "OPT-350M", "--gbs", "64", "--available", avail, "--json")
    assert out.returncode == 0, out.stderr
    best = json.loads(out.stdout)["plans"][0]
    assert set(best["gpus_per_cluster"]) <= {"us-central1-a", "us-central1-b"}
    assert all(n <= 8 for n in best["gpus_per_cluster"].values())
    assert best["egress_cost_per_iteration"] == pytest.approx(best["egress_bytes_per_iteration"] / 1e9 * 0.01
                                                              if len(best["gpus_per_cluster"]) == 2 else 0.0)
    text = cli("plan", "--site", GCP, "--model", "OPT-350M", "--gbs", "64", "--available", avail)
    assert "GPUs us-central1-b" in text.stdout and "egress USD/iter" in text.stdout


def test_simulate_prints_the_egress_of_a_plan_across_zones(tmp_path: Path) -> None:
    """One pipeline from us-central1-a to us-west1-b: its activations and the tied embedding's all-reduce
    cross the region link at 0.02 USD/GB."""
    from sailor_hpc.core.plan import Pipeline, Plan, Stage

    plan = Plan("OPT-350M", 16, (Pipeline(1, 16, (Stage(0, 12, 1, "A100-40", "a100-us-central1-a"),
                                                  Stage(13, 25, 1, "A100-40", "a100-us-west1-b"))),))
    plan.save(tmp_path / "x.json")
    out = cli("simulate", str(tmp_path / "x.json"), "--site", GCP, "--json")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    act = 16 * 2 * 2048 * 1024 * 4  # 16 micro-batches of one 2048 x 1024 fp32 activation, there and back
    tied = 2 * 50272 * 1024 * 4  # each end sends its copy of the tied embedding once (H = 2)
    assert res["egress_bytes_per_iteration"] == pytest.approx(act + tied, rel=0.01)  # the vocabulary is padded
    assert res["egress_cost_per_iteration"] == pytest.approx(res["egress_bytes_per_iteration"] / 1e9 * 0.02)
    text = cli("simulate", str(tmp_path / "x.json"), "--site", GCP).stdout
    assert "of which egress" in text and "between clusters" in text
