"""Every option of the runtime's entry points refuses a bad value the same clean way, on every rank.

The entry points: ``megatron_patch.launch``, the DeepSpeed runtime's launcher (the same options) and the dataset
tool ``megatron_patch.data``; plus the launcher's environment (ranks, world size, port). For each option the
table below gives bad values: out of range, of the wrong type, a path that cannot be written, a file where a
folder belongs, a truncated dataset, a bad JSON-lines record. Every one must end in exit 2 with one line,
``error: ... (fix: ...)``, that names the option or the file, without a traceback, having written nothing, the
same line on both ranks, and (the launchers) before torch is imported. The options are read from the parsers,
so an option added without a bad-value case fails :func:`test_every_option_has_bad_values`.

The cases run in two worker processes, one per rank, each its own copy of the scratch folder (refusal_worker.py:
the entry points' ``main`` in process; a process per case would cost a Python start each). A control case per
entry point shows that the base arguments pass every check, so each refusal is its bad value's.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from megatron_patch import local
from megatron_patch.ds_runtime.launch import MEGATRON_PATCH_ONLY
from megatron_patch.launch import parser as launch_parser
from sailor_hpc.core.dist_env import ENV_BOUNDS
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from tests.megatron_patch.refusal_worker import PASSED_CHECKS, snapshot

pytest.importorskip("megatron.core")

#: a plan both runtimes run on two ranks (DeepSpeed takes no heterogeneous one)
PLAN = Plan("tiny-gpt", 8, (Pipeline(2, 2, (Stage(0, 5, 1, "A100-40"),)),) * 2)
BASE = ["--plan", "plan.json", "--model", "tiny-gpt", "--data", "data", "--steps", "2", "--save", "ckpt"]
UNWRITABLE = "/proc/sailor-refusals/out"  # /proc refuses a new file even to root, which os.access does not say
WORKER = Path(__file__).with_name("refusal_worker.py")


@dataclass(frozen=True)
class Bad:
    """A bad input: ``args`` appended to the base arguments (argparse keeps an option's last value), ``drop``
    base options removed, ``env`` variables set (None: unset); the refusal must contain ``named``."""

    args: tuple[str, ...]
    named: str
    drop: tuple[str, ...] = ()
    env: dict[str, str | None] = field(default_factory=dict)


def values(option: str, *bad: str, named: str | None = None) -> list[Bad]:
    """``option VALUE`` for each bad value, the refusal naming the option."""
    return [Bad((option, v), named or option) for v in bad]


#: the launchers' options (both parse the same); each list is that option's bad values
LAUNCH: dict[str, list[Bad]] = {
    "--plan": [Bad(("--plan", "missing.json"), "missing.json"), Bad(("--plan", "afile"), "afile"),
               Bad(("--plan", "folder"), "folder")],
    "--model": [Bad(("--model", "OPT-350M"), "not OPT-350M"), Bad(("--model", "no-such-model"), "no-such-model")],
    "--data": [Bad(("--data", "missing"), "missing"), Bad(("--data", "cut_idx"), "cut_idx.idx"),
               Bad(("--data", "cut_bin"), "cut_bin.bin"), Bad(("--data", "data.bin"), "data.bin"),
               Bad(("--data", "0.5", "data", "0.5", "cut_bin"), "cut_bin.bin"),
               Bad(("--data", "0.5", "data", "0.5"), "--data"), Bad((), "--data", drop=("--data",))],
    "--save": [Bad(("--save", "afile"), "afile"), Bad(("--save", "afile/ckpt"), "afile"),
               Bad(("--save", UNWRITABLE), UNWRITABLE)],
    "--load": [Bad(("--load", "missing"), "missing"), Bad(("--load", "afile"), "afile")],
    "--auto-resume": [Bad(("--auto-resume",), "--auto-resume", drop=("--save",)),
                      Bad(("--auto-resume=yes",), "--auto-resume")],
    "--dry-run": [Bad(("--dry-run=yes",), "--dry-run")],
    "--steps": values("--steps", "0", "-1", "1.5", "x") + [Bad((), "--steps", drop=("--steps",))],
    "--save-interval": values("--save-interval", "-1", "x") + [Bad(("--save-interval", "5"), "--save-interval",
                                                                   drop=("--save",))],
    "--keep": values("--keep", "0", "-3"),
    "--seed": values("--seed", "-1", str(2**32), "1e3"),
    "--grad-bucket-mb": values("--grad-bucket-mb", "-1", "nan", "inf"),
    "--timeout-min": values("--timeout-min", "0", "-5", "inf", "1e7"),
    "--lr": values("--lr", "0", "-1e-3", "nan", "x"),
    "--min-lr": values("--min-lr", "-1", "0.5"),
    "--lr-decay-style": values("--lr-decay-style", "exponential"),
    "--lr-warmup-iters": values("--lr-warmup-iters", "-1") + [
        Bad(("--lr-warmup-iters", "2", "--lr-warmup-samples", "16"), "--lr-warmup-samples")],
    "--lr-warmup-samples": values("--lr-warmup-samples", "-1"),
    "--lr-decay-iters": values("--lr-decay-iters", "0", "-2"),
    "--lr-decay-samples": values("--lr-decay-samples", "0"),
    "--weight-decay": values("--weight-decay", "-0.1", "nan"),
    "--clip-grad": values("--clip-grad", "-1", "inf"),
    "--adam-eps": values("--adam-eps", "0", "-1e-8"),
    "--split": values("--split", "x", "0,0,0", "1,2,3,4", "-1,2"),
    "--eval-interval": values("--eval-interval", "-1") + [Bad(("--eval-interval", "5"), "--eval-interval")],
    "--eval-iters": values("--eval-iters", "0"),
    "--log-interval": values("--log-interval", "0", "-1"),
    "--metrics-file": [Bad(("--metrics-file", "folder"), "--metrics-file"),
                       Bad(("--metrics-file", "afile/m.jsonl"), "afile"),
                       Bad(("--metrics-file", f"{UNWRITABLE}/m.jsonl"), "--metrics-file")],
    "--tensorboard-dir": [Bad(("--tensorboard-dir", "afile"), "afile"),
                          Bad(("--tensorboard-dir", UNWRITABLE), UNWRITABLE)],
    "--device": values("--device", "tpu"),  # and "cuda" where no GPU is: CUDA_CASE
    "--layer-spec": values("--layer-spec", "te", "xla"),
    "--no-tf32": [Bad(("--no-tf32=1",), "--no-tf32")],
    "--initial-loss-scale": values("--initial-loss-scale", "0", "nan") + [
        Bad(("--initial-loss-scale", "0.5"), "--initial-loss-scale")],  # below the minimum scale (1)
    "--loss-scale-window": values("--loss-scale-window", "0", "2.5"),
    "--min-loss-scale": values("--min-loss-scale", "0", "-1"),
    "--inject-overflow": values("--inject-overflow", "x", "1:", "a:b"),
    "--grad-weighting": values("--grad-weighting", "none"),
    "--wait-for": [Bad(("--wait-for", "folder"), "folder"), Bad(("--wait-for", "afile/gate"), "afile")],
    "--resident": [Bad(("--resident", "afile"), "afile"), Bad(("--resident", UNWRITABLE), UNWRITABLE)],
}
#: --device cuda needs torch to see the refusal (the one case that imports it); only where no GPU is
CUDA_CASE = Bad(("--device", "cuda"), "--device")

#: the launcher's environment (RANK, WORLD_SIZE, ... as torchrun or srun set it)
ENV: dict[str, list[Bad]] = {
    "RANK": [Bad((), "RANK", env={"RANK": "x"}), Bad((), "RANK", env={"RANK": "-1"}),
             Bad((), "RANK", env={"RANK": "2"})],
    "WORLD_SIZE": [Bad((), "WORLD_SIZE", env={"WORLD_SIZE": "0"}), Bad((), "WORLD_SIZE", env={"WORLD_SIZE": "two"})],
    "LOCAL_RANK": [Bad((), "LOCAL_RANK", env={"LOCAL_RANK": "-1"}), Bad((), "LOCAL_RANK", env={"LOCAL_RANK": "x"})],
    "MASTER_PORT": [Bad((), "MASTER_PORT", env={"MASTER_PORT": p}) for p in ("0", "65536", "http")],
    **{var: [Bad((), var, env={"RANK": None, "WORLD_SIZE": None, **slurm, var: bad})]
       for var, bad in (("SLURM_PROCID", "-1"), ("SLURM_NTASKS", "0"), ("SLURM_LOCALID", "x"))
       for slurm in [{"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}]},
}

#: megatron_patch's own options, given a valid value, under DeepSpeed (whose trainer would ignore them)
DS_ONLY_REFUSES = {"--no-tf32": (), "--initial-loss-scale": ("1024",), "--loss-scale-window": ("10",),
                   "--min-loss-scale": ("2",), "--inject-overflow": ("0:1",), "--grad-bucket-mb": ("1",),
                   "--grad-weighting": ("uniform",), "--resident": ("folder",)}

#: the dataset tool's arguments: (argv, named)
DATA: dict[str, list[tuple[list[str], str]]] = {
    "prefix": [(["afile/web", "good.txt"], "afile/web"), ([f"{UNWRITABLE}/web", "good.txt"], UNWRITABLE),
               (["out/web.bin", "good.txt"], "web.bin"), (["folder", "good.txt"], "folder"),
               (["binfolder", "good.txt"], "binfolder.bin"), ([], "prefix")],
    "files": [(["out/web", "good.txt", "missing.txt"], "missing.txt"), (["out/web", "folder"], "folder"),
              (["out/web", "good.txt", "number.jsonl"], "number.jsonl, line 2: text"),
              (["out/web", "null.jsonl"], "null.jsonl, line 1: text"),
              (["out/web", "list.jsonl"], "list.jsonl, line 2"),
              (["out/web", "notjson.jsonl"], "notjson.jsonl, line 1"),
              (["out/web", "nokey.jsonl"], "nokey.jsonl, line 1: text")],
    "--json-key": [(["out/web", "good.jsonl", "--json-key", "body"], "good.jsonl, line 1: body"),
                   (["out/web", "good.txt", "--json-key", "text"], "--json-key"),
                   (["out/web", "good.jsonl", "--json-key"], "--json-key")],
}
JSONL = {"good.jsonl": ['{"text": "a document"}'], "number.jsonl": ['{"text": "fine"}', '{"text": 5}'],
         "null.jsonl": ['{"text": null}'], "list.jsonl": ['{"text": "fine"}', '["text"]'],
         "notjson.jsonl": ["text: plain"], "nokey.jsonl": ['{"body": "elsewhere"}']}


def test_every_option_has_bad_values() -> None:
    """The tables cover every option the parsers define and every variable the launcher reads."""
    from megatron_patch.data import parser as data_parser
    options = {max(a.option_strings, key=len) for a in launch_parser()._actions if a.option_strings} - {"--help"}
    assert options == set(LAUNCH), f"options without bad values: {options - set(LAUNCH)}; gone: {set(LAUNCH) - options}"
    data = {max(a.option_strings, key=len) if a.option_strings else a.dest for a in data_parser()._actions} - {"--help"}
    assert data == set(DATA), data ^ set(DATA)
    assert set(ENV_BOUNDS) == set(ENV)
    assert set(MEGATRON_PATCH_ONLY) == set(DS_ONLY_REFUSES)
    assert all(cases for cases in (*LAUNCH.values(), *ENV.values(), *DATA.values()))


def scratch(root: Path) -> None:
    """What the cases name: a plan, a dataset and its truncated copies, a file, a folder, raw text."""
    from megatron_patch.data import build_dataset
    root.mkdir()
    PLAN.save(root / "plan.json")
    build_dataset(root / "data", ["a first document", "and a second, a little longer"])
    for name, cut in (("cut_idx", ".idx"), ("cut_bin", ".bin")):
        for suffix in (".bin", ".idx"):
            payload = (root / f"data{suffix}").read_bytes()
            (root / f"{name}{suffix}").write_bytes(payload[:-3] if suffix == cut else payload)
    (root / "afile").write_text("a file where a folder belongs\n")
    (root / "folder").mkdir()
    (root / "binfolder.bin").mkdir()  # where the dataset tool would write a file
    (root / "good.txt").write_text("some raw text\n")
    for name, lines in JSONL.items():
        (root / name).write_text("".join(f"{line}\n" for line in lines))


def launch_case(entry: str, bad: Bad) -> dict[str, Any]:
    argv = [tok for i in range(0, len(BASE), 2) if BASE[i] not in bad.drop for tok in BASE[i:i + 2]]
    return {"entry": entry, "argv": [*argv, *bad.args], "env": bad.env, "named": bad.named}


def cases(cuda_case: bool) -> list[dict[str, Any]]:
    """Every case in the order the worker runs them: controls first, torch-importing ones last."""
    out = [dict(launch_case(e, Bad((), "")), control=True) for e in ("launch", "ds")]
    for entry in ("launch", "ds"):
        out += [launch_case(entry, bad) for table in (LAUNCH, ENV) for bads in table.values() for bad in bads]
    out += [launch_case("ds", Bad((flag, *args), flag)) for flag, args in DS_ONLY_REFUSES.items()]
    if cuda_case:
        out += [launch_case(e, CUDA_CASE) for e in ("launch", "ds")]
    out.append({"entry": "data", "argv": ["out/good", "good.txt", "good.jsonl"], "env": {}, "named": "",
                "control": True})
    out += [{"entry": "data", "argv": argv, "env": {}, "named": named} for table in DATA.values()
            for argv, named in table]
    return out


def gpu_visible() -> bool:
    return shutil.which("nvidia-smi") is not None and subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                                                                     check=False).returncode == 0


Results = dict[int, list[tuple[dict[str, Any], dict[str, Any]]]]  # rank -> (case, its result) in order


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Results, list[Path]]:
    """Each rank's cases and results (both ranks at once, each in its own copy of the scratch folder; the
    dataset tool is one process: rank 0 runs its cases)."""
    base = tmp_path_factory.mktemp("refusals")
    scratch(base / "scratch")
    todo = cases(cuda_case=not gpu_visible())
    roots, procs, mine = [], [], {}
    for rank in range(2):
        root = base / f"rank{rank}"
        shutil.copytree(base / "scratch", root)
        mine[rank] = [c for c in todo if rank == 0 or c["entry"] != "data"]
        (base / f"cases{rank}.json").write_text(json.dumps(mine[rank]))
        env = local.rank_env(rank, 2, local.free_port())
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(base / f"cases{rank}.json")], cwd=root,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        roots.append(root)
    out: Results = {}
    for rank, proc in enumerate(procs):
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        got = [json.loads(line) for line in stdout.splitlines()]
        assert len(got) == len(mine[rank]), stderr
        out[rank] = list(zip(mine[rank], got))
    return out, roots


def _label(case: dict[str, Any]) -> str:
    return f"{case['entry']} {' '.join(case['argv'])} {case['env'] or ''}"


def test_the_base_arguments_pass_every_check(results: tuple[Results, list[Path]]) -> None:
    per_rank, _ = results
    controls = [(rank, case, res) for rank, pairs in per_rank.items() for case, res in pairs if case.get("control")]
    assert len(controls) == 5  # launch and ds on each rank, the dataset tool on rank 0
    for rank, case, res in controls:
        data = case["entry"] == "data"
        assert res["code"] == (0 if data else PASSED_CHECKS), (rank, _label(case), res)
        assert data or res["stderr"] == "", res["stderr"]
        assert res["written"] == (["out", "out/good.bin", "out/good.idx"] if data else []), (rank, res["written"])


def test_every_bad_value_is_one_clean_line_naming_it_on_every_rank(results: tuple[Results, list[Path]]) -> None:
    per_rank, roots = results
    failures, said = [], {}
    for rank, pairs in per_rank.items():
        for i, (case, res) in enumerate(pairs):
            if case.get("control"):
                continue
            err = res["stderr"]
            problems = [what for what, bad in (
                (f"exit {res['code']}", res["code"] != 2), ("a traceback", "Traceback" in err),
                (f"not naming {case['named']!r}", case["named"] not in err),
                ("not one 'error: ... (fix: ...)' line",
                 not (err.startswith("error: ") and err.count("\n") == 1 and "(fix: " in err)),
                (f"wrote {res['written']}", bool(res["written"])),
                ("torch imported", res["torch"] and case["entry"] != "data" and "cuda" not in case["argv"]))
                if bad]
            if problems:
                failures.append(f"rank {rank}: {_label(case)}: {', '.join(problems)}\n    {err.strip()[-600:]}")
            if case["entry"] != "data":
                said.setdefault(i, []).append(err.replace(str(roots[rank]), "<root>"))
    failures += [f"{_label(per_rank[0][i][0])}: the ranks say different things: {lines}"
                 for i, lines in said.items() if len(set(lines)) > 1]
    print(f"{sum(len(p) for p in per_rank.values())} cases over 2 ranks")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(("module", "bad", "named"), [
    ("megatron_patch.launch", ("--data", "cut_idx"), "cut_idx.idx"),
    ("megatron_patch.ds_runtime.launch", ("--steps", "0"), "--steps"),
])
def test_the_launchers_refuse_alike_as_processes(results: tuple[Results, list[Path]], module: str,
                                                 bad: tuple[str, str], named: str) -> None:
    """``python -m`` on two ranks, as torchrun or srun starts them: the same line from each, exit 2, nothing
    written (the entry point's own way out, not only its ``main``)."""
    root = results[1][0]
    argv = [str(root / a) if a in ("plan.json", "data", "ckpt", "cut_idx") else a for a in (*BASE, *bad)]
    before = snapshot(root)
    ranks = local.run(["-m", module, *argv], 2, timeout=120)
    assert [r.returncode for r in ranks] == [2, 2], [r.stderr for r in ranks]
    assert ranks[0].stderr == ranks[1].stderr and ranks[0].stderr.count("\n") == 1, [r.stderr for r in ranks]
    assert ranks[0].stderr.startswith("error: ") and named in ranks[0].stderr and "Traceback" not in ranks[0].stderr
    assert snapshot(root) == before
