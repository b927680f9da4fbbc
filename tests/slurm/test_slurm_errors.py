"""Slurm's failures carry their meaning by type: a request Slurm refuses is bad input (SailorError, exit 2);
a controller that does not answer is SlurmUnavailable (retry later; the CLI exits 3 and says so). Checked on
the real local cluster, its slurmctld really stopped."""
from __future__ import annotations

import pytest

from sailor_hpc.core.errors import EXIT_BAD_INPUT, EXIT_SLURM_UNAVAILABLE, SailorError, SlurmUnavailable
from sailor_hpc.slurm.commands import controller_answers, run_slurm, sinfo_nodes, squeue


def test_a_refused_request_is_bad_input_and_a_stopped_controller_is_unavailable(slurm_cluster):
    env = slurm_cluster.env
    with pytest.raises(SailorError) as refused:  # slurmctld answers: an unknown job id is the request's fault
        run_slurm(["scontrol", "update", "JobId=999999", "Requeue=0"], env)
    assert not isinstance(refused.value, SlurmUnavailable) and refused.value.exit_code == EXIT_BAD_INPUT
    assert squeue(env, jobs=["999999"]) == []  # an id slurmctld does not know is no job, not an error
    with slurm_cluster.slurmctld_stopped():
        assert not controller_answers(env)
        with pytest.raises(SlurmUnavailable) as down:  # a client that hangs past our timeout
            run_slurm(["squeue", "-h"], env, timeout=1.0)
        assert down.value.exit_code == EXIT_SLURM_UNAVAILABLE and "squeue" in str(down.value)
        # the client's own failure (after ~10 s, its MessageTimeout), while `scontrol ping` says DOWN
        proc = slurm_cluster.run(["sailor-hpc", "status", "--json"])
    assert controller_answers(env) and sinfo_nodes(env)
    assert proc.returncode == EXIT_SLURM_UNAVAILABLE, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and '"exit_code": 3' in proc.stderr
