"""A mixed-GPU plan as a *bundle*: one plain job per component of its job layout (Slurm ends a whole het job
that loses a node, a plain ``--no-kill`` job only that node's step). Each script runs its component's ranks
under their plan ranks and its own job agent; the first (plan rank 0's) publishes the rendezvous in the
bundle's folder, the others wait for it there. What cannot run that way is refused. The end-to-end run:
tests/controller/test_resident_cluster.py."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.plan import Plan
from sailor_hpc.core.roles import rank_roles
from sailor_hpc.core.site import Site, load_site
from sailor_hpc.jobs.layout import component_layout, job_layout
from sailor_hpc.jobs.options import BundlePart, DryRun, InPlace, JobOptions, Training
from sailor_hpc.jobs.rank_env import rank_environment
from sailor_hpc.jobs.render import bundle_partitions, render_job_script
from tests.jobs.conftest import LOCAL_LAB, tiny_plan

GPU = {"a100": "A100-40", "v100": "V100-16"}


def _plan(site: Site, *pipelines: tuple[str, ...]) -> Plan:
    return tiny_plan(site, GPU, *pipelines)


def _render(plan: Plan, site: Site, tmp_path: Path, bundle: BundlePart | None, resident: bool = True,
            **kw) -> str:
    path = tmp_path / "p.json"
    plan.save(path)
    options = JobOptions(**{"plan_path": path, "work": Training(tmp_path / "data", tmp_path / "ckpt"),
                            "requeue": False, "scope": InPlace(tmp_path / "run", resident, bundle), **kw})
    return render_job_script(plan, site, options)


def test_one_script_per_partition_covers_every_rank_once(tmp_path: Path) -> None:
    site = load_site(LOCAL_LAB)
    plan = _plan(site, ("v100", "v100"), ("a100",))  # rank 0 on a V100: the V100 job leads
    order = bundle_partitions(plan)
    assert order[0] == str(rank_roles(plan)[0].partition) == "v100" and sorted(order) == ["a100", "v100"]
    folder = tmp_path / "bundle"
    scripts = [_render(plan, site, tmp_path, BundlePart(p, i, 2, folder)) for i, p in enumerate(order)]
    for text in scripts:
        assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
        assert f"RESIDENT={folder}\nLAUNCH+=(--resident \"$RESIDENT\")" in text
        assert "#SBATCH --no-kill" in text and "#SBATCH hetjob" not in text
    lead, other = scripts
    assert 'mv -f "$RDZV.$SLURM_JOB_ID.tmp" "$RDZV"' in lead and "until [" not in lead
    assert f"RDZV={folder}/rendezvous" in other and "read -r MASTER_ADDR MASTER_PORT" in other
    assert "--bundle-part=v100:0/2 " in lead and "--bundle-part=a100:1/2 " in other
    assert "--component 0 " in lead and "#SBATCH --partition=v100" in lead and "--partition=a100" not in lead
    assert "--component 1 " in other and "#SBATCH --nodes=1" in other and "--partitions" not in other


def test_each_job_runs_one_layout_component_and_every_rank_runs_once(tmp_path: Path) -> None:
    """Two components may share a partition (its nodes run different numbers of ranks): one job each."""
    site = load_site(LOCAL_LAB)
    # 5 one-stage A100 pipelines: 4 ranks on a100-1, 1 on a100-2 (4 GPUs a node), two components
    plan = tiny_plan(site, GPU, ("v100", "v100"), *[("a100",)] * 5)
    full = job_layout(plan)
    assert bundle_partitions(plan) == ["v100", "a100", "a100"]
    got = {}
    for i, part in enumerate(bundle_partitions(plan)):
        text = _render(plan, site, tmp_path, BundlePart(part, i, len(full.components), tmp_path / "b"))
        assert f"--component {i} " in text and f"#SBATCH --partition={part}\n" in text
        layout = component_layout(full, i)
        assert layout.world_size == full.world_size and len(layout.components) == 1
        for procid in range(layout.num_tasks):
            env = rank_environment(layout, {"SLURM_PROCID": str(procid), "SLURM_NTASKS": str(layout.num_tasks)})
            got[int(env["RANK"])] = (part, env["WORLD_SIZE"])
    assert got == {r.rank: (str(r.partition), str(full.world_size)) for r in rank_roles(plan)}


@pytest.mark.parametrize("bundle, resident, kw, field", [
    (BundlePart("a100", 0, 2, "f"), True, {}, "bundle"),  # rank 0 is on v100: job 0 must be the V100 job
    (BundlePart("v100", 0, 3, "f"), True, {}, "bundle"),  # the plan has two components, not three
    (BundlePart("v100", 0, 2, "f"), True, {"requeue": True}, "requeue"),  # one job requeued alone would wait
    (BundlePart("v100", 0, 2, "f"), True, {"work": DryRun()}, "bundle"),  # a dry run has no resident ranks
])
def test_refused(tmp_path: Path, bundle, resident, kw, field) -> None:
    site = load_site(LOCAL_LAB)
    plan = _plan(site, ("v100", "v100"), ("a100",))
    with pytest.raises(SailorError) as info:
        _render(plan, site, tmp_path, bundle, resident, **kw)
    assert info.value.field == field and info.value.fix


def test_a_bundle_needs_resident_ranks() -> None:
    with pytest.raises(SailorError) as info:
        InPlace("run", False, BundlePart("v100", 0, 2, "f"))
    assert info.value.field == "bundle"
