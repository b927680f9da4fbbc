"""Rendering job scripts: components, site settings, time limits, and refusal/quoting of hostile input."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from sailor_hpc.cli import main
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.site import load_site, load_site_dict
from sailor_hpc.core.toml_writer import dump_toml
from sailor_hpc.jobs.options import ClusterPart, DryRun, InPlace, JobOptions, Limits, Training, UserEntry
from sailor_hpc.jobs.render import placed_plan_file, render_job_script
from tests.conftest import slurm_missing
from tests.jobs.conftest import LOCAL_LAB, job_options, write_plan


def _render(tmp_path: Path, name: str, site=None, **kw) -> str:
    site = site or load_site(LOCAL_LAB)
    path = write_plan(tmp_path, name)
    plan = load_plan(path, site=site)
    return render_job_script(plan, site, job_options(path, **kw))


def _header(script: str) -> list[list[str]]:
    """The #SBATCH options of each het component (job-wide options land in the first)."""
    comps: list[list[str]] = [[]]
    for line in script.splitlines():
        if line.strip() == "#SBATCH hetjob":
            comps.append([])
        elif line.startswith("#SBATCH "):
            comps[-1].append(line[len("#SBATCH "):])
    return comps


def _placed_files(directory: Path) -> list[Path]:
    return sorted(p.absolute() for p in directory.rglob("*.placed.json"))


