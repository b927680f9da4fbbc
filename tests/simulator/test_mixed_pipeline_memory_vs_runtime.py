"""Each memory term of every stage of a pipeline over two GPU types against what megatron_patch allocates.

Three gloo ranks train tiny-gpt as a three-stage plan whose stages sit on two GPU types of different sizes
and fixed overheads (``small`` | ``large`` | ``small``, as Sailor's pipelines over mixed consumer GPUs do),
6 micro-batches of 2: more micro-batches than stages, so 1F1B keeps 3, 2 and 1 in flight.
``memory_worker.py`` runs the runtime's own step under torch's memory profiler and reports, on every rank,
the model state by kind (weights, fp32 main grads, Adam's m and v, counted from the runtime's tensors),
the optimizer step's temporary, the bytes autograd saved for backward at their peak, and the step's peak
allocated. The simulator (``SimOptions.megatron_patch(backend="gloo")``), given the layer profile rank 0
takes, must predict per stage:

* the model state to the byte (each stage's own layers; the first and last stage each hold their copy of
  the tied embedding, as megatron keeps one per end);
* the optimizer temporary up to the no-decay group (the one named term, as on one stage);
* the activations in flight, ``min(P - s, m)`` micro-batches of the stage's layers plus the received
  inputs, minus the sent output, up to the two named terms of ``test_memory_vs_runtime`` that do not scale
  with the micro-batch size;
* the peak allocated from above within :data:`PEAK_TOL`, and the same busiest rank;
* each stage's device total = its peak allocated + its own GPU type's overhead (nothing else differs).

Negative control: one micro-batch fewer in flight on the first stage misses its saved bytes.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_patch import local
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from sailor_hpc.core.site import load_site_dict
from simulator import SimOptions, simulate
from simulator.api import StageReport
from simulator.memory import in_flight
from tests.megatron_patch.conftest import ADAM, MODEL, events, shipped_data  # noqa: F401 - fixture
from tests.simulator.conftest import MIXED_OVERHEAD, MIXED_SITE, mixed_archive

WORKER = str(Path(__file__).parents[1] / "megatron_patch" / "memory_worker.py")
MBS, MICRO = 2, 6
GPUS = ("small", "large", "small")
PEAK_TOL = 0.05  # the blocks' working set is charged as a whole activation (test_memory_terms_vs_runtime)
# What a step starts with beyond the model state, none of it modelled; listed from the live tensors at a step's
# start on this model: three RNG states of 5,056 B, the causal mask (seq^2 bool), the padded vocabulary's mask,
# Adam's step counters (15-17 KB on every rank), and on a stage that receives, the previous step's last two
# received tensors (one boundary activation each), still referenced until the schedule's next receive.
START_BUFFERS = 17 * 1024


# the embedding with one block, two blocks, the last block with the head
PLAN = Plan(MODEL, MBS * MICRO, (Pipeline(MBS, MICRO, tuple(
    Stage(a, b, 1, gpu, gpu) for (a, b), gpu in zip(((0, 1), (2, 3), (4, 5)), GPUS, strict=True))),))


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory, shipped_data: str) -> tuple[dict[int, dict], dict]:  # noqa: F811
    root = tmp_path_factory.mktemp("mixed-pipeline-memory")
    PLAN.save(root / "plan.json")
    argv = [WORKER, "--plan", str(root / "plan.json"), "--model", MODEL, "--data", shipped_data,
            "--steps", "2", *ADAM]
    # AVX2 kernels: oneDNN's bf16/AMX scratch is the CPU library's, not the runtime's (test_memory_terms_vs_runtime)
    results = local.run(argv, PLAN.num_gpus, {"PROFILE_MBS": str(MBS), "ONEDNN_MAX_CPU_ISA": "AVX2"}, timeout=600)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}:\n{r.stderr[-4000:]}"
    terms = {e["stage"]: e for r in results for e in events(r, "memory_terms")}
    (profile,) = events(results[0], "profile")
    return terms, profile


def _simulated(profile: dict) -> list[StageReport]:
    res = simulate(PLAN, load_site_dict(MIXED_SITE, source="<test>"), mixed_archive(MODEL, MBS, profile),
                   options=SimOptions.megatron_patch(backend="gloo"))
    return sorted(res.stages, key=lambda s: s.stage)


def _unscaled(stage: int, flight: int) -> int:
    """The two per-micro-batch terms the model scales from a micro-batch-1 profile but the runtime does not
    (``test_memory_vs_runtime._known_difference``): the embedding's expanded position ids, the per-token loss."""
    spec = PLAN.model_spec
    s = PLAN.pipelines[0].stages[stage]
    position_ids = flight * (MBS - 1) * spec.seq_len * 8 if s.first_layer == 0 else 0
    loss = flight * MBS * spec.seq_len * 4 if s.last_layer == spec.num_pipeline_layers - 1 else 0
    return position_ids + loss


