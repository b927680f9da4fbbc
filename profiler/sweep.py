"""A profiling sweep: submit the jobs, watch them, record every outcome, resume a partial sweep.

``run_sweep`` builds the grid (per partition: micro-batch sizes x TP degrees that fit; network links
inside a node, between two nodes of a partition, between partitions), submits it through submitit
(one job array per partition and TP degree, ``points_per_job`` micro-batch sizes per array element;
one job per network link, a het job between partitions), and watches all jobs with
:class:`sailor_hpc.slurm.watch.JobWatcher`, never submitit's own polling, which loses het jobs and waits
forever on jobs that die without a result.

Outcomes, every one reported and recorded, none dropped:

- a job's own result: per point ok, or failed with its reason (out of memory: the job records it);
- a job that ends without a result (cancelled, node failure, time limit, lost, exception): each of its
  grid points is written to the archive as a failed entry with the Slurm state as the reason;
- ``timeout_s`` reached: the open jobs are cancelled and their points recorded as failed;
- a job whose measurement could not start for a reason of the compute side's environment (no ``srun``, an
  interpreter without torch or submitit: the same on every job) stops the sweep at once with
  :class:`EnvironmentFailure`: the open jobs are cancelled and no failed point is written for it, since
  no point was measured;
- Ctrl-C: :class:`SweepInterrupted` names the jobs that keep running (the caller says how to cancel them
  or finish the sweep with ``resume``);
- a measured point that breaks monotonicity in the micro-batch size against a point another job measured
  (:mod:`profiler.monotonic`; a job checks its own points itself) is measured once more, the pair's
  points in one job per partition and TP degree, and if it still breaks it, flagged in the archive.

State lives in ``<folder>/sweep-state.json`` (unit -> job id, status). ``resume=True`` skips every point
the archive already holds as ok (and every network link it has), re-attaches to jobs of the previous
run that are still queued or running, and submits the rest, so an interrupted or partly failed sweep
is completed by running the same command with ``--resume``.

``local=True`` (``--local``: a laptop, no Slurm) runs every measurement as processes on this machine,
one at a time (:mod:`profiler.local`), through the same functions, archive merge, report and resume; it
measures one machine, so links between nodes or partitions are 'skipped' with the reason.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import submitit

from profiler.executors import Allocation, JobSettings, make_executor
from profiler.fit import check_message_sizes
from profiler.jobs import ComputeTask, NetworkTask, compute_job, network_job, record_network, write_net_spec
from profiler.keys import ComputePoint, NetworkLink, device_key, network_site_key
from profiler.local import run_ranks, task_to_json
from profiler.monotonic import MONOTONIC, ModelTotals, violations
from profiler.noise import flag_parts, with_flag
from profiler.progress import Progress
from sailor_hpc.core.archive import (
    EMBEDDED_ARCHIVE,
    ComputeEntry,
    ProfileArchive,
    make_provenance,
    read_archive,
    write_entries,
)
from sailor_hpc.core.atomic import atomic_write_text
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import get_model
from sailor_hpc.core.precision import DTYPES
from sailor_hpc.core.site import Site
from sailor_hpc.slurm.commands import SlurmRefused, show_nodes
from sailor_hpc.slurm.container import rank_wrapper
from sailor_hpc.slurm.status import JobStatus, poll_jobs
from sailor_hpc.slurm.submit import cancel_job
from sailor_hpc.slurm.watch import JobWatcher

NETWORK_KINDS = ("intra", "inter", "between")
GPU_SIZES = tuple(2 ** e for e in range(16, 31, 2))  # 64 KiB .. 1 GiB, as Sailor's fits
CPU_SIZES = tuple(2 ** e for e in range(16, 25, 2))  # 64 KiB .. 16 MiB (gloo over loopback)
STATE_FILE = "sweep-state.json"


@dataclass(frozen=True)
class SweepConfig:
    site: Site
    model: str
    archive: Path
    partitions: tuple[str, ...] = ()  # () = every partition of the site
    mbs: tuple[int, ...] = (1, 2, 4, 8)
    tp: tuple[int, ...] = (1, 2, 4)
    cpu: bool = False
    compute: bool = True
    network: tuple[str, ...] = NETWORK_KINDS
    senders: tuple[int, ...] = (1, 2, 4)
    sizes: tuple[int, ...] = ()  # () = by device
    dtype: str = "fp32"
    blocks: int | None = None
    warmup: int = 3
    iters: int = 20
    min_time_s: float = 1.0  # timed work per point at least (profiler.compute.Repetitions)
    net_iters: int = 5
    time_min: int = 30
    begin: str | None = None
    folder: Path = Path("sailor-profile")
    python: str = sys.executable
    points_per_job: int = 1
    timeout_s: float | None = None
    lost_after_s: float = 120.0
    poll_s: float = 1.0
    resume: bool = False
    local: bool = False  # run the measurements as processes on this machine (no Slurm)
    deepspeed: bool = False  # also DeepSpeed's engine costs at every TP-1 point (--runtime deepspeed)

    @property
    def part_names(self) -> tuple[str, ...]:
        return self.partitions or tuple(p.name for p in self.site.partitions)

    @property
    def message_sizes(self) -> tuple[int, ...]:
        return self.sizes or (CPU_SIZES if self.cpu else GPU_SIZES)


class EnvironmentFailure(SailorError):
    """A profiling job could not start measuring because of the compute side's environment; every other job
    would fail the same way, so the sweep stopped (exit 2) and recorded no failed point for it."""


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C while the sweep waited; ``jobs``: its Slurm jobs still queued or running, which keep writing
    into the archive."""

    def __init__(self, jobs: Sequence[str]) -> None:
        super().__init__()
        self.jobs = tuple(jobs)