def _bash_argv(script: str, var: str) -> list[str]:
    """The words of bash array ``var`` as the job's bash builds them: the script's variable block runs
    alone (the --load condition dropped, so --load is always appended)."""
    start = script.index("PLAN=")
    block = script[start:script.index("\necho ", start)]
    block = "\n".join(line for line in block.splitlines() if not line.startswith(("if ", "fi", "#")))
    proc = subprocess.run(["bash", "-c", f"set -u\n{block}\nprintf '%s\\0' \"${{{var}[@]}}\""],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("\0")[:-1]


def test_single_partition_plan_renders_an_ordinary_job(tmp_path):
    script = _render(tmp_path, "a100-only")
    comps = _header(script)
    assert len(comps) == 1 and "hetjob" not in script
    for opt in ("--partition=a100", "--nodes=2", "--ntasks-per-node=4", "--gres=gpu:a100:4", "--cpus-per-task=1"):
        assert opt in comps[0]
    assert "--het-group" not in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert srun.count('"${TASK[@]}"') == 1 and "--distribution=block" in srun
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_het_plan_components_and_srun(tmp_path):
    script = _render(tmp_path, "het-mixed", time="00:05:00")
    comps = _header(script)
    parts = [[o for o in c if o.startswith(("--partition", "--nodes", "--ntasks-per-node", "--gres", "--cpus"))]
             for c in comps]
    assert parts == [["--partition=v100", "--nodes=1", "--ntasks-per-node=2", "--gres=gpu:v100:2", "--cpus-per-task=1"],
                     ["--partition=a100", "--nodes=1", "--ntasks-per-node=3", "--gres=gpu:a100:3", "--cpus-per-task=1"],
                     ["--partition=a100", "--nodes=1", "--ntasks-per-node=1", "--gres=gpu:a100:1", "--cpus-per-task=1"]]
    assert "--time=00:05:00" in comps[0] and "--job-name=sailor-tiny-gpt" in comps[0]
    assert "SLURM_PROCID -> plan rank, het group by het group): 0 1 2 5 4 3" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert [int(g) for g in re.findall(r"--het-group=(\d+)", srun)] == [0, 1, 2]
    assert srun.count(" : ") == 2
    # dry run: no checkpoint signal / requeue; the rank wrapper runs the runtime with the plan
    assert "--signal" not in script and "requeue" not in script.split("set -uo")[1]
    task = _bash_argv(script, "TASK")
    plan_path = str((tmp_path / "het-mixed.json").absolute())
    assert task[:6] == [sys.executable, "-m", "sailor_hpc.jobs.rank_env", "--plan", plan_path, "--"]
    assert task[6:] == [sys.executable, "-m", "megatron_patch.launch", "--plan", plan_path, "--model", "tiny-gpt",
                        "--steps", "100", "--dry-run"]


def test_training_job_checkpoints_and_requeues(tmp_path):
    script = _render(tmp_path, "het-mixed", dry_run=False, data=tmp_path / "data" / "tok", save=tmp_path / "ckpt",
                     load=tmp_path / "old", steps=50, time="02:00:00", train_args=["--save-interval", "10"])
    comps = _header(script)
    assert "--signal=USR1@300" in comps[0] and "--requeue" in comps[0] and "--open-mode=append" in comps[0]
    assert 'if [ "$rc" -eq 75 ]; then' in script and 'scontrol requeue "${SLURM_JOB_ID}"' in script
    launch = _bash_argv(script, "LAUNCH")
    assert launch[launch.index("--data") + 1] == str(tmp_path / "data" / "tok")
    assert launch[launch.index("--save") + 1] == str(tmp_path / "ckpt") and "--auto-resume" in launch
    assert launch[launch.index("--save-interval") + 1] == "10" and launch[launch.index("--steps") + 1] == "50"
    # --load only while --save has no complete checkpoint of its own
    assert 'for m in "$SAVE"/step_*/manifest.json' in script and f"LAUNCH+=(--load {tmp_path / 'old'})" in script
    # a controller that resubmits by itself: no requeue after the checkpoint, none after a node failure
    no_requeue = _render(tmp_path, "het-mixed", dry_run=False, data="d", save="s", requeue=False)
    assert "--no-requeue" in _header(no_requeue)[0] and "scontrol requeue" not in no_requeue
    # five-minute job: the signal comes at a tenth of the limit
    assert "--signal=USR1@30" in _header(_render(tmp_path, "het-mixed", dry_run=False, data="d", save="s",
                                                 time="5"))[0]
    with pytest.raises(SailorError, match="--data"):
        _render(tmp_path, "het-mixed", dry_run=False)


def test_time_limits(tmp_path):
    assert "--time=01:00:00" in _header(_render(tmp_path, "a100-only"))[0]
    assert "--time=1-00:00:00" in _header(_render(tmp_path, "a100-only", time="1-0"))[0]
    with pytest.raises(SailorError, match="exceeds partition 'a100'"):
        _render(tmp_path, "a100-only", time="2-00:00:00")
    with pytest.raises(SailorError, match="not a Slurm time"):
        _render(tmp_path, "a100-only", time="soon")


def _site_with(**slurm) -> object:
    doc = tomllib.loads(LOCAL_LAB.read_text())
    prelude = slurm.pop("prelude", None)
    doc["slurm"].update(slurm)
    if prelude is not None:
        doc["environment"]["prelude"] = prelude
    return load_site_dict(doc, source="test-site.toml")


def test_site_account_qos_constraint_extra_and_prelude(tmp_path):
    site = _site_with(account="proj42", qos="normal", constraint="ib&nvlink", extra_sbatch=["--mail-type=END"],
                      prelude=["module load cuda/12.4", "source /opt/venv/bin/activate"])
    script = _render(tmp_path, "het-mixed", site=site)
    for comp in _header(script):
        assert {"--account=proj42", "--qos=normal", "--constraint=ib&nvlink"} <= set(comp)
    assert "--mail-type=END" in _header(script)[0] and script.count("--mail-type=END") == 1
    body = script.split("set -uo pipefail", 1)[1]
    assert body.index("module load cuda/12.4") < body.index("source /opt/venv/bin/activate") < body.index("srun ")


CANARY = "sailor-pwned"


@pytest.mark.parametrize("kw, field", [
    ({"job_name": "x;touch sailor-pwned"}, "--job-name"),
    ({"job_name": "$(touch sailor-pwned)"}, "--job-name"),
    ({"job_name": "ok\n#SBATCH --partition=v100"}, "--job-name"),
    ({"workdir": "/tmp/with space"}, "--workdir"),
    ({"log_dir": "/tmp/$(touch sailor-pwned)"}, "--log-dir"),
    ({"extra_sbatch": ["--wrap=touch sailor-pwned"]}, "--extra-sbatch"),
    ({"extra_sbatch": ["--partition=v100"]}, "--extra-sbatch"),
    ({"extra_sbatch": ["--comment=a b"]}, "--extra-sbatch"),
    ({"extra_sbatch": ["--comment='x'"]}, "--extra-sbatch"),
    ({"extra_sbatch": ["--mail-type=END\n#SBATCH --gres=gpu:a100:4"]}, "--extra-sbatch"),
    ({"extra_sbatch": ["-p v100"]}, "--extra-sbatch"),
    ({"python": "python\ntouch sailor-pwned"}, "--python"),
    ({"python": "--version"}, "--python"),
    ({"train_args": ["--x\ntouch sailor-pwned"]}, "--train-arg"),
    ({"data": "/tmp/d\ntouch sailor-pwned", "save": "/tmp/s", "dry_run": False}, "--data"),
    ({"save": "/tmp/s\rtouch", "data": "/tmp/d", "dry_run": False}, "--save"),
])
def test_injection_attempts_are_refused(tmp_path, kw, field):
    with pytest.raises(SailorError) as err:
        _render(tmp_path, "het-mixed", **kw)
    assert err.value.field is not None and err.value.field.startswith(field), err.value


@pytest.mark.parametrize("slurm, field", [
    ({"account": "acct;touch"}, "slurm.account"),
    ({"qos": "normal --partition=v100"}, "slurm.qos"),
    ({"constraint": "a'b"}, "slurm.constraint"),
    ({"extra_sbatch": ["--gres=gpu:v100:8"]}, "slurm.extra_sbatch"),
    ({"prelude": ["module load x\ntouch sailor-pwned"]}, "environment.prelude[0]"),
])
def test_hostile_site_values_are_refused(tmp_path, slurm, field):
    with pytest.raises(SailorError) as err:
        _render(tmp_path, "het-mixed", site=_site_with(**slurm))
    assert err.value.field is not None and err.value.field.startswith(field), err.value


def test_hostile_paths_are_quoted_not_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    nasty = [f"/tmp/a b/$(touch {CANARY})", f"/tmp/`touch {CANARY}`", "/tmp/x'; touch " + CANARY + "; '",
             '/tmp/"q"/$HOME/*']
    python = f"/tmp/my env/$(touch {CANARY});/bin/python"  # sys.executable may be any path: it is quoted
    script = _render(tmp_path, "het-mixed", dry_run=False, data=nasty[0], save=nasty[1], load=nasty[2],
                     train_args=[nasty[3], f"; touch {CANARY}"], python=python)
    launch = _bash_argv(script, "LAUNCH")
    assert launch[0] == python and _bash_argv(script, "TASK")[0] == python
    assert launch[launch.index("--data") + 1] == nasty[0]
    assert launch[launch.index("--save") + 1] == nasty[1]
    assert launch[launch.index("--load") + 1] == nasty[2]
    assert "--dry-run" not in launch
    assert launch[launch.index("--load") - 2:launch.index("--load")] == [nasty[3], f"; touch {CANARY}"]
    assert not (tmp_path / CANARY).exists()


def test_plan_file_must_match_the_rendered_plan(tmp_path):
    site = load_site(LOCAL_LAB)
    plan = load_plan(write_plan(tmp_path, "het-mixed"), site=site)
    other = write_plan(tmp_path, "a100-only")
    with pytest.raises(SailorError, match="differs"):
        render_job_script(plan, site, job_options(other))
    with pytest.raises(SailorError, match="does not exist"):
        render_job_script(plan, site, job_options(tmp_path / "missing.json"))


def test_unplaced_plan_gets_a_placed_copy(tmp_path):
    site = load_site(LOCAL_LAB)
    path = write_plan(tmp_path, "unplaced")
    plan, placed = placed_plan_file(path, site, directory=tmp_path / "job")
    assert placed.parent == (tmp_path / "job").absolute() and re.fullmatch(r"unplaced\.[0-9a-f]{12}\.placed\.json",
                                                                          placed.name)
    assert load_plan(placed, site=site) == plan
    assert placed_plan_file(path, site, directory=tmp_path / "job")[1] == placed  # same plan, same file
    assert all(s.placement is not None for p in plan.pipelines for s in p.stages)
    # an already placed plan is used as it is
    _, same = placed_plan_file(write_plan(tmp_path, "het-mixed"), site)
    assert same == (tmp_path / "het-mixed.json").absolute()


def test_cli_sbatch_renders_and_refuses(tmp_path):
    runner = CliRunner()
    plan = write_plan(tmp_path, "unplaced")
    out = tmp_path / "job.sh"
    res = runner.invoke(main, ["sbatch", str(plan), "--site", str(LOCAL_LAB), "--dry-run", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert out.stat().st_mode & 0o100 and "#SBATCH hetjob" in out.read_text()
    placed = _placed_files(tmp_path)
    assert len(placed) == 1 and f"\nPLAN={placed[0]}\n" in out.read_text()
    res = runner.invoke(main, ["sbatch", str(plan), "--site", str(LOCAL_LAB), "--job-name", "a;b", "--dry-run"])
    assert res.exit_code == 2 and "--job-name" in res.output and "not a safe job name" in res.output
    res = runner.invoke(main, ["sbatch", str(plan), "--site", str(LOCAL_LAB), "--json", "--job-name", "a b",
                               "--dry-run"])
    assert res.exit_code == 2
    res = runner.invoke(main, ["sbatch", str(plan), "--site", str(LOCAL_LAB)])
    assert res.exit_code == 2 and "--data" in res.output
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "sailor-hpc-plan", "model": "tiny-gpt"}))
    res = runner.invoke(main, ["sbatch", str(bad), "--site", str(LOCAL_LAB), "--dry-run"])
    assert res.exit_code == 2 and "bad.json: pipelines: is missing" in res.output


