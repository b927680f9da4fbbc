"""A plan across clusters renders one script per cluster (a het job cannot span clusters): each script runs
its cluster's ranks under their plan ranks, rank 0's job publishes the rendezvous, the others wait for it.
What cannot run that way is refused with the reason. The end-to-end run: tests/jobs/test_geo_jobs.py."""
from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.site import Site
from sailor_hpc.jobs.layout import job_layout
from sailor_hpc.jobs.rank_env import rank_environment
from sailor_hpc.jobs.render import cluster_submit_env, plan_clusters, render_job_script
from tests.jobs.conftest import job_options, tiny_plan
from tests.simulator.conftest import two_cluster_site

GPU = {"p1": "G1", "p2": "G2"}


def _site(conf: Path | None = None) -> Site:
    """two_cluster_site, with c2 reached by its own SLURM_CONF when ``conf`` is given (else by -M)."""
    site = two_cluster_site()
    if conf is None:
        return site
    c1, c2 = site.clusters
    return dataclasses.replace(site, clusters=(c1, dataclasses.replace(c2, slurm_cluster="", slurm_conf=str(conf))))


def _plan(site: Site, *pipelines: tuple[str, ...]) -> Plan:
    return tiny_plan(site, GPU, *pipelines)


def _render(plan: Plan, site: Site, tmp_path: Path, **kw) -> str:
    path = tmp_path / "p.json"
    plan.save(path)
    return render_job_script(plan, site, job_options(path, **kw))


@pytest.mark.parametrize("parts, kw, field, words", [
    (("p1", "p2"), {}, "clusters", "spans clusters c1, c2"),
    (("p2", "p2"), {}, "clusters[c2]", "reached by -M"),
    (("p1", "p2"), {"cluster": "c2", "rendezvous_file": "r", "requeue": False}, "clusters[c2].slurm_cluster", "by -M"),
    (("p1", "p1"), {"cluster": "c2"}, "clusters", "no rank on cluster 'c2'"),
])
def test_refused(tmp_path: Path, parts, kw, field, words) -> None:
    site = _site()
    with pytest.raises(SailorError) as info:
        _render(_plan(site, parts), site, tmp_path, **kw)
    assert info.value.field == field and words in str(info.value) and info.value.fix


@pytest.mark.parametrize("kw, field", [({"requeue": False}, "rendezvous_file"),
                                       ({"rendezvous_file": "r"}, "requeue")])
def test_cross_cluster_job_needs_a_rendezvous_file_and_no_requeue(tmp_path: Path, kw, field) -> None:
    site = _site(tmp_path / "c2.conf")
    with pytest.raises(SailorError) as info:
        _render(_plan(site, ("p1", "p2")), site, tmp_path, cluster="c1", **kw)
    assert info.value.field == field and info.value.fix


def test_one_script_per_cluster_covers_every_rank_once(tmp_path: Path) -> None:
    site = _site(tmp_path / "c2.conf")
    # ranks: 0 = p2 (c2) ... so c2 holds rank 0 and hosts the rendezvous, whatever the clusters' order
    plan = _plan(site, ("p2", "p1"), ("p1",), ("p2", "p2"))
    assert plan_clusters(plan, site) == ["c2", "c1"]
    rdzv = tmp_path / "rdzv"
    scripts = {c: _render(plan, site, tmp_path, cluster=c, rendezvous_file=rdzv, requeue=False) for c in ("c1", "c2")}
    for c, text in scripts.items():
        assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0, c
    host, guest = scripts["c2"], scripts["c1"]
    assert 'mv -f "$RDZV.$SLURM_JOB_ID.tmp" "$RDZV"' in host and "until [" not in host
    assert f"RDZV={rdzv}" in guest and "read -r MASTER_ADDR MASTER_PORT" in guest and "scontrol show hostnames" not in guest
    assert "--partitions p2 " in host and "--partitions p1 " in guest
    assert "#SBATCH --partition=p1" in guest and "#SBATCH --partition=p2" not in guest
    assert "--no-requeue" not in host  # dry-run scripts carry no requeue line at all

    # the per-cluster layouts' tasks are the plan's ranks, each exactly once; WORLD_SIZE is the whole plan's
    world = plan.num_gpus
    got: dict[int, dict[str, str]] = {}
    for parts in (["p1"], ["p2"]):
        layout = job_layout(plan, parts)
        for procid in range(layout.num_tasks):
            env = rank_environment(layout, {"SLURM_PROCID": str(procid), "SLURM_NTASKS": str(layout.num_tasks)})
            got[int(env["RANK"])] = env
    assert sorted(got) == list(range(world)) and {e["WORLD_SIZE"] for e in got.values()} == {str(world)}
    # and each rank runs on the partition its stage was planned on
    from sailor_hpc.core.roles import rank_roles
    assert [str(r.partition) for r in rank_roles(plan)] == [
        "p1" if r in job_layout(plan, ["p1"]).task_ranks else "p2" for r in range(world)]


def test_one_cluster_job_is_the_whole_plan(tmp_path: Path) -> None:
    site = _site(tmp_path / "c2.conf")
    plan = _plan(site, ("p2", "p2"))
    text = _render(plan, site, tmp_path, cluster="c2")
    assert "--partitions" not in text and "RDZV" not in text and "scontrol show hostnames" in text
    assert job_layout(plan, ["p2"]).world_size == job_layout(plan).world_size == 2


def test_each_cluster_is_submitted_with_its_own_slurm_conf(tmp_path: Path) -> None:
    site = _site(tmp_path / "c2.conf")
    base = {"SLURM_CONF": "/etc/slurm/slurm.conf", "X": "1"}
    assert cluster_submit_env(site, "c2", base) == {"SLURM_CONF": str(tmp_path / "c2.conf"), "X": "1"}
    assert cluster_submit_env(site, "c1", base) == base
