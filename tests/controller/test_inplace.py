"""Which nodes and srun options the next in-place step gets (the cluster test runs the whole path)."""
from __future__ import annotations

import pytest

from sailor_hpc.controller.inplace import Component, step_components, survivors
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.plan import Plan, plan_from_dict
from tests.jobs.conftest import A100, V100, plan_doc, stage


def _plan(doc) -> Plan:
    return plan_from_dict(doc)


HET = _plan(plan_doc([(2, 2, [stage(0, 5, 2, V100, "v100", 0, [0, 1])]), (2, 2, [stage(0, 5, 1, A100, "a100", 0, [0])]),
                      (2, 2, [stage(0, 5, 1, A100, "a100", 1, [0])])]))


def test_survivors_hold_what_the_job_was_given_on_each_node():
    comps = [Component("7", "v100", ["v100-1"]), Component("8", "a100", ["a100-1", "a100-2"])]
    assert survivors(comps, HET, {"a100-2": "drained"}) == {"v100": {"v100-1": 2}, "a100": {"a100-1": 1}}


def test_next_step_runs_each_component_on_surviving_nodes_with_explicit_counts():
    comps = [Component("7", "v100", ["v100-1"]), Component("8", "a100", ["a100-1", "a100-2"])]
    smaller = _plan(plan_doc([(4, 1, [stage(0, 5, 2, V100, "v100", 0, [0, 1])]),
                              (4, 1, [stage(0, 5, 1, A100, "a100", 0, [0])])]))
    free = {"v100": {"v100-1": 2}, "a100": {"a100-2": 1}}
    opts, nodes = step_components(smaller, comps, free, True, [1, 1])
    assert opts == ["--het-group=0 -N 1 -n 2 --ntasks-per-node=2 --nodelist=v100-1 --cpus-per-task=1",
                    "--het-group=1 -N 1 -n 1 --ntasks-per-node=1 --nodelist=a100-2 --cpus-per-task=1"]
    assert nodes == ["v100-1", "a100-2"]


def test_a_plan_that_leaves_a_component_out_needs_a_new_job():
    comps = [Component("7", "v100", ["v100-1"]), Component("8", "a100", ["a100-1"])]
    only_a100 = _plan(plan_doc([(4, 2, [stage(0, 5, 1, A100, "a100", 0, [0])])]))
    with pytest.raises(SailorError, match="partitions"):
        step_components(only_a100, comps, {"a100": {"a100-1": 1}}, True, [1, 1])


def test_a_bundle_goes_on_without_a_job_slurm_ended():
    # the V100 job of a bundle ended with its batch node (no nodes): the plan runs on the A100 job alone
    comps = [Component("7", "v100", []), Component("8", "a100", ["a100-1", "a100-2"])]
    free = survivors(comps, HET, {"a100-2": "down"})
    assert free == {"a100": {"a100-1": 1}}
    only_a100 = _plan(plan_doc([(4, 2, [stage(0, 5, 1, A100, "a100", 0, [0])])]))
    opts, nodes = step_components(only_a100, comps, free, True, [3, 1])
    assert opts == ["--het-group=0 -N 1 -n 1 --ntasks-per-node=1 --nodelist=a100-1 --cpus-per-task=1"]
    assert nodes == ["a100-1"]
    with pytest.raises(SailorError, match="partitions"):  # the ended job cannot run a part of the plan
        step_components(HET, comps, {"v100": {"v100-1": 2}, "a100": {"a100-1": 1}}, True, [1, 1])
