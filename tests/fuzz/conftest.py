"""Settings of the fuzz suite (tests/conftest.py prints its per-loader case counts at the end of the session).

One hypothesis profile for every fuzz test: derandomized (CI and a developer see the same cases), no example
database and hypothesis' caches in the temporary folder (nothing written into the checkout), a deadline per
example so a slow path shows up as a failure, and the examples per loader bounded (each test's
``max_examples``) so the suite stays within `make test`'s budget. SAILOR_FUZZ_SCALE raises the bound for a
longer local hunt.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.configuration import set_hypothesis_home_dir

# hypothesis keeps caches (constants, unicode data) in ./.hypothesis even without a database: out of the checkout
if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
    set_hypothesis_home_dir(Path(tempfile.gettempdir()) / f"sailor-hpc-hypothesis-{os.getuid()}")

settings.register_profile(
    "sailor-fuzz", derandomize=True, database=None, deadline=2000, print_blob=True,
    # the inputs are whole files (the archive is 27 kB): bigger and slower to generate than hypothesis expects
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("sailor-fuzz")
