"""Ranks in the site's container: the command lines every job kind renders (training, profiling, the network
benchmark, the node probe), checked word by word against each runtime's documented syntax, as bash builds
them from the rendered scripts.

The documented forms (the runtimes' manuals):
- ``apptainer exec [--nv] [--bind src:dst]... [--pwd dir] IMAGE COMMAND...`` (``singularity exec`` the same);
- pyxis adds options to ``srun``: ``--container-image=IMAGE --container-mounts=SRC:DST[,SRC:DST...]
  --container-workdir=DIR``;
- ``ch-run [-b SRC[:DST]]... [-c DIR] IMAGE -- COMMAND...`` (long forms ``--bind=``, ``--cd=``).
"""
from __future__ import annotations

import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from profiler.executors import Allocation, JobSettings, make_executor
from profiler.jobs import NetworkTask, _step_options
from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.site import Site, load_site_dict
from sailor_hpc.jobs.render import render_job_script
from sailor_hpc.slurm.container import path_inside, rank_wrapper
from tests.jobs.conftest import LOCAL_LAB, job_options, write_plan
from tests.jobs.test_render import _bash_argv

MOUNTS = ["/scratch:/scratch", "/users/me/venv:/opt/venv"]


def site_with(runtime: str | None, image: str = "") -> Site:
    doc: dict[str, Any] = tomllib.loads(LOCAL_LAB.read_text())
    if runtime is not None:
        doc["environment"]["container"] = {"runtime": runtime, "image": image, "mounts": MOUNTS}
    return load_site_dict(doc, source=LOCAL_LAB)


@pytest.fixture()
def images(tmp_path: Path) -> dict[str, str]:
    sif, folder = tmp_path / "torch.sif", tmp_path / "torch-image"
    sif.write_bytes(b"SIF")
    folder.mkdir()
    return {"apptainer": str(sif), "singularity": "docker://nvcr.io/nvidia/pytorch:24.05-py3",
            "pyxis": "nvcr.io#nvidia/pytorch:24.05-py3", "charliecloud": str(folder)}


def documented(runtime: str, image: str, workdir: str | None) -> tuple[list[str], list[str]]:
    """(srun options, words before the command) as each runtime's manual writes them."""
    if runtime in ("apptainer", "singularity"):
        return [], [runtime, "exec", "--nv", "--bind=/scratch:/scratch", "--bind=/users/me/venv:/opt/venv",
                    *([f"--pwd={workdir}"] if workdir else []), image]
    if runtime == "pyxis":
        return [f"--container-image={image}", "--container-mounts=/scratch:/scratch,/users/me/venv:/opt/venv",
                *([f"--container-workdir={workdir}"] if workdir else [])], []
    return [], ["ch-run", "--bind=/scratch:/scratch", "--bind=/users/me/venv:/opt/venv",
                *([f"--cd={workdir}"] if workdir else []), image, "--"]


RUNTIMES = ("apptainer", "singularity", "pyxis", "charliecloud")


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_wrapper_is_each_runtimes_documented_command_line(runtime: str, images: dict[str, str]) -> None:
    site = site_with(runtime, images[runtime])
    for workdir in ("/scratch/run", None):
        w = rank_wrapper(site.container, workdir)
        assert (list(w.srun_options), list(w.prefix)) == documented(runtime, images[runtime], workdir)
        assert w.command(["python", "-V"]) == [*documented(runtime, images[runtime], workdir)[1], "python", "-V"]
    bare = rank_wrapper(None, "/x")
    assert bare.srun_options == () and bare.command(["python"]) == ["python"] and bare.shell_prefix == ""


