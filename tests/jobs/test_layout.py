"""Job layout and per-task rank mapping, against megatron_patch's rank order (no cluster needed)."""
from __future__ import annotations

from collections import defaultdict

import pytest

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.placement import place_plan
from sailor_hpc.core.plan import plan_from_dict
from sailor_hpc.core.roles import rank_roles
from sailor_hpc.core.site import load_site
from sailor_hpc.jobs.layout import job_layout
from sailor_hpc.jobs.rank_env import rank_environment
from tests.jobs.conftest import LOCAL_LAB, PLANS


def _simulate_srun(layout) -> list[dict[str, int]]:
    """What srun does with the rendered components: tasks numbered component by component, node by
    node, ``--ntasks-per-node`` consecutive tasks per node (block distribution)."""
    tasks = []
    for comp in layout.components:
        for node in range(comp.nodes):
            for local in range(comp.tasks_per_node):
                tasks.append({"component": comp.index, "node": node, "local": local})
    return tasks


@pytest.mark.parametrize("name", ["a100-only", "het-mixed", "het-full", "unplaced"])
def test_every_rank_lands_on_its_planned_node_and_gpu_order(name):
    site = load_site(LOCAL_LAB)
    plan = plan_from_dict(PLANS[name])
    if name == "unplaced":
        plan = place_plan(plan, site)
    layout = job_layout(plan)
    roles = rank_roles(plan)
    tasks = _simulate_srun(layout)
    assert len(tasks) == layout.world_size == len(roles) == plan.num_gpus
    # the wrapper's mapping is a permutation of the plan's ranks
    assert sorted(layout.task_ranks) == list(range(plan.num_gpus))
    seen_nodes: dict[tuple[int, int], set[tuple[str, int]]] = defaultdict(set)
    by_slurm_node: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for procid, task in enumerate(tasks):
        env = {"SLURM_PROCID": str(procid), "SLURM_NTASKS": str(len(tasks)), "SLURM_LOCALID": str(task["local"])}
        out = rank_environment(layout, env)
        role = roles[int(out["RANK"])]
        comp = layout.components[task["component"]]
        assert comp.partition == role.partition and comp.gpu_type == role.gpu_type
        seen_nodes[(task["component"], task["node"])].add((role.partition, role.node))
        by_slurm_node[(task["component"], task["node"])].append((role.local_gpu, int(out["LOCAL_RANK"])))
        assert out["WORLD_SIZE"] == str(plan.num_gpus)
    # one Slurm node <-> one planned (partition, node); LOCAL_RANK follows the planned GPU order
    assert all(len(v) == 1 for v in seen_nodes.values())
    assert len({next(iter(v)) for v in seen_nodes.values()}) == len(seen_nodes)
    for pairs in by_slurm_node.values():
        assert [lr for _, lr in sorted(pairs)] == list(range(len(pairs)))
    # plan rank 0 is the first task of het group 0, on its first node (the rendezvous host)
    first = layout.place(layout.task_ranks.index(0))
    assert (first.component, first.node) == (0, 0)


def test_components_split_partitions_and_node_sizes():
    layout = job_layout(plan_from_dict(PLANS["het-mixed"]))
    got = [(c.partition, c.nodes, c.tasks_per_node) for c in layout.components]
    # v100 holds rank 0 -> group 0; a100 node 0 runs 3 ranks, a100 node 1 one rank
    assert got == [("v100", 1, 2), ("a100", 1, 3), ("a100", 1, 1)]
    # hand-derived: v100 node: ranks 0,1; a100 node 0: rank 2 (gpu 0), 5 (gpu 1), 4 (gpu 2); a100 node 1: rank 3
    assert layout.task_ranks == (0, 1, 2, 5, 4, 3)
    assert job_layout(plan_from_dict(PLANS["a100-only"])).heterogeneous is False


def test_wrapper_refuses_a_mismatched_launch():
    layout = job_layout(plan_from_dict(PLANS["het-mixed"]))
    with pytest.raises(SailorError, match="srun started 5 tasks"):
        rank_environment(layout, {"SLURM_PROCID": "0", "SLURM_NTASKS": "5"})
    with pytest.raises(SailorError, match="SLURM_LOCALID"):  # cyclic distribution would put task 3 at local 0
        rank_environment(layout, {"SLURM_PROCID": "3", "SLURM_NTASKS": "6", "SLURM_LOCALID": "0"})
    with pytest.raises(SailorError, match="not set"):
        rank_environment(layout, {})
    env = rank_environment(layout, {"SLURM_PROCID": "2", "SLURM_NTASKS": "6", "SLURM_LOCALID": "0",
                                    "SLURM_CPUS_PER_TASK_HET_GROUP_1": "3"})
    assert env["RANK"] == "2" and env["OMP_NUM_THREADS"] == "3" and env["SAILOR_HET_GROUP"] == "1"


def test_unplaced_plan_is_refused():
    with pytest.raises(SailorError, match="placement"):
        job_layout(plan_from_dict(PLANS["unplaced"]))
