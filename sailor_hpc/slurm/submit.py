"""Submit, cancel and find the logs of job scripts; remember what was submitted.

``sbatch`` answers with the job id only, and ``squeue``/``sacct`` forget where a job writes its log
(``scontrol`` remembers it for ``MinJobAge`` seconds), so every submission is recorded as a small JSON
file (job id, script, plan, log path) under the state directory: ``$SAILOR_HPC_STATE_DIR``, else
``$XDG_STATE_HOME/sailor-hpc/jobs``, else ``~/.local/state/sailor-hpc/jobs``.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sailor_hpc.core.atomic import atomic_write_text
from sailor_hpc.core.errors import SailorError
from sailor_hpc.slurm import safety
from sailor_hpc.slurm.commands import parse_kv_line, run_for_jobs, run_slurm, slurm_env


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    name: str
    script: str
    log: str
    submitted: str
    plan: str = ""
    site: str = ""
    slurm_conf: str = ""


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    e = slurm_env(env)
    if e.get("SAILOR_HPC_STATE_DIR"):
        return Path(e["SAILOR_HPC_STATE_DIR"])
    base = Path(e["XDG_STATE_HOME"]) if e.get("XDG_STATE_HOME") else Path(e.get("HOME", "~")).expanduser() / ".local" / "state"
    return base / "sailor-hpc" / "jobs"


def _header_value(script: str, option: str) -> str | None:
    m = re.search(rf"^#SBATCH --{option}=(\S+)\s*$", script, flags=re.M)
    return m.group(1) if m else None


def expand_log_pattern(pattern: str, job_id: str, name: str) -> str:
    """The ``%j``/``%x``/``%%`` of an ``--output`` pattern for a (het leader) job id."""
    return re.sub(r"%(%|j|x)", lambda m: {"%": "%", "j": job_id, "x": name}[m.group(1)], pattern)


def submit_script(script: str | os.PathLike[str], env: Mapping[str, str] | None = None, *, plan: str = "",
                  site: str = "") -> JobRecord:
    """``sbatch`` a script file; returns (and records) the job. Raises SailorError when sbatch refuses."""
    path = Path(script).absolute()
    if not path.is_file():
        raise SailorError("job script not found", file=path, fix="render it first (sailor-hpc sbatch -o FILE)")
    out = run_slurm(["sbatch", "--parsable", str(path)], env).stdout.strip()
    job_id = out.split(";")[0].strip()
    safety.job_id(job_id, "sbatch output")
    text = path.read_text()
    name = _header_value(text, "job-name") or path.name
    log = expand_log_pattern(_header_value(text, "output") or f"slurm-{job_id}.out", job_id, name)
    rec = JobRecord(job_id=job_id, name=name, script=str(path), log=log, submitted=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    plan=plan, site=site, slurm_conf=slurm_env(env).get("SLURM_CONF", ""))
    record_job(rec, env)
    return rec


def check_script(script: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> str:
    """``sbatch --test-only``: Slurm checks the script and answers when it would start (nothing is queued)."""
    proc = run_slurm(["sbatch", "--test-only", str(Path(script).absolute())], env)
    return (proc.stderr + proc.stdout).strip()


def _record_path(job_id: str, slurm_conf: str, env: Mapping[str, str] | None) -> Path:
    """Job ids are per cluster (two clusters' first job is 1 each), so a record is named by the id and the
    SLURM_CONF that reached the cluster."""
    conf = hashlib.sha256(slurm_conf.encode()).hexdigest()[:8]
    return state_dir(env) / f"{job_id}.{conf}.json"


def record_job(rec: JobRecord, env: Mapping[str, str] | None = None) -> Path:
    path = _record_path(rec.job_id, rec.slurm_conf, env)
    atomic_write_text(path, json.dumps(asdict(rec), indent=1) + "\n")
    return path


def load_record(job_id: str, env: Mapping[str, str] | None = None) -> JobRecord | None:
    """The record of job ``job_id`` on the cluster ``env``'s SLURM_CONF reaches (or an older record named by
    the id alone, written before records were per cluster)."""
    jid = safety.job_id(job_id)
    conf = slurm_env(env).get("SLURM_CONF", "")
    for path in (_record_path(jid, conf, env), state_dir(env) / f"{jid}.json"):
        try:
            data: dict[str, Any] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        return JobRecord(**{k: data.get(k, "") for k in JobRecord.__dataclass_fields__})
    return None


def cancel_job(job_id: str | int, env: Mapping[str, str] | None = None) -> str:
    """``scancel`` a job (all het components / array elements of it; every job of a bundle that still runs)."""
    ids = safety.job_ids(job_id)
    run_for_jobs(["scancel"], ids, env)
    return safety.BUNDLE_SEP.join(ids)


def log_path(job_id: str | int, env: Mapping[str, str] | None = None) -> Path:
    """Where the job writes its output: the submission record, else what slurmctld still knows. A bundle's is its
    first job's, which holds plan rank 0 and the job agent that re-plans (the others' logs lie beside it)."""
    jid = safety.job_ids(job_id)[0]
    base = jid.split("+")[0]
    rec = load_record(base, env)
    if rec is not None and rec.log:
        return Path(rec.log)
    proc = run_slurm(["scontrol", "-o", "show", "job", jid], env, check=False)
    for line in proc.stdout.splitlines():
        kv = parse_kv_line(line)
        if kv.get("StdOut"):
            return Path(kv["StdOut"])
    raise SailorError(f"no log known for job {jid}", field="JOBID",
                      fix="only jobs submitted with sailor-hpc (or still known to slurmctld) have a known log")


def read_log(job_id: str | int, env: Mapping[str, str] | None = None) -> tuple[Path, str]:
    path = log_path(job_id, env)
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        raise SailorError("the job has not written its log yet (pending?) or it was removed", file=path,
                          fix="check `sailor-hpc status JOBID`") from None
    return path, text