def test_cli_sbatch_that_cannot_render_leaves_no_placed_plan(tmp_path):
    plan = write_plan(tmp_path, "unplaced")
    res = CliRunner().invoke(main, ["sbatch", str(plan), "--site", str(LOCAL_LAB), "--dry-run", "--time", "bogus"])
    assert res.exit_code == 2 and "--time" in res.output
    assert not _placed_files(tmp_path)


# ---- extra sbatch options: per component or once for the whole het job

def test_extra_options_are_written_in_every_component_and_job_wide_ones_once(tmp_path):
    """sbatch 22.05 gives most options written before the first `#SBATCH hetjob` to the first component
    only (--exclusive, --mem-per-cpu, --constraint, --gres-flags ... are not copied): per-component
    options must stand in every component; mail, dependency, comment once."""
    site = _site_with(extra_sbatch=["--exclusive", "--mail-type=END"])
    script = _render(tmp_path, "het-mixed", site=site,
                     extra_sbatch=["--mem-per-cpu=2000", "--gres-f=enforce-binding", "--comment=sailor",
                                   "--dependency=afterok:12", "--mail-u=me@example.org"])
    comps = _header(script)
    assert len(comps) == 3
    for comp in comps:
        assert {"--exclusive", "--mem-per-cpu=2000", "--gres-flags=enforce-binding"} <= set(comp), comp
    job_wide = ["--mail-type=END", "--comment=sailor", "--dependency=afterok:12", "--mail-user=me@example.org"]
    first = comps[0]
    for opt in job_wide:
        assert script.count(opt) == 1 and first.index(opt) < first.index("--partition=v100"), opt
    # the site's options come before the command line's (a later sbatch option wins)
    assert comps[1].index("--exclusive") < comps[1].index("--mem-per-cpu=2000")


