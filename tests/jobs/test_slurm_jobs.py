"""Rendered jobs on the real local Slurm cluster: --test-only, a het job whose ranks report their roles,
status / logs / cancel through the CLI, and the het-aware watcher (arrays, cancelled and lost jobs)."""
from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.roles import rank_roles
from sailor_hpc.core.site import load_site
from sailor_hpc.jobs.options import DryRun, JobOptions, Limits, Training
from sailor_hpc.jobs.render import placed_plan_file, render_job_script, write_job_script
from sailor_hpc.slurm.status import poll_jobs
from sailor_hpc.slurm.submit import check_script
from sailor_hpc.slurm.watch import JobWatcher
from tests.conftest import ranks_as_new_interpreters
from tests.jobs.conftest import LOCAL_LAB, PLANS, write_plan
from tests.slurm import ranks

pytestmark = pytest.mark.slurm


@pytest.fixture(autouse=True, scope="module")
def _ranks_as_new_interpreters(slurm_cluster) -> Iterator[None]:
    """This file's jobs start their ranks as a user's do (srun -> rank_env -> exec), not from the lab's fork
    server: the path every other Slurm test shortens."""
    with ranks_as_new_interpreters(slurm_cluster):
        yield


def _cli(cluster, env, *args, check=True, **kw):
    proc = cluster.run(["sailor-hpc", *args], env=env, **kw)
    if check:
        assert proc.returncode == 0, f"sailor-hpc {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return proc


