"""Rank -> role mapping, rendezvous variables and ``launch --dry-run`` (all torch-free)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_patch import local
from sailor_hpc.core.dist_env import EXIT_BAD_INPUT, read_env
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.plan import Pipeline, Placement, Plan, Stage
from sailor_hpc.core.roles import rank_roles, role_of

PLAN = Plan("tiny-gpt", 8, (
    Pipeline(2, 2, (Stage(0, 2, 2, "A100-40", "a100", Placement(0, (0, 1))),
                    Stage(3, 5, 1, "V100-16", "v100", Placement(0, (0,))))),
    Pipeline(4, 1, (Stage(0, 5, 1, "V100-16", "v100", Placement(1, (2,))),)),
))


def test_rank_order_is_pipelines_then_stages_then_tp_ranks() -> None:
    got = [(r.rank, r.pipeline, r.stage, r.tp_rank, r.layers, r.gpu_type, r.partition, r.node, r.local_gpu)
           for r in rank_roles(PLAN)]
    assert got == [
        (0, 0, 0, 0, [0, 1, 2], "A100-40", "a100", 0, 0),
        (1, 0, 0, 1, [0, 1, 2], "A100-40", "a100", 0, 1),
        (2, 0, 1, 0, [3, 4, 5], "V100-16", "v100", 0, 0),
        (3, 1, 0, 0, [0, 1, 2, 3, 4, 5], "V100-16", "v100", 1, 2),
    ]
    assert [r.stage_ranks for r in rank_roles(PLAN)] == [(0, 1), (0, 1), (2,), (3,)]


def test_role_of_checks_the_world_size() -> None:
    assert role_of(PLAN, 2, 4).stage == 1
    with pytest.raises(SailorError, match="4 GPUs"):
        role_of(PLAN, 0, 3)


def test_env_from_slurm_and_torchrun() -> None:
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURMD_NODENAME": "v100-2",
             "SLURM_JOB_NODELIST_HET_GROUP_0": "a100-[3-4],v100-1", "SLURM_JOB_NODELIST": "v100-[1-2]"}
    e = read_env(slurm)
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port, e.host, e.source) == \
        (3, 4, 1, "a100-3", 29500, "v100-2", "slurm")
    both = {**slurm, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "7"}
    e = read_env(both)
    assert (e.rank, e.world_size, e.master_addr, e.master_port, e.source) == (0, 2, "h", 7, "torchrun")
    with pytest.raises(SailorError):
        read_env({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"})


def _dry_run(plan_path: str, rank: int, world: int, *extra: str) -> subprocess.CompletedProcess:
    # torch is made unimportable: the dry run must not need it (login nodes, the het-job test)
    argv = ["--plan", plan_path, "--model", "tiny-gpt", "--steps", "1", "--dry-run", *extra]
    code = ("import sys; sys.modules['torch'] = None\n"
            "from megatron_patch.launch import main\n"
            f"raise SystemExit(main({argv!r}))")
    env = local.rank_env(0, 1, 0)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k)
    env.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(world), SLURM_LOCALID="0", SLURMD_NODENAME=f"node{rank}")
    return subprocess.run([sys.executable, "-c", code], cwd=local.REPO, env=env, capture_output=True, text=True)


def test_dry_run_prints_each_ranks_role_without_torch(tmp_path) -> None:
    path = tmp_path / "plan.json"
    PLAN.save(path)
    for role in rank_roles(PLAN):
        res = _dry_run(str(path), role.rank, 4)
        assert res.returncode == 0, res.stderr
        line = json.loads(res.stdout)
        assert {k: line[k] for k in ("rank", "pipeline", "stage", "tp_rank", "layers", "gpu_type", "partition")} == \
            {"rank": role.rank, "pipeline": role.pipeline, "stage": role.stage, "tp_rank": role.tp_rank,
             "layers": role.layers, "gpu_type": role.gpu_type, "partition": role.partition}
        assert line["host"] == f"node{role.rank}"


def test_dry_run_with_the_wrong_number_of_tasks_is_bad_input(tmp_path) -> None:
    path = tmp_path / "plan.json"
    PLAN.save(path)
    res = _dry_run(str(path), 0, 5)
    assert res.returncode == EXIT_BAD_INPUT
    assert "plan uses 4 GPUs" in res.stderr


def test_transformer_engine_layer_spec_is_refused_before_anything_starts(tmp_path) -> None:
    path = tmp_path / "plan.json"
    PLAN.save(path)
    res = _dry_run(str(path), 0, 4, "--layer-spec", "te")
    assert res.returncode == EXIT_BAD_INPUT
    assert "--layer-spec te" in res.stderr and "--layer-spec local" in res.stderr
