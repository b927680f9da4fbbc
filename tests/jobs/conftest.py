"""Plans, site and job environment shared by the job tests."""
from __future__ import annotations

import copy
import json
import os
import tomllib
from pathlib import Path
from typing import Any

import pytest

from sailor_hpc.core.placement import place_plan
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from sailor_hpc.core.site import Site, load_site_dict
from sailor_hpc.jobs.options import ClusterPart, DryRun, InPlace, JobOptions, Limits, Training, WholePlan

REPO = Path(__file__).resolve().parents[2]
LOCAL_LAB = REPO / "site_configs" / "local-lab.toml"
A100, V100 = "A100-40", "V100-16"


def stage(first: int, last: int, tp: int, gpu: str, part: str | None = None, node: int | None = None,
          gpus: list[int] | None = None) -> dict[str, Any]:
    s: dict[str, Any] = {"layers": [first, last], "tp": tp, "gpu_type": gpu}
    if part is not None:
        s["partition"] = part
    if node is not None:
        s["placement"] = {"node": node, "gpus": gpus if gpus is not None else list(range(tp))}
    return s


def plan_doc(pipelines: list[tuple[int, int, list[dict[str, Any]]]], model: str = "tiny-gpt") -> dict[str, Any]:
    pipes = [{"micro_batch_size": mbs, "num_micro_batches": m, "stages": st} for mbs, m, st in pipelines]
    return {"format": "sailor-hpc-plan", "version": 1, "model": model,
            "global_batch_size": sum(mbs * m for mbs, m, _ in pipelines), "pipelines": pipes}


# tiny-gpt has pipeline layers 0..5 (embedding, 4 blocks, head) and 4 heads (TP 1, 2, 4)
PLANS: dict[str, dict[str, Any]] = {
    # one partition, equal nodes: an ordinary job
    "a100-only": plan_doc([(2, 2, [stage(0, 2, 2, A100, "a100", 0, [0, 1]), stage(3, 5, 2, A100, "a100", 0, [2, 3])]),
                           (2, 2, [stage(0, 5, 4, A100, "a100", 1)])]),
    # both partitions, pipelines interleave partitions; a100 nodes run 3 and 1 ranks (two a100 components)
    "het-mixed": plan_doc([(2, 2, [stage(0, 2, 2, V100, "v100", 0, [0, 1]), stage(3, 5, 1, A100, "a100", 0, [0])]),
                           (2, 2, [stage(0, 3, 1, A100, "a100", 1, [0]), stage(4, 5, 2, A100, "a100", 0, [2, 1])])]),
    # every GPU of the cluster: 2 x 4 a100 + 2 x 8 v100 = 24 ranks
    "het-full": plan_doc([(1, 4, [stage(0, 2, 4, V100, "v100", n, [0, 1, 2, 3]), stage(3, 5, 4, V100, "v100", n, [4, 5, 6, 7])])
                          for n in (0, 1)] + [(2, 2, [stage(0, 5, 4, A100, "a100", n)]) for n in (0, 1)]),
    # no partition/placement: sailor-hpc places it (first fit)
    "unplaced": plan_doc([(2, 1, [stage(0, 1, 1, V100), stage(2, 5, 2, A100)]), (1, 2, [stage(0, 5, 4, V100)])]),
}


def two_lab_site(first: Path, second: Path) -> Site:
    """local-lab.toml's a100 partition in cluster lab and again as a100_lab2 in lab2, each reached by its
    own SLURM_CONF, joined by a 1 GB/s link (a made-up measurement: the simulator is not under test)."""
    return load_site_dict(two_lab_doc(first, second), source="<two local clusters>")


