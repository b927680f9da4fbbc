"""A small chaos soak in ``make test`` (tests/controller/chaos.py; ``benchmarks/chaos_soak.py`` runs a longer one):
seed 3 injects a node going down under the job, slurmctld stopped for seconds, and an operator's cancel of the job
after which the newest checkpoint is truncated (the next job must pass it over and roll back), each once the
previous one was handled.
The run is then stopped; the final parameters must equal the uninterrupted reference's at the same step, no step
is skipped, and the only steps trained twice are those a job redid after rolling back to an older checkpoint.
"""
from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

from tests.conftest import slurm_missing
from tests.controller.chaos import Soak, describe, final_step, step_account
from tests.controller.scenario import Scenario, build_inputs, start_reference

pytestmark = pytest.mark.slurm

SEED, FAULTS = 3, 3
PARAM_TOL = MOMENT_TOL = 5e-6


@pytest.fixture(scope="module")
def soak(slurm_cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("megatron.core")
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        slurm_missing("the operator's cancel runs scancel as another user: needs root and setpriv (util-linux)")
    root = tmp_path_factory.mktemp("chaos")
    data, archive = build_inputs(tmp_path_factory, root)
    sc = Scenario(slurm_cluster, root, data, archive, steps=100_000, save_interval=5)
    soak = Soak(sc, SEED)
    try:
        results = soak.run(FAULTS)
        records = sc.records()
        step = final_step(sc)
    finally:
        sc.cleanup()
    reference = start_reference(root, data, step)  # to the step the run stopped at, known only now
    assert reference.wait(timeout=600) == 0, (root / "reference.log").read_text()[-3000:]
    print("\n" + describe(results, SEED))
    return {"sc": sc, "results": results, "records": records, "step": step}


def test_every_fault_is_survived(soak):
    results = soak["results"]
    assert [r.name for r in results] == ["down", "slurmctld", "corrupt"]
    kinds = [r["kind"] for r in soak["records"]]
    assert "node_lost" in kinds or "in_place" in kinds  # the loss was seen as such ...
    assert [r["where"] for r in soak["records"] if r["kind"] == "error"][:2] == ["slurm unavailable", "slurm available"]
    passed = [r for r in soak["records"] if r["kind"] == "checkpoint_passed_over"]
    assert passed, "the truncated checkpoint was passed over by the next job"
    assert kinds[-1] == "run_stopped"


def test_no_step_is_skipped_and_only_rolled_back_steps_are_trained_twice(soak):
    seen, twice = step_account(soak["sc"].save)
    assert seen == set(range(1, soak["step"] + 1)), sorted(set(range(1, soak["step"] + 1)) - seen)
    assert twice, "the rollback past the truncated checkpoint redid its steps"
    print(f"\n{soak['step']} steps trained, {len(twice)} of them twice (after rollbacks): {twice}")


def test_the_final_parameters_equal_the_uninterrupted_reference(soak):
    from sailor_hpc.core.checkpoint import latest_complete
    from tests.megatron_patch.conftest import max_diff
    sc: Scenario = soak["sc"]
    final = latest_complete(sc.save)
    assert final is not None
    diff = max_diff(final, sc.root / "ref" / f"ref_step_{soak['step']}.pt")
    print(f"\nafter {soak['step']} steps and {len(soak['results'])} faults: max |delta| vs reference {diff}")
    assert diff["param"] <= PARAM_TOL and diff["exp_avg"] <= MOMENT_TOL and diff["exp_avg_sq"] <= MOMENT_TOL
