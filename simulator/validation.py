"""Simulator against measured runs: Sailor's ``plan_config`` files with ``real`` (s/iteration) and
``max_mem`` (bytes, nvidia-smi, max over ranks).

Error = |estimate - measured| / measured (Sailor's definition). A file is kept out of a mean only for a
reason that is printed with it:

* documented data anomalies of the published files (:data:`DOCUMENTED_ANOMALIES`, from the reference
  notes on Sailor's data);
* the plan cannot be evaluated (e.g. it does not cover the model's layers): the error is shown;
* ``real`` equals ``red_grads``: a copied value, not an iteration time (time only);
* the reported peak memory is below what the busiest rank must hold at once (its model state plus one
  micro-batch of its stage's activations, from the profile): it cannot be that run's peak (memory only).
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sailor_hpc.core.archive import ProfileArchive
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import get_model
from sailor_hpc.core.plan_io import load_run
from sailor_hpc.core.site import Site
from simulator.api import SimOptions, SimResult, simulate

# trailing path parts -> reason (the reference notes on Sailor's data, section 4.3)
DOCUMENTED_ANOMALIES: dict[tuple[str, ...], str] = {
    ("GPT-NEO", "N4", "plan_config_N4_D4.json"):
        "documented anomaly: its plan covers 26 of GPT-Neo's 34 layers (copied from OPT) and `real` is a copy "
        "of `red_grads`",
    ("GPT-NEO", "N2", "plan_config_N2_D1.json"):
        "documented anomaly: gbs = 1 does not match the run that was timed",
}


@dataclass
class ValidationRow:
    file: str
    real_s: float | None = None
    est_s: float | None = None
    real_mem_bytes: float | None = None
    est_mem_bytes: float | None = None
    time_excluded: str | None = None
    mem_excluded: str | None = None
    error: str | None = None
    result: SimResult | None = field(default=None, repr=False)

    @property
    def time_err_pct(self) -> float | None:
        if self.real_s is None or self.est_s is None:
            return None
        return abs(self.est_s - self.real_s) / self.real_s * 100

    @property
    def mem_err_pct(self) -> float | None:
        if self.real_mem_bytes is None or self.est_mem_bytes is None:
            return None
        return abs(self.est_mem_bytes - self.real_mem_bytes) / self.real_mem_bytes * 100

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "real_s": self.real_s, "est_s": self.est_s, "time_err_pct": self.time_err_pct,
                "real_mem_bytes": self.real_mem_bytes, "est_mem_bytes": self.est_mem_bytes,
                "mem_err_pct": self.mem_err_pct, "time_excluded": self.time_excluded,
                "mem_excluded": self.mem_excluded, "error": self.error}


def _stats(values: Sequence[float]) -> dict[str, float | int | None]:
    if not values:
        return {"mean": None, "median": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "max": max(values),
            "n": len(values)}


@dataclass
class ValidationReport:
    rows: list[ValidationRow]

    def time_errors(self) -> list[float]:
        return [r.time_err_pct for r in self.rows if r.time_err_pct is not None and not r.time_excluded]

    def mem_errors(self) -> list[float]:
        return [r.mem_err_pct for r in self.rows if r.mem_err_pct is not None and not r.mem_excluded]

    def summary(self) -> dict[str, Any]:
        t, m = _stats(self.time_errors()), _stats(self.mem_errors())
        return {"time_mape_pct": t["mean"], "mem_mape_pct": m["mean"], "time_median_pct": t["median"],
                "mem_median_pct": m["median"], "time_max_pct": t["max"], "mem_max_pct": m["max"],
                "time_files": t["n"], "mem_files": m["n"], "files": len(self.rows)}

    def to_dict(self) -> dict[str, Any]:
        return {"files": [r.to_dict() for r in self.rows], "summary": self.summary()}


def find_runs(paths: Iterable[str | Path]) -> list[Path]:
    """Every ``*.json`` under the given files and folders, sorted, each once (a file also named inside a
    given folder would count twice in the means)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(q for q in p.rglob("*.json") if q.is_file()))
        elif p.is_file():
            out.append(p)
        else:
            raise SailorError("no such file or folder", file=p, fix="pass Sailor plan_config files or folders of them")
    seen: set[Path] = set()
    unique = []
    for f in out:
        if f.resolve() not in seen:
            seen.add(f.resolve())
            unique.append(f)
    return unique


