"""The import contract: who may import whom, checked over every module of the project (no hand-kept list).

Layers, highest first; a module imports only from its own part or from layers below it, and parts
joined by ``|`` are independent (neither imports the other)::

    cli > controller > jobs | profiler > planner > simulator | megatron_patch > slurm > core | sbatch_templates

On top of the layers: the planner, the simulator and the runtime never talk to Slurm; imports inside
functions are only for what must stay off a login node (torch, megatron, matplotlib, and project modules
whose import pulls torch in), so that go-to-definition and type checkers see every other dependency.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.data import REPO

LAYERS: list[list[str]] = [
    ["sailor_hpc.cli"],
    ["sailor_hpc.controller"],
    ["sailor_hpc.jobs", "profiler"],
    ["planner"],
    ["simulator", "megatron_patch"],
    ["sailor_hpc.slurm"],
    ["sailor_hpc.core", "sbatch_templates"],
]
# the package root holds only a docstring and the version (which anyone may read), and imports nothing
ROOTS = {"sailor_hpc"}
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "planner": ("sailor_hpc.slurm", "torch", "megatron", "submitit"),
    "simulator": ("sailor_hpc.slurm", "torch", "megatron", "submitit"),
    "megatron_patch": ("sailor_hpc.slurm", "submitit"),
    "sailor_hpc.core": ("torch", "megatron", "submitit", "click"),
}
HEAVY = ("torch", "megatron", "transformer_engine", "deepspeed", "matplotlib")
PACKAGES = ("sailor_hpc", "simulator", "planner", "profiler", "megatron_patch", "sbatch_templates")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # what it imports (a module, or module.name for ``from module import name``)
    line: int
    lazy: bool  # inside a function


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_files() -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((REPO / package).rglob("*.py"))


def imports_of(path: Path, module: str | None = None) -> list[Import]:
    module = module or module_name(path)
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import):
                found.extend(Import(module, a.name, child.lineno, lazy) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolve against this module's package
                    pkg = module.split(".") if is_package else module.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (child.level - 1)]
                    base = ".".join(pkg + ([child.module] if child.module else []))
                found.extend(Import(module, f"{base}.{a.name}", child.lineno, lazy) for a in child.names)
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def part_of(module: str) -> str | None:
    """The layer part (longest prefix) a module belongs to, or None outside the project."""
    best = None
    for layer in LAYERS:
        for part in layer:
            if (module == part or module.startswith(part + ".")) and (best is None or len(part) > len(best)):
                best = part
    return best


def layer_index(part: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if part in layer)


def all_imports() -> list[Import]:
    return [imp for path in project_files() for imp in imports_of(path)]


def torch_modules(imports: list[Import]) -> set[str]:
    """Project modules whose import (module level, transitively) pulls in torch or megatron."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if not imp.lazy:
            graph.setdefault(imp.module, set()).add(imp.target)
    heavy = {m for m, targets in graph.items() if any(t.split(".")[0] in HEAVY[:4] for t in targets)}
    changed = True
    while changed:
        changed = False
        for m, targets in graph.items():
            if m not in heavy and any(t in heavy or t.rsplit(".", 1)[0] in heavy for t in targets):
                heavy.add(m)
                changed = True
    return heavy


def layer_violations(imports: list[Import]) -> list[str]:
    bad = []
    for imp in imports:
        if imp.target.split(".")[0] not in PACKAGES:
            continue
        if imp.module in ROOTS:
            bad.append(f"{imp.module}:{imp.line} package root imports {imp.target}")
            continue
        src, dst = part_of(imp.module), part_of(imp.target)
        if dst is None:
            if imp.target not in ROOTS and imp.target not in {f"{r}.__version__" for r in ROOTS}:
                bad.append(f"{imp.module}:{imp.line} imports {imp.target}, which no layer holds")
            continue
        if src is None:
            bad.append(f"{imp.module}:{imp.line} is in no layer")
        elif src != dst and layer_index(dst) <= layer_index(src):
            how = "a sibling" if layer_index(dst) == layer_index(src) else "a higher layer"
            bad.append(f"{imp.module}:{imp.line} imports {imp.target} ({how}: {dst} from {src})")
    return bad


def forbidden_violations(imports: list[Import]) -> list[str]:
    bad = []
    for imp in imports:
        src = part_of(imp.module)
        for prefix in FORBIDDEN.get(src or "", ()):
            if imp.target == prefix or imp.target.startswith(prefix + "."):
                bad.append(f"{imp.module}:{imp.line} imports {imp.target} ({src} must not use {prefix})")
    return bad


def lazy_violations(imports: list[Import], heavy: set[str]) -> list[str]:
    bad = []
    for imp in imports:
        if not imp.lazy or imp.target.split(".")[0] in HEAVY:
            continue
        if imp.target in heavy or imp.target.rsplit(".", 1)[0] in heavy:
            continue
        bad.append(f"{imp.module}:{imp.line} imports {imp.target} inside a function; import it at module level")
    return bad