def _srun_argv(script: str) -> list[list[str]]:
    """The argument lists of every ``srun`` the script's training part runs, as bash builds them (``srun``
    replaced by a function that prints its arguments; in place: the first step, which then ends)."""
    start = script.index("PLAN=")
    end = script.index("\ndone", start) + len("\ndone") if "while :; do" in script else script.index("\nrc=$?", start)
    block = "\n".join(line for line in script[start:end].splitlines() if not line.startswith(("if ", "fi", "#")))
    stub = "srun() { printf '%s\\0' \"$@\"; printf '\\n'; }\nscontrol() { :; }\n"
    setup = "set -u\nexport SLURM_JOB_ID=7 MASTER_ADDR=n1 MASTER_PORT=1\n"
    proc = subprocess.run(["bash", "-c", f"{setup}{stub}{block}\n"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return [line.split("\0")[:-1] for line in proc.stdout.splitlines() if "\0" in line]


def _components(argv: list[str]) -> list[list[str]]:
    out: list[list[str]] = [[]]
    for w in argv:
        if w == ":":
            out.append([])
        else:
            out[-1].append(w)
    return out


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("in_place", [False, True])
def test_training_ranks_start_in_the_container_and_the_script_outside(runtime: str, in_place: bool,
                                                                      images: dict[str, str], tmp_path: Path) -> None:
    site = site_with(runtime, images[runtime])
    path = write_plan(tmp_path, "het-mixed")
    plan = load_plan(path, site=site)
    python = "/opt/venv/bin/python"  # the image's interpreter: not on this machine
    script = render_job_script(plan, site, job_options(path, python=python, in_place=tmp_path / "run" if in_place else None))
    srun_opts, prefix = documented(runtime, images[runtime], str(tmp_path))
    task = _bash_argv(script, "TASK")
    assert task[:len(prefix) + 3] == [*prefix, python, "-m", "sailor_hpc.jobs.rank_env"]
    [srun] = _srun_argv(script)
    comps = _components(srun)
    assert len(comps) == 3  # one per het component, each with the container's srun options and the wrapped task
    for comp in comps:
        opts, cmd = comp[:-len(task)], comp[-len(task):]
        assert cmd == task
        assert [o for o in opts if o.startswith("--container")] == srun_opts
    # the batch script itself (the prelude, the rendezvous, the in-place re-plan) runs outside the container
    prelude_to_task = script[script.index("# ---- site environment"):script.index("TASK=")]
    assert "ch-run" not in prelude_to_task and "apptainer exec" not in prelude_to_task
    assert "--container-image" not in prelude_to_task
    if in_place:
        replan = next(line for line in script.splitlines() if " -m sailor_hpc.controller.inplace " in line)
        assert shlex.split(replan)[0] == sys.executable  # sailor-hpc's own interpreter, which has Slurm's clients
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_without_a_container_nothing_changes(tmp_path: Path) -> None:
    site = site_with(None)
    path = write_plan(tmp_path, "het-mixed")
    script = render_job_script(load_plan(path, site=site), site, job_options(path, in_place=tmp_path / "run"))
    assert _bash_argv(script, "TASK")[:3] == [sys.executable, "-m", "sailor_hpc.jobs.rank_env"]
    assert "--container" not in script and "ch-run" not in script and "exec --nv" not in script
    replan = next(line for line in script.splitlines() if " -m sailor_hpc.controller.inplace " in line)
    assert shlex.split(replan)[0] == sys.executable


def _submitit_srun(text: str) -> list[str]:
    """The ``srun ... python -u -m submitit.core._submit FOLDER`` line of a submitit script, as bash splits it."""
    line = next(line for line in text.splitlines() if line.startswith("srun "))
    proc = subprocess.run(["bash", "-c", f"srun() {{ printf '%s\\0' \"$@\"; }}\n{line}"], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("\0")[:-1]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_profiling_jobs_measure_in_the_container(runtime: str, images: dict[str, str], tmp_path: Path) -> None:
    site = site_with(runtime, images[runtime])
    srun_opts, prefix = documented(runtime, images[runtime], None)
    python = "/opt/venv/bin/python"
    settings = JobSettings(folder=tmp_path, python=python, time_min=5, site=site)
    part = site.partitions[0]
    # a compute job: every task is a measuring rank, in the container
    ex = make_executor(settings, Allocation(part, 1, 2), job_name="compute")
    argv = _submitit_srun(ex._make_submission_file_text(ex._submitit_command_str, "uid"))
    i = argv.index("-u")
    assert argv[i - 1 - len(prefix):i] == [*prefix, python]
    assert [o for o in argv if o.startswith("--container")] == srun_opts
    # a network job: its one-task driver starts the benchmark's step itself, so it runs outside, with
    # sailor-hpc's interpreter; the benchmark's ranks run in the container
    ex = make_executor(settings, Allocation(part, 1, 2), job_name="net", one_task=True)
    argv = _submitit_srun(ex._make_submission_file_text(ex._submitit_command_str, "uid"))
    assert argv[argv.index("-u") - 1] == sys.executable and not any(o.startswith("--container") for o in argv)
    assert "ch-run" not in argv and "exec" not in argv
    task = NetworkTask(site_key="lab", kind="inter", a="a100", b="v100", senders=1, nodes=1, sizes=(16,), archive="a.h5",
                       cpu=True, sweep="s", folder=str(tmp_path), python=python, wrapper=rank_wrapper(site.container))
    step = _step_options(task, tmp_path / "spec.json", tmp_path / "out.json")
    comps = _components(step)
    assert len(comps) == 2
    for comp in comps:
        j = comp.index(python)
        assert comp[j - len(prefix):j + 3] == [*prefix, python, "-m", "profiler.netbench"]
        assert [o for o in comp if o.startswith("--container")] == srun_opts


def test_a_host_path_is_found_under_its_mount_inside() -> None:
    site = site_with("pyxis", "ubuntu")
    assert path_inside(site.container, "/users/me/venv/bin/python") == "/opt/venv/bin/python"
    assert path_inside(site.container, "/users/me/venv") == "/opt/venv"
    assert path_inside(site.container, "/users/me/venvs/x") == "/users/me/venvs/x"  # not under the mount
    assert path_inside(site.container, "/scratch/ckpt") == "/scratch/ckpt"
    assert path_inside(None, "/users/me/venv/x") == "/users/me/venv/x"
