"""Who may import whom (README, ../shared/reference/architecture.md), checked on the source and at run time."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA_MODEL = ["errors", "atomic", "fields", "network", "site", "models", "plan", "archive", "locking", "sailor_import", "sbatch_values"]
PROJECT = {"sailor_hpc", "simulator", "planner", "profiler", "megatron_patch", "sbatch_templates"}


def imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def package_imports(package: str) -> dict[str, set[str]]:
    return {str(p.relative_to(REPO)): imports(p) for p in (REPO / package).rglob("*.py")}


def test_data_model_imports_no_other_package() -> None:
    for name in DATA_MODEL:
        mods = imports(REPO / "sailor_hpc" / f"{name}.py")
        bad = {m for m in mods if m.split(".")[0] in PROJECT - {"sailor_hpc"}}
        assert not bad, (name, bad)
        assert not {m for m in mods if m.startswith(("sailor_hpc.cli", "sailor_hpc.slurm", "sailor_hpc.jobs",
                                                     "sailor_hpc.controller"))}, name


def test_simulator_and_planner_stay_on_the_login_node() -> None:
    for package, forbidden in (("simulator", {"planner", "profiler", "megatron_patch", "torch", "submitit"}),
                               ("planner", {"profiler", "megatron_patch", "torch", "submitit"})):
        for file, mods in package_imports(package).items():
            bad = {m for m in mods if m.split(".")[0] in forbidden or m.startswith(("sailor_hpc.slurm", "sailor_hpc.jobs"))}
            assert not bad, (file, bad)


def test_cli_simulator_and_planner_run_without_torch() -> None:
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'megatron'):\n"
        "            raise ImportError('no ' + name + ' on a login node')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import sailor_hpc.cli, simulator, planner, sailor_hpc.controller, sailor_hpc.jobs, megatron_patch.roles\n"
        "from click.testing import CliRunner\n"
        "r = CliRunner().invoke(sailor_hpc.cli.main, ['plan', '--site', 'site_configs/local-lab.toml',\n"
        "                                           '--model', 'OPT-350M', '--gbs', '16', '--json'])\n"
        "assert r.exit_code == 0, r.output\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
