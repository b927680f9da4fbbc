"""Which part of a plan each global rank runs (torch-free: the Slurm side imports it on login nodes).

The mapping the sbatch jobs rely on is fixed and simple: global ranks are numbered **pipelines in plan
order, then stages in pipeline order, then TP ranks in order**. For a plan with pipelines
``[[tp2, tp1], [tp1]]`` that is::

    rank 0: pipeline 0, stage 0, tp_rank 0      rank 2: pipeline 0, stage 1, tp_rank 0
    rank 1: pipeline 0, stage 0, tp_rank 1      rank 3: pipeline 1, stage 0, tp_rank 0

A launcher therefore has to start the tasks of every stage's TP group as consecutive ranks, in this
order (``srun`` numbers the tasks of a het job component after those of the previous component).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.plan import Plan


@dataclass(frozen=True)
class Role:
    """What one global rank does under a plan."""

    rank: int
    pipeline: int
    stage: int
    tp_rank: int
    tp: int
    num_stages: int
    first_layer: int
    last_layer: int  # inclusive
    stage_ranks: tuple[int, ...]  # global ranks of this stage's TP group, in TP order
    gpu_type: str
    partition: str | None
    node: int | None  # placement node index inside the job's share of the partition
    local_gpu: int | None  # placement GPU id of this TP rank on that node

    @property
    def layers(self) -> list[int]:
        return list(range(self.first_layer, self.last_layer + 1))

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stage_ranks"] = list(self.stage_ranks)
        d["layers"] = self.layers
        return d


def stage_rank_table(plan: Plan) -> list[list[tuple[int, ...]]]:
    """``table[p][s]`` = the global ranks (TP order) of stage ``s`` of pipeline ``p``."""
    table: list[list[tuple[int, ...]]] = []
    nxt = 0
    for pipe in plan.pipelines:
        row = []
        for st in pipe.stages:
            row.append(tuple(range(nxt, nxt + st.tp)))
            nxt += st.tp
        table.append(row)
    return table


def rank_roles(plan: Plan) -> list[Role]:
    """The role of every global rank, indexed by rank (len == plan.num_gpus)."""
    roles: list[Role] = []
    for p, (pipe, ranks_row) in enumerate(zip(plan.pipelines, stage_rank_table(plan))):
        for s, (st, ranks) in enumerate(zip(pipe.stages, ranks_row)):
            for k, r in enumerate(ranks):
                pl = st.placement
                roles.append(Role(
                    rank=r, pipeline=p, stage=s, tp_rank=k, tp=st.tp, num_stages=len(pipe.stages),
                    first_layer=st.first_layer, last_layer=st.last_layer, stage_ranks=ranks,
                    gpu_type=st.gpu_type, partition=st.partition,
                    node=None if pl is None else pl.node,
                    local_gpu=None if pl is None or k >= len(pl.gpus) else pl.gpus[k]))
    return roles


def role_of(plan: Plan, rank: int, world_size: int | None = None) -> Role:
    """This rank's role, checking that the launcher started as many ranks as the plan has GPUs."""
    roles = rank_roles(plan)
    if world_size is not None and world_size != len(roles):
        raise SailorError(f"the job has {world_size} ranks but the plan uses {len(roles)} GPUs",
                          field="pipelines", fix="launch one task per GPU of the plan (sum of all stages' tp)")
    if not 0 <= rank < len(roles):
        raise SailorError(f"rank {rank} is outside the plan's {len(roles)} ranks", field="pipelines",
                          fix="check SLURM_PROCID / RANK")
    return roles[rank]
