"""A job the controller submits asks only for what can be had now: the pure parts (per-node fit, CPUs, nodes to
exclude, pending reasons that do not clear). The real-cluster stories are in test_startable_cluster.py."""
from __future__ import annotations

import itertools
from collections.abc import Mapping

import pytest

from sailor_hpc.controller import records
from sailor_hpc.controller.attempt_job import attempt_options
from sailor_hpc.controller.events import about_nodes, cpu_bound, never_now, stuck_reason
from sailor_hpc.controller.planning import misfit
from sailor_hpc.controller.state import RunDir, RunState, apply
from sailor_hpc.core.plan import Plan, plan_from_dict
from sailor_hpc.jobs.layout import job_layout
from sailor_hpc.jobs.options import InPlace
from sailor_hpc.slurm.commands import SinfoNode
from sailor_hpc.slurm.status import ComponentStatus, JobStatus
from tests.controller.scenario import started_run
from tests.jobs.conftest import PLANS


def fits_by_search(plan: Plan, free: Mapping[str, Mapping[str, int]]) -> bool:
    """The reference: try every choice of distinct nodes for every het component (small cases only)."""
    comps = job_layout(plan).components

    def place(i: int, left: dict[str, dict[str, int]]) -> bool:
        if i == len(comps):
            return True
        c = comps[i]
        nodes = sorted(left.get(c.partition, {}))
        for chosen in itertools.combinations(nodes, c.nodes):
            if all(left[c.partition][n] >= c.tasks_per_node for n in chosen):
                nxt = {p: dict(v) for p, v in left.items()}
                for n in chosen:
                    nxt[c.partition][n] -= c.tasks_per_node
                if place(i + 1, nxt):
                    return True
        return False

    return place(0, {p: dict(v) for p, v in free.items()})


@pytest.mark.parametrize("name", ["a100-only", "het-mixed", "het-full"])
def test_misfit_agrees_with_an_exhaustive_placement(name: str):
    """Each component's nodes are distinct nodes: two one-node demands of one component never share a node."""
    plan = plan_from_dict(PLANS[name])
    shapes = [{}, {"n1": 8}, {"n1": 4}, {"n1": 4, "n2": 4}, {"n1": 3, "n2": 1}, {"n1": 8, "n2": 0},
              {"n1": 2, "n2": 2}, {"n1": 4, "n2": 3}, {"n1": 8, "n2": 8}, {"n1": 1}]
    for a100, v100 in itertools.product(shapes, shapes):
        free = {"a100": a100, "v100": v100}
        assert (misfit(plan, free) is None) == fits_by_search(plan, free), (name, free)


def test_two_nodes_are_not_one_node_of_twice_the_gpus():
    """The soak's case: 4 A100s idle on one node, the other down; a plan of two A100 nodes cannot start."""
    plan = plan_from_dict(PLANS["a100-only"])  # one component: 2 nodes of 4 ranks
    assert misfit(plan, {"a100": {"a100-1": 8}}) == "a100"
    assert misfit(plan, {"a100": {"a100-1": 4, "a100-2": 4}}) is None


def row(name: str, part: str, state: str, cpus_idle: int) -> SinfoNode:
    return SinfoNode(name=name, partition=part, default_partition=False, state=state, gres=(), gres_used=(),
                     cpus=8, cpus_idle=cpus_idle, memory_mb=8000)


def test_idle_gpus_are_bounded_by_idle_cpus():
    idle = {"v100": {"v100-1": 6, "v100-2": 8}, "a100": {"a100-1": 4}}
    rows = [row("v100-1", "v100", "mixed", 2), row("v100-2", "v100", "idle", 8), row("a100-1", "a100", "mixed", 3)]
    got = cpu_bound(idle, rows, {"v100": 2, "a100": 1})
    assert got == {"v100": {"v100-1": 1, "v100-2": 4}, "a100": {"a100-1": 3}}


def test_nodes_a_new_job_excludes():
    unusable = {"a-1": "down*", "a-2": "drained", "a-3": "draining", "a-4": "reserved", "a-5": "planned",
                "a-6": "idle-", "a-7": "maint"}
    assert never_now(unusable) == ["a-1", "a-2", "a-3", "a-4", "a-7"]


def test_exclude_is_rendered_in_the_job_options(tmp_path):
    rd, _ = started_run(tmp_path, steps=4)
    spec = rd.spec()
    opts = attempt_options(spec.job, tmp_path / "p.json", rd, model=spec.planning.model, runtime="megatron_patch",
                           name="sailor-x-1", scope=InPlace(rd.path), exclude=["a100-2", "v100-1"])
    assert opts.extra_sbatch[-1] == "--exclude=a100-2,v100-1"
    assert "--exclude" not in " ".join(attempt_options(spec.job, tmp_path / "p.json", rd, model=spec.planning.model,
                                                       runtime="megatron_patch", name="sailor-x-1",
                                                       scope=InPlace(rd.path)).extra_sbatch)


def pending(*reasons: str) -> JobStatus:
    return JobStatus("7", [ComponentStatus(job_id=str(7 + i), partition="a100", state="PENDING", nodes="", reason=r)
                           for i, r in enumerate(reasons)], state="PENDING")


def test_pending_reasons_that_do_not_clear():
    """squeue's reasons, as Slurm 22.05 prints them (seen on the local cluster)."""
    assert stuck_reason(pending("Resources")) is None
    assert stuck_reason(pending("Priority", "")) is None
    down = "Nodes required for job are DOWN, DRAINED or reserved for jobs in higher priority partitions"
    assert stuck_reason(pending("Resources", down)) == down
    assert about_nodes(stuck_reason(pending("ReqNodeNotAvail, UnavailableNodes:a100-2")) or "")
    assert stuck_reason(pending("PartitionDown")) == "PartitionDown"
    assert not about_nodes("PartitionDown") and not about_nodes("Reservation")


def test_a_grow_timeout_keeps_its_queue_in_the_fold(tmp_path):
    """The queue a bigger job could not start on is state (replayed from the journal), not a variable."""
    rd, j = started_run(tmp_path, steps=4)
    j.append(records.Submitted(attempt=1, job_id="11", log="l"))
    j.append(records.GrowSubmitted(attempt=1, next_attempt=2, job_id="12", job_name="n", log="l2", plan_file="p",
                                   script="s", trigger_t=1.0, gpus={"a100": 2}, throughput=2.0, cost_per_hour=1.0))
    queue = {"a100": {"a100-1": 3, "a100-2": 0}, "v100": {}}
    j.append(records.GrowCancelled(attempt=1, job_id="12", reason="timed out", state="CANCELLED", queue=queue))
    state = RunState()
    for rec in RunDir(rd.path).records():
        apply(state, rec)
    assert state.grow_blocked == queue
    # an old journal's grow_cancelled (no queue) replays without one
    old = RunState()
    for rec in RunDir(rd.path).records():
        apply(old, rec if not isinstance(rec, records.GrowCancelled) else
              records.GrowCancelled(attempt=1, job_id="12", reason="timed out"))
    assert old.grow_blocked is None
