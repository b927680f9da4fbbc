"""`sbatch`/`submit --runtime deepspeed --entry SCRIPT -- ARGS`: a user's own DeepSpeed script under the plan's
allocation and ds_config.json. Rendered and refused here; run for real on the local Slurm cluster, where a
tiny script calls ``deepspeed.initialize`` on the config and reports what it saw."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sailor_hpc.core.ds_config import batch_fields
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.roles import rank_roles
from sailor_hpc.core.site import load_site
from sailor_hpc.jobs.options import JobOptions, UserEntry
from sailor_hpc.jobs.render import render_job_script
from sailor_hpc.slurm.watch import JobWatcher
from tests.jobs.conftest import A100, LOCAL_LAB, V100, plan_doc, stage, write_plan

SCRIPT = Path(__file__).with_name("user_entry_script.py")
ZERO = 1
# two replicas of one stage, one on each partition (a het job), TP 1: DeepSpeed's plain engine, ZeRO 1
DOC = {**plan_doc([(2, 2, [stage(0, 5, 1, A100, "a100", 0, [0])]), (2, 2, [stage(0, 5, 1, V100, "v100", 0, [0])])]),
       "notes": {"deepspeed": {"zero_stage": ZERO}}}
NASTY = "a b; $(touch pwned)"  # one argument of the user's, quoted all the way to the script


def _sailor(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from sailor_hpc.cli import main; main(prog_name='sailor-hpc')",
                           *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def _sbatch(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    plan = write_plan(tmp_path, "ds", copy.deepcopy(DOC))
    return _sailor("sbatch", str(plan), "--site", str(LOCAL_LAB), "-o", str(tmp_path / "job.sh"), *extra)


def _launch_words(script: str) -> list[str]:
    """The words of the task command, as the job's bash builds them."""
    block = "\n".join(line for line in script.splitlines() if line.startswith(("PLAN=", "export SAILOR", "LAUNCH=")))
    proc = subprocess.run(["bash", "-c", f"set -u\n{block}\nprintf '%s\\0' \"${{LAUNCH[@]}}\""], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("\0")[:-1]


def test_the_job_starts_the_users_script_with_the_plans_config(tmp_path: Path) -> None:
    res = _sbatch(tmp_path, "--runtime", "deepspeed", "--entry", str(SCRIPT), "--lr", "1e-3", "--", "--tag", NASTY)
    assert res.returncode == 0, res.stderr
    script = (tmp_path / "job.sh").read_text()
    configs = list(tmp_path.glob("ds.*.ds_config.json"))
    assert len(configs) == 1, res.stderr
    config = json.loads(configs[0].read_text())
    plan = load_plan(tmp_path / "ds.json")
    assert {k: config[k] for k in batch_fields(plan)} == {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                                                          "gradient_accumulation_steps": 2}
    assert config["zero_optimization"]["stage"] == ZERO and config["optimizer"]["params"]["lr"] == 1e-3
    words = _launch_words(script)
    assert words[1:] == [str(SCRIPT), "--deepspeed_config", str(configs[0]), "--tag", NASTY]
    assert "megatron_patch" not in script.split("PLAN=")[1] and "#SBATCH hetjob" in script


@pytest.mark.parametrize("extra, field", [
    (("--entry", str(SCRIPT)), "--entry"),  # megatron_patch's runtime has no ds_config
    (("--runtime", "deepspeed", "--entry", str(SCRIPT), "--data", "d"), "--data"),
    (("--runtime", "deepspeed", "--entry", str(SCRIPT), "--dry-run"), "--dry-run"),
    (("--runtime", "deepspeed", "--entry", str(SCRIPT), "--train-arg", "--x"), "--train-arg"),
    (("--runtime", "deepspeed", "--entry", "missing.py"), "--entry"),
    (("--runtime", "deepspeed", "--", "--tag", "x"), "--entry"),  # a script's arguments without a script
    (("--runtime", "deepspeed", "--entry", str(SCRIPT), "--lr-decay-style", "cosine"), "--lr-decay-style"),
])
def test_refused_before_anything_is_written(tmp_path: Path, extra, field) -> None:
    res = _sbatch(tmp_path, *extra)
    assert res.returncode == 2 and field in res.stderr, res.stderr
    assert not (tmp_path / "job.sh").exists() and not list(tmp_path.glob("*.ds_config.json"))


def test_a_config_of_another_plan_is_refused(tmp_path: Path) -> None:
    site = load_site(LOCAL_LAB)
    path = write_plan(tmp_path, "ds", copy.deepcopy(DOC))
    plan = load_plan(path, site=site)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**batch_fields(plan), "train_batch_size": 16, "zero_optimization": {"stage": ZERO}}))
    options = JobOptions(plan_path=path, work=UserEntry(SCRIPT, other), runtime="deepspeed")
    with pytest.raises(SailorError) as err:
        render_job_script(plan, site, options)
    assert err.value.field == "train_batch_size" and err.value.file is not None


@pytest.mark.slurm
def test_users_script_runs_on_the_plans_allocation(slurm_cluster, job_env, job_dir) -> None:
    pytest.importorskip("deepspeed")
    plan_path = write_plan(job_dir, "ds", copy.deepcopy(DOC))
    out = job_dir / "seen"
    out.mkdir()
    res = slurm_cluster.run(["sailor-hpc", "submit", str(plan_path), "--site", str(LOCAL_LAB), "--runtime", "deepspeed",
                             "--entry", str(SCRIPT), "--time", "00:10:00", "--", "--out", str(out), "--tag", NASTY],
                            env=job_env)
    assert res.returncode == 0, res.stdout + res.stderr
    job = res.stdout.strip()
    watcher = JobWatcher(job_env, poll_s=0.5)
    watcher.add([job])
    status = watcher.wait(timeout_s=400).statuses[job]
    log = next(job_dir.glob(f"*-{job}.out"), None)
    assert status.state == "COMPLETED", (status, log.read_text()[-4000:] if log else "(no log)")

    plan = load_plan(plan_path)
    config_path = next(job_dir.glob("ds.*.ds_config.json"))
    config = json.loads(config_path.read_text())
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(plan.num_gpus)]
    node_part = {line.split()[0]: line.split()[1] for line in
                 slurm_cluster.run(["sinfo", "-h", "-N", "-o", "%N %R"], check=True).stdout.splitlines()}
    for rank, (rec, role) in enumerate(zip(seen, rank_roles(plan), strict=True)):
        assert rec["rank"] == rank and rec["world_size"] == plan.num_gpus and rec["local_rank"] == 0
        assert node_part[rec["node"]] == role.partition, (rec, role)  # each rank on its replica's partition
        # DeepSpeed read the plan's config: its batch split and ZeRO stage, data parallel over the replicas
        assert (rec["train_batch_size"], rec["micro_batch"], rec["accumulation"]) == (
            config["train_batch_size"], config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"])
        assert rec["zero_stage"] == ZERO and rec["dp_world_size"] == len(plan.pipelines)
        assert rec["rank_sum"] == sum(range(plan.num_gpus)) and rec["tag"] == NASTY
        assert rec["config"] == rec["env_config"] == str(config_path) and Path(rec["plan"]).name.startswith("ds")
    assert not (job_dir / "pwned").exists() and not (slurm_cluster.shared / "pwned").exists()