def _sbatch_defined_options(script: str, workdir: Path) -> list[dict[str, str]]:
    """What sbatch's own option parser makes of each het component of ``script`` (``sbatch -vv`` lists
    the defined options of every component before it contacts a controller). Runs only the sbatch
    client, with a private slurm.conf naming an unreachable controller: no cluster is used."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        slurm_missing("sbatch (slurm-client) is not installed")
    conf = workdir / "slurm.conf"
    conf.write_text("ClusterName=render-test\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=1\n"
                    "AuthType=auth/none\nCredType=cred/none\nSelectType=select/cons_tres\nGresTypes=gpu\n"
                    "NodeName=n[1-4] CPUs=8 Gres=gpu:a100:4,gpu:v100:8 State=UNKNOWN\n"
                    "PartitionName=a100 Nodes=n[1-2]\nPartitionName=v100 Nodes=n[3-4]\n")
    job = workdir / "job.sh"
    job.write_text(script)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SLURM_CONF": str(conf)}
    components = script.count("#SBATCH hetjob") + 1
    blocks: list[dict[str, str]] = []
    with subprocess.Popen([sbatch, "-vv", str(job)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                          env=env, cwd=workdir) as proc:
        assert proc.stderr is not None
        current: dict[str, str] | None = None
        for line in proc.stderr:  # stop reading once every component is listed: the submission then times out
            text = line.removeprefix("sbatch: ").strip()
            if text == "defined options":
                current = {}
            elif text == "end of defined options" and current is not None:
                blocks.append(current)
                current = None
                if len(blocks) == components:
                    break
            elif current is not None and " : " in text:
                key, _, value = text.partition(" : ")
                current[key.strip()] = value.strip()
        proc.kill()
    assert len(blocks) == components, "sbatch did not list every component's options"
    return blocks


def test_sbatch_itself_gives_every_component_the_per_component_options(tmp_path):
    """The rendered header as sbatch 22.05 parses it: every component gets --exclusive and --mem-per-cpu
    (written once, before the first hetjob, only component 0 would), and also the time limit, job name
    and signal that are written once (sbatch copies those itself)."""
    script = _render(tmp_path, "het-mixed", dry_run=False, data="d", save="s", time="00:30:00",
                     extra_sbatch=["--exclusive", "--mem-per-cpu=100", "--mail-type=END"])
    blocks = _sbatch_defined_options(script, tmp_path)
    assert [b["partition"] for b in blocks] == ["v100", "a100", "a100"]
    for b in blocks:
        assert b.get("exclusive") == "exclusive" and b.get("mem-per-cpu") == "100", b
        assert b["time"] == "00:30:00" and b["job-name"] == "sailor-tiny-gpt" and b["signal"] == "USR1@180", b
    assert blocks[0]["mail-type"] == "END"


@pytest.mark.parametrize("option, words", [
    ("--parti=v100", "--parti (sbatch reads it as --partition)"),
    ("--ntasks-per-n=2", "sbatch reads it as --ntasks-per-node"),
    ("--tasks-per-node=2", "--tasks-per-node cannot be added"),  # sbatch's hidden alias of --ntasks-per-node
    ("--gpus-per-n=1", "sbatch reads it as --gpus-per-node"),
    ("--nod=2", "ambiguous: sbatch could read it as --nodefile, --nodelist, --nodes"),
    ("--ntasks-per=2", "ambiguous"),
    ("--sig=USR1@5", "sbatch reads it as --signal"),
    ("--no-r", "sbatch reads it as --no-requeue"),
    ("--chd=/tmp", "sbatch reads it as --chdir"),
    ("--wait", "changes what sbatch does or prints"),
    ("--wai", "ambiguous: sbatch could read it as --wait, --wait-all-nodes"),
    ("--test-only", "changes what sbatch does or prints"),
    ("--test", "sbatch reads it as --test-only"),
    ("--parsable", "changes what sbatch does or prints"),
    ("--pars", "sbatch reads it as --parsable"),
    ("--quiet", "changes what sbatch does or prints"),
    ("--clusters=other", "another cluster"),
    ("--het-group=1", "--het-group cannot be added"),
    ("-N 2", "'-N 2' (-N is --nodes) cannot be added"),
    ("-n4", "-n is --ntasks"),
    ("-p x", "-p is --partition"),
    ("-W", "-W is --wait"),
    ("-x n1", "short option"),
])
def test_forbidden_options_cannot_sneak_in_abbreviated_or_short(tmp_path, option, words):
    with pytest.raises(SailorError) as err:
        _render(tmp_path, "het-mixed", extra_sbatch=[option])
    assert err.value.field == "--extra-sbatch" and words in err.value.message and err.value.fix, err.value


def test_abbreviated_allowed_option_is_written_under_its_full_name(tmp_path):
    script = _render(tmp_path, "a100-only", extra_sbatch=["--mail-t=END", "--exclusi"])
    assert _header(script)[0].count("--mail-type=END") == 1 and "--exclusive" in _header(script)[0]
    with pytest.raises(SailorError, match="write it as --exclude=VALUE"):
        _render(tmp_path, "a100-only", extra_sbatch=["-x n1"])


def test_cli_refuses_a_forbidden_option_with_exit_2(tmp_path):
    plan = write_plan(tmp_path, "het-mixed")
    res = CliRunner().invoke(main, ["sbatch", str(plan), "--site", str(LOCAL_LAB), "--dry-run",
                                    "--extra-sbatch", "--ntasks-per-n=2"])
    assert res.exit_code == 2
    assert "--extra-sbatch: --ntasks-per-n (sbatch reads it as --ntasks-per-node) cannot be added" in res.output
    assert "fix: change the plan" in res.output


# ---- the --load condition: a shell glob over $SAVE

def _load_block(script: str) -> str:
    """The script's lines from PLAN= to the end of the --load condition, plus a print of LAUNCH."""
    start = script.index("PLAN=")
    end = script.index("\nfi\n", start) + len("\nfi\n")
    return script[start:end] + 'printf "%s\\0" "${LAUNCH[@]}"\n'


