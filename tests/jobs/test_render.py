"""Rendering job scripts: components, site settings, time limits, and refusal/quoting of hostile input."""
from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from sailor_hpc.cli import main
from sailor_hpc.errors import SailorError
from sailor_hpc.jobs.render import placed_plan_file, render_job_script
from sailor_hpc.plan import load_plan
from sailor_hpc.site import load_site, load_site_dict
from tests.jobs.conftest import LOCAL_LAB, write_plan


def _render(tmp_path: Path, name: str, site=None, **kw) -> str:
    site = site or load_site(LOCAL_LAB)
    path = write_plan(tmp_path, name)
    plan = load_plan(path, site=site)
    kw.setdefault("dry_run", True)
    return render_job_script(plan, site, plan_path=path, **kw)


def _header(script: str) -> list[list[str]]:
    """The #SBATCH options of each het component (job-wide options land in the first)."""
    comps: list[list[str]] = [[]]
    for line in script.splitlines():
        if line.strip() == "#SBATCH hetjob":
            comps.append([])
        elif line.startswith("#SBATCH "):
            comps[-1].append(line[len("#SBATCH "):])
    return comps


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
    assert task[:6] == ["python", "-m", "sailor_hpc.jobs.rank_env", "--plan", plan_path, "--"]
    assert task[6:] == ["python", "-m", "megatron_patch.launch", "--plan", plan_path, "--model", "tiny-gpt",
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
    assert 'compgen -G "$SAVE/step_*/manifest.json"' in script and f"LAUNCH+=(--load {tmp_path / 'old'})" in script
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
    assert "--mail-type=END" in _header(script)[0]
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
    ({"python": "python; touch sailor-pwned"}, "--python"),
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
    script = _render(tmp_path, "het-mixed", dry_run=False, data=nasty[0], save=nasty[1], load=nasty[2],
                     train_args=[nasty[3], f"; touch {CANARY}"])
    launch = _bash_argv(script, "LAUNCH")
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
        render_job_script(plan, site, plan_path=other, dry_run=True)
    with pytest.raises(SailorError, match="does not exist"):
        render_job_script(plan, site, plan_path=tmp_path / "missing.json", dry_run=True)


def test_unplaced_plan_gets_a_placed_copy(tmp_path):
    site = load_site(LOCAL_LAB)
    path = write_plan(tmp_path, "unplaced")
    plan, placed = placed_plan_file(path, site)
    assert placed == (tmp_path / "unplaced.placed.json").absolute()
    assert load_plan(placed, site=site) == plan
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
    assert f"\nPLAN={(tmp_path / 'unplaced.placed.json').absolute()}\n" in out.read_text()
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
    assert not (tmp_path / "unplaced.placed.json").exists()
