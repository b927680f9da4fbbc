"""One host list expander, in Python, checked against Slurm's own (``scontrol show hostnames``)."""
from __future__ import annotations

import pytest

from sailor_hpc.core.errors import SailorError
from sailor_hpc.slurm.hostlist import expand_hostlist, expand_hostlists

EXPRESSIONS = ["a100-[1-2],v100-[01-03,7]", "r[1-2]n[08-10]", "node[9-11]", "v100-1", "gpu[001-003,010],cpu-2",
               "a100-[1-2]"]


def test_expands_as_scontrol_does(slurm_cluster):
    for text in EXPRESSIONS:
        slurm = slurm_cluster.run(["scontrol", "show", "hostnames", text])
        assert slurm.returncode == 0, slurm.stderr
        assert expand_hostlist(text) == slurm.stdout.split(), text


def test_empty_lists_duplicates_and_bad_text():
    assert expand_hostlist("(null)") == [] and expand_hostlist("") == [] and expand_hostlist("None assigned") == []
    assert expand_hostlists(["a100-[1-2]", "a100-2,v100-1"]) == ["a100-1", "a100-2", "v100-1"]
    for bad in ("a100-[1-2", "a100-[2-1]", "a100-[x]", "a[1-[2]]"):
        with pytest.raises(SailorError, match="not a Slurm host list"):
            expand_hostlist(bad)
