"""Site discovery from Slurm (sailor_hpc.slurm): parsing with canned command output, and the live cluster."""
from __future__ import annotations

import os
import stat
import time
import tomllib
import warnings
from pathlib import Path

import pytest

from sailor_hpc.core.errors import SailorError, SlurmUnavailable
from sailor_hpc.core.toml_writer import dump_toml
from sailor_hpc.slurm.commands import parse_gres, parse_kv_line, run_slurm, show_partitions, sinfo_nodes
from sailor_hpc.slurm.discover import (
    discover,
    discover_site,
    dump_site_toml,
    guess_gpu_type,
    live_availability,
    normalize_walltime,
)


def _load_site(d: dict):
    from sailor_hpc.core.site import load_site_dict  # noqa: PLC0415 - lead-owned module
    return load_site_dict(d, source="<discovered>")


# ------------------------------------------------------------------------------------ without a cluster

def test_parse_gres_variants():
    assert [(g.name, g.type, g.count) for g in parse_gres("gpu:a100:4")] == [("gpu", "a100", 4)]
    assert [(g.spec, g.count) for g in parse_gres("gpu:a100:2(IDX:0-1),gpu:v100:0(IDX:N/A)")] == [
        ("gpu:a100", 2), ("gpu:v100", 0)]
    assert [(g.spec, g.count) for g in parse_gres("gpu:4(S:0-1),shard:8")] == [("gpu", 4), ("shard", 8)]
    assert parse_gres("(null)") == [] and parse_gres("") == []
    assert [(g.spec, g.count) for g in parse_gres("gres:gpu:a100:2")] == [("gpu:a100", 2)]


def test_parse_kv_line_keeps_values_with_spaces():
    kv = parse_kv_line("NodeName=a1 Gres=gpu:a100:4 OS=Linux 6.1 #1 SMP State=IDLE Reason=down for x [root@2024]")
    assert kv["NodeName"] == "a1" and kv["OS"] == "Linux 6.1 #1 SMP" and kv["State"] == "IDLE"
    assert kv["Reason"] == "down for x [root@2024]"


def test_normalize_walltime():
    assert normalize_walltime("UNLIMITED") is None and normalize_walltime("INFINITE") is None
    assert normalize_walltime("1-00:00:00") == "1-00:00:00"
    assert normalize_walltime("2-12") == "2-12:00:00"
    assert normalize_walltime("30") == "00:30:00"
    assert normalize_walltime("90:00") == "01:30:00"        # M:S
    assert normalize_walltime("48:00:00") == "2-00:00:00"


def test_guess_gpu_type_aliases():
    assert guess_gpu_type("a100").name == "A100-40"
    assert guess_gpu_type("V100").name == "V100-16"
    assert guess_gpu_type("gh200").name == "GH-96"
    assert guess_gpu_type("h100").name == "H100-80"
    assert guess_gpu_type("rtx3090").name == "RTX-3090" and guess_gpu_type("3090").name == "RTX-3090"
    assert guess_gpu_type("a100_80g").name == "A100-80"
    assert guess_gpu_type("mystery9000") is None and guess_gpu_type(None) is None


def test_missing_slurm_command_is_a_sailor_error(tmp_path):
    with pytest.raises(SailorError) as exc:
        run_slurm(["sinfo", "-h"], env={"PATH": str(tmp_path)})
    assert "not found" in str(exc.value) and exc.value.fix