@pytest.mark.parametrize("save_name, complete", [
    ("ckpt", True), ("ckpt", False),
    ("with space", True), ("with space", False),
    ("glob [1] *", True), ("glob [1] *", False),  # * [ ? in the path are literal, not a pattern
    ("ck*", False),  # a sibling's checkpoint (ck-other/) must not count as this job's
    ("ck?other", False),
])
def test_load_is_passed_only_while_save_has_no_complete_checkpoint(tmp_path, save_name, complete):
    root = tmp_path / "root dir"
    (root / "ck-other" / "step_5").mkdir(parents=True)
    (root / "ck-other" / "step_5" / "manifest.json").write_text("{}")
    save = root / save_name
    (save / "step_9").mkdir(parents=True, exist_ok=True)  # an unfinished checkpoint: no manifest yet
    if complete:
        (save / "step_3").mkdir()
        (save / "step_3" / "manifest.json").write_text("{}")
    script = _render(tmp_path, "het-mixed", dry_run=False, data="d", save=save, load=tmp_path / "old")
    proc = subprocess.run(["bash", "-c", "set -uo pipefail\n" + _load_block(script)], capture_output=True,
                          text=True, timeout=30, cwd=root)
    assert proc.returncode == 0, proc.stderr
    launch = proc.stdout.split("\0")[:-1]
    assert launch[launch.index("--save") + 1] == str(save)
    assert ("--load" in launch) is not complete, launch


def test_load_condition_with_an_empty_save_directory_and_none_at_all(tmp_path):
    for save in (tmp_path / "empty", tmp_path / "missing"):
        if save.name == "empty":
            save.mkdir()
        script = _render(tmp_path, "het-mixed", dry_run=False, data="d", save=save, load=tmp_path / "old")
        proc = subprocess.run(["bash", "-c", "set -uo pipefail\n" + _load_block(script)], capture_output=True,
                              text=True, timeout=30)
        assert proc.returncode == 0 and "--load" in proc.stdout.split("\0"), proc.stderr


# ---- the placed plan: next to the job script, named by its content

def test_placed_plan_goes_next_to_the_script_not_the_input(tmp_path):
    """A plan in a read-only directory (the shared Sailor data) can be rendered: nothing is written there."""
    shared, jobs = tmp_path / "shared", tmp_path / "jobs"
    shared.mkdir()
    plan = write_plan(shared, "unplaced")
    shared.chmod(0o555)
    try:
        res = CliRunner().invoke(main, ["sbatch", str(plan), "--site", str(LOCAL_LAB), "--data", "/d",
                                        "--skip-path-check", "--save", str(jobs / "ckpt"), "-o", str(jobs / "train.sh")])
        assert res.exit_code == 0, res.output
        assert sorted(p.name for p in shared.iterdir()) == ["unplaced.json"]
    finally:
        shared.chmod(0o755)
    placed = _placed_files(jobs)
    assert len(placed) == 1 and f"placed plan written to {placed[0]}" in res.output
    script = (jobs / "train.sh").read_text()
    assert f"\nPLAN={placed[0]}\n" in script and f"--chdir={jobs.absolute()}" in script
    assert f"SAVE={(jobs / 'ckpt').absolute()}" in script


