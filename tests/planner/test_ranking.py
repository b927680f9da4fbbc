"""The ranking's tie rule: plans whose iteration time (throughput objective) or cost per sample (cost objective)
is equal on the ranking's grid, as the plan table prints it, go to the plan with fewer GPUs, then to the one
cheaper per hour. A search once ranked a 16-GPU plan over a 12-GPU plan of the same printed time.

The plans are real and simulated; their times are then set to a constructed tie (the simulator has no knob
that makes two different allocations exactly as fast), with throughput and cost per iteration kept
consistent with the time."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from planner import Candidate, PlanRequest
from planner.candidates import ranking
from sailor_hpc.core.archive import open_archive
from sailor_hpc.core.placement import place_plan
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from sailor_hpc.core.site import load_site
from simulator import simulate

LAB = Path(__file__).resolve().parents[2] / "site_configs" / "local-lab.toml"  # A100s at 1.0/h, V100s at 0.5/h
GBS = 48


def _plan(a100: int, v100: int) -> Plan:
    """``a100`` + ``v100`` one-stage pipelines of OPT-350M, the global batch shared evenly."""
    per = GBS // (a100 + v100)
    pipes = [Pipeline(1, per, (Stage(0, 25, 1, gpu, part),)) for gpu, part, n in
             (("A100-40", "a100", a100), ("V100-16", "v100", v100)) for _ in range(n)]
    return Plan("OPT-350M", GBS, tuple(pipes))


@pytest.fixture(scope="module")
def simulated() -> dict[str, Candidate]:
    """Three allocations: 16 GPUs, 12 dearer, 12 cheaper (per hour)."""
    site = load_site(LAB)
    archive = open_archive(site=site)
    out = {}
    for name, (a, v) in {"16 GPUs": (4, 12), "12 dear": (8, 4), "12 cheap": (4, 8)}.items():
        plan = place_plan(_plan(a, v), site)
        out[name] = Candidate(plan, simulate(plan, site, archive))
    assert [out[n].plan.num_gpus for n in ("16 GPUs", "12 dear", "12 cheap")] == [16, 12, 12]
    assert out["12 cheap"].result.cost_per_hour < out["12 dear"].result.cost_per_hour
    return out


def _at(c: Candidate, seconds: float) -> Candidate:
    """``c`` as if an iteration took ``seconds`` (throughput and cost per iteration to match)."""
    r = c.result
    return Candidate(c.plan, replace(r, iteration_time_s=seconds, throughput_samples_per_s=GBS / seconds,
                                     tokens_per_s=r.tokens_per_s * r.iteration_time_s / seconds,
                                     cost_per_iteration=r.cost_per_hour * seconds / 3600))


def test_a_time_tie_goes_to_fewer_gpus_then_to_the_cheaper(simulated: dict[str, Candidate]) -> None:
    # 1.2340, 1.23402 and 1.23404 s all print (and rank) as 1.234; the 16-GPU plan is the fastest of them
    tied = {"16 GPUs": _at(simulated["16 GPUs"], 1.2340), "12 dear": _at(simulated["12 dear"], 1.23404),
            "12 cheap": _at(simulated["12 cheap"], 1.23402)}
    faster = _at(simulated["16 GPUs"], 1.2330)  # one step of the grid faster: no tie
    slower = _at(simulated["12 cheap"], 1.2350)
    order = sorted([slower, *tied.values(), faster], key=ranking(PlanRequest("OPT-350M", GBS)))
    assert order == [faster, tied["12 cheap"], tied["12 dear"], tied["16 GPUs"], slower]
    # outside a tie, time alone decides: the slower plan is last although it has the fewest GPUs and is cheapest
    assert max(c.throughput for c in tied.values()) == tied["16 GPUs"].throughput


def test_a_cost_tie_goes_to_fewer_gpus_then_to_the_cheaper_per_hour(simulated: dict[str, Candidate]) -> None:
    # equal cost per sample: the cheap 12-GPU allocation runs longer at its lower price
    per_hour = {n: c.result.cost_per_hour for n, c in simulated.items()}
    budget = 1.0 * per_hour["16 GPUs"] / 3600  # cost per iteration of the 16-GPU plan at 1 s
    tied = {n: _at(c, budget * 3600 / per_hour[n]) for n, c in simulated.items()}
    costs = {n: c.result.cost_per_iteration for n, c in tied.items()}
    assert max(costs.values()) == pytest.approx(min(costs.values()), rel=1e-12)
    order = sorted(tied.values(), key=ranking(PlanRequest("OPT-350M", GBS, objective="cost")))
    assert order == [tied["12 cheap"], tied["12 dear"], tied["16 GPUs"]]
