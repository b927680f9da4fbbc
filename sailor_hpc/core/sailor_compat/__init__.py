"""Sailor compatibility: readers of Sailor's plan_config runs and profile files, and its shipped data.

Sailor (SOSP'25) publishes profiles, network fits and measured runs in its own JSON formats; these
readers turn them into this project's data model, so that everything downstream speaks one format.
"""
from pathlib import Path

# Sailor's published data, shipped with the package (MIT; see its README and LICENSE).
SAILOR_DATA = Path(__file__).resolve().parent.parent / "data" / "sailor"
