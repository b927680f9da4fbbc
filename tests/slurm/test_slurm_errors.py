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


def test_a_cluster_without_accounting_reads_job_states_from_squeue(slurm_cluster, tmp_path):
    """Slurm's refusal is typed (SlurmRefused, with Slurm's own output), so status tells a cluster whose
    accounting is switched off (sacct refuses: squeue carries the state) from other refusals without reading
    our message; a missing Slurm binary is its own type too."""
    from sailor_hpc.slurm.commands import SlurmCommandMissing, SlurmRefused, sacct
    from sailor_hpc.slurm.status import poll_jobs

    conf = (slurm_cluster.lab / "etc" / "slurm.conf").read_text()
    no_acct = tmp_path / "slurm.conf"
    no_acct.write_text("\n".join(ln for ln in conf.splitlines() if not ln.startswith(("AccountingStorage",
                                                                                      "JobAcctGather")))
                       + "\nAccountingStorageType=accounting_storage/none\n")
    env = {**slurm_cluster.env, "SLURM_CONF": str(no_acct)}
    with pytest.raises(SlurmRefused) as refused:
        sacct(env, jobs=["1"])
    assert "accounting storage is disabled" in refused.value.output.lower()
    job = slurm_cluster.sbatch(["-p", "v100", "-o", "/dev/null", "--wrap", "sleep 30"])
    try:
        status = poll_jobs([job], env)[job]  # squeue alone: the job is known and its state read
        assert status.known and status.state in ("PENDING", "RUNNING"), status
    finally:
        slurm_cluster.run(["scancel", job])
    with pytest.raises(SlurmCommandMissing):
        sacct({**env, "PATH": str(tmp_path)}, jobs=["1"])