def _fake_bin(tmp_path: Path, name: str, body: str) -> None:
    p = tmp_path / name
    p.write_text("#!/bin/sh\n" + body)
    p.chmod(p.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def test_failing_slurm_command_is_unavailable_or_refused_as_slurmctld_answers(tmp_path):
    # slurmctld down (`scontrol ping` fails too): Slurm is unavailable, not the request wrong
    _fake_bin(tmp_path, "scontrol", "echo 'slurm_load_partitions: Unable to contact slurm controller' >&2; exit 1\n")
    with pytest.raises(SlurmUnavailable) as exc:
        show_partitions(env={"PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert "Unable to contact slurm controller" in str(exc.value) and exc.value.exit_code == 3
    # slurmctld answers the ping but refuses the request: bad input (exit 2)
    _fake_bin(tmp_path, "scontrol", 'case "$1" in ping) exit 0;; esac; echo "error: Invalid partition" >&2; exit 1\n')
    with pytest.raises(SailorError) as refused:
        show_partitions(env={"PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert "Invalid partition" in str(refused.value) and refused.value.exit_code == 2


FAKE_SCONTROL = r"""
case "$*" in
  *"show partition"*) cat <<'END'
PartitionName=gpu Default=YES MaxNodes=4 MaxTime=2-00:00:00 Nodes=g[1-3],c1 State=UP TotalCPUs=160 TotalNodes=4
PartitionName=cpu Default=NO MaxNodes=UNLIMITED MaxTime=INFINITE Nodes=c1 State=UP TotalCPUs=64 TotalNodes=1
PartitionName=odd Default=NO MaxNodes=UNLIMITED MaxTime=30:00 Nodes=x1 State=DOWN TotalCPUs=8 TotalNodes=1
PartitionName=gpu-long Default=NO MaxNodes=2 MaxTime=7-00:00:00 Nodes=g[1-2] State=UP TotalCPUs=64 TotalNodes=2
END
  ;;
  *"show node"*) cat <<'END'
NodeName=g1 CPUTot=32 Gres=gpu:h100:4(S:0-1) RealMemory=500000 State=IDLE Partitions=gpu,gpu-long OS=Linux 5 #1
NodeName=g2 CPUTot=32 Gres=gpu:h100:4(S:0-1) RealMemory=500000 State=MIXED Partitions=gpu,gpu-long
NodeName=g3 CPUTot=16 Gres=gpu:h100:2 RealMemory=250000 State=IDLE Partitions=gpu
NodeName=c1 CPUTot=64 Gres=(null) RealMemory=250000 State=IDLE Partitions=gpu,cpu
NodeName=x1 CPUTot=8 Gres=gpu:mystery9000:2 RealMemory=64000 State=IDLE Partitions=odd
END
  ;;
  *"show config"*) echo "ClusterName              = fakecluster" ;;
esac
"""


def test_discover_with_canned_scontrol_output(tmp_path):
    _fake_bin(tmp_path, "scontrol", FAKE_SCONTROL)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}"}
    found = discover(env=env)
    site = found.site
    assert site["name"] == "fakecluster"
    parts = {p["name"]: p for p in site["partitions"]}
    # the CPU-only partition is left out, and so is gpu-long: its GPUs are gpu's (counted once)
    assert set(parts) == {"gpu", "odd"}
    assert any("'gpu-long' shares nodes with 'gpu'" in n for n in found.notes)
    gpu = parts["gpu"]
    assert (gpu["gpu_type"], gpu["gres"], gpu["nodes"], gpu["gpus_per_node"]) == ("H100-80", "gpu:h100", 3, 2)
    assert (gpu["cpus_per_node"], gpu["memory_per_node_mb"], gpu["max_nodes_per_job"]) == (16, 250000, 3)
    assert gpu["max_walltime"] == "2-00:00:00"
    odd = parts["odd"]
    assert odd["gpu_type"] == "mystery9000" and odd["max_walltime"] == "00:30:00"
    assert site["gpu_types"]["H100-80"] == {"memory_gib": 80.0, "aliases": ["h100"]}
    text = "\n".join(found.notes)
    assert "'cpu'" in text and "mystery9000" in text and "differ in GPUs" in text and "DOWN" in text
    toml_text = found.toml()
    assert "# - partition 'odd': gres type 'mystery9000' is not a known GPU type" in toml_text
    assert tomllib.loads(toml_text) == site
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert discover_site(env=env) == site
    assert any("mystery9000" in str(w.message) for w in caught) and len(caught) == len(found.notes)
    loaded = _load_site(site)
    assert loaded.partition("gpu").max_walltime_s == 2 * 86400
    assert loaded.gpu("h100").name == "H100-80"


FAKE_SINFO = r"""cat <<'END'
g1|gpu*|mixed|gpu:h100:4(S:0-1)|gpu:h100:3(IDX:0-2)|32|4/28/0/32|500000|
g2|gpu*|allocated|gpu:h100:4|gpu:h100:1(IDX:0)|32|32/0/0/32|500000|
g3|gpu*|drained|gpu:h100:4|gpu:h100:0(IDX:N/A)|32|0/32/0/32|500000|
g4|gpu*|idle|gpu:h100:4|gpu:h100:0(IDX:N/A)|32|0/32/0/32|500000|
g5|gpu*|idle*|gpu:h100:4|gpu:h100:0(IDX:N/A)|32|0/32/0/32|500000|
END
"""


def test_live_availability_with_canned_sinfo(tmp_path):
    _fake_bin(tmp_path, "sinfo", FAKE_SINFO)
    _fake_bin(tmp_path, "scontrol", "echo 'PartitionName=gpu Nodes=g[1-5] State=UP'\n")
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}"}
    nodes = sinfo_nodes(env)
    assert [n.usable for n in nodes] == [True, True, False, True, False]
    avail = live_availability(env)["gpu"]
    # g1: 1 free; g2: 3 free GPUs but no free CPU -> 0; g3 drained, g5 not responding; g4: 4
    assert avail["idle_gpus_by_node"] == {"g1": 1, "g2": 0, "g4": 4}
    assert (avail["gpus"], avail["gpus_usable"], avail["gpus_idle"]) == (20, 12, 5)
    assert (avail["nodes"], avail["nodes_usable"], avail["nodes_idle"]) == (5, 3, 1)
    assert avail["gres"] == "gpu:h100"
    # the partition DOWN: its nodes are still counted, none is free for a job (it would never start)
    _fake_bin(tmp_path, "scontrol", "echo 'PartitionName=gpu Nodes=g[1-5] State=DOWN'\n")
    down = live_availability(env)["gpu"]
    assert down["state"] == "DOWN" and (down["nodes"], down["gpus"]) == (5, 20)
    assert (down["gpus_idle"], down["nodes_idle"], down["idle_gpus_by_node"]) == (0, 0, {})


def test_dump_toml_round_trips():
    doc = {"a": 1, "s": 'q"uo\\te\n', "f": 2.0, "b": True, "l": [1, 2], "t": {"x": {"y": [[1], [2, 3]]}},
           "arr": [{"n": 1, "sub": {"k": "v"}}, {"n": 2}], "empty": [], "e": {}}
    assert tomllib.loads(dump_toml(doc)) == doc
    assert tomllib.loads(dump_site_toml({"name": "x"}, comments=["one", "two"])) == {"name": "x"}


# ------------------------------------------------------------------------------------ the live cluster

@pytest.mark.slurm
def test_discover_site_on_live_cluster(slurm_cluster):
    site = discover_site(env=slurm_cluster.env)
    assert site["name"] == "lab"
    parts = {p["name"]: p for p in site["partitions"]}
    assert parts["a100"] == {"name": "a100", "gpu_type": "A100-40", "gres": "gpu:a100", "nodes": 2,
                             "gpus_per_node": 4, "cpus_per_node": 4, "memory_per_node_mb": 4000,
                             "max_nodes_per_job": 2, "cost_per_gpu_hour": 1.0}
    assert parts["v100"] == {"name": "v100", "gpu_type": "V100-16", "gres": "gpu:v100", "nodes": 2,
                             "gpus_per_node": 8, "cpus_per_node": 8, "memory_per_node_mb": 8000,
                             "max_nodes_per_job": 2, "cost_per_gpu_hour": 1.0}
    assert site["gpu_types"] == {"A100-40": {"memory_gib": 39.43, "aliases": ["a100"]},
                                 "V100-16": {"memory_gib": 16.0, "aliases": ["v100"]}}
    text = dump_site_toml(site)
    assert tomllib.loads(text) == site
    loaded = _load_site(tomllib.loads(text))
    assert loaded.partition("a100").total_gpus == 8 and loaded.partition("v100").total_gpus == 16
    assert loaded.gpu("a100").name == "A100-40" and loaded.partition("v100").max_walltime is None


def _wait_running(cluster, job: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cluster.job_states(job) == ["RUNNING"]:
            return
        time.sleep(0.1)
    raise AssertionError(f"job {job} not running: {cluster.job_states(job)}")


@pytest.mark.slurm
def test_live_availability_on_live_cluster(slurm_cluster):
    before = live_availability(slurm_cluster.env)
    assert set(before) == {"a100", "v100"}
    assert before["a100"]["gpus"] == before["a100"]["gpus_idle"] == 8
    assert before["v100"]["gpus"] == before["v100"]["gpus_idle"] == 16
    assert before["a100"]["nodes_idle"] == before["v100"]["nodes_idle"] == 2
    assert before["a100"]["gres"] == "gpu:a100"
    job = slurm_cluster.sbatch(["-p", "a100", "-N", "1", "--gres=gpu:a100:3", "-c", "1", "-o", "/dev/null",
                                "--wrap", "sleep 300"])
    try:
        _wait_running(slurm_cluster, job)
        during = live_availability(slurm_cluster.env)
        assert during["a100"]["gpus_idle"] == 5
        assert during["a100"]["nodes_idle"] == 1
        assert sorted(during["a100"]["idle_gpus_by_node"].values()) == [1, 4]
        assert during["v100"]["gpus_idle"] == 16
    finally:
        slurm_cluster.run(["scancel", job])
    slurm_cluster.wait_job(job)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if live_availability(slurm_cluster.env)["a100"]["gpus_idle"] == 8:
            break
        time.sleep(0.2)
    assert live_availability(slurm_cluster.env)["a100"]["gpus_idle"] == 8


def test_cli_discover_writes_the_notes_into_the_toml(tmp_path):
    import subprocess
    import sys

    _fake_bin(tmp_path, "scontrol", FAKE_SCONTROL)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    out = tmp_path / "site.toml"
    proc = subprocess.run([str(Path(sys.executable).with_name("sailor-hpc")), "site", "discover", "-o", str(out)],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "# - partition 'gpu-long' shares nodes with 'gpu'" in text and "mystery9000" in text
    assert "note: partition 'gpu-long' shares nodes" in proc.stderr
    assert tomllib.loads(text) == discover(env=env).site


FAKE_A100_SCONTROL = r"""
case "$*" in
  *"show partition"*) cat <<'END'
PartitionName=small Default=YES MaxNodes=2 MaxTime=1-00:00:00 Nodes=s[1-2] State=UP TotalCPUs=64 TotalNodes=2
PartitionName=big Default=NO MaxNodes=UNLIMITED MaxTime=1-00:00:00 Nodes=b1 State=UP TotalCPUs=32 TotalNodes=1
END
  ;;
  *"show node"*) cat <<'END'
NodeName=s1 CPUTot=32 Gres=gpu:a100:4 RealMemory=256000 State=IDLE Partitions=small
NodeName=s2 CPUTot=32 Gres=gpu:a100:4 RealMemory=256000 State=IDLE Partitions=small
NodeName=b1 CPUTot=32 Gres=gpu:a100_80gb:8 RealMemory=512000 State=IDLE Partitions=big
END
  ;;
  *"show config"*) echo "ClusterName              = lab2" ;;
esac
"""


def _discover_cli(tmp_path: Path, *args: str):
    import subprocess
    import sys

    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    return subprocess.run([str(Path(sys.executable).with_name("sailor-hpc")), "site", "discover", *args],
                          capture_output=True, text=True, env=env, timeout=60)


def test_discover_says_which_gpu_types_it_guessed_and_what_to_edit(tmp_path):
    """gres 'a100' does not say 40 or 80 GB: a guess, named as one, with the fields to edit; 'a100_80gb' says
    it: an inference. Costs are placeholders, said so too."""
    _fake_bin(tmp_path, "scontrol", FAKE_A100_SCONTROL)
    out = tmp_path / "site.toml"
    proc = _discover_cli(tmp_path, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert ("note: partition(s) 'small': GPU type 'A100-40' (39.43 GiB per GPU) guessed from gres type 'a100', "
            "which does not say the memory: if these are A100-80, edit gpu_type of partition(s) 'small' and "
            "[gpu_types.\"A100-40\"] (its name and memory_gib)") in proc.stderr
    assert ("note: partition(s) 'big': GPU type 'A100-80' (80 GiB per GPU) inferred from gres type 'a100_80gb'; "
            "if that is wrong, edit gpu_type of partition(s) 'big'") in proc.stderr
    assert "cost_per_gpu_hour = 1 on every partition" in proc.stderr
    text = out.read_text()
    assert "# - partition(s) 'small': GPU type 'A100-40' (39.43 GiB per GPU) guessed" in text
    assert proc.stdout.strip() == (f"wrote {out}: site 'lab2', partitions small (2 x 4 A100-40), big (1 x 8 A100-80); "
                                   "review the 3 note(s) above (also on top of the file)")
    site = tomllib.loads(text)
    assert site["gpu_types"] == {"A100-40": {"memory_gib": 39.43, "aliases": ["a100"]},
                                 "A100-80": {"memory_gib": 80.0, "aliases": ["a100_80gb"]}}


USER_SITE = '''\
# our cluster, kept by hand
name = "ours"
cost_unit = "CHF"                 # the price list's currency

[gpu_types."A100-40"]
memory_gib = 39.43
aliases = ["a100"]

[[partitions]]
name = "small"
gpu_type = "a100"                 # by its alias
gres = "gpu:a100"
nodes = 1                         # before the upgrade
gpus_per_node = 4
cost_per_gpu_hour = 2.5           # CHF per GPU-hour
'''


def test_discover_into_an_existing_site_updates_slurms_facts_and_keeps_the_rest(tmp_path):
    _fake_bin(tmp_path, "scontrol", FAKE_A100_SCONTROL)
    out = tmp_path / "ours.toml"
    out.write_text(USER_SITE)
    proc = _discover_cli(tmp_path, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    # the author's choices and comments stay; what Slurm says now replaces what it said before
    for line in ('name = "ours"', 'cost_unit = "CHF"                 # the price list\'s currency',
                 'gpu_type = "a100"                 # by its alias', "nodes = 2                         # before the upgrade",
                 "cost_per_gpu_hour = 2.5           # CHF per GPU-hour"):
        assert line in text.splitlines(), text
    from sailor_hpc.core.site import load_site
    site = load_site(out)
    small = site.partition("small")
    assert (small.nodes, small.cpus_per_node, small.memory_per_node_mb, small.max_nodes_per_job, small.max_walltime) \
        == (2, 32, 256000, 2, "1-00:00:00")
    assert [p.name for p in site.partitions] == ["small", "big"] and site.partition("big").gpu_type == "A100-80"
    lines = proc.stdout.splitlines()
    assert lines[0] == f"wrote {out}: 8 field(s) changed"
    assert "  partitions[small].nodes: 1 -> 2" in lines and "  partitions[small].cpus_per_node: 1 -> 32" in lines
    assert any(line.startswith('  partitions[big]: (absent) -> {name = "big", gpu_type = "A100-80"') for line in lines)
    assert "  gpu_types.A100-80.memory_gib: (absent) -> 80" in lines
    assert '\n\n[gpu_types."A100-80"]\n' in text and '\n\n[[partitions]]\nname = "big"' in text
