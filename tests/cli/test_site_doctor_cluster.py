"""``sailor-hpc site doctor`` on the real local Slurm cluster (fake GPUs: no NVIDIA driver, so a rank reports
Slurm's assignment and "no CUDA device", as it is).

- local-lab.toml as shipped matches: exit 0, and what it reports agrees with Slurm asked directly;
- a site file with a wrong GPU count and a wrong gres name is refused (exit 2) with each field and its fix,
  and ``--write-site`` writes the file back as the shipped one;
- in a container (Charliecloud): the rank reports the container's interpreter, and a checkpoint folder that
  is not mounted into the image is reported as not shared.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sailor_hpc.core.site import load_site
from tests.conftest import slurm_missing
from tests.slurm.container_image import PYTHON_INSIDE, local_lab_in_image, user_env, why_no_charliecloud

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
LOCAL_LAB = REPO / "site_configs" / "local-lab.toml"


def _doctor(cluster, site: Path, *args: str, cwd: Path, env: dict[str, str] | None = None):
    return cluster.run(["sailor-hpc", "site", "doctor", str(site), *args], cwd=cwd, env=env, timeout=300)


def test_the_shipped_local_lab_matches_its_nodes(slurm_cluster, tmp_path):
    proc = _doctor(slurm_cluster, LOCAL_LAB, "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["findings"] == []
    version = slurm_cluster.run(["sinfo", "--version"]).stdout.split()[-1]
    assert report["slurm"] == [{"cluster": None, "slurm_version": version, "gpu_gres": ["gpu:a100", "gpu:v100"]}]
    for part in report["partitions"]:
        name, facts = part["partition"], part["facts"]
        gres = slurm_cluster.run(["sinfo", "-h", "-p", name, "-o", "%G"]).stdout.split()  # e.g. gpu:a100:4
        rows = {r[0]: r for r in part["rows"]}
        spec, count = gres[0].rsplit(":", 1)
        assert rows["gres (GPUs per node)"][2] == f"{spec} x {count} (Slurm)"
        # the rank was given a whole node's GPUs: Slurm's CUDA_VISIBLE_DEVICES names that many
        assert len(facts["env"]["CUDA_VISIBLE_DEVICES"].split(",")) == int(count)
        assert facts["env"]["SLURM_JOB_PARTITION"] == name
        assert facts["torch"]["found"] and not facts["torch"]["cuda_available"]  # honest: no CUDA device here
        assert rows["shared folder (--checkpoints)"][2] == "seen by the node"
    assert not list(tmp_path.glob(".sailor-doctor-*"))  # the token files are gone again


def test_a_wrong_site_file_is_refused_with_the_fix_and_written_right(slurm_cluster, tmp_path):
    text = LOCAL_LAB.read_text()
    a100 = text.index('name = "a100"')
    wrong = text[:a100] + text[a100:].replace("gpus_per_node = 4", "gpus_per_node = 8", 1)
    wrong = wrong.replace('gres = "gpu:v100"', 'gres = "gpu:h100"')
    site = tmp_path / "wrong.toml"
    site.write_text(wrong)
    proc = _doctor(slurm_cluster, site, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert ("mismatch: partitions[a100].gpus_per_node: the site file says 8 GPUs per node, Slurm's nodes have 4 "
            "(fix: set gpus_per_node = 4)") in proc.stdout
    assert ("mismatch: partitions[v100].gres: Slurm's nodes of v100 have no gres 'gpu:h100' (they have: gpu:v100 x 8) "
            '(fix: set gres = "gpu:v100")') in proc.stdout
    assert f"error: {site}: partitions[a100].gpus_per_node:" in proc.stderr and "--write-site" in proc.stderr
    fixed = tmp_path / "fixed.toml"
    proc = _doctor(slurm_cluster, site, "--write-site", str(fixed), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "partitions[a100].gpus_per_node: 8 -> 4" in proc.stdout
    assert 'partitions[v100].gres: "gpu:h100" -> "gpu:v100"' in proc.stdout
    assert fixed.read_text() == text  # the shipped file, comments and all
    assert load_site(fixed).partitions == load_site(LOCAL_LAB).partitions


def test_the_doctor_looks_from_inside_the_container(slurm_cluster, tmp_path):
    why = why_no_charliecloud()
    if why:
        slurm_missing(f"no container runtime: {why}")
    site = local_lab_in_image(tmp_path, tmp_path)
    env = {**user_env(), "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    elsewhere = Path("/var/tmp") / f"sailor-doctor-{os.getpid()}"  # on the host, not mounted into the image
    elsewhere.mkdir(exist_ok=True)
    try:
        proc = _doctor(slurm_cluster, site, "--partitions", "a100", "--python", PYTHON_INSIDE, "--checkpoints",
                       str(elsewhere), "--json", cwd=tmp_path, env=env)
    finally:
        elsewhere.rmdir()  # empty again: the doctor took its token away
    assert proc.returncode == 2, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    [part] = report["partitions"]
    assert part["facts"]["python"]["executable"] == PYTHON_INSIDE and part["facts"]["env"]["CH_RUNNING"]
    assert [(f["field"], "is not the same shared folder" in f["message"]) for f in report["findings"]] == [
        ("--checkpoints", True)]
    assert "mount it into the container (environment.container.mounts)" in report["findings"][0]["fix"]
