"""The CLI's exit codes and messages: the installed ``sailor-hpc`` console script (test_site_show_and_validate),
and the same command group run in this process for the rest (:func:`cli`)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from sailor_hpc.cli import main
from sailor_hpc.core.site import load_site
from tests.data import SAILOR_DATA, SITE_CONFIGS

EXE = shutil.which("sailor-hpc", path=str(Path(sys.executable).parent)) or "sailor-hpc"


def script(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed console script, as a user runs it."""
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=120)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``sailor-hpc ARGS`` in this process: the console script's command group with its argv (``--json``
    refusals read ``sys.argv``), exit code, stdout and stderr, without a new interpreter's 0.7 s of CPU."""
    argv = sys.argv
    sys.argv = [EXE, *args]
    try:
        res = CliRunner().invoke(main, list(args))
    finally:
        sys.argv = argv
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception  # the script would end in this traceback
    return subprocess.CompletedProcess([EXE, *args], res.exit_code, res.stdout, res.stderr)


def test_each_command_comes_from_the_module_the_root_names() -> None:
    """The root imports a command's module only when a call names it (:data:`COMMAND_MODULES`): every module's
    commands are the ones it is named for, and a call imports no other command's module."""
    probe = ("import sys\nfrom click.testing import CliRunner\nfrom sailor_hpc.cli import main\n"
             "CliRunner().invoke(main, ['site', 'show', 'nope.toml'])\n"
             "print(' '.join(sorted(m for m in sys.modules if m.startswith(('sailor_hpc.cli.', 'planner', "
             "'simulator', 'profiler', 'sailor_hpc.controller')))))")
    loaded = set(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                                timeout=120).stdout.split())
    assert {m for m in loaded if m.endswith(("_cmds", "doctor"))} == {"sailor_hpc.cli.site_cmds",
                                                                      "sailor_hpc.cli.site_doctor"}, loaded
    assert not {m for m in loaded if m.startswith(("planner", "simulator", "profiler", "sailor_hpc.controller"))}
    import importlib

    from sailor_hpc.cli.app import COMMAND_MODULES
    for module in set(COMMAND_MODULES.values()):
        importlib.import_module(f"sailor_hpc.cli.{module}")
    assert {n: c.callback.__module__ for n, c in main.commands.items() if c.callback} == \
        {n: f"sailor_hpc.cli.{m}" for n, m in COMMAND_MODULES.items()}


def test_site_show_and_validate() -> None:
    out = script("site", "show", str(SITE_CONFIGS / "a100-v100.toml"))
    assert out.returncode == 0 and "a100" in out.stdout and "V100-16" in out.stdout
    # the cost column: its unit once, in the header, and a number per partition (not "1 GPU-hours")
    site = load_site(SITE_CONFIGS / "a100-v100.toml")
    header, _, *rows = out.stdout.splitlines()[1:]
    assert f"cost/GPU-h ({site.cost_unit})" in header and not any(site.cost_unit in row for row in rows)
    at = header.index("cost/GPU-h")
    assert [row[at:].split()[0] for row in rows] == [f"{p.cost_per_gpu_hour:g}" for p in site.partitions]
    data = json.loads(cli("site", "show", "--json", str(SITE_CONFIGS / "a100-v100.toml")).stdout)
    assert [p["nodes"] for p in data["partitions"]] == [64, 64]
    ok = script("site", "validate", "--json", str(SITE_CONFIGS / "clariden.toml"))
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
    raw = json.loads((SAILOR_DATA / "profiles" / "compute_profiles.json").read_text())["OPT-350"]["GH-96"]["1"]["4"]
    assert point["fwd_s"] == pytest.approx(sum(v[0] for v in raw.values()))
    missing = cli("profiles", "show", "OPT-350", "H100-80")
    assert missing.returncode == 2 and "sailor-hpc profile" in missing.stderr


