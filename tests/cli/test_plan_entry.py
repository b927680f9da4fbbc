"""``plan --runtime deepspeed --sbatch JOB --entry SCRIPT -- ARGS``: the best plan's job runs the user's DeepSpeed script.

The reference is ``sbatch --entry`` (tests/jobs/test_user_entry.py runs its jobs on Slurm) rendering the plan
that ``plan`` wrote, with the same options: both must write the same config (same content, same name) and the
same script. Bad combinations exit 2 naming the option, before anything is written.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.controller.scenario import LOCAL_LAB
from tests.data.tiny_archive import write_tiny_archive
from tests.jobs.test_user_entry import NASTY, SCRIPT, _launch_words

TRAINING = ("--lr", "1e-3", "--steps", "40")


def _sailor(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from sailor_hpc.cli import main; main(prog_name='sailor-hpc')",
                           *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def _plan(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    archive = tmp_path / "tiny.h5"
    if not archive.exists():
        write_tiny_archive(archive)
    return _sailor("plan", "--site", str(LOCAL_LAB), "--profiles", str(archive), "--model", "tiny-gpt", "--gbs", "64",
                   "--max-gpus", "2", "--top", "1", *extra, cwd=tmp_path)


def test_plan_sbatch_entry_renders_what_sbatch_entry_renders(tmp_path: Path) -> None:
    (tmp_path / "plan").mkdir()
    (tmp_path / "ref").mkdir()
    res = _plan(tmp_path, "--runtime", "deepspeed", "--sbatch", "plan/job.sbatch", *TRAINING, "--entry", str(SCRIPT),
                "--", "--tag", NASTY)
    assert res.returncode == 0, res.stderr
    configs = list((tmp_path / "plan").glob("job.plan.*.ds_config.json"))
    assert len(configs) == 1, res.stdout
    config = json.loads(configs[0].read_text())
    plan = json.loads((tmp_path / "plan" / "job.plan.json").read_text())
    assert config["zero_optimization"]["stage"] == plan["notes"]["deepspeed"]["zero_stage"]
    assert config["optimizer"]["params"]["lr"] == 1e-3
    script = (tmp_path / "plan" / "job.sbatch").read_text()
    assert _launch_words(script)[1:] == [str(SCRIPT), "--deepspeed_config", str(configs[0]), "--tag", NASTY]
    # the reference: sbatch --entry on the plan `plan` wrote, its job directory beside it
    (tmp_path / "ref" / "job.plan.json").write_text((tmp_path / "plan" / "job.plan.json").read_text())
    ref = _sailor("sbatch", "ref/job.plan.json", "--site", str(LOCAL_LAB), "--runtime", "deepspeed", *TRAINING,
                  "--entry", str(SCRIPT), "-o", "ref/job.sbatch", "--", "--tag", NASTY, cwd=tmp_path)
    assert ref.returncode == 0, ref.stderr
    ref_configs = list((tmp_path / "ref").glob("job.plan.*.ds_config.json"))
    assert [c.name for c in ref_configs] == [configs[0].name]
    assert ref_configs[0].read_text() == configs[0].read_text()
    assert (tmp_path / "ref" / "job.sbatch").read_text() == script.replace(str(tmp_path / "plan"), str(tmp_path / "ref"))


@pytest.mark.parametrize("extra, field", [
    (("--sbatch", "job.sbatch", "--entry", str(SCRIPT)), "--entry"),  # megatron_patch has no ds_config
    (("--runtime", "deepspeed", "--entry", str(SCRIPT)), "--entry"),  # no job to run it in
    (("--runtime", "deepspeed", "--sbatch", "job.sbatch", "--entry", str(SCRIPT), "--data", "d"), "--data"),
    (("--runtime", "deepspeed", "--sbatch", "job.sbatch", "--entry", "missing.py"), "--entry"),
    (("--runtime", "deepspeed", "--sbatch", "job.sbatch", "--", "--tag", "x"), "--entry"),  # arguments, no script
    (("--runtime", "deepspeed", "--sbatch", "job.sbatch", "--entry", str(SCRIPT), "--lr-decay-style", "cosine"),
     "--lr-decay-style"),
])
def test_refused_before_anything_is_written(tmp_path: Path, extra, field) -> None:
    res = _plan(tmp_path, *extra)
    assert res.returncode == 2 and field in res.stderr, res.stderr
    assert not list(tmp_path.glob("job*")) and not list(tmp_path.glob("*.ds_config.json"))


def test_plan_validate_is_still_a_subcommand(tmp_path: Path) -> None:
    res = _plan(tmp_path, "-o", "best.json")
    assert res.returncode == 0, res.stderr
    assert _sailor("plan", "validate", "best.json", cwd=tmp_path).returncode == 0