def _data(stage: int, flight: int) -> int:
    """The step's data autograd keeps, which a layer profile leaves out (``memory_worker`` counts it): the
    first stage's token ids (int64), which the embedding's backward keeps as its indices."""
    first = PLAN.pipelines[0].stages[stage].first_layer == 0
    return first * flight * MBS * PLAN.model_spec.seq_len * 8


def test_every_term_of_every_stage_on_its_gpu_type(measured: tuple[dict[int, dict], dict]) -> None:
    got, profile = measured
    stages = _simulated(profile)
    P = len(stages)
    assert sorted(got) == list(range(P)) and [s.gpu_type for s in stages] == list(GPUS)
    flights = [int(in_flight(s.stage, P, MICRO)) for s in stages]
    assert flights == [3, 2, 1]  # more micro-batches than stages: 1F1B's P - s, not m
    for s, flight in zip(stages, flights, strict=True):
        g, mem = got[s.stage], s.memory
        print(f"stage {s.stage} ({s.gpu_type}, {flight} in flight): peak allocated measured {g['step_peak']:,} B, "
              f"predicted {float(mem.peak_allocated):,.0f} B ({float(mem.peak_allocated) / g['step_peak'] - 1:+.1%}); "
              f"saved {g['saved_peak']:,} B, predicted activations {float(mem.activations):,.0f} B")
        n = g["params_elems"]
        # weights, fp32 main grads, Adam m and v: each what the runtime holds, and their sum the simulator's state
        assert (g["params"], g["main_grads"], g["masters"], g["moments"]) == (4 * n, 4 * n, 0, 8 * n)
        assert mem.state == g["state"] == 16 * n
        # the step's temporary: sqrt(v) of the decay group (+ a few scalars); the simulator charges every parameter
        decay, no_decay = g["param_groups"]
        assert 0 <= g["optimizer_peak"] - g["optimizer_start"] - 4 * decay < 64
        assert mem.optimizer_temp == 4 * (decay + no_decay)
        # the activations of the micro-batches in flight: what autograd saved at its peak
        assert g["saved_peak"] - mem.activations == _data(s.stage, flight) - _unscaled(s.stage, flight)
        # the step's peak allocated, from above
        unmodelled = g["start"] - g["state"]
        received = 2 * MBS * PLAN.model_spec.seq_len * PLAN.model_spec.hidden_size * 4 if s.stage > 0 else 0
        assert 0 <= unmodelled <= START_BUFFERS + received
        assert g["step_peak"] - unmodelled <= mem.peak_allocated <= (1 + PEAK_TOL) * g["step_peak"]
        # the device total adds the stage's own GPU type's overhead (no caching allocator on the gloo backend)
        assert float(mem.peak_device) == pytest.approx(float(mem.peak_allocated) + mem.allocator_slack
                                                       + MIXED_OVERHEAD[s.gpu_type])
    assert max(got, key=lambda r: got[r]["step_peak"]) == max(stages, key=lambda s: s.memory.peak_allocated).stage
    # negative control: the first stage with one micro-batch fewer in flight
    first = stages[0].memory.activations * (flights[0] - 1) / flights[0]
    assert got[0]["saved_peak"] - first > 0.3 * got[0]["saved_peak"] / flights[0]