@dataclass
class Unit:
    """One thing the sweep measures: a compute point or a network link."""

    key: str
    point: ComputePoint | None = None
    link: NetworkLink | None = None
    status: str = "pending"  # pending, queued, running, ok, failed, skipped
    job_id: str | None = None
    reason: str = ""
    result: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "status": self.status, "job_id": self.job_id, "reason": self.reason}


@dataclass
class SweepReport:
    units: list[Unit]
    archive: Path
    folder: Path
    seconds: float
    overhead: dict[str, dict[int, float]] = field(default_factory=dict)

    def by_status(self, status: str) -> list[Unit]:
        return [u for u in self.units if u.status == status]

    @property
    def complete(self) -> bool:
        return not self.by_status("failed") and all(u.status in ("ok", "skipped") for u in self.units)

    def to_dict(self) -> dict[str, Any]:
        return {"archive": str(self.archive), "folder": str(self.folder), "seconds": self.seconds,
                "complete": self.complete, "counts": dict(Counter(u.status for u in self.units)),
                "units": [u.to_dict() for u in self.units],
                "overhead": {g: {str(t): b for t, b in v.items()} for g, v in self.overhead.items()}}


# ------------------------------------------------------------------------------------------- checking

def real_path(path: Path) -> Path:
    """``path`` with ``~``, ``..`` and every symlink resolved. The sweep hands paths to jobs on other nodes
    (where the working directory differs and a login node's symlink may not exist or point elsewhere)
    and compares them with the embedded and the site's shared archive (a symlink to either must not
    slip past the checks): only the real path names the same file everywhere. (The interpreter path is
    left alone: a virtual environment's python is a symlink that must stay one.)"""
    return Path(os.path.realpath(path.expanduser()))


def check_config(cfg: SweepConfig) -> None:
    spec = get_model(cfg.model)
    for name in cfg.part_names:
        cfg.site.partition(name)
    if cfg.dtype not in DTYPES:
        raise SailorError(f"unknown dtype {cfg.dtype!r}", field="--dtype", fix=f"use one of {', '.join(DTYPES)}")
    for name in cfg.part_names if not cfg.cpu else ():  # a CPU runs every dtype
        gpu = cfg.site.gpu(cfg.site.partition(name).gpu_type)
        if cfg.dtype not in gpu.dtypes:
            raise SailorError(f"{gpu.name} (partition {name!r}) does not train in {cfg.dtype}", field="--dtype",
                              fix=f"profile it in {' or '.join(gpu.dtypes)}, or leave the partition out (--partitions)")
    for flag, values in (("--mbs", cfg.mbs), ("--tp", cfg.tp), ("--net-senders", cfg.senders)):
        if not values or any(v <= 0 for v in values):
            raise SailorError(f"needs positive integers, got {list(values)}", field=flag)
    if cfg.deepspeed and 1 not in cfg.tp:
        raise SailorError(f"DeepSpeed's engine costs are measured at TP 1, and --tp is {list(cfg.tp)}",
                          field="--runtime", fix="add 1 to --tp, or drop --runtime deepspeed")
    bad = [k for k in cfg.network if k not in NETWORK_KINDS]
    if bad:
        raise SailorError(f"unknown network measurement {bad[0]!r}", field="--network",
                          fix=f"use any of {', '.join(NETWORK_KINDS)} or 'none'")
    if cfg.sizes:
        check_message_sizes(cfg.sizes)
    if cfg.points_per_job <= 0 or cfg.iters <= 0 or cfg.warmup < 0 or cfg.time_min <= 0:
        raise SailorError("points per job, iterations and the time limit must be positive", field="--iters")
    archive = real_path(cfg.archive)
    if archive == real_path(EMBEDDED_ARCHIVE):
        raise SailorError("refusing to write into the embedded Sailor profiles", file=archive, field="--archive",
                          fix="pass the site's shared archive or a file of your own")
    if cfg.cpu:
        shared = cfg.site.archive and real_path(Path(cfg.site.archive)) == archive
        if shared:
            raise SailorError("a CPU sweep may not write into the site's shared archive", file=archive,
                              field="--archive", fix="pass --archive with a test archive of its own")
    del spec
    if cfg.local:
        if cfg.begin:
            raise SailorError("a local sweep starts now", field="--begin", fix="drop --begin, or drop --local")
        if shutil.which(cfg.python) is None:  # started here and now: it must exist here
            raise SailorError(f"no interpreter {cfg.python!r} on this machine", field="--python",
                              fix="pass an existing python (the default is this one)")
        if not cfg.cpu and not _has_cuda(cfg.python):
            raise SailorError("no CUDA device on this machine for a local GPU sweep", field="--cpu",
                              fix="add --cpu to measure on the CPU (recorded under cpu-<GPU type>)")
        return
    _settings(cfg).additional()  # site account/QOS/extra options and --begin, before anything is submitted