def test_profiles_import_sailor(tmp_path: Path) -> None:
    out = cli("profiles", "import-sailor", str(SAILOR_DATA), "--archive", str(tmp_path / "a.h5"), "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["entries"] > 200
    assert list(json.loads(out.stdout)["skipped"]) == ["LLAMA-3-8"]  # another network than Llama-3-8B
    listing = json.loads(cli("profiles", "list", "--archive", str(tmp_path / "a.h5"), "--json").stdout)
    assert len(listing["profiles"]) == 16 - 3  # Sailor's LLAMA-3-8 was profiled on A100-40, V100-16, GH-96
    bad = cli("profiles", "import-sailor", str(tmp_path), "--archive", str(tmp_path / "b.h5"))
    assert bad.returncode == 2 and "compute_profiles.json: file not found" in bad.stderr
    assert not (tmp_path / "b.h5").exists()  # nothing half-written


def test_plan_validate_sailor_and_errors(tmp_path: Path) -> None:
    path = SAILOR_DATA / "validation" / "mit" / "N4" / "plan_config_N4_D1.json"
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


def _archive_with(path: Path, build) -> Path:
    import h5py

    with h5py.File(path, "w") as h5:
        h5.attrs["format"] = "sailor-hpc-profiles"
        h5.attrs["version"] = 1
        build(h5)
    return path


def test_profiles_list_and_show_refuse_a_malformed_archive_naming_file_path_and_fix(tmp_path: Path) -> None:
    import numpy as np

    def text_times(h5) -> None:
        h5.create_dataset("compute/tiny-gpt/G/mbs1_tp1", data=np.array([b"fast", b"slow"]))

    cases = {  # archive: (HDF5 path, words)
        _archive_with(tmp_path / "a.h5", lambda h5: h5.create_dataset("compute/tiny-gpt/G", data=[1.0])):
            ("compute/tiny-gpt/G", "is a dataset where the archive has a group"),
        _archive_with(tmp_path / "b.h5", text_times): ("compute/tiny-gpt/G/mbs1_tp1", "not numbers"),
        _archive_with(tmp_path / "c.h5", lambda h5: h5.create_dataset("network/lab/x", data=np.ones(3))):
            ("network/lab/x", "has no 'kind' attribute"),
    }
    for path, (hpath, words) in cases.items():
        for command in (["list"], ["show", "tiny-gpt", "G"]):
            out = cli("profiles", *command, "--archive", str(path))
            assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
            assert f"{path}: {hpath}: " in out.stderr and words in out.stderr and f"del f['{hpath}']" in out.stderr
        err = json.loads(cli("profiles", "list", "--archive", str(path), "--json").stderr)
        assert (err["file"], err["field"]) == (str(path), hpath) and err["fix"]


def test_profiles_list_shows_pairs_whose_every_point_failed(tmp_path: Path) -> None:
    import numpy as np

    from sailor_hpc.core.archive import ComputeEntry, make_provenance, write_entries

    path = tmp_path / "a.h5"
    prov = make_provenance("test")
    write_entries(path, [
        ComputeEntry("tiny-gpt", "A100-40", 1, 1, np.ones((6, 3)), prov),
        ComputeEntry("tiny-gpt", "A100-40", 8, 1, np.full((6, 3), np.nan), prov, status="failed", reason="CUDA out of memory"),
        ComputeEntry("tiny-gpt", "V100-16", 1, 2, np.full((6, 3), np.nan), prov, status="failed",
                     reason="job 12 NODE_FAIL on n3"),
        ComputeEntry("tiny-gpt", "V100-16", 2, 2, np.full((6, 3), np.nan), prov, status="failed",
                     reason="job 12 NODE_FAIL on n3")])
    rows = {r["gpu"]: r for r in json.loads(cli("profiles", "list", "--archive", str(path), "--json").stdout)["profiles"]}
    assert rows["A100-40"]["status"] == "partly failed" and rows["A100-40"]["points"] == 1
    v100 = rows["V100-16"]
    assert (v100["status"], v100["points"], v100["failed"], v100["mbs"], v100["tp"]) == ("failed", 0, 2, [1, 2], [2])
    assert [f["reason"] for f in v100["failed_points"]] == ["job 12 NODE_FAIL on n3"] * 2
    text = cli("profiles", "list", "--archive", str(path))
    line = next(x for x in text.stdout.splitlines() if "V100-16" in x)
    assert text.returncode == 0 and "failed" in line and "NODE_FAIL on n3" in line and line.count("NODE_FAIL") == 1
    shown = cli("profiles", "show", "tiny-gpt", "V100-16", "--archive", str(path))
    assert shown.returncode == 0 and "failed: mbs 2 tp 2: job 12 NODE_FAIL on n3" in shown.stdout


def _sailor_copy(tmp_path: Path, where: str, mutate) -> Path:
    """Sailor's data directory with one JSON file changed by ``mutate``."""
    root = tmp_path / "sailor"
    for sub in ("profiles", "network"):
        shutil.copytree(SAILOR_DATA / sub, root / sub, dirs_exist_ok=True)
    doc = json.loads((root / where).read_text())
    text = mutate(doc)
    (root / where).write_text(text if isinstance(text, str) else json.dumps(doc))
    return root


def test_import_sailor_refuses_malformed_json_naming_file_and_field(tmp_path: Path) -> None:
    compute, memory = "profiles/compute_profiles.json", "profiles/memory_profiles.json"
    opt = lambda d: d["OPT-350"]["V100-16"]["1"]["1"]  # noqa: E731 - OPT-350 on V100-16, mbs 1, TP 1
    cases = [
        (compute, lambda d: "{\"OPT-350\": ", "not valid JSON", None),
        (compute, lambda d: d["OPT-350"].__setitem__("V100-16", [1, 2]), "must be a JSON object", "OPT-350.V100-16"),
        (compute, lambda d: opt(d).__setitem__("3", ["fast", 1, 2]), "must be a non-negative finite number, got 'fast'",
         "OPT-350.V100-16.1.1.3.0"),
        (memory, lambda d: d["OPT-350"]["2"]["5"].__setitem__("act_mem_bytes", "lots"), "got 'lots'",
         "OPT-350.2.5.act_mem_bytes"),
        (compute, lambda d: opt(d).__setitem__("26", [1.0, 2.0, 3.0]),
         "has 27 layers, but the catalog's OPT-350M has 26 (embedding + 24 blocks + 1 tail)", "OPT-350.V100-16.1.1"),
        (memory, lambda d: d["OPT-350"]["4"].pop("25"), "has 25 layers, but the catalog's OPT-350M has 26", "OPT-350.4"),
    ]
    for i, (where, mutate, words, field) in enumerate(cases):
        root = _sailor_copy(tmp_path / str(i), where, mutate)
        archive = tmp_path / f"{i}.h5"
        out = cli("profiles", "import-sailor", str(root), "--archive", str(archive))
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert f"{root / where}: {field + ': ' if field else ''}" in out.stderr and words in out.stderr, out.stderr
        assert not archive.exists()  # nothing of a malformed directory is imported


def test_models_names_each_entry_for_what_the_runtime_builds() -> None:
    rows = {r["name"]: r for r in json.loads(cli("models", "--json").stdout)}
    # keys stay (profiles, plans, Sailor's data use them); what is built is said beside them
    assert rows["OPT-350M"]["model"] == "GPT (OPT-350M shape)" and "post-LN" in rows["OPT-350M"]["architecture"]
    assert rows["GPT-Neo-2.7B"]["model"] == "GPT (GPT-Neo-2.7B shape)" and "OPT-350" in rows["OPT-350M"]["aliases"]
    assert rows["Llama-3-8B"]["model"] == "Llama-3-8B" and rows["tiny-llama"]["kv_heads"] == 2
    text = cli("models").stdout
    assert "GPT (OPT-350M shape)" in text and "local attention" in text


def test_checkpoint_commands_on_a_login_node_without_torch(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['torch'] = None  # as if torch were not installed\n"
            "from sailor_hpc.cli import main\n"
            "main(sys.argv[1:])")
    run = lambda *a: subprocess.run([sys.executable, "-c", code, *a], capture_output=True, text=True,  # noqa: E731
                                    timeout=120)
    assert run("checkpoint", "--help").returncode == 0
    out = run("checkpoint", "export", str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "out"))
    assert out.returncode == 2 and "needs torch" in out.stderr and "sailor-hpc[runtime]" in out.stderr
    assert not (tmp_path / "out").exists()
