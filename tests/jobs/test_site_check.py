"""The site check's parts that need no cluster: what the node probe reads (nvidia-smi's output, NCCL's choice
of interfaces) and how facts become findings and a measured site file."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sailor_hpc.core.site import GIB, load_site
from sailor_hpc.jobs import node_probe
from sailor_hpc.jobs.site_check import PROBE_SOURCE, Finding, PartitionCheck, check_partition, measured_site
from sailor_hpc.slurm.commands import parse_gres
from sailor_hpc.slurm.partition_view import partition_of
from tests.jobs.conftest import LOCAL_LAB

# nvidia-smi's output in the formats the probe asks for (nvidia-smi --help-query-gpu; an H100 node's banner)
SMI_CSV = "NVIDIA H100 80GB HBM3, 81559, 550.54.15\nNVIDIA H100 80GB HBM3, 81559, 550.54.15\n"
SMI_BANNER = ("+-----------------------------------------------------------------------------------------+\n"
              "| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |\n")


@pytest.fixture()
def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``nvidia-smi`` on PATH that answers as the real one does (this machine has no NVIDIA driver)."""
    exe = tmp_path / "bin" / "nvidia-smi"
    exe.parent.mkdir()
    exe.write_text(f"#!/bin/sh\nif [ $# -gt 0 ]; then printf '%s' '{SMI_CSV}'; else printf '%s' '{SMI_BANNER}'; fi\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ['PATH']}")


def test_the_probe_reads_nvidia_smi(fake_smi: None) -> None:
    smi = node_probe.nvidia_smi()
    assert smi == {"found": True, "driver": "550.54.15", "cuda": "12.4",
                   "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559.0}] * 2}


def test_the_probe_runs_as_python_c_and_imports_nothing_of_sailor_hpc(tmp_path: Path) -> None:
    """Sent as ``python -c SOURCE``: it must run where neither sailor-hpc nor torch is installed (-I -S: no
    site-packages, no current folder on the path)."""
    token = tmp_path / "token"
    token.write_text("abc\n")
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", PROBE_SOURCE, str(token), str(tmp_path / "absent")],
                          capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith(node_probe.MARKER))
    facts = json.loads(line[len(node_probe.MARKER):])
    assert facts["tokens"] == {str(token): "abc", str(tmp_path / "absent"): None}
    assert facts["python"]["executable"] == sys.executable and facts["python"]["sailor_hpc"] is False
    assert facts["torch"] == {"found": False}
    names = {i["name"] for i in facts["interfaces"]}
    assert names == {name for _, name in __import__("socket").if_nameindex()}


@pytest.mark.parametrize(("ifname", "want"), [
    (None, ["eth0", "eth1"]),                       # no loopback, no docker
    ("eth", ["eth0", "eth1"]),                      # prefixes
    ("eth1,ib", ["eth1"]),
    ("^eth0,docker", ["lo", "eth1"]),               # ^: every interface but those
    ("=eth", []),                                   # =: exact names only
    ("=eth1", ["eth1"]),
])
def test_nccl_interfaces_follow_nccl_socket_ifname(ifname: str | None, want: list[str]) -> None:
    assert node_probe.nccl_interfaces(["lo", "docker0", "eth0", "eth1"], ifname) == want


def test_nccl_prefers_infiniband_then_falls_back() -> None:
    assert node_probe.nccl_interfaces(["lo", "eth0", "ib0"], None) == ["ib0"]
    assert node_probe.nccl_interfaces(["lo", "docker0"], None) == ["docker0"]
    assert node_probe.nccl_interfaces(["lo"], None) == ["lo"]


def _slurm(gres: str, cpus: int = 4, mem: int = 4000):
    from sailor_hpc.slurm.commands import NodeInfo
    nodes = [NodeInfo(f"n{i}", ("a100",), tuple(parse_gres(gres)), cpus, mem, "IDLE", {}) for i in (1, 2)]
    return partition_of("a100", nodes)


def _facts(**over: Any) -> dict[str, Any]:
    facts: dict[str, Any] = {"host": "n1", "env": {"CUDA_VISIBLE_DEVICES": "0,1,2,3"},
                             "python": {"executable": "/venv/bin/python", "version": "3.11.7", "sailor_hpc": True},
                             "nvidia_smi": {"found": False}, "interfaces": [], "nccl_interfaces": [], "tokens": {},
                             "torch": {"found": True, "version": "2.13.0", "cuda": "12.4", "cuda_available": False,
                                       "devices": []}}
    facts.update(over)
    return facts


