"""Where every rank of a plan runs inside a (heterogeneous) Slurm job, and which task is which rank.

The job has one het component per partition the plan uses (a partition whose nodes run different
numbers of ranks gets one component per node size, because ``--ntasks-per-node`` is per component).
``srun`` numbers tasks component by component, node by node (block distribution), so the layout
fixes, for every ``SLURM_PROCID``, the plan rank it runs (``task_ranks``). Plan ranks follow
:func:`sailor_hpc.core.roles.rank_roles` (pipelines, stages, TP ranks in plan order), which in general
interleaves partitions, so the two orders differ and :mod:`sailor_hpc.jobs.rank_env` translates.

Order guarantees (the contract of ``sbatch_templates/README.md``):

- components are ordered by the lowest plan rank they hold, so plan rank 0 is in het group 0, on
  the first node of group 0 (where the batch script runs, and where the rendezvous address comes from);
- inside a component, nodes are ordered by their lowest plan rank, and the ranks of a node by their
  placement GPU id, so ``LOCAL_RANK`` follows the plan's GPU order on the node.

A plan across several Slurm clusters runs as one job per cluster (a het job cannot span clusters):
``job_layout(plan, partitions=...)`` is the layout of the job holding only those partitions' ranks; its
tasks keep their plan ranks and ``world_size`` stays the whole plan's, so every cluster's ranks join one
process group under the plan's global numbering.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.roles import Role, rank_roles


@dataclass(frozen=True)
class NodeSlot:
    """One node of the job: the plan's (partition, node index) and the plan ranks on it, in local order."""

    partition: str
    node: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Component:
    """One het component: nodes of one partition that all run the same number of ranks."""

    index: int
    partition: str
    gpu_type: str
    slots: tuple[NodeSlot, ...]

    @property
    def nodes(self) -> int:
        return len(self.slots)

    @property
    def tasks_per_node(self) -> int:
        return len(self.slots[0].ranks)

    @property
    def num_tasks(self) -> int:
        return self.nodes * self.tasks_per_node


@dataclass(frozen=True)
class TaskPlace:
    """Where ``srun`` puts one task: het group, node index inside it, local index on the node."""

    component: int
    node: int
    local: int
    rank: int


@dataclass(frozen=True)
class JobLayout:
    components: tuple[Component, ...]
    tasks: tuple[TaskPlace, ...]  # indexed by SLURM_PROCID
    plan_ranks: int = 0  # ranks of the whole plan (0: this job runs all of them)

    @property
    def num_tasks(self) -> int:
        """Tasks of this job (``SLURM_NTASKS``)."""
        return len(self.tasks)

    @property
    def world_size(self) -> int:
        """Ranks of the whole plan (``WORLD_SIZE``): more than this job's tasks when other clusters hold the rest."""
        return self.plan_ranks or len(self.tasks)

    @property
    def task_ranks(self) -> tuple[int, ...]:
        return tuple(t.rank for t in self.tasks)

    @property
    def heterogeneous(self) -> bool:
        return len(self.components) > 1

    def place(self, procid: int) -> TaskPlace:
        if not 0 <= procid < len(self.tasks):
            raise SailorError(f"task {procid} is outside the job's {len(self.tasks)} tasks", field="SLURM_PROCID",
                              fix="launch exactly one task per GPU of the plan")
        return self.tasks[procid]


def _check_placed(roles: list[Role]) -> None:
    for r in roles:
        if r.partition is None or r.node is None or r.local_gpu is None:
            raise SailorError(f"pipeline {r.pipeline} stage {r.stage} has no partition/placement",
                              field=f"pipelines[{r.pipeline}].stages[{r.stage}]",
                              fix="place the plan on the site first (sailor-hpc sbatch does it when given --site)")


def job_layout(plan: Plan, partitions: Collection[str] | None = None) -> JobLayout:
    """The het components, nodes and task order of the job that runs ``plan`` (which must be placed), or
    only its ranks on ``partitions`` (one cluster's job of a plan across clusters)."""
    all_roles = rank_roles(plan)
    _check_placed(all_roles)
    roles = all_roles if partitions is None else [r for r in all_roles if r.partition in partitions]
    if not roles:
        raise SailorError(f"the plan has no rank on partitions {sorted(partitions or ())}", field="partitions",
                          fix="render a job only for a cluster the plan uses")
    slots: dict[tuple[str, int], list[Role]] = {}
    for role in roles:  # rank order: a slot's position is the first appearance of its lowest rank
        slots.setdefault((role.partition, role.node), []).append(role)  # type: ignore[arg-type]
    for (part, node), members in slots.items():
        gpus = [r.local_gpu for r in members]
        if len(set(gpus)) != len(gpus):
            raise SailorError(f"node {node} of partition {part!r} has two ranks on the same GPU", field="pipelines",
                              fix="give every stage its own GPUs (validate the plan against the site)")
    groups: dict[tuple[str, int], list[NodeSlot]] = {}
    gpu_types: dict[str, str] = {}
    for (part, node), members in slots.items():
        ordered = sorted(members, key=lambda r: r.local_gpu)  # type: ignore[arg-type, return-value]
        groups.setdefault((part, len(ordered)), []).append(NodeSlot(part, node, tuple(r.rank for r in ordered)))
        types = {r.gpu_type for r in members}
        gpu_types.setdefault(part, sorted(types)[0])
        if len(types) > 1 or gpu_types[part] not in types:
            raise SailorError(f"partition {part!r} is used with several GPU types {sorted(types)}", field="pipelines",
                              fix="each partition has one GPU type; fix the stages' gpu_type")
    components = []
    tasks = []
    for index, ((part, _size), node_slots) in enumerate(groups.items()):
        comp = Component(index=index, partition=part, gpu_type=gpu_types[part], slots=tuple(node_slots))
        components.append(comp)
        for n, slot in enumerate(comp.slots):
            tasks += [TaskPlace(component=index, node=n, local=k, rank=r) for k, r in enumerate(slot.ranks)]
    return JobLayout(components=tuple(components), tasks=tuple(tasks),
                     plan_ranks=len(all_roles) if len(roles) < len(all_roles) else 0)


def component_layout(layout: JobLayout, index: int) -> JobLayout:
    """Only component ``index`` of ``layout``, as a job of its own (a bundle's: one plain job per component,
    which Slurm can end alone, see :class:`sailor_hpc.jobs.options.BundlePart`); its tasks keep their plan ranks."""
    if not 0 <= index < len(layout.components):
        raise SailorError(f"the job has {len(layout.components)} components, not a component {index}",
                          field="component", fix="name a component of the plan's job layout")
    comp = layout.components[index]
    tasks = tuple(TaskPlace(component=0, node=t.node, local=t.local, rank=t.rank)
                  for t in layout.tasks if t.component == index)
    return JobLayout(components=(Component(0, comp.partition, comp.gpu_type, comp.slots),), tasks=tasks,
                     plan_ranks=layout.world_size)
