"""`--dtype auto`: the best plan over the dtypes the GPU types train in and the archive has profiles of."""
from __future__ import annotations

from dataclasses import replace

import pytest

from planner import PlanRequest
from planner.candidates import candidate_dtypes, tie_value
from planner.search import search
from sailor_hpc.core.archive import ComputeEntry
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.site import load_site_dict
from tests.simulator.conftest import TINY_SITE, tiny_archive


@pytest.fixture(scope="module")
def world():
    site = load_site_dict(TINY_SITE, source="<tiny>")  # G1 trains in bf16; G2 (default by name) does not
    archive = tiny_archive()
    for (mbs, tp), e in list(archive.compute_points("tiny-gpt", "G1").items()):  # bf16 G1: 40 % faster
        archive.add(ComputeEntry("tiny-gpt", "G1", mbs, tp, e.times * 0.6, {"source": "test"}, dtype="bf16"))
    return site, archive


def test_auto_is_the_best_of_the_explicit_searches(world) -> None:
    site, archive = world
    request = PlanRequest(model="tiny-gpt", global_batch_size=16, top_k=3)
    assert candidate_dtypes(site, archive, replace(request, dtype="auto")) == ["bf16", "fp32"]
    best = {d: search(site, archive, replace(request, dtype=d)).candidates[0] for d in ("bf16", "fp32")}
    auto = search(site, archive, replace(request, dtype="auto")).candidates
    top = max(best.values(), key=lambda c: c.throughput)
    assert auto[0].throughput == pytest.approx(top.throughput) and auto[0].plan.dtype == top.plan.dtype
    times = [tie_value(c.result.iteration_time_s) for c in auto]  # best first, up to the ranking's ties
    assert times == sorted(times)
    # a bf16 plan never uses G2, which does not train in bf16
    assert all(s.gpu_type == "G1" for c in auto if c.plan.dtype == "bf16" for p in c.plan.pipelines for s in p.stages)


def test_an_explicit_dtype_no_gpu_has_profiles_of_is_refused(world) -> None:
    site, archive = world
    with pytest.raises(SailorError) as info:
        search(site, archive, PlanRequest(model="tiny-gpt", global_batch_size=16, dtype="fp16"))
    assert "in fp16" in info.value.message and "--dtype auto" in info.value.fix


def test_embedded_profiles_plan_in_fp32(world) -> None:
    from click.testing import CliRunner

    from sailor_hpc.cli import main
    runner = CliRunner()
    ok = runner.invoke(main, ["plan", "--site", "site_configs/a100-v100.toml", "--model", "OPT-350M", "--gbs", "64",
                              "--max-gpus", "16", "--top", "1", "--json"])
    assert ok.exit_code == 0, ok.output
    assert '"dtype": "fp32"' in ok.output  # Sailor's published profiles are fp32 only
    bad = runner.invoke(main, ["plan", "--site", "site_configs/a100-v100.toml", "--model", "OPT-350M", "--dtype",
                               "bf16", "--max-gpus", "16"])
    assert bad.exit_code == 2 and "in bf16" in bad.output


def test_auto_with_no_profiled_dtype_says_what_to_profile_not_to_use_auto(world) -> None:
    site, archive = world
    with pytest.raises(SailorError) as info:
        search(site, archive, PlanRequest(model="tiny-llama", global_batch_size=16, dtype="auto"))
    e = info.value
    assert "has profiles of tiny-llama" in e.message and "G1, G2" in e.message
    assert "--dtype auto" not in e.fix and "sailor-hpc profile" in e.fix
    with pytest.raises(SailorError) as info:
        search(site, archive, PlanRequest(model="tiny-gpt", global_batch_size=16, dtype="auto",
                                          available={"p1": 0, "p2": 0}))
    assert "no GPU" in info.value.message and "--available" in info.value.fix