def test_every_module_is_in_a_layer() -> None:
    stray = [module_name(p) for p in project_files() if module_name(p) not in ROOTS and part_of(module_name(p)) is None]
    assert not stray, f"modules outside every layer of the contract: {stray}"


def test_layers_import_only_downwards() -> None:
    bad = layer_violations(all_imports())
    assert not bad, "\n".join(bad)


def test_forbidden_dependencies() -> None:
    bad = forbidden_violations(all_imports())
    assert not bad, "\n".join(bad)


def test_lazy_imports_only_keep_torch_off_login_nodes() -> None:
    imports = all_imports()
    bad = lazy_violations(imports, torch_modules(imports))
    assert not bad, "\n".join(bad)


def test_the_contract_catches_violations(tmp_path: Path) -> None:
    """The checks are not vacuous: an upward, a sibling, a forbidden and a lazy import are each reported."""
    probe = tmp_path / "probe.py"
    probe.write_text("from sailor_hpc.cli import main\nimport torch\n\ndef f():\n    import json\n"
                     "    from megatron_patch import model\n")
    core = imports_of(probe, "sailor_hpc.core.probe")
    assert [(i.target, i.lazy) for i in core] == [("sailor_hpc.cli.main", False), ("torch", False), ("json", True),
                                                  ("megatron_patch.model", True)]
    assert layer_violations(core) == ["sailor_hpc.core.probe:1 imports sailor_hpc.cli.main (a higher layer: "
                                      "sailor_hpc.cli from sailor_hpc.core)",
                                      "sailor_hpc.core.probe:6 imports megatron_patch.model (a higher layer: "
                                      "megatron_patch from sailor_hpc.core)"]
    assert forbidden_violations(core) == ["sailor_hpc.core.probe:2 imports torch (sailor_hpc.core must not use torch)"]
    assert lazy_violations(core, {"megatron_patch.model"}) == [
        "sailor_hpc.core.probe:5 imports json inside a function; import it at module level"]
    sibling = tmp_path / "sibling.py"
    sibling.write_text("from profiler.sweep import run_sweep\n")
    assert layer_violations(imports_of(sibling, "sailor_hpc.jobs.probe")) == [
        "sailor_hpc.jobs.probe:1 imports profiler.sweep.run_sweep (a sibling: profiler from sailor_hpc.jobs)"]


def test_cli_simulator_and_planner_run_without_torch() -> None:
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'megatron'):\n"
        "            raise ImportError('no ' + name + ' on a login node')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import sailor_hpc.cli, simulator, planner, sailor_hpc.controller, sailor_hpc.jobs.render, profiler.sweep\n"
        "import sailor_hpc.core.roles, sailor_hpc.core.checkpoint, sailor_hpc.core.dist_env\n"
        "from click.testing import CliRunner\n"
        "r = CliRunner().invoke(sailor_hpc.cli.main, ['plan', '--site', 'site_configs/local-lab.toml',\n"
        "                                           '--model', 'OPT-350M', '--gbs', '16', '--json'])\n"
        "assert r.exit_code == 0, r.output\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


SLURM_BINARIES = frozenset({"sbatch", "srun", "salloc", "squeue", "sacct", "sacctmgr", "scontrol", "scancel", "sinfo",
                            "sstat", "sattach"})
SLURM_HOME = "sailor_hpc.slurm"  # the one layer that runs Slurm's commands
_RUNNERS = ("subprocess.", "os.system", "os.exec", "os.spawn", "os.popen")


def slurm_commands(path: Path, module: str | None = None) -> list[str]:
    """Where a module runs a Slurm binary: a command line literal (list or tuple) whose first item names one, or
    a subprocess/os call given a command text that starts with one."""
    module = module or module_name(path)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.List | ast.Tuple) and node.elts:
            first = node.elts[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value in SLURM_BINARIES:
                found.append(f"{module}:{node.lineno} runs {first.value} (command line {ast.unparse(node)[:60]})")
        elif isinstance(node, ast.Call) and ast.unparse(node.func).startswith(_RUNNERS) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and \
                    arg.value.split()[:1] and arg.value.split()[0] in SLURM_BINARIES:
                found.append(f"{module}:{node.lineno} runs {arg.value.split()[0]} ({ast.unparse(node.func)})")
    return sorted(found, key=lambda hit: int(hit.split(":")[1].split()[0]))


def test_only_the_slurm_layer_runs_slurm_commands() -> None:
    bad = [hit for path in project_files() if part_of(module_name(path)) != SLURM_HOME
           for hit in slurm_commands(path)]
    assert not bad, "run Slurm's commands through sailor_hpc.slurm:\n" + "\n".join(bad)


def test_the_slurm_check_catches_command_lines(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('import os, subprocess\nsubprocess.run(["scancel", "1"])\nargs = ("sinfo", "-h")\n'
                     'os.system("squeue -h")\nsubprocess.run(["echo", "sbatch"])\n')
    assert [hit.split(" (")[0] for hit in slurm_commands(probe, "profiler.probe")] == [
        "profiler.probe:2 runs scancel", "profiler.probe:3 runs sinfo", "profiler.probe:4 runs squeue"]
