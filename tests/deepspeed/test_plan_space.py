"""The DeepSpeed plan space (torch-free): what the engine can run, the split, ZeRO in the simulator, the CLI."""
from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from planner import PlanRequest
from planner.deepspeed_space import balanced_split, deepspeed_search
from sailor_hpc.cli import main
from sailor_hpc.core.archive import open_archive
from sailor_hpc.core.deepspeed_plan import engine_refusals, with_zero_stage, zero_stage_of, zero_stages_for
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.site import load_site
from simulator import SimOptions, simulate
from tests.planner.conftest import small_site

SITES = Path(__file__).resolve().parents[2] / "site_configs"


def run(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_balanced_split_is_the_brute_force_optimum() -> None:
    rng = np.random.default_rng(7)
    for L, P in [(6, 2), (7, 3), (8, 4), (9, 1)]:
        times = [rng.uniform(0.5, 2.0, L) * rng.uniform(0.5, 2.0) for _ in range(P)]
        got, bounds = balanced_split(times)
        best = min(max(times[s][a:b].sum() for s, (a, b) in enumerate(zip((0, *cuts), (*cuts, L))))
                   for cuts in itertools.combinations(range(1, L), P - 1))
        assert got == pytest.approx(best, rel=1e-12)
        assert bounds[0][0] == 0 and bounds[-1][1] == L - 1
        assert all(b[0] == a[1] + 1 for a, b in zip(bounds, bounds[1:]))
        assert max(times[s][a:b + 1].sum() for s, (a, b) in enumerate(bounds)) == pytest.approx(got, rel=1e-12)


def _stage(a: int, b: int, tp: int = 1, gpu: str = "A100-40") -> Stage:
    return Stage(a, b, tp, gpu)


def test_refusals_name_every_reason() -> None:
    uniform = Plan("OPT-350M", 16, (Pipeline(2, 4, (_stage(0, 12), _stage(13, 25, gpu="V100-16"))),) * 2)
    assert engine_refusals(uniform) == []  # GPU types may differ between stages
    hetero = Plan("OPT-350M", 16, (Pipeline(2, 4, (_stage(0, 12), _stage(13, 25))),
                                  Pipeline(4, 1, (_stage(0, 10, tp=2), _stage(11, 25)))))
    reasons = " | ".join(engine_refusals(hetero))
    assert "micro-batch" in reasons and "cut the model differently" in reasons and "tensor parallelism" in reasons
    assert "ZeRO stage 2" in " ".join(engine_refusals(with_zero_stage(uniform, 2)))
    one = Plan("OPT-350M", 16, (Pipeline(2, 4, (_stage(0, 25),)),) * 2)
    assert engine_refusals(with_zero_stage(one, 3)) == []
    assert zero_stages_for(1) == (0, 1, 2, 3) and zero_stages_for(2) == (0, 1)


def test_zero_memory_and_step_fall_with_the_stage() -> None:
    """More partitioned state: less memory per GPU and a shorter optimizer step; stage 0 is the runtime without ZeRO."""
    site = load_site(SITES / "a100-v100.toml")
    archive = open_archive(None, site)
    one = Plan("OPT-350M", 64, (Pipeline(2, 8, (_stage(0, 25),)),) * 4)
    res = [simulate(with_zero_stage(one, z), site, archive, options=SimOptions(runtime="deepspeed")) for z in range(4)]
    state = [r.stages[0].memory.state for r in res]
    assert state[0] > state[1] > state[2] > state[3]
    assert res[1].stages[0].update_s == pytest.approx(res[0].stages[0].update_s / 4)
    # ZeRO 1 (optimizer state over 4): 16 -> 4 + 4 + 12/4 bytes per parameter of fp32 Adam
    assert state[1] / state[0] == pytest.approx((4 + 4 + 12 / 4) / 16)
    assert res[3].iteration_time_s > res[1].iteration_time_s  # stage 3 moves 1.5x the bytes
    with pytest.raises(Exception, match="ZeRO stage 2 with 2 pipeline stages"):
        two = Plan("OPT-350M", 64, (Pipeline(2, 8, (_stage(0, 12), _stage(13, 25))),) * 4)
        simulate(with_zero_stage(two, 2), site, archive, options=SimOptions(runtime="deepspeed"))


def test_planner_returns_only_plans_the_engine_runs(tiny_archive) -> None:
    site = small_site(a100_nodes=2, v100_nodes=2)
    res = deepspeed_search(site, tiny_archive, PlanRequest("tiny-gpt", 16, dtype="fp32", runtime="deepspeed"))
    assert res.candidates
    for c in res.candidates:
        assert engine_refusals(c.plan) == []
        assert zero_stage_of(c.plan) in zero_stages_for(len(c.plan.pipelines[0].stages))
        again = simulate(c.plan, site, tiny_archive, options=SimOptions(runtime="deepspeed"))
        assert again.iteration_time_s == pytest.approx(c.result.iteration_time_s, rel=1e-12)
    speeds = [c.throughput for c in res.candidates]
    assert speeds == sorted(speeds, reverse=True)
    assert any(len({s.gpu_type for s in c.plan.pipelines[0].stages}) == 2 for c in res.simulated)


def test_plan_cli_writes_a_ds_config_or_refuses(tmp_path: Path) -> None:
    cfg, plan = tmp_path / "ds.json", tmp_path / "plan.json"
    r = run("plan", "--site", SITES / "mit-mixed.toml", "--model", "OPT-350M", "--gbs", 64, "--dtype", "fp32",
            "--runtime", "deepspeed", "--available", "rtx2080=4,rtx3090=4", "--ds-config", cfg, "-o", plan,
            "--lr-warmup-iters", 2, "--lr-decay-style", "linear", "--steps", 20, "--top", 2)
    assert r.exit_code == 0, r.output
    config, best = json.loads(cfg.read_text()), load_plan(plan)
    assert engine_refusals(best) == []
    assert config["train_batch_size"] == 64 == (config["train_micro_batch_size_per_gpu"]
                                                * config["gradient_accumulation_steps"] * len(best.pipelines))
    assert config["zero_optimization"]["stage"] == zero_stage_of(best)
    assert config["scheduler"] == {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 2, "warmup_type": "linear",
        "total_num_steps": 20}}
    bad = tmp_path / "bad.json"
    r = run("plan", "--site", SITES / "mit-mixed.toml", "--model", "OPT-350M", "--gbs", 64, "--dtype", "fp32",
            "--runtime", "deepspeed", "--available", "rtx3090=2", "--ds-config", bad, "--lr-decay-style", "cosine")
    assert r.exit_code == 2 and "--lr-decay-style" in r.output and not bad.exists()
    r = run("plan", "--site", SITES / "mit-mixed.toml", "--model", "OPT-350M", "--ds-config", bad)
    assert r.exit_code == 2 and "--runtime deepspeed" in r.output