def _wait_state(cluster, env, job: str, want: set[str], timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        state = json.loads(_cli(cluster, env, "status", job, "--json").stdout)["state"]
        if state in want:
            return state
        time.sleep(0.2)
    raise AssertionError(f"job {job} still {state} after {timeout} s")


@pytest.mark.parametrize("name", sorted(PLANS))
def test_rendered_scripts_pass_sbatch_test_only(slurm_cluster, job_env, job_dir, name):
    site = load_site(LOCAL_LAB)
    plan, plan_path = placed_plan_file(write_plan(job_dir, name), site)
    for dry in (True, False):
        options = JobOptions(plan_path=plan_path, work=DryRun() if dry else Training(job_dir / "data", job_dir / "ckpt"),
                             limits=Limits("00:30:00"), extra_sbatch=("--comment=sailor-test",))
        script = render_job_script(plan, site, options)
        path = write_job_script(job_dir / f"{name}-{dry}.sh", script)
        answer = check_script(path, job_env)
        assert "to start at" in answer and f"using {plan.num_gpus} processors" in answer, answer


def test_het_job_starts_every_rank_in_its_planned_role(slurm_cluster, job_env, job_dir):
    plan_path = write_plan(job_dir, "het-mixed")
    nasty = f"{job_dir}/x $(touch {job_dir}/pwned)"  # reaches the ranks as one quoted argument
    t0 = time.monotonic()
    job = _cli(slurm_cluster, job_env, "submit", str(plan_path), "--site", str(LOCAL_LAB), "--dry-run",
               "--data", nasty, "--time", "00:05:00").stdout.strip()
    watcher = JobWatcher(job_env, poll_s=0.1)
    watcher.add([job])
    started = None
    while started is None and time.monotonic() - t0 < 60:
        st = poll_jobs([job], job_env)[job]
        if st.state in ("RUNNING", "COMPLETED"):
            started = time.monotonic() - t0
        time.sleep(0.1)
    result = watcher.wait(timeout_s=90)
    finished = time.monotonic() - t0
    status = result.statuses[job]
    assert status.state == "COMPLETED", status
    print(f"\nhet job {job}: submit -> running {started:.2f} s, submit -> completed {finished:.2f} s")

    # squeue/sacct view through the CLI: three components (v100, a100 x3 ranks, a100 x1 rank)
    st = json.loads(_cli(slurm_cluster, job_env, "status", job, "--json").stdout)
    assert [(c["job_id"], c["partition"], c["state"]) for c in st["components"]] == [
        (f"{job}+0", "v100", "COMPLETED"), (f"{job}+1", "a100", "COMPLETED"), (f"{job}+2", "a100", "COMPLETED")]

    log = _cli(slurm_cluster, job_env, "logs", job, "--json").stdout
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    plan = load_plan(plan_path)
    roles = rank_roles(plan)
    assert sorted(r["rank"] for r in records) == list(range(plan.num_gpus)), log
    node_part = {line.split()[0]: line.split()[1] for line in
                 slurm_cluster.run(["sinfo", "-h", "-N", "-o", "%N %R"], check=True).stdout.splitlines()}
    hosts: dict[tuple[str, int], set[str]] = {}
    for rec in records:
        role = roles[rec["rank"]]
        assert (rec["pipeline"], rec["stage"], rec["tp_rank"], rec["layers"]) == (
            role.pipeline, role.stage, role.tp_rank, role.layers)
        assert rec["world_size"] == plan.num_gpus
        assert node_part[rec["host"]] == role.partition, (rec, role)  # each rank runs in its stage's partition
        hosts.setdefault((role.partition, role.node), set()).add(rec["host"])
    # ranks planned on one node share a Slurm node; different planned nodes got different Slurm nodes
    assert all(len(h) == 1 for h in hosts.values()), hosts
    assert len({next(iter(h)) for h in hosts.values()}) == len(hosts), hosts
    # LOCAL_RANK follows the planned GPU order on every node
    for key in hosts:
        on_node = sorted((roles[r["rank"]].local_gpu, r["local_rank"]) for r in records
                         if (roles[r["rank"]].partition, roles[r["rank"]].node) == key)
        assert [lr for _, lr in on_node] == list(range(len(on_node)))
    assert not (job_dir / "pwned").exists() and not (slurm_cluster.shared / "pwned").exists()


def test_cancelled_het_job_is_reported_not_waited_on(slurm_cluster, job_env, job_dir):
    plan_path = write_plan(job_dir, "het-mixed")
    job = _cli(slurm_cluster, job_env, "submit", str(plan_path), "--site", str(LOCAL_LAB), "--dry-run",
               "--extra-sbatch=--begin=now+1hour").stdout.strip()
    assert _wait_state(slurm_cluster, job_env, job, {"PENDING"}) == "PENDING"
    text = _cli(slurm_cluster, job_env, "status").stdout
    assert f"{job}+2" in text and "BeginTime" in text
    watcher = JobWatcher(job_env, poll_s=0.2)
    watcher.add([job])
    assert watcher.poll()[job].state == "PENDING"
    assert _cli(slurm_cluster, job_env, "cancel", job).stdout.strip() == f"cancelled {job}"
    t0 = time.monotonic()
    result = watcher.wait(timeout_s=30)
    assert result.statuses[job].state == "CANCELLED" and not result.timed_out
    assert time.monotonic() - t0 < 15
    assert {c.state for c in result.statuses[job].components} == {"CANCELLED"}
    assert len(result.statuses[job].components) == 3
    assert _cli(slurm_cluster, job_env, "logs", job, check=False).returncode == 2  # never ran: no log yet


def test_watcher_array_elements_and_lost_jobs(slurm_cluster, job_env, job_dir):
    job = slurm_cluster.sbatch(["-p", "v100", "--gres=gpu:v100:1", "-o", "/dev/null", "--array=0-2",
                                "--wrap", "exit $SLURM_ARRAY_TASK_ID"])
    watcher = JobWatcher(job_env, poll_s=0.2, lost_after_s=2.0)
    ids = [f"{job}_0", f"{job}", "999999"]
    watcher.add(ids)
    result = watcher.wait(timeout_s=60)
    st = result.statuses
    assert st[f"{job}_0"].state == "COMPLETED"
    assert st[f"{job}"].state == "FAILED"  # the array as a whole: elements 1 and 2 exited non-zero
    assert sorted(c.job_id for c in st[f"{job}"].components) == [f"{job}_0", f"{job}_1", f"{job}_2"]
    assert st["999999"].state == "LOST" and not result.timed_out
    # squeue notices the end first; sacct's rows (with exit codes) take over once accounting has them
    deadline, codes = time.monotonic() + 30, {}
    while time.monotonic() < deadline:
        codes = {c.job_id: c.exit_code for c in poll_jobs([job], job_env)[job].components}
        if all(codes.values()):
            break
        time.sleep(0.3)
    assert codes == {f"{job}_0": "0:0", f"{job}_1": "1:0", f"{job}_2": "2:0"}
    assert set(result.failed) == {f"{job}", "999999"}


def test_cli_refuses_bad_job_ids(slurm_cluster, job_env):
    for cmd in (["status", "1;ls"], ["cancel", "$(id)"], ["logs", "12 13"]):
        proc = _cli(slurm_cluster, job_env, *cmd, check=False)
        assert proc.returncode == 2 and "is not a Slurm job id" in proc.stderr, proc.stderr


def test_training_job_checkpoints_on_the_limit_signal_requeues_and_resumes(slurm_cluster, job_env, job_dir):
    """The time-limit path of the template, end to end on CPU ranks of both partitions: USR1 (what
    ``--signal=USR1@grace`` delivers before the limit) -> every rank saves and exits 75 -> the script
    requeues the job -> the requeued run resumes from the checkpoint (--auto-resume) and completes."""
    data = job_dir / "tok"
    built = slurm_cluster.run(["python", "-m", "megatron_patch.data", str(data)], env=job_env)
    assert built.returncode == 0, built.stderr
    plan = write_plan(job_dir, "two-stage", {
        "format": "sailor-hpc-plan", "version": 1, "model": "tiny-gpt", "global_batch_size": 4,
        "pipelines": [{"micro_batch_size": 1, "num_micro_batches": 4, "stages": [
            {"layers": [0, 2], "tp": 1, "gpu_type": "A100-40", "partition": "a100", "placement": {"node": 0, "gpus": [0]}},
            {"layers": [3, 5], "tp": 1, "gpu_type": "V100-16", "partition": "v100", "placement": {"node": 0, "gpus": [0]}}]}]})
    steps = 12
    job = _cli(slurm_cluster, job_env, "submit", str(plan), "--site", str(LOCAL_LAB), "--data", str(data),
               "--save", str(job_dir / "ckpt"), "--steps", str(steps), "--time", "00:10:00").stdout.strip()
    log = Path(_cli(slurm_cluster, job_env, "logs", job, "--path").stdout.strip())
    ranks.wait_in_log(log, '"event": "step"', timeout=90)
    ranks.pause(plan)  # the signal takes seconds to arrive: the run must not end before it does
    slurm_cluster.run(["scancel", "--signal=USR1", job], check=True)
    ranks.resume(plan, once_pending=signal.SIGUSR1)
    watcher = JobWatcher(job_env, poll_s=0.5)
    watcher.add([job])
    result = watcher.wait(timeout_s=150)
    text = log.read_text()
    assert result.statuses[job].state == "COMPLETED", text[-3000:]
    events = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    saved_on_signal = [e for e in events if e["event"] == "saved" and e["step"] < steps]
    assert len(saved_on_signal) == 2 and len({e["step"] for e in saved_on_signal}) == 1
    resumed = saved_on_signal[0]["step"]
    assert "Exited with exit code 75" in text and f"requeueing job {job}" in text and "restart 1:" in text
    loaded = [e for e in events if e["event"] == "loaded"]
    assert sorted(e["rank"] for e in loaded) == [0, 1] and {e["step"] for e in loaded} == {resumed}
    assert sorted((e["rank"], e["step"]) for e in events if e["event"] == "done") == [(0, steps), (1, steps)]
    show = slurm_cluster.run(["scontrol", "show", "job", job], check=True).stdout
    assert "Restarts=1" in show