def checked(cfg: SweepConfig) -> SweepConfig:
    """``cfg`` with real paths (:func:`real_path`), checked (:func:`check_config`): a caller checks its input
    this way before it looks at the environment."""
    cfg = replace(cfg, archive=real_path(cfg.archive), folder=real_path(cfg.folder))
    check_config(cfg)
    return cfg


def _has_cuda(python: str) -> bool:
    """Whether ``python``'s torch sees a CUDA device (asked in a process of its own: the driver stays torch-free)."""
    probe = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"
    return subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


def grid(cfg: SweepConfig) -> list[Unit]:
    """Every unit of the sweep; TP degrees that cannot run on a partition are 'skipped' with the reason."""
    spec = get_model(cfg.model)
    units: list[Unit] = []
    parts = [cfg.site.partition(n) for n in cfg.part_names]
    for part in parts if cfg.compute else []:
        key = device_key(part.gpu_type, cfg.cpu)
        for tp in sorted(set(cfg.tp)):
            why = ""
            if tp > part.gpus_per_node:
                why = f"TP {tp} does not fit a {part.gpus_per_node}-GPU node of {part.name}"
            elif spec.num_heads % tp or spec.ffn_hidden_size % tp:
                why = f"TP {tp} does not divide {spec.name}'s {spec.num_heads} heads"
            for mbs in sorted(set(cfg.mbs)):
                pt = ComputePoint(part.name, key, mbs, tp)
                units.append(Unit(pt.key, point=pt, status="skipped" if why else "pending", reason=why))
    links: list[NetworkLink] = []
    for part in parts:
        if "intra" in cfg.network:
            links += [NetworkLink("intra", part.name, part.name, k) for k in sorted(set(cfg.senders))
                      if 2 <= k <= part.gpus_per_node]
        if "inter" in cfg.network and min(part.nodes, part.max_nodes_per_job) >= 2:
            links += [NetworkLink("inter", part.name, part.name, k) for k in sorted(set(cfg.senders))
                      if k <= part.gpus_per_node]
    if "between" in cfg.network:
        for i, a in enumerate(parts):
            for b in parts[i + 1:]:
                links += [NetworkLink("inter", a.name, b.name, k) for k in sorted(set(cfg.senders))
                          if k <= min(a.gpus_per_node, b.gpus_per_node)]
    one_machine = "--local measures this machine only: there is no second node or partition to reach"
    units += [Unit(link.key, link=link, status="skipped" if cfg.local and link.kind != "intra" else "pending",
                   reason=one_machine if cfg.local and link.kind != "intra" else "") for link in links]
    return units


# ------------------------------------------------------------------------------------------- resume

def _archive_or_empty(path: Path) -> ProfileArchive:
    return read_archive(path) if path.exists() else ProfileArchive()


def _network_path(cfg: SweepConfig, link: NetworkLink) -> str:
    return f"network/{network_site_key(cfg.site.name, cfg.cpu)}/{link.kind}:{link.a}:{link.b}:{link.senders}"


def mark_done(cfg: SweepConfig, units: Sequence[Unit], archive: ProfileArchive) -> None:
    """Resume: units the archive already holds (ok compute points in this dtype, network links) are done."""
    spec = get_model(cfg.model)
    have_net = {e.path for links in archive.network.values() for e in links}
    for u in units:
        if u.status != "pending":
            continue
        if u.point is not None:
            e = archive.compute.get((spec.name, u.point.gpu_key, cfg.dtype), {}).get((u.point.mbs, u.point.tp))
            if e is not None:
                u.status, u.reason = "ok", "in the archive already"
        elif u.link is not None and _network_path(cfg, u.link) in have_net:
            u.status, u.reason = "ok", "in the archive already"