def test_default_checkpoints_stay_next_to_the_plan_whatever_the_script_path(tmp_path):
    """Re-rendering a running training's job elsewhere (another -o) must not move its checkpoints: the
    job would auto-resume from an empty directory and silently start again at step 0."""
    plan = write_plan(tmp_path, "unplaced")
    saves = set()
    for out in (tmp_path / "jobs" / "a.sh", tmp_path / "other" / "b.sh"):
        res = CliRunner().invoke(main, ["sbatch", str(plan), "--site", str(LOCAL_LAB), "--data", "/d", "-o", str(out),
                                        "--skip-path-check"])
        assert res.exit_code == 0, res.output
        saves |= {line for line in out.read_text().splitlines() if line.startswith("SAVE=")}
    assert saves == {f"SAVE={(tmp_path / 'unplaced-ckpt').absolute()}"}


def test_renders_for_other_sites_or_plans_do_not_replace_a_queued_jobs_plan(tmp_path):
    jobs = tmp_path / "jobs"
    plan = write_plan(tmp_path, "unplaced")
    runner = CliRunner()
    assert runner.invoke(main, ["sbatch", str(plan), "--site", str(LOCAL_LAB), "--dry-run",
                                "-o", str(jobs / "a.sh")]).exit_code == 0
    (first,) = _placed_files(jobs)
    queued = first.read_text()
    doc = tomllib.loads(LOCAL_LAB.read_text())  # another site: v100 nodes have 4 GPUs, so the placement differs
    doc["partitions"][1]["gpus_per_node"] = 4
    other_site = tmp_path / "other.toml"
    other_site.write_text(dump_toml(doc))
    res = runner.invoke(main, ["sbatch", str(plan), "--site", str(other_site), "--dry-run", "-o", str(jobs / "b.sh")])
    assert res.exit_code == 0, res.output
    placed = _placed_files(jobs)
    assert len(placed) == 2 and first.read_text() == queued
    assert f"PLAN={first}\n" in (jobs / "a.sh").read_text() and f"PLAN={first}\n" not in (jobs / "b.sh").read_text()


# ---- hints name options that exist; directories are checked before anything is written

def test_missing_data_hint_offers_dry_run_only_where_the_command_has_it(tmp_path):
    runner = CliRunner()
    ctx = click.Context(main)
    assert "--dry-run" not in {o for p in main.get_command(ctx, "plan").params for o in p.opts}
    res = runner.invoke(main, ["plan", "--site", str(LOCAL_LAB), "--model", "tiny-gpt", "--sbatch",
                               str(tmp_path / "job.sh")])
    assert res.exit_code == 2 and "--data" in res.output and "--dry-run" not in res.output, res.output
    assert "--dry-run" in {o for p in main.get_command(ctx, "sbatch").params for o in p.opts}
    res = runner.invoke(main, ["sbatch", str(write_plan(tmp_path, "het-mixed")), "--site", str(LOCAL_LAB)])
    assert res.exit_code == 2 and "or --dry-run" in res.output


def test_log_dir_is_checked_before_anything_is_written(tmp_path):
    plan = write_plan(tmp_path, "unplaced")
    (tmp_path / "a-file").write_text("")
    res = CliRunner().invoke(main, ["sbatch", str(plan), "--site", str(LOCAL_LAB), "--dry-run",
                                    "--log-dir", str(tmp_path / "a-file" / "logs"), "-o", str(tmp_path / "job.sh")])
    assert res.exit_code == 2 and "--log-dir" in res.output and "is not a directory" in res.output, res.output
    assert not (tmp_path / "job.sh").exists() and not _placed_files(tmp_path)
    # a log directory that does not exist yet is created with the job files (Slurm would not create it)
    logs = tmp_path / "new" / "logs"
    res = CliRunner().invoke(main, ["sbatch", str(plan), "--site", str(LOCAL_LAB), "--dry-run",
                                    "--log-dir", str(logs), "-o", str(tmp_path / "job.sh")])
    assert res.exit_code == 0 and logs.is_dir() and f"--output={logs}/%x-%j.out" in (tmp_path / "job.sh").read_text()


def test_unwritable_log_dir_is_refused(tmp_path):
    """Root may write into read-only directories, so under root (CI) the CLI runs without the
    capabilities that let it (setpriv drops them from its bounding set): as any user would."""
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    plan = write_plan(tmp_path, "het-mixed")
    argv = [sys.executable, "-c", "from sailor_hpc.cli import main; main(prog_name='sailor-hpc')",
            "sbatch", str(plan), "--site", str(LOCAL_LAB), "--dry-run", "--log-dir", str(ro / "logs")]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            slurm_missing("root writes into read-only directories, and setpriv (util-linux) is missing to stop it")
        argv = [setpriv, "--bounding-set", "-dac_override,-dac_read_search", "--", *argv]
    res = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--log-dir" in res.stderr and "cannot be created" in res.stderr, res.stderr
    assert not (ro / "logs").exists() and not _placed_files(tmp_path)


