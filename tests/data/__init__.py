"""Where the tests' data lives: the shipped site configs, Sailor's published data (shipped inside the
package, so a clone needs nothing beside it) and generated archives (:mod:`.tiny_archive`)."""
from __future__ import annotations

from pathlib import Path

from sailor_hpc.core.sailor_compat import SAILOR_DATA

REPO = Path(__file__).resolve().parents[2]
SITE_CONFIGS = REPO / "site_configs"
LOCAL_LAB = SITE_CONFIGS / "local-lab.toml"

__all__ = ["LOCAL_LAB", "REPO", "SAILOR_DATA", "SITE_CONFIGS"]