def two_lab_doc(first: Path, second: Path, gbps: float = 1.0) -> dict[str, Any]:
    """The site config of :func:`two_lab_site` (written to a file where a run directory needs one), the link
    between the clusters at ``gbps``."""
    doc: dict[str, Any] = tomllib.loads(LOCAL_LAB.read_text())
    a100 = next(p for p in doc["partitions"] if p["name"] == "a100")
    other = copy.deepcopy(a100)
    a100["cluster"], other["cluster"], other["name"] = "lab", "lab2", "a100_lab2"
    doc["partitions"] = [a100, other]
    doc["clusters"] = [{"name": "lab", "slurm_conf": str(first / "etc" / "slurm.conf")},
                       {"name": "lab2", "slurm_conf": str(second / "etc" / "slurm.conf")}]
    doc["network"] = {"between": [{"clusters": ["lab", "lab2"], "latency_us": 100.0, "cost_per_gb": 0.02,
                                   "links": {"1": {"constant_gbps": gbps}}}]}
    return doc


def cross_plan(site: Site, first: str, second: str, global_batch: int = 8) -> Plan:
    """3 CPU ranks of tiny-gpt: pipeline 0 = layers 0-2 on ``first``, 3-5 on ``second``; pipeline 1 = all
    layers on ``second`` (across two clusters' partitions, or both in one)."""
    mbs = global_batch // 4
    return place_plan(Plan("tiny-gpt", global_batch, (
        Pipeline(mbs, 2, (Stage(0, 2, 1, A100, first), Stage(3, 5, 1, A100, second))),
        Pipeline(mbs, 2, (Stage(0, 5, 1, A100, second),)))), site)


def write_plan(directory: Path, name: str, doc: dict[str, Any] | None = None) -> Path:
    path = directory / f"{name}.json"
    path.write_text(json.dumps(doc if doc is not None else PLANS[name], indent=1))
    return path


@pytest.fixture()
def job_env(slurm_cluster, tmp_path: Path) -> dict[str, str]:
    """The cluster's environment plus this checkout on PYTHONPATH (jobs run from other directories and
    must import this checkout's megatron_patch / sailor_hpc) and a private job-record directory."""
    env = dict(slurm_cluster.env)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["SAILOR_HPC_STATE_DIR"] = str(tmp_path / "job-records")
    return env


@pytest.fixture()
def job_dir(slurm_cluster, tmp_path: Path) -> Path:
    """A directory visible to the jobs (on this one-host cluster any directory is)."""
    d = tmp_path / "jobs"
    d.mkdir()
    return d


def job_options(plan_path: Path, *, dry_run: bool = True, data: Any = None, save: Any = None, load: Any = None,
                time: str | None = None, time_min: str | None = None, signal_grace_s: int | None = None,
                cluster: str | None = None, rendezvous_file: Any = None, rendezvous_wait_s: int = 600,
                in_place: Any = None, **rest: Any) -> JobOptions:
    """A :class:`JobOptions` from the few words a test varies (a dry run of the whole plan by default)."""
    scope: WholePlan | InPlace | ClusterPart = WholePlan()
    if cluster is not None:
        scope = ClusterPart(cluster, rendezvous_file, rendezvous_wait_s)
    elif in_place is not None:
        scope = InPlace(in_place)
    return JobOptions(plan_path=plan_path, work=DryRun() if dry_run else Training(data, save, load),
                      limits=Limits(time, time_min, signal_grace_s), scope=scope, **rest)


def tiny_plan(site: Site, gpu: dict[str, str], *pipelines: tuple[str, ...]) -> Plan:
    """A placed tiny-gpt plan, one pipeline per tuple of partitions (a stage each, its 6 layers split evenly);
    ``gpu``: each partition's GPU type."""
    def stages(parts: tuple[str, ...]) -> tuple[Stage, ...]:
        n = len(parts)
        return tuple(Stage(i * 6 // n, (i + 1) * 6 // n - 1, 1, gpu[p], p) for i, p in enumerate(parts))
    pipes = tuple(Pipeline(1, 1, stages(parts)) for parts in pipelines)
    return place_plan(Plan("tiny-gpt", len(pipes), pipes), site)