def test_a_matching_partition_has_no_findings() -> None:
    site = load_site(LOCAL_LAB)
    c = check_partition(site, site.partition("a100"), _slurm("gpu:a100:4"), _facts(), None, [])
    assert c.findings == [] and c.rows


def test_slurms_nodes_against_the_site_file() -> None:
    site = load_site(LOCAL_LAB)
    part = site.partition("a100")
    c = check_partition(site, part, _slurm("gpu:a100:2", cpus=2, mem=8000), _facts(), None, [])
    by_field = {f.field: f for f in c.findings}
    assert set(by_field) == {"partitions[a100].gpus_per_node", "partitions[a100].cpus_per_node"}  # more memory is fine
    assert by_field["partitions[a100].gpus_per_node"].value == 2 and "set gpus_per_node = 2" in by_field[
        "partitions[a100].gpus_per_node"].fix
    c = check_partition(site, part, _slurm("gpu:tesla_a100:4"), _facts(), None, [])
    [f] = c.findings
    assert (f.field, f.value, f.fix) == ("partitions[a100].gres", "gpu:tesla_a100", 'set gres = "gpu:tesla_a100"')
    c = check_partition(site, part, None, None, None, [])
    assert [f.field for f in c.findings] == ["partitions[a100].name"]


def test_the_gpus_a_rank_sees(fake_smi: None) -> None:
    site = load_site(LOCAL_LAB)
    part = site.partition("a100")  # says 4 x A100-40 (39.43 GiB)
    smi = node_probe.nvidia_smi()  # 2 x H100 80GB
    c = check_partition(site, part, _slurm("gpu:a100:4"), _facts(nvidia_smi=smi), None, [])
    fields = {f.field: f for f in c.findings}
    # torch (a CUDA build) sees no device though the driver shows two: the container or the build
    assert "--python" in fields and "torch sees no CUDA device" in fields["--python"].message
    assert fields["partitions[a100].gpus_per_node"].value == 2
    assert "H100-80" in fields["partitions[a100].gpu_type"].message and fields["partitions[a100].gpu_type"].value is None
    assert "gpu_types.A100-40.memory_gib" not in fields  # 39.43 GiB fits on an 80 GB card
    a100s = [{"name": "NVIDIA A100-SXM4-40GB", "memory_mib": 30000.0}] * 4
    small = _facts(nvidia_smi={"found": True, "gpus": a100s},
                   torch={"found": True, "version": "2.13.0", "cuda": "12.4", "cuda_available": True, "devices": a100s})
    c = check_partition(site, part, _slurm("gpu:a100:4"), small, None, [])
    [f] = c.findings
    assert f.field == "gpu_types.A100-40.memory_gib" and f.value == round(30000 / 1024, 2)


def test_a_job_that_gave_no_report_names_the_container_or_interpreter(tmp_path: Path) -> None:
    site = load_site(LOCAL_LAB)
    c = check_partition(site, site.partition("a100"), _slurm("gpu:a100:4"), None, "exit 1: ch-run: error", [])
    assert [(f.field, "ch-run: error" in f.message) for f in c.findings] == [("--python", True)]


def test_the_measured_site_takes_every_measured_value() -> None:
    site = load_site(LOCAL_LAB)
    checks = [PartitionCheck("a100", findings=[
        Finding("a100", "partitions[a100].gpus_per_node", "", "", 2),
        Finding("a100", "partitions[a100].nodes", "", "", 1),
        Finding("a100", "gpu_types.A100-40.memory_gib", "", "", 30.0),
        Finding("a100", "--checkpoints", "", "", None)]),
        PartitionCheck("v100", findings=[Finding("v100", "partitions[v100].gres", "", "", "gpu:tesla_v100")])]
    new = measured_site(site, checks)
    a100, v100 = new.partition("a100"), new.partition("v100")
    assert (a100.gpus_per_node, a100.nodes, a100.max_nodes_per_job) == (2, 1, 1)
    assert v100.gres == "gpu:tesla_v100" and v100.gpus_per_node == site.partition("v100").gpus_per_node
    assert new.gpu("A100-40").memory_bytes == int(30.0 * GIB)
    assert new.partition("a100").inter_node == site.partition("a100").inter_node  # the rest untouched
