"""The CLI's exit codes and messages (through the installed ``sailor-hpc`` console script)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.spine.conftest import SITE_CONFIGS, sailor_data

EXE = shutil.which("sailor-hpc", path=str(Path(sys.executable).parent)) or "sailor-hpc"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=120)


def test_site_show_and_validate() -> None:
    out = cli("site", "show", str(SITE_CONFIGS / "a100-v100.toml"))
    assert out.returncode == 0 and "a100" in out.stdout and "V100-16" in out.stdout
    data = json.loads(cli("site", "show", "--json", str(SITE_CONFIGS / "a100-v100.toml")).stdout)
    assert [p["nodes"] for p in data["partitions"]] == [64, 64]
    ok = cli("site", "validate", "--json", str(SITE_CONFIGS / "clariden.toml"))
    assert ok.returncode == 0 and json.loads(ok.stdout)["valid"] is True


def test_bad_site_exits_2_naming_file_field_and_fix(lab_site: Path) -> None:
    lab_site.write_text(lab_site.read_text().replace("gpus_per_node = 8", "gpus_per_node = 0"))
    out = cli("site", "validate", str(lab_site))
    assert out.returncode == 2
    assert f"{lab_site}: partitions[1].gpus_per_node: must be a positive integer" in out.stderr
    out = cli("site", "validate", "--json", str(lab_site))
    err = json.loads(out.stderr)
    assert out.returncode == 2 and err["field"] == "partitions[1].gpus_per_node" and err["file"] == str(lab_site)


def test_profiles_list_and_show_embedded() -> None:
    listing = json.loads(cli("profiles", "list", "--json").stdout)
    pairs = {(p["model"], p["gpu"]) for p in listing["profiles"]}
    assert ("OPT-350M", "A100-40") in pairs and ("GPT-Neo-2.7B", "V100-16") in pairs
    shown = json.loads(cli("profiles", "show", "OPT-350", "GH-96", "--json").stdout)
    point = next(p for p in shown["points"] if (p["mbs"], p["tp"]) == (1, 4))
    raw = json.loads((sailor_data() / "profiles" / "compute_profiles.json").read_text())["OPT-350"]["GH-96"]["1"]["4"]
    assert point["fwd_s"] == pytest.approx(sum(v[0] for v in raw.values()))
    missing = cli("profiles", "show", "OPT-350", "H100-80")
    assert missing.returncode == 2 and "sailor-hpc profile" in missing.stderr


def test_profiles_import_sailor(tmp_path: Path) -> None:
    out = cli("profiles", "import-sailor", str(sailor_data()), "--archive", str(tmp_path / "a.h5"), "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["entries"] > 200
    assert list(json.loads(out.stdout)["skipped"]) == ["LLAMA-3-8"]  # another network than Llama-3-8B
    listing = json.loads(cli("profiles", "list", "--archive", str(tmp_path / "a.h5"), "--json").stdout)
    assert len(listing["profiles"]) == 16 - 3  # Sailor's LLAMA-3-8 was profiled on A100-40, V100-16, GH-96
    bad = cli("profiles", "import-sailor", str(tmp_path), "--archive", str(tmp_path / "b.h5"))
    assert bad.returncode == 2 and "compute_profiles.json: file not found" in bad.stderr
    assert not (tmp_path / "b.h5").exists()  # nothing half-written


def test_plan_validate_sailor_and_errors(tmp_path: Path) -> None:
    path = sailor_data() / "validation" / "mit" / "N4" / "plan_config_N4_D1.json"
    ok = cli("plan", "validate", str(path), "--model", "OPT-350", "--site", str(SITE_CONFIGS / "mit-mixed.toml"), "--json")
    assert ok.returncode == 0
    assert json.loads(ok.stdout)["plan"]["pipelines"][0]["stages"][1]["partition"] == "rtx2080"
    no_model = cli("plan", "validate", str(path))
    assert no_model.returncode == 2 and "--model" in no_model.stderr
    wrong_site = cli("plan", "validate", str(path), "--model", "OPT-350", "--site", str(SITE_CONFIGS / "a100-v100.toml"))
    assert wrong_site.returncode == 2 and f"{path}: pipeline_list[*].tmp_per_stage[0]: unknown GPU type 'RTX-3090' " \
        "on site 'a100-v100'" in wrong_site.stderr  # the plan's error, named in the plan; the site named too
    missing = cli("plan", "validate", str(tmp_path / "none.json"))
    assert missing.returncode == 2 and "file not found" in missing.stderr


def test_usage_errors_exit_2() -> None:
    assert cli("site", "show").returncode == 2
    assert cli("no-such-command").returncode == 2
