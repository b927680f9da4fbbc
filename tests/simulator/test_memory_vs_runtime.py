"""The simulator's activation memory against what megatron_patch really holds, per stage of a real pipeline.

Three gloo ranks train tiny-gpt as a three-stage pipeline with more micro-batches than stages, so each
stage holds a different number in flight (1F1B: 3, 2, 1). ``activation_worker.py`` counts, on every
rank, the bytes of every tensor autograd keeps for a backward, from when it is saved until it is
released, and reports the peak; rank 0 profiles the layers as the profiler does. The simulator, given
that profile, must predict each stage's peak (``StageMemory.activations``, megatron_patch: the profiled
layers times the micro-batches in flight, plus each received input, minus the sent output the runtime
frees) to the byte, up to two named terms that do not grow with the micro-batch size (a few hundred bytes
here; ``seq`` x 8 bytes per micro-batch on a real model). The allocator's slack and the backward's working
set are not saved tensors and are not part of this check; on CPU there is no caching allocator to measure
them against.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megatron_patch import local
from sailor_hpc.core.archive import ComputeEntry, MemoryEntry, OverheadEntry, ProfileArchive
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from sailor_hpc.core.site import load_site_dict
from simulator import SimOptions, simulate
from simulator.memory import in_flight
from tests.megatron_patch.conftest import ADAM, MODEL, events, shipped_data  # noqa: F401 - fixture

WORKER = str(Path(__file__).parents[1] / "megatron_patch" / "activation_worker.py")
MBS, MICRO = 2, 4
SITE = {"name": "this-machine", "cost_unit": "GPU-hours", "gpu_types": {"CPU": {"memory_gib": 16.0}},
        "partitions": [{"name": "cpu", "gpu_type": "CPU", "nodes": 1, "gpus_per_node": 3,
                        "network": {"intra_node": {"1": {"constant_gbps": 1.0}},
                                    "inter_node": {"1": {"constant_gbps": 1.0}}}}]}
# uneven stages: the embedding with one block, two blocks, the last block with the head
PLAN = Plan(MODEL, MBS * MICRO, (Pipeline(MBS, MICRO, (Stage(0, 1, 1, "CPU"), Stage(2, 3, 1, "CPU"),
                                                        Stage(4, 5, 1, "CPU"))),))


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory, shipped_data: str) -> tuple[list[dict], dict]:  # noqa: F811
    root = tmp_path_factory.mktemp("saved-bytes")
    PLAN.save(root / "plan.json")
    argv = [WORKER, "--plan", str(root / "plan.json"), "--model", MODEL, "--data", shipped_data,
            "--save", str(root / "ckpt"), "--steps", "2", *ADAM]
    results = local.run(argv, PLAN.num_gpus, {"PROFILE_MBS": str(MBS)}, timeout=300)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}:\n{r.stderr[-4000:]}"
    peaks = sorted((e for r in results for e in events(r, "saved_bytes")), key=lambda e: e["stage"])
    (profile,) = events(results[0], "profile")
    return peaks, profile


def _known_difference(stage: int, flight: int) -> int:
    """Bytes the model charges that the runtime does not hold, from two per-micro-batch terms that do not
    scale with the micro-batch as the model scales a profile taken at micro-batch 1: the embedding's
    position ids (one expanded ``arange`` of ``seq`` int64 per micro-batch, at any size) and the last
    stage's per-token loss (the head's output, which the loss function reduces and drops)."""
    spec = PLAN.model_spec
    first, last = PLAN.pipelines[0].stages[stage].first_layer, PLAN.pipelines[0].stages[stage].last_layer
    position_ids = flight * (MBS - 1) * spec.seq_len * 8 if first == 0 else 0
    loss = flight * MBS * spec.seq_len * 4 if last == spec.num_pipeline_layers - 1 else 0
    return position_ids + loss


def _simulated(profile: dict, options: SimOptions):
    archive = ProfileArchive()
    archive.add(ComputeEntry(MODEL, "CPU", MBS, 1, np.array(profile["times"]), {"source": "test"}))
    archive.add(MemoryEntry(MODEL, 1, np.array(profile["memory"]), {"source": "test"}))
    archive.add(OverheadEntry("CPU", {1: 0.0}, {"source": "test"}))
    res = simulate(PLAN, load_site_dict(SITE, source="<test>"), archive, options=options)
    return sorted(res.stages, key=lambda s: s.stage)


def test_stage_activations_are_what_the_runtime_holds(measured: tuple[list[dict], dict]) -> None:
    peaks, profile = measured
    stages = _simulated(profile, SimOptions.megatron_patch())
    assert [p["stage"] for p in peaks] == [0, 1, 2]
    for peak, stage in zip(peaks, stages, strict=True):
        flight = int(in_flight(stage.stage, len(stages), MICRO))
        print(f"stage {stage.stage}: {flight} in flight, held {peak['peak']} B, predicted "
              f"{stage.memory.activations:.0f} B")
        assert peak["live_after"] == 0  # every saved tensor was released by the step's backwards
        assert stage.memory.activations - peak["peak"] == _known_difference(stage.stage, flight)
    # negative controls: one micro-batch fewer in flight, or the sent output kept (as DeepSpeed keeps a
    # TP-1 stage's), are not what the stages hold
    flight0 = int(in_flight(0, len(stages), MICRO))
    one_fewer = stages[0].memory.activations * (flight0 - 1) / flight0
    assert peaks[0]["peak"] - one_fewer > 0.3 * peaks[0]["peak"] / flight0
    output = MBS * PLAN.model_spec.seq_len * PLAN.model_spec.hidden_size * 4  # one micro-batch's stage output
    kept = _simulated(profile, SimOptions.deepspeed_pipe())
    for peak, stage in zip(peaks[:2], kept[:2]):
        flight = int(in_flight(stage.stage, len(stages), MICRO))
        assert stage.memory.activations - peak["peak"] - _known_difference(stage.stage, flight) == flight * output
