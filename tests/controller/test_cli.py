"""``sailor-hpc run`` refuses bad input with exit 2 and names the field; ``run status`` tells a run's story."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sailor_hpc.controller.journal import Journal
from sailor_hpc.controller.records import NodeLost, PlanChosen, RunStarted, SubmitIntent, Submitted
from sailor_hpc.controller.spec import RunSpec
from sailor_hpc.controller.state import RunDir, job_name
from tests.controller.scenario import LOCAL_LAB, REPO
from tests.data.tiny_archive import write_tiny_archive


def cli(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "sailor-hpc"
    return subprocess.run([str(exe), *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_archive(tmp_path_factory.mktemp("tiny") / "tiny.h5")


def base_args(tmp_path: Path, archive: Path) -> list[str]:
    return ["run", "--site", str(LOCAL_LAB), "--profiles", str(archive), "--model", "tiny-gpt", "--gbs", "64",
            "--data", str(tmp_path / "nodata"), "--save", str(tmp_path / "ckpt")]


@pytest.mark.parametrize("extra,field", [
    ([], "--data"),  # the dataset files do not exist
    (["--train-arg=--steps=3"], "--train-arg"),
    (["--min-gain", "lots"], "--min-gain"),
    (["--time", "2-00:00:00"], "--time"),  # every partition of the lab allows at most a day
    (["--time", "soon"], "--time"),
])
def test_bad_input_exits_2_naming_the_field(tmp_path: Path, archive: Path, extra: list[str], field: str):
    for suffix in ((".bin", ".idx") if field != "--data" else ()):
        (tmp_path / f"nodata{suffix}").write_bytes(b"")
    proc = cli(*base_args(tmp_path, archive), *extra)
    assert proc.returncode == 2 and field in proc.stderr, proc.stderr
    assert not (tmp_path / "ckpt" / "controller" / "journal.jsonl").exists()


def test_resume_refuses_run_options_and_non_run_dirs(tmp_path: Path):
    proc = cli("run", "--resume", str(tmp_path), "--steps", "5")
    assert proc.returncode == 2 and "--resume takes no run options" in proc.stderr
    proc = cli("run", "--resume", str(tmp_path))
    assert proc.returncode == 2 and "not a run directory" in proc.stderr


def _fake_run(tmp_path: Path, archive: Path) -> RunDir:
    spec = RunSpec.of(run_id="feed01", site=str(LOCAL_LAB), model="tiny-gpt", objective="throughput",
                   data=str(tmp_path / "d"), save=str(tmp_path / "ckpt"), steps=60, gbs=64, profiles=str(archive))
    rd = RunDir.create(tmp_path / "run", spec)
    t = iter(range(100, 200))
    j = Journal(rd.journal_file, clock=lambda: float(next(t)))
    j.append(RunStarted(run_id="feed01"))
    j.append(PlanChosen(reason="start", available={"a100": 1, "v100": 8}, gpus={"a100": 1, "v100": 1},
             throughput=26.39, cost_per_hour=1.5))
    j.append(SubmitIntent(attempt=1, job_name=job_name("feed01", 1), plan_file="p", script="s", reason="start",
             gpus={"a100": 1, "v100": 1}, throughput=26.39, cost_per_hour=1.5))
    j.append(Submitted(attempt=1, job_id="13", log="/l"))
    j.append(NodeLost(attempt=1, job_id="13", nodes={"a100-1": "down"}))
    return rd


def test_status_shows_the_history(tmp_path: Path, archive: Path):
    rd = _fake_run(tmp_path, archive)
    proc = cli("run", "status", str(rd.path))
    assert proc.returncode == 0, proc.stderr
    assert "run feed01" in proc.stdout and "its controller is not running (interrupted or killed): --resume" in proc.stdout
    assert "node(s) of the job lost: a100-1 down" in proc.stdout and "1 a100+1 v100" in proc.stdout
    data = json.loads(cli("run", "status", str(rd.path), "--json").stdout)
    assert data["attempts"][0]["job"] == "13" and [r["kind"] for r in data["records"]][-1] == "node_lost"
    # `sailor-hpc status RUN_DIR` is the same history
    plain = cli("status", str(rd.path))
    assert plain.returncode == 0 and plain.stdout == proc.stdout


def test_a_second_controller_is_refused(tmp_path: Path, archive: Path):
    rd = _fake_run(tmp_path, archive)
    code = ("import sys, time; from sailor_hpc.controller.state import RunDir\n"
            "with RunDir(sys.argv[1]).lock():\n    print('locked', flush=True); time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(rd.path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = rd.journal_file.read_text()
        proc = cli("run", "--resume", str(rd.path))
        assert proc.returncode == 2 and "another controller is running this run" in proc.stderr, proc.stderr
        assert rd.journal_file.read_text() == before  # it wrote nothing
    finally:
        holder.kill()
        holder.wait()


def test_replans_only_on_partitions_that_admit_the_time_limit(archive: Path):
    """A re-plan onto a partition whose maximum is below the run's --time would be refused by Slurm."""
    from dataclasses import replace

    from sailor_hpc.controller.planning import partitions_for_time, plan_on
    from sailor_hpc.core.archive import open_archive
    from sailor_hpc.core.site import load_site

    lab = load_site(LOCAL_LAB)
    short_a100 = replace(lab, partitions=tuple(replace(p, max_walltime="12:00:00") if p.name == "a100" else p
                                               for p in lab.partitions))
    assert partitions_for_time("1-00:00:00", short_a100) == {"v100"}
    assert partitions_for_time("12:00:00", short_a100) == {"a100", "v100"}
    assert partitions_for_time(None, short_a100) == {"a100", "v100"}
    spec = RunSpec.of(run_id="r1", site=str(LOCAL_LAB), model="tiny-gpt", objective="throughput", data="/d", save="/s",
                   steps=10, gbs=64, profiles=str(archive), time_limit="1-00:00:00")
    free = {"a100": {"a100-1": 4, "a100-2": 4}, "v100": {"v100-1": 8, "v100-2": 8}}
    arch = open_archive(str(archive), short_a100)
    assert set(plan_on(spec, short_a100, arch, free).summary()["gpus"]) == {"v100"}
    assert "a100" in plan_on(spec.changed(time_limit="12:00:00"), short_a100, arch, free).summary()["gpus"]


def test_a_site_of_several_clusters_without_slurm_is_refused_before_anything_is_written(tmp_path: Path,
                                                                                       archive: Path):
    """``sailor-hpc run`` on two clusters, where no Slurm command can be found (an empty PATH): the pre-queue check
    refuses it at once, naming the missing command, with exit 2, and writes no run directory."""
    from sailor_hpc.core.toml_writer import dump_toml
    from tests.jobs.conftest import two_lab_doc

    site = tmp_path / "two.toml"
    site.write_text(dump_toml(two_lab_doc(tmp_path / "lab", tmp_path / "lab2")))
    for suffix in (".bin", ".idx"):
        (tmp_path / f"nodata{suffix}").write_bytes(b"")
    args = base_args(tmp_path, archive)
    args[args.index(str(LOCAL_LAB))] = str(site)
    proc = cli(*args, "--max-restarts", "0", env={**os.environ, "PATH": ""})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "not found" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "ckpt" / "controller").exists()
