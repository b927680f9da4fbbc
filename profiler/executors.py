"""submitit executors for profiling jobs, het jobs included.

submitit (1.5) writes one ``#SBATCH`` block; it has no het-job support. :class:`HetSlurmExecutor` adds
``#SBATCH hetjob`` components after submitit's block (the function then runs in het group 0, and
:func:`profiler.jobs.network_job` reaches the other group with its own ``srun --het-group=...`` step).
submitit also cannot follow a het job's state (sacct reports ``12+0``/``12+1``, it looks up ``12``), so
:mod:`profiler.sweep` watches every job itself (:class:`sailor_hpc.slurm.watch.JobWatcher`) and reads only
the result file of task 0.

Every value that reaches an ``#SBATCH`` line is checked with :mod:`sailor_hpc.slurm.safety` first.
"""
from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import submitit

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.site import Partition, Site
from sailor_hpc.slurm import safety
from sailor_hpc.slurm.container import rank_wrapper


@dataclass(frozen=True)
class Allocation:
    """Resources of one job (or of one het component) on one partition."""

    partition: Partition
    nodes: int
    tasks_per_node: int

    @property
    def cpus_per_task(self) -> int:
        return max(1, self.partition.cpus_per_node // self.partition.gpus_per_node)

    @property
    def gres(self) -> str:
        return f"{self.partition.gres}:{self.tasks_per_node}"

    def sbatch_options(self) -> dict[str, Any]:
        safety.slurm_word(self.partition.name, "partition")
        return {"partition": self.partition.name, "nodes": self.nodes, "ntasks-per-node": self.tasks_per_node,
                "gres": self.gres, "cpus-per-task": self.cpus_per_task}


@dataclass(frozen=True)
class JobSettings:
    """What every profiling job of a sweep shares."""

    folder: Path
    python: str
    time_min: int
    site: Site
    begin: str | None = None
    setup: tuple[str, ...] = ()
    extra: dict[str, str] = field(default_factory=dict)

    def per_component(self) -> dict[str, Any]:
        """The options every het component needs in its own header (sbatch does not copy --constraint,
        --exclusive, ... to later components): ``--exclusive`` (a measuring job owns its nodes: work of
        another job beside it on the node's cores or GPUs would be timed as the model's), then the site's."""
        return {"exclusive": True} | self._site_options(job_wide=False)

    def _site_options(self, *, job_wide: bool) -> dict[str, Any]:
        """The site's sbatch options of one kind (:func:`safety.site_sbatch_options`), as submitit's
        parameters."""
        return {o.name: o.value if o.value is not None else True
                for o in safety.site_sbatch_options(self.site) if o.job_wide == job_wide}

    def additional(self) -> dict[str, Any]:
        """submitit's extra header options of the first component: the per-component ones and those of
        the whole job."""
        add: dict[str, Any] = dict(self.extra)
        add.update(self.per_component())
        add.update(self._site_options(job_wide=True))
        if self.begin:
            safety.no_control_chars(self.begin, "--begin")
            if not safety.SBATCH_OPTION.match(f"--begin={self.begin}"):
                raise SailorError(f"{self.begin!r} is not a Slurm --begin time", field="--begin",
                                  fix="e.g. now+1hour, 2030-01-01T20:00 or 20:00")
            add["begin"] = self.begin
        return add


class HetSlurmExecutor(submitit.SlurmExecutor):
    """A SlurmExecutor whose job has more het components after submitit's own (group 0)."""

    def __init__(self, folder: str | Path, *, het_components: Sequence[Mapping[str, Any]] = (), **kw: Any) -> None:
        super().__init__(folder, **kw)
        self.het_components = [dict(c) for c in het_components]

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        lines = super()._make_submission_file_text(command, uid).split("\n")
        last = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
        extra: list[str] = []
        for comp in self.het_components:
            extra.append("#SBATCH hetjob")
            extra += [f"#SBATCH --{k}" if v is True else f"#SBATCH --{k}={v}" for k, v in comp.items()]
        lines[last + 1:last + 1] = extra
        return "\n".join(lines)


def make_executor(settings: JobSettings, alloc: Allocation, *, job_name: str, one_task: bool = False,
                  het: Allocation | None = None, after: Sequence[str] = (),
                  one_at_a_time: bool = False) -> submitit.SlurmExecutor:
    """An executor for ``alloc`` (+ het component ``het``). ``one_task``: submitit starts the function in
    one task only (it then starts its own step over the allocation), instead of one per task. ``after``:
    jobs that must have ended before this one starts; ``one_at_a_time``: an array's elements run one after
    the other (:class:`profiler.sweep.Queue` uses both where Slurm's nodes share one machine)."""
    safety.job_name(job_name, "job name")
    safety.python_exe(settings.python)
    settings.folder.mkdir(parents=True, exist_ok=True)
    wrapper = rank_wrapper(settings.site.container)
    if one_task and settings.site.container is not None:
        # the driver of a one-task job starts its own srun step (the network benchmark's ranks, in the
        # container): it needs Slurm's clients, which a container lacks, so it runs outside, with sailor-hpc's
        # own interpreter (the nodes see it as they see the sweep's folder)
        python, container_srun = shlex.quote(sys.executable), []
    else:
        python, container_srun = wrapper.shell_prefix + shlex.quote(settings.python), list(wrapper.srun_options)
    kw: dict[str, Any] = {"python": python}
    if het is not None:
        components = [het.sbatch_options() | settings.per_component()]
        ex: submitit.SlurmExecutor = HetSlurmExecutor(settings.folder, het_components=components, **kw)
    else:
        ex = submitit.SlurmExecutor(settings.folder, **kw)
    srun_args = [f"--cpus-per-task={alloc.cpus_per_task}"]  # Slurm 22.05's srun does not inherit it
    if one_task:
        srun_args += ["--ntasks=1", "--nodes=1"]
    srun_args += container_srun
    ex.update_parameters(job_name=job_name, partition=alloc.partition.name, nodes=alloc.nodes,
                         ntasks_per_node=alloc.tasks_per_node, gres=alloc.gres, cpus_per_task=alloc.cpus_per_task,
                         time=settings.time_min, setup=list(settings.setup), stderr_to_stdout=True,
                         srun_args=srun_args, additional_parameters=settings.additional(), signal_delay_s=30,
                         **({"dependency": "afterany:" + ":".join(after)} if after else {}),
                         **({"array_parallelism": 1} if one_at_a_time else {}))
    return ex