def documented_anomaly(path: Path) -> str | None:
    parts = path.resolve().parts
    for suffix, reason in DOCUMENTED_ANOMALIES.items():
        if tuple(parts[-len(suffix):]) == suffix:
            return reason
    return None


def memory_floor(result: SimResult) -> float:
    """What the busiest rank must hold at once: its model state plus one micro-batch of activations."""
    plan = result.plan
    floor = 0.0
    for s in result.stages:
        pipe = plan.pipelines[s.pipeline]
        state = s.memory.state
        one = s.memory.activations / max(1, min(len(pipe.stages) - s.stage, pipe.num_micro_batches))
        floor = max(floor, state + one)
    return floor


def compute_floor(result: SimResult) -> float:
    """The earliest any simulator that takes the stages' compute from the profile can end the iteration.

    Whatever the schedule, overlap and network, stage s waits for micro-batch 0 to pass the forwards of
    stages 0..s-1, runs m forwards and m backwards, and its last gradient then passes the backwards of
    stages s-1..0; transfers, all-reduces and optimizer steps count as zero. A measured time below
    this floor is an error no schedule or network model can remove (``benchmarks/profile_bound.py``).
    """
    floor = 0.0
    for index, pipe in enumerate(result.plan.pipelines):
        stages = sorted((s for s in result.stages if s.pipeline == index), key=lambda s: s.stage)
        upstream = 0.0  # forward + backward of the stages before s, per micro-batch
        for s in stages:
            floor = max(floor, upstream + pipe.num_micro_batches * (s.fwd_s + s.bwd_s))
            upstream += s.fwd_s + s.bwd_s
    return floor


def validate_file(path: Path, site: Site, model: str, archive: ProfileArchive,
                  options: SimOptions | None = None) -> ValidationRow:
    """One measured run against its simulation (``options``: default, DeepSpeed's pipeline engine, which
    produced Sailor's runs)."""
    row = ValidationRow(file=str(path))
    anomaly = documented_anomaly(path)
    try:
        run = load_run(path, model=model, site=site)
        row.real_s, row.real_mem_bytes = run.real_s, run.max_mem_bytes
        res = simulate(run.plan, site, archive, options=options or SimOptions.deepspeed_pipe())
    except SailorError as exc:
        row.error = str(exc)
        row.time_excluded = row.mem_excluded = anomaly or f"cannot be evaluated: {exc}"
        return row
    row.result = res
    row.est_s, row.est_mem_bytes = res.iteration_time_s, res.peak_memory_bytes
    if anomaly:
        row.time_excluded = row.mem_excluded = anomaly
        return row
    if row.real_s is None:
        row.time_excluded = "no measured `real` (s/iteration) in the file"
    elif run.red_grads_s == row.real_s:
        row.time_excluded = "`real` equals `red_grads` (a copied value, not an iteration time)"
    if row.real_mem_bytes is None:
        row.mem_excluded = "no measured `max_mem` in the file"
    else:
        floor = memory_floor(res)
        if row.real_mem_bytes < floor:
            row.mem_excluded = (f"reported peak {row.real_mem_bytes / 2**30:.2f} GiB is below the {floor / 2**30:.2f} GiB "
                                "the busiest rank must hold (model state + one micro-batch of activations)")
    return row


def validate_runs(paths: Iterable[str | Path], site: Site, model: str, archive: ProfileArchive,
                  options: SimOptions | None = None) -> ValidationReport:
    """Simulate every measured run under ``paths`` and compare."""
    get_model(model)  # an unknown --model is the command's error, not every file's
    files = find_runs(paths)
    if not files:
        raise SailorError("no plan_config JSON files found", field="PATHS", fix="pass files or folders of them")
    report = ValidationReport([validate_file(f, site, model, archive, options) for f in files])
    if all(r.error for r in report.rows):  # nothing to compare: the input as a whole is wrong
        first = report.rows[0]
        raise SailorError(f"none of the {len(files)} file(s) can be evaluated; the first: {first.error}",
                          field="PATHS", fix="check --site and --model against the runs (e.g. mit/* with "
                                             "mit-mixed.toml, clariden/* with clariden.toml)")
    return report


__all__ = ["DOCUMENTED_ANOMALIES", "ValidationRow", "ValidationReport", "validate_runs", "validate_file", "find_runs",
           "memory_floor", "compute_floor"]