def test_simulate_cli_refuses_what_deepspeed_cannot_run(tmp_path: Path) -> None:
    hetero = Plan("OPT-350M", 16, (Pipeline(2, 4, (_stage(0, 12), _stage(13, 25))), Pipeline(4, 2, (_stage(0, 25),))))
    path = tmp_path / "hetero.json"
    hetero.save(path)
    r = run("simulate", path, "--site", SITES / "a100-v100.toml", "--runtime", "deepspeed")
    assert r.exit_code == 2 and "DeepSpeed cannot run" in r.output and "micro-batch" in r.output
    uniform = replace(hetero, pipelines=(hetero.pipelines[0],) * 2, global_batch_size=16)
    uniform.save(path)
    r = run("simulate", path, "--site", SITES / "a100-v100.toml", "--runtime", "deepspeed", "--json")
    assert r.exit_code == 0, r.output


def test_sbatch_renders_the_deepspeed_entry_point_or_refuses(tmp_path: Path) -> None:
    uniform = Plan("tiny-gpt", 8, (Pipeline(2, 2, (_stage(0, 2), _stage(3, 5, gpu="V100-16"))),) * 2)
    path, script = tmp_path / "plan.json", tmp_path / "job.sbatch"
    uniform.save(path)
    r = run("sbatch", path, "--site", SITES / "local-lab.toml", "--runtime", "deepspeed", "--dry-run", "-o", script)
    assert r.exit_code == 0, r.output
    text = script.read_text()
    assert "-m megatron_patch.ds_runtime.launch --plan" in text and "-m megatron_patch.launch " not in text
    hetero = Plan("tiny-gpt", 8, (Pipeline(2, 2, (_stage(0, 2), _stage(3, 5))), Pipeline(4, 1, (_stage(0, 5),))))
    hetero.save(path)
    bad = tmp_path / "bad.sbatch"
    r = run("sbatch", path, "--site", SITES / "local-lab.toml", "--runtime", "deepspeed", "--dry-run", "-o", bad)
    assert r.exit_code == 2 and "DeepSpeed cannot run" in r.output and not bad.exists()