@pytest.mark.parametrize("make, words", [
    (lambda d: d / "logs-%u", "Slurm expands"),  # Slurm would expand it in --output: logs to a missing dir
    (lambda d: (d / "link").symlink_to(d / "nowhere") or d / "link", "broken symbolic link"),
])
def test_log_dirs_slurm_cannot_use_are_refused_and_leave_nothing(tmp_path, make, words):
    plan = write_plan(tmp_path, "unplaced")
    log_dir = make(tmp_path)
    res = CliRunner().invoke(main, ["sbatch", str(plan), "--site", str(LOCAL_LAB), "--dry-run",
                                    "--log-dir", str(log_dir), "-o", str(tmp_path / "job.sh")])
    assert res.exit_code == 2 and "--log-dir" in res.output and words in res.output, res.output
    assert not (tmp_path / "job.sh").exists() and not _placed_files(tmp_path) and not (tmp_path / "logs-%u").exists()


# ---- in place: training as a loop of srun steps that a re-plan on the surviving nodes continues

def test_in_place_job_runs_steps_until_the_replanner_ends_it(tmp_path):
    """The loop as bash runs it, with stand-ins for srun (a lost node, then done) and for the re-planner
    (it writes the next step's plan and options, as sailor_hpc.controller.inplace does)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/bash\nprintf "%s\\n" "$*" >> {calls}\n'
                                  f'[ $(wc -l < {calls}) -ge 3 ] && exit 0 || exit 137\n')
    (bin_dir / "py").write_text(f'#!/bin/bash\nprintf "inplace %s\\n" "$*" >> {calls}\n'
                                 'while [ "$1" != --job-plan ]; do shift; done; jp=$2; while [ "$1" != --step ]; do shift; done\n'
                                 "printf \"PLAN=%s\\nSTEP_COMPONENTS=('--het-group=1 -N 1 -n 2 --nodelist=v100-1')\\n\" "
                                 '"${jp%.json}.new.json" > "${jp%.json}.step-$2.env"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    script = _render(tmp_path, "het-mixed", dry_run=False, data="d", save="s", python="py", time="00:20:00",
                     time_min="00:05:00", in_place=tmp_path / "run")
    comps = _header(script)
    assert "--no-kill" in comps[0] and "--time-min=00:05:00" in comps[0]
    loop = script[script.index("JOB_PLAN=$PLAN"):script.index("\ndone\n") + len("\ndone\n")]
    block = script[script.index("PLAN="):script.index("\necho ")]
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-c", f"set -u\n{block}\n{loop}\necho rc=$rc"], capture_output=True, text=True,
                          env=env, timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("rc=0"), proc.stderr
    first, replan, second = calls.read_text().splitlines()
    plan = str((tmp_path / "het-mixed.json").absolute())
    assert first.count("--het-group=") == 3 and first.count(f"--plan {plan}") == 6  # 3 components x 2
    assert replan.startswith("inplace -m sailor_hpc.controller.inplace") and "--rc 137" in replan and "--step 1" in replan
    new = plan[:-len(".json")] + ".new.json"
    assert second.startswith("--het-group=1 -N 1 -n 2 --nodelist=v100-1 --wait=120 --distribution=block")
    assert " : " not in second and second.count(f"--plan {new}") == 2 and plan + " " not in second


def test_time_min_is_rendered_and_one_longer_than_the_limit_is_refused(tmp_path):
    with pytest.raises(SailorError, match="--time-min"):
        _render(tmp_path, "het-mixed", time="00:10:00", time_min="00:20:00")
    plan = write_plan(tmp_path, "het-mixed")
    args = ["sbatch", str(plan), "--site", str(LOCAL_LAB), "--dry-run", "--time", "00:10:00", "-o", str(tmp_path / "j.sh")]
    res = CliRunner().invoke(main, [*args, "--time-min", "5"])
    assert res.exit_code == 0 and "--time-min=00:05:00" in _header((tmp_path / "j.sh").read_text())[0], res.output
    res = CliRunner().invoke(main, [*args, "--time-min", "00:20:00"])
    assert res.exit_code == 2 and "--time-min" in res.output


# ---- what the job will read is checked before anything is written or submitted

def _dataset(prefix: Path) -> Path:
    """The two files of an indexed dataset (their contents are the runtime's business, not the renderer's)."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    for suffix in (".bin", ".idx"):
        Path(f"{prefix}{suffix}").write_bytes(b"x")
    return prefix