def load_state(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def save_state(cfg: SweepConfig, units: Sequence[Unit]) -> None:
    doc = {"model": cfg.model, "site": cfg.site.name, "archive": str(cfg.archive), "cpu": cfg.cpu,
           "units": {u.key: u.to_dict() for u in units}}
    atomic_write_text(cfg.folder / STATE_FILE, json.dumps(doc, indent=1) + "\n")


def reattach(units: Sequence[Unit], state: dict[str, Any]) -> None:
    """Resume: pending units whose job from the previous run is still queued or running are watched again."""
    old = {k: v for k, v in state.get("units", {}).items() if v.get("job_id") and v.get("status") in
           ("queued", "running")}
    ids = sorted({v["job_id"] for v in old.values()})
    alive = {j for j, st in poll_jobs(ids).items() if st.known and not st.final} if ids else set()
    for u in units:
        v = old.get(u.key)
        if u.status == "pending" and v is not None and v["job_id"] in alive:
            u.status, u.job_id, u.reason = "queued", v["job_id"], "re-attached"


# ------------------------------------------------------------------------------------------- submitting

def shared_hosts(partitions: Sequence[str]) -> dict[str, list[str]]:
    """Machines that carry several Slurm nodes of ``partitions`` (``NodeHostName``), with those nodes: a test lab
    runs one slurmd per fake node on one host. None on a cluster whose nodes are machines of their own."""
    by_host: dict[str, list[str]] = defaultdict(list)
    for node in show_nodes():
        if set(node.partitions) & set(partitions):
            by_host[node.raw.get("NodeHostName") or node.name].append(node.name)
    return {host: sorted(nodes) for host, nodes in sorted(by_host.items()) if len(nodes) > 1}


@dataclass
class Queue:
    """How a sweep queues its measuring jobs so that none times another's work (on the 2-core test lab, 13
    jobs at once measured 3-7x what training then took). Every job owns its nodes (``--exclusive``:
    :meth:`profiler.executors.JobSettings.per_component`). Where Slurm's nodes share a machine
    (:func:`shared_hosts`), exclusive nodes still share its cores, so there the jobs also run one after the
    other: each after the jobs submitted before it, an array's elements one at a time."""

    shared: dict[str, list[str]] = field(default_factory=dict)
    after: list[str] = field(default_factory=list)  # the jobs the next one waits for

    @property
    def serial(self) -> bool:
        return bool(self.shared)

    def options(self) -> dict[str, Any]:
        """``make_executor``'s ordering arguments for the next job."""
        return {"after": tuple(self.after), "one_at_a_time": True} if self.serial else {}

    def submitted(self, job_id: str) -> None:
        if self.serial:
            self.after = [job_id.split("_")[0]]  # an array element's id: the array's, which ends with its last

    def why(self) -> str:
        machines = "; ".join(f"{', '.join(nodes)} on {host}" for host, nodes in self.shared.items())
        return (f"Slurm nodes share a machine ({machines}): measuring jobs run one at a time, so that none "
                "times another's work")


def _settings(cfg: SweepConfig) -> JobSettings:
    return JobSettings(folder=cfg.folder, python=cfg.python, time_min=cfg.time_min, site=cfg.site, begin=cfg.begin,
                       setup=tuple(cfg.site.prelude))


def _fail(units: Sequence[Unit], reason: str) -> None:
    for u in units:
        u.status, u.reason = "failed", reason


def compute_groups(cfg: SweepConfig, units: Sequence[Unit], *, remeasure: bool = True
                   ) -> dict[tuple[str, int], list[tuple[list[Unit], ComputeTask]]]:
    """The pending compute points by (partition, TP degree), in chunks of ``points_per_job`` micro-batch
    sizes, each chunk with the task one job (or one local run) measures."""
    groups: dict[tuple[str, int], list[tuple[ComputePoint, Unit]]] = defaultdict(list)
    for u in units:
        if u.point is not None and u.status == "pending":
            groups[(u.point.partition, u.point.tp)].append((u.point, u))
    spec = get_model(cfg.model)
    out: dict[tuple[str, int], list[tuple[list[Unit], ComputeTask]]] = {}
    for (part_name, tp), members in groups.items():
        members.sort(key=lambda pu: pu[0].mbs)
        chunks = [members[i:i + cfg.points_per_job] for i in range(0, len(members), cfg.points_per_job)]
        out[(part_name, tp)] = [
            ([u for _, u in c],
             ComputeTask(model=spec.name, partition=part_name, gpu_key=c[0][0].gpu_key, tp=tp,
                         mbs=tuple(p.mbs for p, _ in c), archive=str(cfg.archive), cpu=cfg.cpu,
                         sweep=str(cfg.folder), dtype=cfg.dtype, blocks=cfg.blocks, warmup=cfg.warmup,
                         iters=cfg.iters, min_time_s=cfg.min_time_s, remeasure=remeasure,
                         deepspeed=cfg.deepspeed and tp == 1)) for c in chunks]
    return out


def network_task(cfg: SweepConfig, link: NetworkLink) -> NetworkTask:
    nodes = 1 if link.kind == "intra" or link.het else 2
    return NetworkTask(site_key=network_site_key(cfg.site.name, cfg.cpu), kind=link.kind, a=link.a, b=link.b,
                       senders=link.senders, nodes=nodes, sizes=cfg.message_sizes, archive=str(cfg.archive),
                       cpu=cfg.cpu, sweep=str(cfg.folder), folder=str(cfg.folder), python=cfg.python,
                       iters=cfg.net_iters, wrapper=rank_wrapper(cfg.site.container))


def submit_compute(cfg: SweepConfig, units: Sequence[Unit], *, remeasure: bool = True, queue: Queue | None = None) -> None:
    settings = _settings(cfg)
    queue = queue or Queue()
    spec = get_model(cfg.model)
    for (part_name, tp), group in compute_groups(cfg, units, remeasure=remeasure).items():
        members = [u for chunk, _ in group for u in chunk]
        chunks = [chunk for chunk, _ in group]
        tasks = [task for _, task in group]
        alloc = Allocation(cfg.site.partition(part_name), nodes=1, tasks_per_node=tp)
        try:
            ex = make_executor(settings, alloc, job_name=f"sailor-prof-{spec.name}-{part_name}-tp{tp}", **queue.options())
            jobs = ex.map_array(compute_job, tasks) if len(tasks) > 1 else [ex.submit(compute_job, tasks[0])]
            queue.submitted(str(jobs[-1].job_id))
        except SailorError:
            raise
        except Exception as exc:  # noqa: BLE001 - sbatch refused: every point of the group failed
            _fail(members, f"submission failed: {str(exc).strip().splitlines()[-1][:300]}")
            continue
        for chunk, job in zip(chunks, jobs):
            for u in chunk:
                u.status, u.job_id, u.reason = "queued", str(job.job_id), ""


def submit_network(cfg: SweepConfig, units: Sequence[Unit], *, queue: Queue | None = None) -> None:
    settings = _settings(cfg)
    queue = queue or Queue()
    for u in units:
        if u.link is None or u.status != "pending":
            continue
        link = u.link
        a = cfg.site.partition(link.a)
        task = network_task(cfg, link)
        nodes = task.nodes
        het = Allocation(cfg.site.partition(link.b), 1, link.senders) if link.het else None
        try:
            ex = make_executor(settings, Allocation(a, nodes, link.senders), one_task=True, het=het,
                               job_name=f"sailor-net-{link.kind}-{link.a}-{link.b}-k{link.senders}", **queue.options())
            job = ex.submit(network_job, task)
            queue.submitted(str(job.job_id))
        except SailorError:
            raise
        except Exception as exc:  # noqa: BLE001
            _fail([u], f"submission failed: {str(exc).strip().splitlines()[-1][:300]}")
            continue
        u.status, u.job_id, u.reason = "queued", str(job.job_id), ""


# ------------------------------------------------------------------------------------------- local

def _local_files(cfg: SweepConfig, name: str, world: int) -> tuple[Path, list[Path]]:
    stem = cfg.folder / f"local-{name}"
    return stem, [stem.with_name(f"{stem.name}.rank{r}.log") for r in range(world)]


def _timeout_note(cfg: SweepConfig) -> str:
    return f" of {cfg.timeout_s:.0f} s" if cfg.timeout_s is not None else ""


def measure_locally(cfg: SweepConfig, units: Sequence[Unit], progress: Progress, deadline: float | None, *,
                    remeasure: bool = True) -> None:
    """Measure every pending unit as processes on this machine, one measurement at a time, recording each
    outcome as :func:`_watch` records a job's."""
    todo: list[tuple[list[Unit], Any]] = [pair for group in compute_groups(cfg, units, remeasure=remeasure).values()
                                          for pair in group]
    todo += [([u], network_task(cfg, u.link)) for u in units if u.link is not None and u.status == "pending"]
    for members, task in todo:
        if deadline is not None and time.monotonic() >= deadline:  # what the timeout left is not started
            _fail(members, f"not measured: the sweep's timeout{_timeout_note(cfg)} came first")
            for u in members:
                progress.message(f"failed: {u.key}: {u.reason}")
            continue
        for u in members:
            u.status = "running"
        save_state(cfg, units)
        progress.update(_counts(units))
        value, reason = None, ""
        if isinstance(task, ComputeTask):
            name = f"tp{task.tp}-{task.partition}-mbs{'-'.join(map(str, task.mbs))}"
            stem, logs = _local_files(cfg, name, task.tp)
            task_file, out = stem.with_suffix(".task.json"), stem.with_suffix(".result.json")
            atomic_write_text(task_file, task_to_json(task))
            out.unlink(missing_ok=True)
            ran = run_ranks([cfg.python, "-m", "profiler.local", str(task_file), str(out)], task.tp, logs, deadline,
                            _timeout_note(cfg))
            if not ran.reason:
                value = json.loads(out.read_text()) if out.exists() else None
                reason = "" if value is not None else f"rank 0 wrote no result ({out})"
        else:
            name = f"net-{task.kind}-{task.a}-{task.b}-k{task.senders}"
            stem, logs = _local_files(cfg, name, task.senders)
            spec_file, out = stem.with_suffix(".spec.json"), stem.with_suffix(".result.json")
            write_net_spec(task, spec_file)
            out.unlink(missing_ok=True)
            ran = run_ranks([cfg.python, "-m", "profiler.netbench", "--spec", str(spec_file), "--out", str(out)],
                            task.senders, logs, deadline, _timeout_note(cfg))
            if not ran.reason:
                value = record_network(task, json.loads(out.read_text())) if out.exists() else None
                reason = "" if value is not None else f"rank 0 wrote no result ({out})"
        for u in members:
            u.job_id = f"local:{ran.pid}"
        apply_result(members, value, ran.reason or reason)
        _tell(members, progress)
    save_state(cfg, units)
    progress.update(_counts(units))


def _measure(cfg: SweepConfig, units: Sequence[Unit], progress: Progress, deadline: float | None,
             queue: Queue) -> None:
    """Measure the pending units (Slurm jobs, or local processes) and record every outcome."""
    if cfg.local:
        measure_locally(cfg, units, progress, deadline)
        return
    submit_compute(cfg, units, queue=queue)
    submit_network(cfg, units, queue=queue)
    save_state(cfg, units)
    for u in units:
        if u.status == "failed":
            progress.message(f"failed: {u.key}: {u.reason}")
    _watch(cfg, units, progress, deadline)


# ------------------------------------------------------------------------------------------- results

def _error_summary(exc: BaseException) -> str:
    """The last line of a job's traceback (submitit puts the whole trace into the exception)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip() and not set(line.strip()) <= {"-"}]
    tail = [line for line in lines if not line.startswith(("You can check", "or at paths", "- /"))]
    return (tail[-1] if tail else type(exc).__name__)[:400]


def job_result(folder: Path, job_id: str, status: JobStatus, wait_s: float = 10.0) -> tuple[Any, str]:
    """(result, "") from task 0's result file, or (None, reason) when the job ended without one."""
    job: submitit.SlurmJob[Any] = submitit.SlurmJob(folder=folder, job_id=job_id, tasks=[0])
    pickle = job.paths.result_pickle
    # a job that never got a node (cancelled while pending) has no result to wait for: a cancelled sweep
    # of many queued jobs would otherwise report a second per job late
    grace = wait_s if status.ok else 1.0 if status.nodes else 0.0
    deadline = time.monotonic() + grace
    while not pickle.exists() and time.monotonic() < deadline:  # shared filesystems can lag
        time.sleep(0.2)
    if pickle.exists():
        try:
            return job.result(), ""
        except Exception as exc:  # noqa: BLE001 - the function raised in the job
            return None, f"job {job_id} raised: {_error_summary(exc)}"
    where = f" on {', '.join(status.nodes)}" if status.nodes else ""
    detail = "; ".join(sorted({c.reason or c.exit_code for c in status.components if c.reason or c.exit_code}))
    if status.state == "COMPLETED":
        return None, f"job {job_id} completed{where} without a result file ({pickle})"
    return None, f"job {job_id} {status.state}{where}" + (f" ({detail})" if detail and detail != "0:0" else "")


_SUBMITIT_START = "Starting with"  # submitit's log line once the job's function runs
_IMPORT_ERRORS = ("raised: ModuleNotFoundError", "raised: ImportError")
_STEP_EXIT = re.compile(r"^srun: error: .*task \d+: Exited with exit code")


def environment_cause(folder: Path, job_id: str, status: JobStatus, reason: str) -> str | None:
    """Why a job that ended without a measurement could not start one, when the cause is the compute side's
    environment rather than the measurement: its function could not import its modules, or the job failed
    before its function ran (its log has output, but not submitit's start line: ``srun`` missing, an
    interpreter without submitit, the site's prelude failing). None for anything else (out of memory is a
    point's result; a cancelled, lost or timed-out job is not the environment's)."""
    if any(marker in reason for marker in _IMPORT_ERRORS):
        return reason.split("raised: ", 1)[1]
    if status.state != "FAILED" or " raised: " in reason:
        return None
    log = submitit.SlurmJob(folder=folder, job_id=job_id, tasks=[0]).paths.stdout
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return None
    if not lines or any(_SUBMITIT_START in line for line in lines):
        return None
    said = [line for line in lines if not _STEP_EXIT.search(line)] or lines  # srun's exit line names no cause
    return f"{said[-1][:300]} (in {log})"


def apply_result(units: Sequence[Unit], value: Any, reason: str) -> None:
    """Update the units of one job from its outcome."""
    if value is None:
        _fail(units, reason)
        return
    if "points" in value:
        by_mbs = {p["mbs"]: p for p in value["points"]}
        for u in units:
            p = by_mbs.get(u.point.mbs) if u.point else None
            if p is None:
                u.status, u.reason = "failed", "the job returned no result for this point"
            else:
                u.status, u.reason = ("ok", "") if p["ok"] else ("failed", p["reason"])
                if p["ok"] and p.get("flag"):  # measured, but the job doubts it (a busy node, out of order)
                    u.reason = f"flagged: {p['flag']}"
            u.result = value
    else:
        for u in units:
            u.status, u.reason, u.result = "ok", "", value


def _tell(units: Sequence[Unit], progress: Progress) -> None:
    """A person hears of every point that failed, and of every point measured but doubted, as it ends."""
    for u in units:
        if u.status == "failed":
            progress.message(f"failed: {u.key}: {u.reason}")
        elif u.reason.startswith("flagged: "):
            progress.message(f"{u.reason.replace('flagged: ', f'flagged: {u.key}: ', 1)}")


def record_failures(cfg: SweepConfig, units: Sequence[Unit]) -> None:
    """Failed compute points the jobs could not record themselves go into the archive as failed entries."""
    spec = get_model(cfg.model)
    L = spec.num_pipeline_layers
    entries = []
    for u in units:
        if u.point is None or u.status != "failed" or (u.result and "points" in u.result):
            continue  # the job recorded its own failure (e.g. out of memory)
        prov = make_provenance(f"sailor-hpc profile ({cfg.folder})", device="cpu" if cfg.cpu else "cuda",
                               partition=u.point.partition, slurm_job=u.job_id, recorded_by="sweep driver")
        entries.append(ComputeEntry(spec.name, u.point.gpu_key, u.point.mbs, u.point.tp, np.full((L, 3), np.nan),
                                    prov, status="failed", reason=u.reason, dtype=cfg.dtype))
    if entries:
        write_entries(cfg.archive, entries)


def record_overhead(units: Sequence[Unit]) -> dict[str, dict[int, float]]:
    """The per-TP fixed memory the compute jobs of this sweep measured (each job wrote its own into the
    archive, where an overhead entry adds its TP degree to the GPU's table), for the report."""
    found: dict[str, dict[int, float]] = defaultdict(dict)
    for u in units:
        if u.point is not None and u.result and u.result.get("overhead_bytes") is not None and u.status == "ok":
            found[u.point.gpu_key][u.result["tp"]] = float(u.result["overhead_bytes"])
    return {k: dict(v) for k, v in found.items()}


# ------------------------------------------------------------------------------------------- the sweep

def _counts(units: Sequence[Unit]) -> Counter[str]:
    return Counter(u.status for u in units)


def _watch(cfg: SweepConfig, units: Sequence[Unit], progress: Progress, deadline: float | None) -> None:
    """Follow the queued units' jobs until each has ended (or the deadline cancelled it), recording outcomes."""
    by_job: dict[str, list[Unit]] = defaultdict(list)
    for u in units:
        if u.status == "queued" and u.job_id:
            by_job[u.job_id].append(u)
    watcher = JobWatcher(poll_s=cfg.poll_s, lost_after_s=cfg.lost_after_s)
    watcher.add(by_job)
    progress.update(_counts(units))
    while watcher.open:
        for jid, st in watcher.poll().items():
            members = by_job[jid]
            if not st.final:
                for u in members:
                    u.status = "running" if st.state == "RUNNING" else "queued"
                continue
            value, reason = job_result(cfg.folder, jid, st)
            cause = environment_cause(cfg.folder, jid, st, reason) if value is None else None
            if cause is not None:
                _stop_for_environment(cfg, units, by_job, watcher.open, jid, cause)
            apply_result(members, value, reason)
            _tell(members, progress)
        save_state(cfg, units)
        progress.update(_counts(units))
        if not watcher.open:
            break
        if deadline is not None and time.monotonic() >= deadline:
            for jid in watcher.open:
                cancel_job(jid)
                last = watcher.status(jid)
                _fail(by_job[jid], f"job {jid} still {last.state if last else 'queued'}"
                                   f" after the sweep's timeout of {cfg.timeout_s:.0f} s: cancelled")
                for u in by_job[jid]:
                    progress.message(f"failed: {u.key}: {u.reason}")
            break
        time.sleep(cfg.poll_s)


def _stop_for_environment(cfg: SweepConfig, units: Sequence[Unit], by_job: dict[str, list[Unit]],
                          still_open: Sequence[str], jid: str, cause: str) -> None:
    """Cancel the sweep's open jobs and raise :class:`EnvironmentFailure`; their units are left pending (not
    failed, nothing recorded): a resumed sweep measures them once the environment is fixed."""
    for other in still_open:
        if other != jid:
            with contextlib.suppress(SlurmRefused):  # it ended meanwhile
                cancel_job(other)
    for u in units:
        if u.status in ("queued", "running") or u.job_id == jid:
            u.status, u.job_id, u.reason = "pending", None, f"not measured: {cause}"
    save_state(cfg, units)
    n = len(by_job)
    raise EnvironmentFailure(f"profiling job {jid} could not start measuring: {cause}. This is the compute "
                             f"side's environment, the same for every job: the sweep stopped and cancelled its "
                             f"other {n - 1} job(s); no failed point was written", field="--python",
                             fix="make srun, and torch, megatron-core and submitit in --python, available on the "
                                 "compute nodes (the site's [environment].prelude sets their environment up), then "
                                 "run the same command with --resume")


def open_jobs(units: Sequence[Unit]) -> list[str]:
    """The sweep's Slurm jobs still queued or running (a local sweep's processes end with it)."""
    return sorted({u.job_id for u in units if u.job_id and u.status in ("queued", "running")
                   and not u.job_id.startswith("local:")})


def non_monotonic(cfg: SweepConfig, units: Sequence[Unit], archive: ProfileArchive) -> dict[str, tuple[Unit, str]]:
    """unit key -> (unit, why) for this sweep's measured points that break monotonicity against any measured
    point of the same profile (GPU key, TP degree, dtype) in the archive, whichever job measured it."""
    name = get_model(cfg.model).name
    mine = {(u.point.gpu_key, u.point.tp, u.point.mbs): u for u in units if u.point is not None and u.status == "ok"}
    found: dict[str, tuple[Unit, str]] = {}
    for gpu_key, tp in sorted({(g, t) for g, t, _ in mine}):
        points = archive.compute.get((name, gpu_key, cfg.dtype), {})
        totals = [ModelTotals.of(b, e.times, e.spread) for (b, t), e in points.items() if t == tp]
        for mbs, why in violations(totals).items():
            u = mine.get((gpu_key, tp, mbs))
            if u is not None:
                found[u.key] = (u, why)
    return found


def recheck_monotonic(cfg: SweepConfig, units: Sequence[Unit], progress: Progress, deadline: float | None,
                      queue: Queue | None = None) -> None:
    """Points that break monotonicity across jobs are measured once more (those a job flagged itself were
    already), then flagged in the archive if they still break it. A re-measure that fails keeps the first
    measurement: the point is in the archive, and a resumed sweep would not measure it again."""
    archive = _archive_or_empty(cfg.archive)
    name = get_model(cfg.model).name

    def entry(u: Unit) -> ComputeEntry:
        assert u.point is not None
        return archive.compute[(name, u.point.gpu_key, cfg.dtype)][(u.point.mbs, u.point.tp)]

    again = [(u, why) for u, why in non_monotonic(cfg, units, archive).values()
             if MONOTONIC not in flag_parts(entry(u).flag)]
    if again:
        for u, why in again:
            progress.message(f"measuring again: {u.key}: {why}")
            u.status, u.reason = "pending", ""
        # the pair's points in one job per partition and TP degree, which checks them itself and flags
        # what still breaks, without a third measurement
        again_cfg = replace(cfg, points_per_job=len(again))
        if cfg.local:
            measure_locally(again_cfg, units, progress, deadline, remeasure=False)
        else:
            submit_compute(again_cfg, [u for u, _ in again], remeasure=False,
                           queue=Queue(queue.shared) if queue else None)  # the first jobs have ended
            save_state(cfg, units)
            _watch(cfg, units, progress, deadline)
        for u, why in again:
            u.reason = f"measured again ({why})" if u.status == "ok" else \
                f"first measurement kept; measuring again failed: {u.reason}"
            u.status = "ok"
        archive = _archive_or_empty(cfg.archive)
    flags = [(u, replace(entry(u), flag=with_flag(entry(u).flag, why, MONOTONIC)))
             for u, why in non_monotonic(cfg, units, archive).values()]
    for u, e in flags:
        u.reason = f"flagged: {e.flag}"
        progress.message(f"flagged: {u.key}: {e.flag}")
    changed = [e for u, e in flags if e.flag != entry(u).flag]
    if changed:
        write_entries(cfg.archive, changed)


def run_sweep(cfg: SweepConfig, progress: Progress | None = None) -> SweepReport:
    """Run (or, with ``cfg.resume``, complete) a sweep; returns every unit's outcome."""
    cfg = checked(cfg)
    cfg.folder.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    units = grid(cfg)
    if cfg.resume:
        mark_done(cfg, units, _archive_or_empty(cfg.archive))
        if not cfg.local:  # a local sweep's processes ended with its driver: nothing to re-attach to
            reattach(units, load_state(cfg.folder))
    progress = progress or Progress(len(units))
    deadline = None if cfg.timeout_s is None else time.monotonic() + cfg.timeout_s
    queue = Queue() if cfg.local else Queue(shared_hosts(cfg.part_names))
    if queue.serial:
        progress.message(queue.why())
        queue.after = open_jobs(units)  # re-attached jobs of the run before: the first new job waits for them
    try:
        _measure(cfg, units, progress, deadline, queue)
        if cfg.compute:
            recheck_monotonic(cfg, units, progress, deadline, queue)
    except KeyboardInterrupt:
        raise SweepInterrupted(open_jobs(units)) from None
    finally:
        save_state(cfg, units)
        progress.update(_counts(units))
        progress.close()
    record_failures(cfg, units)
    overhead = record_overhead(units)
    return SweepReport(units=units, archive=cfg.archive, folder=cfg.folder, seconds=time.monotonic() - t0,
                       overhead=overhead)
