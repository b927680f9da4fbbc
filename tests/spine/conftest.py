"""Shared paths for the spine tests."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SAILOR_DATA = REPO.parent / "shared" / "sailor_data"
SITE_CONFIGS = REPO / "site_configs"


@pytest.fixture()
def lab_site(tmp_path: Path) -> Path:
    """A private copy of local-lab.toml that tests may edit."""
    dst = tmp_path / "site.toml"
    shutil.copy(SITE_CONFIGS / "local-lab.toml", dst)
    return dst


def sailor_data() -> Path:
    if not SAILOR_DATA.exists():
        pytest.fail(f"Sailor's published data is expected at {SAILOR_DATA} (shared/ beside the checkout)")
    return SAILOR_DATA
