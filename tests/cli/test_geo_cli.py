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
    assert "-M us-west1-b" in out.stdout and "us-central1-a - us-west1-b" in out.stdout and "0.02 USD" in out.stdout


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