@pytest.mark.parametrize("case", ["missing_prefix", "missing_blend_prefix", "save_under_a_file", "missing_load"])
def test_sbatch_and_plan_refuse_paths_the_job_could_not_read(tmp_path, case):
    data = str(_dataset(tmp_path / "data" / "web"))
    save, load, named, field = str(tmp_path / "ckpt"), None, "", "--data"
    if case == "missing_prefix":
        data, named = str(tmp_path / "data" / "wbe"), f"{tmp_path / 'data' / 'wbe'}: --data: no indexed dataset"
    elif case == "missing_blend_prefix":
        data, named = f"0.7 {data} 0.3 {tmp_path / 'code'}", f"{tmp_path / 'code'}: --data: no indexed dataset"
    elif case == "save_under_a_file":
        (tmp_path / "afile").write_text("")
        save, named, field = str(tmp_path / "afile" / "ckpt"), str(tmp_path / "afile"), "--save"
    else:
        load, named, field = str(tmp_path / "no-such-ckpt"), str(tmp_path / "no-such-ckpt"), "--load"
    out = tmp_path / "jobs" / "train.sh"
    args = ["sbatch", str(write_plan(tmp_path, "unplaced")), "--site", str(LOCAL_LAB), "--data", data, "--save", save,
            "-o", str(out), *(["--load", load] if load else [])]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and named in res.output and field in res.output, res.output
    assert "--skip-path-check" in res.output  # the way out for paths only the compute nodes see
    assert not out.exists() and not (tmp_path / "jobs").exists()  # no script, no placed plan
    res = CliRunner().invoke(main, [*args, "--skip-path-check"])
    assert res.exit_code == 0, res.output
    launch = _bash_argv(out.read_text(), "LAUNCH")
    assert launch[launch.index("--data") + 1:launch.index("--data") + 1 + len(data.split())] == data.split()
    if load is None:
        return
    sbatch = tmp_path / "p.sbatch"
    res = CliRunner().invoke(main, ["plan", "--site", str(LOCAL_LAB), "--model", "OPT-350M", "--gbs", "32",
                                    "--sbatch", str(sbatch), "--data", str(tmp_path / "nothing"), "--save", save])
    assert res.exit_code == 2 and "nothing.bin" in res.output and not sbatch.exists()


def test_checked_paths_go_into_the_job_absolute(tmp_path, monkeypatch):
    """The job starts elsewhere (its work directory, another machine): relative paths are made absolute
    against the directory they were checked in."""
    monkeypatch.chdir(tmp_path)
    _dataset(tmp_path / "data" / "web")
    out = tmp_path / "train.sh"
    res = CliRunner().invoke(main, ["sbatch", str(write_plan(tmp_path, "unplaced")), "--site", str(LOCAL_LAB),
                                    "--data", "data/web", "--save", "ck", "-o", str(out)])
    assert res.exit_code == 0, res.output
    launch = _bash_argv(out.read_text(), "LAUNCH")
    assert launch[launch.index("--data") + 1] == str(tmp_path / "data" / "web")
    assert f"SAVE={tmp_path / 'ck'}" in out.read_text()


@pytest.mark.parametrize("build, field", [
    (lambda p: JobOptions(plan_path=p, work=Training(None, "s")), "--data"),  # type: ignore[arg-type]
    (lambda p: JobOptions(plan_path=p, work=Training("d", "")), "--save"),
    (lambda p: JobOptions(plan_path=p, work=DryRun(), steps=0), "--steps"),
    (lambda p: JobOptions(plan_path=p, work=DryRun(), runtime="torchrun"), "--runtime"),
    (lambda p: JobOptions(plan_path=p, work=DryRun(), limits=Limits("00:10:00", time_min="00:20:00")), "--time-min"),
    (lambda p: JobOptions(plan_path=p, work=DryRun(), limits=Limits("00:10:00", signal_grace_s=600)),
     "--signal-grace"),
    (lambda p: JobOptions(plan_path=p, work=DryRun(), limits=Limits("soon")), "--time"),
    (lambda p: JobOptions(plan_path=p, work=DryRun(), scope=ClusterPart("c1", "/shared/rdzv")), "requeue"),
    (lambda p: JobOptions(plan_path=p, work=DryRun(), scope=ClusterPart("c1", rendezvous_wait_s=0)),
     "rendezvous_wait_s"),
    (lambda p: JobOptions(plan_path=p, work="train"), "work"),  # type: ignore[arg-type]
    (lambda p: JobOptions(plan_path=p, work=UserEntry("t.py", "c.json")), "--entry"),  # needs runtime deepspeed
    (lambda p: JobOptions(plan_path=p, work=UserEntry("t.py", "c.json"), runtime="deepspeed", train_args=("--x",)),
     "--train-arg"),
    (lambda p: JobOptions(plan_path=p, work=UserEntry("t.py", "c.json"), runtime="deepspeed", scope=InPlace("run")),
     "scope"),
])
def test_job_options_refuse_a_bad_combination_on_construction(tmp_path, build, field):
    """Checked once, when the CLI or the controller builds the value: before any search or file write."""
    with pytest.raises(SailorError) as err:
        build(tmp_path / "p.json")
    assert err.value.field == field, err.value


def test_job_options_are_one_comparable_value(tmp_path):
    """Lists become tuples: two builds of the same job compare equal (the controller may re-render)."""
    a = JobOptions(plan_path=tmp_path / "p.json", work=Training("d", "s"), train_args=["--lr", "1e-4"],
                   extra_sbatch=["--comment=x"])
    b = JobOptions(plan_path=tmp_path / "p.json", work=Training("d", "s"), train_args=("--lr", "1e-4"),
                   extra_sbatch=("--comment=x",))
    assert a == b and hash(a.train_args) == hash(b.train_args) and not a.dry_run
    assert a.launch_module == "megatron_patch.launch"
