"""Every rank of a three-stage DeepSpeed pipeline over two GPU types: the simulator's memory against the allocator.

Three gloo ranks train tiny-gpt under DeepSpeed's ``PipelineEngine`` (``megatron_patch.ds_runtime``, ZeRO 0),
split 2 | 2 | 2 layers, 6 micro-batches of 2: more micro-batches than stages, so 1F1B keeps 3, 2 and 1 in
flight. ``zero_memory_worker.py`` counts torch's CPU allocator on every rank (the peak allocated of the last
step). The plan puts the stages on two GPU types of different sizes (``small`` | ``large`` | ``small``), as a
pipeline over mixed consumer GPUs does; the runtime does not read them, the simulator charges each stage its
own type's fixed overhead and checks it against its own capacity. From the layer profile rank 0 takes, the
simulator (runtime ``deepspeed``) must predict every rank's peak allocated within :data:`TOL` (model state,
the in-flight micro-batches' activations and received inputs, the backward's working set) and pick the same
rank as the busiest, while its device totals differ by exactly each type's overhead.

Negative control: one micro-batch fewer in flight on the middle stage misses its peak by more than TOL.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megatron_patch import local
from sailor_hpc.core.site import load_site_dict
from simulator import SimOptions, simulate
from simulator.memory import in_flight
from tests.conftest import slurm_missing
from tests.deepspeed.zero_memory_worker import plan_for
from tests.megatron_patch.conftest import shipped_data  # noqa: F401 - fixture
from tests.simulator.conftest import MIXED_OVERHEAD, MIXED_SITE, mixed_archive

if importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("megatron") is None:
    slurm_missing("needs the deepspeed and runtime extras (make install-test)", module=True)

WORKER = str(Path(__file__).with_name("zero_memory_worker.py"))
MBS, MICRO, STAGES = 2, 6, 3
GPUS = ("small", "large", "small")
TOL = 0.06


@pytest.fixture(scope="module")
def measured(shipped_data: str) -> tuple[dict[int, dict], dict]:  # noqa: F811
    env = {"ZERO_CONFIGS": json.dumps([["pipe", 0, STAGES]]), "ZERO_DATA": shipped_data,
           "ZERO_MBS": str(MBS), "ZERO_MICRO": str(MICRO)}
    results = local.run([WORKER], STAGES, env, timeout=900)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}: {r.stderr[-4000:]}"
    lines = [json.loads(x) for r in results for x in r.stdout.splitlines() if x.startswith('{"event"')]
    (profile,) = [e for e in lines if e["event"] == "profile"]
    return {e["rank"]: e["results"]["pipe"] for e in lines if e["event"] == "zero_memory"}, profile


def test_every_stage_on_its_gpu_type(measured: tuple[dict[int, dict], dict]) -> None:
    got, profile = measured
    archive = mixed_archive("tiny-gpt", MBS, profile)
    res = simulate(plan_for(0, STAGES, STAGES, MBS, MICRO, GPUS), load_site_dict(MIXED_SITE, source="<test>"), archive,
                   options=SimOptions(runtime="deepspeed", backend="gloo"))
    stages = sorted(res.stages, key=lambda s: s.stage)  # rank s runs stage s
    assert [s.gpu_type for s in stages] == list(GPUS)
    for s in stages:
        # every steady step does the same work: equal peaks, unless an allocator event went unrecorded
        # (zero_memory_worker: frees on gloo's worker thread)
        steady = got[s.stage]["steady_peaks"]
        assert max(steady) - min(steady) < 1024, f"stage {s.stage}: steady steps' peaks differ: {steady}"
        peak, mem = got[s.stage]["peak"], s.memory
        print(f"stage {s.stage} ({s.gpu_type}, {int(in_flight(s.stage, STAGES, MICRO))} in flight): measured {peak:,} B,"
              f" predicted {float(mem.peak_allocated):,.0f} B")
        assert abs(float(mem.peak_allocated) / peak - 1) <= TOL
        assert float(mem.peak_device) == pytest.approx(float(mem.peak_allocated + mem.allocator_slack)
                                                       + MIXED_OVERHEAD[s.gpu_type])
    assert max(got, key=lambda r: got[r]["peak"]) == max(stages, key=lambda s: s.memory.peak_allocated).stage
    # negative control: the middle stage with one micro-batch fewer in flight
    mid = stages[1].memory
    flight = int(in_flight(1, STAGES, MICRO))
    fewer = float(mid.peak_allocated) - float(mid.activations) / flight
    assert 1 - fewer / got[1]["peak"] > TOL
