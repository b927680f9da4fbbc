"""Render the training job script of a plan on a site (``sbatch_templates/train.sbatch.j2``).

One ``#SBATCH`` component per partition the plan uses (het job; a plan on one partition renders an
ordinary job), nodes / tasks / GPUs / CPUs from the plan's placement and the site, time, account,
QOS and constraint from the site and the caller, the site's environment prelude, the rendezvous
address from het group 0, and one ``srun`` step that starts the runtime (``megatron_patch.launch``, DeepSpeed's
``megatron_patch.ds_runtime.launch``, or the user's own DeepSpeed script with the plan's ds_config.json) on
every rank through :mod:`sailor_hpc.jobs.rank_env`. Every user-supplied value is validated or quoted here
(:mod:`sailor_hpc.slurm.safety`); the template only lays values out.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

import sbatch_templates
from sailor_hpc import __version__
from sailor_hpc.core.atomic import atomic_write_text, removed_on_error
from sailor_hpc.core.deepspeed_plan import check_engine_plan
from sailor_hpc.core.dist_env import EXIT_SAVED_ON_SIGNAL, JOB_PORT_BASE, JOB_PORT_SPAN
from sailor_hpc.core.ds_config import check_ds_config_file
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import get_model
from sailor_hpc.core.paths import writable_dir
from sailor_hpc.core.placement import place_plan
from sailor_hpc.core.plan import Plan, validate_plan
from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.roles import rank_roles
from sailor_hpc.core.sailor_compat.plans import is_sailor_plan
from sailor_hpc.core.site import Partition, Site, parse_walltime
from sailor_hpc.core.training import DataBlend
from sailor_hpc.jobs.layout import JobLayout, component_layout, job_layout
from sailor_hpc.jobs.options import (
    DEFAULT_RENDEZVOUS_WAIT_S,
    LAUNCH_MODULES,
    BundlePart,
    ClusterPart,
    InPlace,
    JobOptions,
    Training,
    UserEntry,
    parse_time_limit,
)
from sailor_hpc.slurm import safety
from sailor_hpc.slurm.container import rank_wrapper
from sailor_hpc.slurm.handle import SlurmCluster

DEFAULT_TIME = "01:00:00"
MAX_SIGNAL_GRACE_S = 300  # SIGUSR1 this long before the time limit (capped at a tenth of the limit)
#: once one rank exits, the others get this long (at least the checkpoint grace) before srun kills them: a
#: rank that finished saving its layers must not kill one still saving (no --kill-on-bad-exit, which
#: would turn a clean exit 75 of one rank into SIGTERM for the rest), and a crashed rank must not leave
#: the others blocked in a collective until the runtime's collective timeout
MIN_RANK_EXIT_WAIT_S = 60


@dataclass(frozen=True)
class ComponentView:
    """What the template needs of one het component (all values already validated)."""

    index: int
    partition: str
    nodes: int
    tasks_per_node: int
    gres: str
    cpus_per_task: int


def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(sbatch_templates.TEMPLATE_DIR)),
                              undefined=jinja2.StrictUndefined, autoescape=False, trim_blocks=True,
                              lstrip_blocks=True, keep_trailing_newline=True)


def cpus_per_task(part: Partition) -> int:
    """The CPUs each rank (one GPU) of a job on ``part`` asks for: the node's CPUs shared by its GPUs."""
    return max(1, part.cpus_per_node // part.gpus_per_node)


def components_for(layout: JobLayout, site: Site) -> list[ComponentView]:
    out = []
    for comp in layout.components:
        part = site.partition(comp.partition)
        safety.slurm_word(part.name, f"partitions[{part.name}].name")
        out.append(ComponentView(index=comp.index, partition=part.name, nodes=comp.nodes,
                                 tasks_per_node=comp.tasks_per_node, gres=f"{part.gres}:{comp.tasks_per_node}",
                                 cpus_per_task=cpus_per_task(part)))
    return out


def job_time(time: str | None, site: Site, layout: JobLayout) -> tuple[str, int]:
    """The job's time limit (Slurm text, seconds), checked against every used partition's maximum."""
    limits = [(p.name, p.max_walltime_s) for p in (site.partition(c.partition) for c in layout.components)
              if p.max_walltime_s is not None]
    if time is None:
        seconds = parse_walltime(DEFAULT_TIME)
        if limits:
            seconds = min([seconds] + [s for _, s in limits])
    else:
        norm, seconds = parse_time_limit(time)
        for name, limit in limits:
            if seconds > limit:
                raise SailorError(f"time limit {norm} exceeds partition {name!r}'s maximum {site.partition(name).max_walltime}",
                                  field="--time", fix="ask for less time; the job requeues itself after a checkpoint")
    if seconds <= 0:
        raise SailorError("the time limit must be positive", field="--time")
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return (f"{days}-{text}" if days else text), seconds


def _time_min(time_min: str | None, limit_s: int) -> str | None:
    """``--time-min`` as Slurm text, checked to be positive and at most the job's limit (sbatch would
    otherwise refuse the job or silently raise it)."""
    if time_min is None:
        return None
    norm, seconds = parse_time_limit(time_min)
    if not 0 < seconds <= limit_s:
        raise SailorError(f"--time-min {norm} must be positive and at most the job's time limit ({limit_s} s)",
                          field="--time-min", fix="give a minimum below --time")
    return norm


def _plan_file_matches(plan: Plan, plan_path: Path) -> None:
    if not plan_path.is_file():
        raise SailorError("the plan file the job will read does not exist", file=plan_path, field="plan_path",
                          fix="write the (placed) plan there first")
    on_disk = load_plan(plan_path, validate=False)
    if on_disk != plan:
        raise SailorError("the plan file differs from the plan being rendered (placement or layers)", file=plan_path,
                          field="plan_path", fix="save the placed plan to this path and render again")


def check_training_args(data: object | None, save: object | None, steps: int, *, dry_run: bool = False,
                        dry_run_option: str | None = None) -> None:
    """What a training job needs besides the plan (callers check it before a long search).

    ``dry_run_option`` is the calling command's flag for a job that does not train, if it has one: the
    fix only offers it then (``plan --sbatch`` and ``run`` have none).
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps <= 0:
        raise SailorError(f"must be a positive integer, got {steps!r}", field="--steps")
    if not dry_run and (data is None or save is None):
        missing = "--data" if data is None else "--save"
        fix = "pass --data PREFIX and --save DIR"
        if dry_run_option:
            fix += f" (or {dry_run_option} for a job whose ranks only print their role)"
        raise SailorError("training needs a dataset prefix and a checkpoint directory", field=missing, fix=fix)


def check_job_dir(path: str | os.PathLike[str], field: str) -> Path:
    """A directory the job or sailor-hpc writes to, checked before anything is written: it exists or can
    be created, and is writable (:func:`sailor_hpc.core.paths.writable_dir`). Slurm does not create a
    missing ``--output`` directory: the job would start, fail to open its log and end without a word."""
    target = Path(path).expanduser().absolute()
    if "%" in str(target):
        raise SailorError("the path has a '%': Slurm expands %-patterns (%u, %j, ...) in the job's log path, so "
                          "the log would go to a directory that was never created", file=target, field=field,
                          fix="choose a directory path without '%'")
    return writable_dir(target, field)


@dataclass(frozen=True)
class ClusterJob:
    """Which part of a plan one script runs: all of it (``cluster`` None), or one cluster's ranks of a plan
    across clusters, whose script either publishes the rendezvous (it holds plan rank 0) or waits for it."""

    cluster: str | None
    partitions: tuple[str, ...] | None  # None: every partition of the plan
    hosts_rendezvous: bool


def plan_clusters(plan: Plan, site: Site) -> list[str]:
    """The clusters a (placed) plan uses, the one holding plan rank 0 first: its job hosts the rendezvous."""
    order = [site.cluster_of(str(r.partition)) for r in rank_roles(plan)]
    return list(dict.fromkeys(order))


def cluster_job(plan: Plan, site: Site, cluster: str | None, rendezvous_file: object | None, requeue: bool) -> ClusterJob:
    """Check that one script can run this (part of the) plan and say which part.

    A (het) job cannot span clusters, so a plan across clusters renders one script per cluster, each
    submitted with that cluster's ``SLURM_CONF`` (:func:`cluster_submit_env`). A cluster reached by ``-M``
    is refused: the controller's squeue/scontrol calls would not reach its jobs either."""
    used = plan_clusters(plan, site)
    if cluster is None:
        if len(used) > 1:
            raise SailorError(f"the plan spans clusters {', '.join(sorted(used))}; one Slurm job cannot",
                              file=site.source, field="clusters",
                              fix="plan inside one cluster (--available with its partitions only); a plan across "
                                  "clusters runs as one job per cluster under `sailor-hpc run` (the co-"
                                  "scheduler)")
        if used and used[0] and (site.cluster(used[0]).slurm_cluster or site.cluster(used[0]).slurm_conf):
            raise SailorError(f"cluster {used[0]!r} is reached by -M or its own SLURM_CONF; name it (cluster=...) so "
                              "the job is submitted there", file=site.source, field=f"clusters[{used[0]}]",
                              fix="render with cluster=NAME and submit with cluster_submit_env")
        return ClusterJob(None, None, True)
    if cluster not in used:
        raise SailorError(f"the plan has no rank on cluster {cluster!r} (it uses {', '.join(used)})",
                          file=site.source, field="clusters", fix="render scripts only for the plan's clusters")
    if site.cluster(cluster).slurm_cluster:
        raise SailorError(f"cluster {cluster!r} is reached by -M, which jobs and the controller do not carry yet",
                          file=site.source, field=f"clusters[{cluster}].slurm_cluster",
                          fix="give the cluster its own slurm_conf instead of slurm_cluster")
    if len(used) > 1 and rendezvous_file is None:
        raise SailorError("a plan across clusters needs one rendezvous file that every cluster's job can read",
                          field="rendezvous_file", fix="pass a fresh path on a filesystem all clusters share")
    if len(used) > 1 and requeue:
        raise SailorError("one cluster's job requeued alone would wait for ranks that have left",
                          field="requeue", fix="render with requeue=False; the controller resubmits every cluster's job")
    parts = tuple(sorted({str(s.partition) for p in plan.pipelines for s in p.stages
                          if site.cluster_of(str(s.partition)) == cluster}))
    return ClusterJob(cluster, parts if len(used) > 1 else None, cluster == used[0])


def bundle_partitions(plan: Plan) -> list[str]:
    """The partition of each component of a (placed) plan's job layout, in order, plan rank 0's first: a bundle
    has one job per component (two components may share a partition: nodes with different numbers of ranks)."""
    return [c.partition for c in job_layout(plan).components]


def bundle_job(plan: Plan, bundle: BundlePart, requeue: bool) -> ClusterJob:
    """Check that one job of a bundle can run: the plan's component ``bundle.index`` is on its partition."""
    order = bundle_partitions(plan)
    if bundle.count != len(order) or bundle.index >= len(order) or order[bundle.index] != bundle.partition:
        raise SailorError(f"job {bundle.index} of {bundle.count} on partition {bundle.partition!r} is not the "
                          f"plan's (its components' partitions in order: {', '.join(order)})", field="bundle",
                          fix="render one job per component of the plan, in bundle_partitions' order")
    if requeue:
        raise SailorError("one job of a bundle requeued alone would wait for ranks that have left", field="requeue",
                          fix="render with requeue=False; the controller resubmits every job of the bundle")
    return ClusterJob(None, None, bundle.index == 0)


def cluster_submit_env(site: Site, cluster: str | None, env: Mapping[str, str]) -> dict[str, str]:
    """The environment to submit (and query) ``cluster``'s job with: its own ``SLURM_CONF`` if it has one."""
    out = dict(env)
    conf = site.cluster(cluster).slurm_conf if cluster else ""
    if conf:
        out["SLURM_CONF"] = conf
    return out


def site_cluster(site: Site, name: str | None, env: Mapping[str, str] | None = None) -> SlurmCluster:
    """The Slurm of the site's cluster ``name`` as this process reaches it (its own ``SLURM_CONF``); None: the one
    ``env`` (default: this process's environment) names."""
    return SlurmCluster(name or "", cluster_submit_env(site, name, os.environ if env is None else env))


def render_job_script(plan: Plan, site: Site, options: JobOptions) -> str:
    """The sbatch script that trains ``plan`` (read by the job from ``options.plan_path``) on ``site``.

    ``options.extra_sbatch`` are ``--option=value`` header lines: job-wide ones (mail, dependency, ...)
    are written once, before the first component, every other one in each component, because sbatch gives
    many options written before ``#SBATCH hetjob`` to the first component only. A :class:`Training` job
    resumes from its own checkpoints in ``save`` once it has one (requeued runs), else from ``load``.
    What :class:`JobOptions` cannot check alone is checked here against the plan and the site: the clusters
    the plan spans (a :class:`ClusterPart` per cluster; across clusters it needs a rendezvous file and no
    requeue), the partitions' walltime maxima, the site's sbatch options. Raises :class:`SailorError` for
    anything unsafe or inconsistent.
    """
    o = options
    plan_path = o.plan_path
    validate_plan(plan, site, source=plan_path, check_placement=True)
    if o.runtime == "deepspeed":  # a plan DeepSpeed's engine cannot run is refused now, not in the job
        check_engine_plan(plan)
    scope = o.scope
    cluster = scope.cluster if isinstance(scope, ClusterPart) else None
    rendezvous_file = scope.rendezvous_file if isinstance(scope, ClusterPart) else None
    part = cluster_job(plan, site, cluster, rendezvous_file, o.requeue)
    bundle = scope.bundle if isinstance(scope, InPlace) else None
    if bundle is not None:
        part, rendezvous_file = bundle_job(plan, bundle, o.requeue), Path(bundle.folder) / "rendezvous"
    plan_file = Path(safety.shell_path(plan_path, "plan_path"))
    _plan_file_matches(plan, plan_file)
    name = get_model(o.model or plan.model).name
    if name != get_model(plan.model).name:
        raise SailorError(f"the plan trains {plan.model}, not {o.model}", field="--model", fix="drop --model or fix it")
    work = o.work
    data, save, load = (work.data, work.save, work.load) if isinstance(work, Training) else (None, None, None)
    entry = _entry_words(work, plan) if isinstance(work, UserEntry) else None
    layout = job_layout(plan, part.partitions)
    if bundle is not None:
        layout = component_layout(layout, bundle.index)
    time_text, seconds = job_time(o.limits.time, site, layout)
    min_text = _time_min(o.limits.time_min, seconds)
    grace = (o.limits.signal_grace_s if o.limits.signal_grace_s is not None
             else min(MAX_SIGNAL_GRACE_S, max(1, seconds // 10)))
    if not 0 < grace < seconds:
        raise SailorError(f"signal grace {grace} s must be between 0 and the time limit ({seconds} s)",
                          field="--signal-grace", fix="checkpointing needs time before the limit, but less than all of it")
    workdir = safety.sbatch_path(o.workdir if o.workdir is not None else plan_file.parent, "--workdir")
    logs = safety.sbatch_path(o.log_dir if o.log_dir is not None else workdir, "--log-dir")
    jname = safety.job_name(o.job_name or f"sailor-{name}", "--job-name")
    header = safety.site_sbatch_options(site, o.extra_sbatch)
    for i, line in enumerate(site.prelude):
        if any(c in line for c in "\n\r\x00"):
            raise SailorError("prelude lines must be single lines", file=site.source, field=f"environment.prelude[{i}]")
    in_place = scope.run_dir if isinstance(scope, InPlace) else None
    python = safety.q(safety.quoted_python_exe(o.python or sys.executable))
    # resident ranks rejoin in their processes: megatron_patch's runtime, outside a container (the agent starts
    # the steps itself)
    resident = (isinstance(scope, InPlace) and scope.resident and o.launch_module == LAUNCH_MODULES["megatron_patch"]
                and entry is None and not site.container and not o.dry_run)
    if bundle is not None and not resident:
        raise SailorError("a bundle's jobs recover together only as resident ranks of megatron_patch's runtime, "
                          "outside a container and not dry-run", field="bundle",
                          fix="render the plan as one het job (InPlace without bundle)")
    wrapper = rank_wrapper(site.container, workdir)
    ctx: dict[str, Any] = {
        "version": __version__, "model": name, "model_q": safety.q(name), "num_ranks": layout.world_size,
        "num_tasks": layout.num_tasks,
        "plan_path_comment": str(plan_file), "task_ranks_comment": " ".join(map(str, layout.task_ranks)),
        "job_name": jname, "output": f"{logs}/%x-%j.out", "workdir": workdir, "time": time_text,
        "signal_grace_s": grace, "rank_exit_wait_s": max(MIN_RANK_EXIT_WAIT_S, grace), "dry_run": o.dry_run,
        "requeue": o.requeue, "time_min": min_text,
        "in_place": safety.q(safety.shell_path(in_place, "--run-dir")) if in_place is not None else "",
        "resident": resident,
        "bundle_part": f"{bundle.partition}:{bundle.index}/{bundle.count}" if bundle is not None else "",
        "bundle_folder": safety.q(safety.shell_path(bundle.folder, "bundle folder")) if bundle is not None else "",
        "job_sbatch": [h.text for h in header if h.job_wide],
        "component_sbatch": [h.text for h in header if not h.job_wide],
        "components": components_for(layout, site), "heterogeneous": layout.heterogeneous,
        "prelude": list(site.prelude), "port_base": JOB_PORT_BASE, "port_span": JOB_PORT_SPAN,
        "plan_path": safety.q(str(plan_file)),
        "data": _data_args(data) if data is not None else "",
        "save": safety.q(safety.shell_path(save, "--save")) if save is not None else "",
        "load": safety.q(safety.shell_path(load, "--load")) if load is not None else "",
        "steps": o.steps, "train_args": [safety.q(a) for a in o.train_args],
        "launch_module": o.launch_module, "entry": entry,
        "python": python, "container_prefix": wrapper.shell_prefix, "container_srun": wrapper.shell_srun_options,
        "container": f"{site.container.runtime} {site.container.image}" if site.container else "",
        # the batch script's own steps (the in-place re-plan) call Slurm's clients, which a container lacks:
        # they run outside it, with sailor-hpc's own interpreter, which the nodes see as they see its folders
        "host_python": safety.q(safety.quoted_python_exe(sys.executable)) if site.container else python,
        "exit_saved_on_signal": EXIT_SAVED_ON_SIGNAL,
        "partitions": ",".join(part.partitions) if part.partitions else "", "hosts_rendezvous": part.hosts_rendezvous,
        "cluster": part.cluster or "",
        "rendezvous_wait_s": scope.rendezvous_wait_s if isinstance(scope, ClusterPart) else DEFAULT_RENDEZVOUS_WAIT_S,
        "rendezvous_file": safety.q(safety.shell_path(Path(rendezvous_file), "rendezvous_file"))
        if (part.partitions or bundle is not None) and rendezvous_file is not None else "",
        "component": bundle.index if bundle is not None else None,
    }
    return _environment().get_template(sbatch_templates.TRAIN_TEMPLATE).render(**ctx)


@dataclass(frozen=True)
class EntryWords:
    """The user's script, its config and its arguments, shell-quoted for the template."""

    script: str
    ds_config: str
    args: tuple[str, ...]


def _entry_words(entry: UserEntry, plan: Plan) -> EntryWords:
    """A user's entry point: its ds_config.json must be the plan's (batch, ZeRO stage), read now, not by
    DeepSpeed once the ranks hold the allocation."""
    config = Path(safety.shell_path(entry.ds_config, "ds_config"))
    check_ds_config_file(config, plan)
    return EntryWords(safety.q(safety.shell_path(entry.script, "--entry")), safety.q(str(config)),
                      tuple(safety.q(a) for a in entry.args))


def _data_args(data: str | os.PathLike[str]) -> str:
    """``--data``'s words for the script: one absolute prefix, or a blend's weights and absolute prefixes."""
    blend = DataBlend.parse(str(data))
    blend = blend.with_prefixes([safety.shell_path(p, "--data") for p in blend.prefixes])
    return " ".join(safety.q(t) for t in blend.tokens())


def write_job_script(path: str | os.PathLike[str], text: str) -> Path:
    """Write a rendered script atomically, executable by its owner and group."""
    target = Path(path)
    atomic_write_text(target, text)
    target.chmod(0o750)
    return target


def placed_plan(plan_path: str | os.PathLike[str], site: Site,
                model: str | None = None) -> tuple[Plan, Path | None]:
    """The plan of ``plan_path`` placed on ``site``, and ``plan_path`` itself if the job can read it from
    there (a plan in our format, already placed), else None: a placed copy must be written
    (:func:`placed_plan_path`), because the job's ranks read the plan file and must see exactly the
    placement the script was rendered for."""
    path = Path(plan_path)
    plan = load_plan(path, model=model, site=site)
    if not all(s.placement is not None and s.partition is not None for p in plan.pipelines for s in p.stages):
        plan = place_plan(plan, site)
    validate_plan(plan, site, source=path, check_placement=True)
    try:
        same = load_plan(path, model=model, validate=False) == plan and not _is_sailor_file(path)
    except SailorError:
        same = False
    return plan, (path.absolute() if same else None)


def placed_plan_path(plan: Plan, directory: str | os.PathLike[str], stem: str) -> Path:
    """``<directory>/<stem>.<content hash>.placed.json``: named by what it holds, so rendering the plan for
    another site, model or placement writes another file instead of replacing the one a queued job
    will read, and rendering the same plan again finds the same file."""
    digest = hashlib.sha256(plan.to_json().encode()).hexdigest()[:12]
    return Path(directory).absolute() / f"{stem}.{digest}.placed.json"


def placed_plan_file(plan_path: str | os.PathLike[str], site: Site, model: str | None = None, *,
                     directory: str | os.PathLike[str] | None = None, undo: ExitStack | None = None
                     ) -> tuple[Plan, Path]:
    """:func:`placed_plan`, writing the placed copy (atomically) into ``directory`` when one is needed:
    the job's directory, never the input's by choice (that may be read-only shared data); None keeps
    the plan's own directory for callers that own it. ``undo``: a copy written now is removed again if that
    block fails (one already there, which a queued job may read, is left), so a failed render leaves none."""
    plan, path = placed_plan(plan_path, site, model)
    if path is None:
        where = Path(plan_path).parent if directory is None else directory
        path = placed_plan_path(plan, where, Path(plan_path).stem)
        if undo is not None:
            undo.enter_context(removed_on_error(path))
        plan.save(path)
    return plan, path


def _is_sailor_file(path: Path) -> bool:
    try:
        return is_sailor_plan(json.loads(path.read_text()))
    except (OSError, ValueError):
        return False
