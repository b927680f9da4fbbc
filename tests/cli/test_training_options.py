"""The training options of ``sailor-hpc sbatch``, ``plan --sbatch`` and ``run`` reach the ranks: the job
script's launch words, parsed by ``megatron_patch.launch``'s own parser, carry the values given; bad
values exit 2 naming the flag before anything is written."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from megatron_patch.launch import parse_args
from sailor_hpc.cli import main
from sailor_hpc.cli.run_cmds import new_run, run_group
from sailor_hpc.controller.attempt_job import prepare_attempt
from sailor_hpc.controller.spec import RunSpec
from sailor_hpc.controller.state import RunDir
from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.site import load_site
from sailor_hpc.jobs.render import bundle_partitions
from tests.data.tiny_archive import write_tiny_archive
from tests.jobs.conftest import LOCAL_LAB, write_plan
from tests.jobs.test_render import _bash_argv

OPTIONS = ["--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "10",
           "--clip-grad", "0.5", "--split", "98,2,0", "--eval-interval", "50", "--eval-iters", "4"]
EXPECTED: dict[str, Any] = {"lr": 3e-4, "min_lr": 3e-5, "lr_decay_style": "cosine", "lr_warmup_iters": 10,
                            "clip_grad": 0.5, "split": "98,2,0", "eval_interval": 50, "eval_iters": 4,
                            "weight_decay": 0.01, "lr_decay_iters": None}  # not given: the runtime's defaults


def _datasets(tmp_path: Path) -> tuple[Path, Path]:
    for name in ("a", "b"):
        for suffix in (".bin", ".idx"):
            (tmp_path / f"{name}{suffix}").write_bytes(b"")
    return tmp_path / "a", tmp_path / "b"


def _launch_values(script: str) -> Any:
    words = _bash_argv(script, "LAUNCH")
    return parse_args(words[words.index("megatron_patch.launch") + 1:])


def _check(args: Any, a: Path, b: Path, **changed: Any) -> None:
    assert {k: getattr(args, k) for k in EXPECTED} == {**EXPECTED, **changed}
    assert args.data == ["0.7", str(a), "0.3", str(b)]


def test_sbatch_carries_schedule_eval_and_blend_into_the_job(tmp_path: Path) -> None:
    a, b = _datasets(tmp_path)
    out = tmp_path / "job.sh"
    res = CliRunner().invoke(main, ["sbatch", str(write_plan(tmp_path, "het-mixed")), "--site", str(LOCAL_LAB),
                                    "--data", f"0.7 {a} 0.3 {b}", "--save", str(tmp_path / "ck"), "-o", str(out),
                                    *OPTIONS])
    assert res.exit_code == 0, res.output
    _check(_launch_values(out.read_text()), a, b)


def test_sbatch_refuses_a_bad_option_before_writing(tmp_path: Path) -> None:
    out = tmp_path / "job.sh"
    for bad, flag in ((["--eval-interval", "10"], "--split"), (["--lr-decay-style", "step"], "--lr-decay-style"),
                      (["--split", "1,2,3,4"], "--split"), (["--data", "0.5 a b"], "--data")):
        args = ["sbatch", str(write_plan(tmp_path, "het-mixed")), "--site", str(LOCAL_LAB), "--data", "d",
                "--save", "s", "-o", str(out), *bad]
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 2 and flag in res.output, res.output
        assert not out.exists()


def test_plan_sbatch_carries_them_and_the_predicted_step_time(tmp_path: Path) -> None:
    a, b = _datasets(tmp_path)
    archive = write_tiny_archive(tmp_path / "tiny.h5")
    script = tmp_path / "best.sh"
    res = CliRunner().invoke(main, ["plan", "--site", str(LOCAL_LAB), "--model", "tiny-gpt", "--profiles",
                                    str(archive), "--gbs", "64", "--sbatch", str(script), "--data",
                                    f"0.7 {a} 0.3 {b}", "--save", str(tmp_path / "ck"), *OPTIONS])
    assert res.exit_code == 0, res.output
    _check(_launch_values(script.read_text()), a, b)
    predicted = load_plan(tmp_path / "best.plan.json").notes["simulator"]["iteration_time_s"]
    assert predicted > 0  # the runtime's log lines compare each step with it


@pytest.mark.slurm
def test_run_spec_keeps_the_options_for_every_job_it_submits(tmp_path: Path, slurm_cluster,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in slurm_cluster.env.items():  # a new run is checked against Slurm before it is written
        monkeypatch.setenv(name, value)
    a, b = _datasets(tmp_path)
    archive = write_tiny_archive(tmp_path / "tiny.h5")
    args = ["--site", str(LOCAL_LAB), "--profiles", str(archive), "--model", "tiny-gpt", "--gbs", "64",
            "--data", f"0.7 {a} 0.3 {b}", "--save", str(tmp_path / "ck"), *OPTIONS,
            "--train-arg=--eval-iters=5"]
    ctx = run_group.make_context("run", args)
    run_dir = new_run({k: v for k, v in ctx.params.items() if k != "resume_dir"})
    spec = RunSpec.read(run_dir / "run.json")
    assert spec.job.data == f"0.7 {a} 0.3 {b}" and "--lr-decay-style" in spec.job.train_args
    rd = RunDir.existing(run_dir)
    site = load_site(LOCAL_LAB)
    plan = load_plan(write_plan(tmp_path, "het-mixed"), site=site)
    _, scripts = prepare_attempt(rd, spec, site, plan, 1, "sailor-x-1")  # a bundle: a job per layout component
    assert len(scripts) == len(bundle_partitions(plan)) > 1
    for script in scripts:
        _check(_launch_values(script.read_text()), a, b, eval_iters=5)  # a --train-arg comes last and wins
    # options of a new run are refused with --resume (they are in run.json)
    res = CliRunner().invoke(main, ["run", "--resume", str(run_dir), "--lr", "1"])
    assert res.exit_code == 2 and "--resume takes no run options (lr)" in res.output
