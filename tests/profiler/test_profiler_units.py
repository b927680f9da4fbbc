"""Profiler parts that need no cluster: the bandwidth fit, the grid, the checks, the progress bar, and the
per-layer measurement itself (one process, gloo), against hand-computed shapes and a whole-model run."""
from __future__ import annotations

import io
import math
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from profiler.fit import fit_bandwidth
from profiler.jobs import NetworkTask, record_network
from profiler.keys import device_key
from profiler.netbench import stream_pairs
from profiler.progress import Progress
from profiler.sweep import SweepConfig, check_config, grid
from sailor_hpc.cli import main
from sailor_hpc.core.archive import EMBEDDED_ARCHIVE, read_archive
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.models import get_model
from sailor_hpc.core.site import load_site

REPO = Path(__file__).resolve().parents[2]
LOCAL_LAB = REPO / "site_configs" / "local-lab.toml"


def test_fit_recovers_a_known_quadratic_and_its_range():
    sizes = [2.0 ** e for e in range(16, 31, 2)]
    a, b, c = -0.02, 0.6, 4.0
    gbps = [a * math.log2(s / 1e6) ** 2 + b * math.log2(s / 1e6) + c for s in sizes]
    fit = fit_bandwidth(sizes, gbps)
    assert np.allclose(fit.coeffs, (a, b, c), atol=1e-9)
    assert fit.max_gbps == pytest.approx(max(gbps)) and (fit.min_bytes, fit.max_bytes) == (2.0 ** 16, 2.0 ** 30)
    # the fit is what the site/simulator evaluates: transfer time of 1 MB = 1e6 B / (c GB/s)
    assert fit.transfer_time(1e6) == pytest.approx(1e6 / (c * 1e9))
    with pytest.raises(SailorError):
        fit_bandwidth(sizes[:2], gbps[:2])
    with pytest.raises(SailorError):
        fit_bandwidth(sizes, [0.0] * len(sizes))


def test_stream_pairs():
    assert stream_pairs("intra", 4, 4) == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert stream_pairs("inter", 2, 4) == [(0, 2), (1, 3)]
    with pytest.raises(ValueError):
        stream_pairs("inter", 2, 3)
    with pytest.raises(ValueError):
        stream_pairs("intra", 1, 1)


def _cfg(tmp_path: Path, **kw) -> SweepConfig:
    kw.setdefault("archive", tmp_path / "a.h5")
    return SweepConfig(site=load_site(LOCAL_LAB), model="tiny-gpt", folder=tmp_path / "f", **kw)


def test_grid_skips_what_cannot_run_and_enumerates_links(tmp_path):
    units = grid(_cfg(tmp_path, tp=(1, 4, 8), mbs=(2, 1), cpu=True, senders=(1, 2, 8)))
    by_key = {u.key: u for u in units}
    # a100 has 4 GPUs per node: TP 8 cannot run there; tiny-gpt has 4 heads: TP 8 cannot run anywhere
    assert by_key["compute:a100:mbs1:tp8"].status == "skipped" and "4-GPU node" in by_key["compute:a100:mbs1:tp8"].reason
    assert by_key["compute:v100:mbs2:tp8"].status == "skipped" and "4 heads" in by_key["compute:v100:mbs2:tp8"].reason
    assert by_key["compute:v100:mbs1:tp4"].status == "pending"
    assert {u.point.gpu_key for u in units if u.point} == {"cpu-A100-40", "cpu-V100-16"}
    links = sorted(u.key for u in units if u.link)
    assert links == sorted([
        "network:intra:a100:a100:k2", "network:intra:v100:v100:k2", "network:intra:v100:v100:k8",
        "network:inter:a100:a100:k1", "network:inter:a100:a100:k2", "network:inter:v100:v100:k1",
        "network:inter:v100:v100:k2", "network:inter:v100:v100:k8",
        "network:inter:a100:v100:k1", "network:inter:a100:v100:k2"])
    assert device_key("A100-40", cpu=False) == "A100-40"


def test_checks_refuse_unsafe_archives_and_options(tmp_path):
    site_archive = tmp_path / "shared.h5"
    site = load_site(LOCAL_LAB)
    from dataclasses import replace
    shared_site = replace(site, archive=str(site_archive))
    with pytest.raises(SailorError, match="shared archive"):
        check_config(SweepConfig(site=shared_site, model="tiny-gpt", archive=site_archive, cpu=True))
    with pytest.raises(SailorError, match="embedded"):
        check_config(_cfg(tmp_path, archive=EMBEDDED_ARCHIVE))
    with pytest.raises(SailorError, match="unknown network"):
        check_config(_cfg(tmp_path, network=("intra", "wan")))
    with pytest.raises(SailorError) as err:
        check_config(_cfg(tmp_path, begin="now+1hour; touch x"))
    assert err.value.field == "--begin"
    with pytest.raises(SailorError, match="no partition"):
        check_config(_cfg(tmp_path, partitions=("h100",)))


def test_cli_profile_bad_input_exits_2(tmp_path):
    runner = CliRunner()
    base = ["profile", "--site", str(LOCAL_LAB), "--model", "tiny-gpt"]
    res = runner.invoke(main, base + ["--cpu"])
    assert res.exit_code == 2 and "--archive" in res.output
    res = runner.invoke(main, base + ["--cpu", "--archive", str(tmp_path / "a.h5"), "--mbs", "1,x"])
    assert res.exit_code == 2 and "--mbs" in res.output
    res = runner.invoke(main, base + ["--model", "nope", "--cpu", "--archive", str(tmp_path / "a.h5")])
    assert res.exit_code == 2 and "unknown model" in res.output
    res = runner.invoke(main, base)  # GPU sweep, but local-lab has no shared archive configured
    assert res.exit_code == 2 and "profiles.archive" in res.output


def test_progress_prints_one_line_per_change():
    out = io.StringIO()
    p = Progress(4, stream=out, tty=False)
    p.update({"queued": 4})
    p.update({"queued": 4})
    p.update({"ok": 1, "running": 3})
    p.message("failed: x")
    p.update({"ok": 3, "failed": 1})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[-") and "0/4 (4 queued)" in lines[0]
    assert "1/4 (1 ok, 3 running)" in lines[1] and lines[2] == "failed: x"
    assert lines[3].startswith("[" + "#" * 28 + "]") and "4/4 (3 ok, 1 failed)" in lines[3]
    assert len(lines) == 4


# ---------------------------------------------------------------------------- the measurement itself

@pytest.fixture(scope="module")
def one_rank():
    """A gloo process group of this process alone (what a TP-1 profiling job has)."""
    import torch.distributed as dist

    from megatron_patch.local import free_port
    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    if mine:
        dist.destroy_process_group()


def _hand_params(h: int, f: int, vocab_padded: int, seq: int, tp: int) -> list[float]:
    """tiny-gpt (GPT: LayerNorm, biases, learned positions, tied embeddings) per TP rank, by hand."""
    block = (3 * h * h + 3 * h + h * h + f * h + f + h * f) / tp + 2 * h + 4 * h  # sharded + proj/fc2 biases + 2 LN
    return [vocab_padded * h / tp + seq * h] + [block] * 4 + [vocab_padded * h / tp + 2 * h]


QUICK = dict(warmup=1, iters=3, min_time_s=0.0)  # the CPU tests' repetitions: structure, not precision


@pytest.fixture(scope="module")
def tiny_prof(one_rank):
    """tiny-gpt's profiled stages (embedding, 2 blocks, head), built once for the tests that only measure."""
    import torch

    from profiler.compute import LayerProfiler
    torch.manual_seed(0)
    return LayerProfiler(get_model("tiny-gpt"), tp_group=one_rank, device=torch.device("cpu"), **QUICK)


def test_layer_profiler_on_tiny_gpt(one_rank, tiny_prof):
    import torch

    from megatron_patch.model import build_stage_module
    from profiler.compute import Repetitions, layer_params

    spec, prof = get_model("tiny-gpt"), tiny_prof
    h, f, s, L = spec.hidden_size, spec.ffn_hidden_size, spec.seq_len, spec.num_pipeline_layers
    mem = prof.memory_table()
    assert mem.shape == (L, 4)
    assert list(mem[:, 0]) == _hand_params(h, f, 256, s, 1)
    assert list(layer_params(spec, 2, 256)) == _hand_params(h, f, 256, s, 2)
    assert list(mem[:, 1]) == [s * h] * 5 + [s]  # hidden states out of every layer, the loss [1, s] out of the head
    assert list(mem[:, 2]) == [2 * s] + [s * h] * 5  # token + position ids into the embedding
    # a block keeps more than its output for the backward, and blocks 3, 4 copy block 2 (profiled_blocks = 2)
    assert mem[1, 3] > mem[1, 1] * 4 and mem[3, 3] == mem[4, 3] == mem[2, 3]
    point = prof.measure_point(2)
    times = point.times
    assert times.shape == (L, 3) and np.isfinite(times).all() and (times > 0).all()
    assert (times[:, 2] == times[0, 2]).all()  # the profiled model's optimizer step, on every row
    assert (times[3] == times[2]).all() and (times[4] == times[2]).all()
    # the spread beside the medians: every layer and column, the whole model, the repetitions behind them
    spread = point.spread
    assert spread.layers.shape == (L, 3) and np.isfinite(spread.layers).all() and (spread.layers >= 0).all()
    assert (spread.layers[3] == spread.layers[2]).all() and spread.repetitions == 3 and min(spread.model) >= 0
    assert point.totals().seconds == pytest.approx((times[:, 0].sum(), times[:, 1].sum()))
    # independent reference: a whole tiny-gpt (one stage, all layers) forward + backward at micro-batch 2.
    # This machine is shared, so the two are measured interleaved (same load) and compared by minima.
    whole = build_stage_module(spec, 0, L - 1, tp_group=one_rank, device="cpu", seed=None)
    tokens = torch.randint(0, spec.vocab_size, (2, s))
    one_rep = Repetitions(warmup=0, iters=1, min_time_s=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref, sums = [], []
        for _ in range(9):
            t0 = time.perf_counter()
            whole(tokens, tokens).sum().backward()
            ref.append(time.perf_counter() - t0)
            one = prof.summarise(2, prof.sample(2, one_rep)).times
            sums.append(float(one[:, 0].sum() + one[:, 1].sum()))
    finally:
        torch.set_num_threads(threads)
    # minima, not medians: other processes on a shared CPU only ever add time, so the least of several
    # samples is the estimate of the work itself that contention cannot move
    reference, per_layer = min(ref[2:]), min(sums[2:])
    assert reference / 3 < per_layer < reference * 3, (per_layer, reference, sums, ref)


def _chain_alone(prof, mbs: int) -> float:
    """The measured layers as one connected autograd graph (no detach between layers), forward + one backward
    from the end, timed around the whole: the chain measured independently of the profiler's marks."""
    import torch

    from profiler.compute import _grad_like, _inputs
    tokens, labels = _inputs(prof.spec, mbs, prof.device, prof.seed + mbs)
    t0 = time.perf_counter()
    h = None
    for layer in prof.measured:
        h = prof._stage_of(layer).run(layer, h, tokens, labels)
    with torch.no_grad():
        grad = _grad_like(h, 0)
    t1 = time.perf_counter()
    h.backward(grad)
    took = time.perf_counter() - t1 + (t1 - t0)
    for opt in prof.optimizers:
        opt.zero_grad()
    return took


def test_per_layer_times_sum_to_the_chain(tiny_prof):
    """Every layer is timed as its slice of one chain: within a repetition the layers' seconds add up to the
    chain's (the marks telescope), and their medians add up to an independently timed chain of the same
    layers within a generous tolerance (interleaved pairs, the median of their ratios: the machine is shared, and
    a quiet moment halves one side's time, so the minima of the two sides need not meet)."""
    import torch

    from profiler.compute import Repetitions
    prof = tiny_prof
    n = len(prof.measured)
    marks = prof._repetition(*_quick_inputs(prof, 2))
    assert len(marks) == 2 * n + 2  # n forward slices, n backward slices, the optimizer step
    gaps = prof.clock.seconds(marks)
    assert gaps.sum() == pytest.approx(marks[-1] - marks[0], rel=1e-12)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        chained, alone = [], []
        for _ in range(15):  # seconds on a loaded 2-core machine swing 3x: many pairs
            chained.append(_chain_alone(prof, 4))
            s = prof.sample(4, Repetitions(warmup=0, iters=1, min_time_s=0.0))
            alone.append(float(s.fwd.sum() + s.bwd.sum()))
    finally:
        torch.set_num_threads(threads)
    ratio = float(np.median([a / c for a, c in zip(alone[1:], chained[1:])]))
    assert 1 / 1.5 < ratio < 1.5, (ratio, alone, chained)


def _quick_inputs(prof, mbs: int):
    from profiler.compute import _grad_like, _inputs
    tokens, labels = _inputs(prof.spec, mbs, prof.device, prof.seed + mbs)
    import torch
    with torch.no_grad():
        out = prof._forward_chain(tokens, labels, lambda _l, run, _x: run())
    return tokens, labels, _grad_like(out, prof.seed)


def test_repetitions_meet_both_minimums_and_the_cap(tiny_prof):
    from profiler.compute import Repetitions
    s = tiny_prof.sample(1, Repetitions(warmup=1, iters=4, min_time_s=0.0))
    assert s.repetitions == 4 and s.fwd.shape == s.bwd.shape == (4, len(tiny_prof.measured))
    s = tiny_prof.sample(1, Repetitions(warmup=0, iters=2, min_time_s=0.25))
    assert s.repetitions >= 2 and float(s.fwd.sum() + s.bwd.sum() + s.upd.sum()) >= 0.25
    s = tiny_prof.sample(1, Repetitions(warmup=0, iters=2, min_time_s=1e6, max_reps=5))
    assert s.repetitions == 5  # capped, whatever min_time_s asks
    assert Repetitions().iters >= 20 and Repetitions().min_time_s >= 1.0  # the minimums are the defaults


class _FakeCudaClock:
    """A GPU clock without a GPU: logs marks and host synchronisations, and reports scripted seconds."""

    cuda = True

    def __init__(self, rep_seconds):
        self.log: list[str] = []
        self.rep_seconds = list(rep_seconds)

    def mark(self):
        self.log.append("m")
        return len(self.log)

    def seconds(self, marks):
        self.log.append("sync")
        total = self.rep_seconds.pop(0) if len(self.rep_seconds) > 1 else self.rep_seconds[0]
        return np.full(len(marks) - 1, total / (len(marks) - 1))


def test_gpu_warm_up_runs_until_the_repetition_time_stops_falling(tiny_prof, monkeypatch):
    from profiler.compute import Repetitions
    reps = Repetitions(warmup=2, warmup_min_s=0.0, warmup_max_s=60.0)
    monkeypatch.setattr(tiny_prof, "clock", _FakeCudaClock([10, 8, 6, 5.5, 5.45, 5.5, 5.0]))
    assert tiny_prof._warm_up(lambda: [0, 1], reps) == (6, True, 5.5)  # 6 -> 5.5 fell; 5.5 -> 5.45 -> 5.5 did not
    monkeypatch.setattr(tiny_prof, "clock", _FakeCudaClock([10, 9, 8, 7, 6, 5]))
    count, settled, _ = tiny_prof._warm_up(lambda: [0, 1], Repetitions(warmup=2, warmup_min_s=0.0, warmup_max_s=0.0))
    assert (count, settled) == (2, False)  # still falling when the cap ran out: the point records it


def test_no_host_synchronisation_inside_a_repetition_on_a_gpu(tiny_prof, monkeypatch):
    """On a GPU the repetitions of a batch are enqueued back to back and the host waits once per batch,
    never between the layers of a repetition."""
    from profiler.compute import Repetitions
    clock = _FakeCudaClock([0.01])
    monkeypatch.setattr(tiny_prof, "clock", clock)
    s = tiny_prof.sample(1, Repetitions(warmup=3, iters=20, min_time_s=0.0, warmup_min_s=0.0, batch_s=0.1))
    per_rep = 2 * len(tiny_prof.measured) + 2
    assert s.repetitions == 20 and s.warmup_reps == 3
    runs = "".join("s" if x == "sync" else "m" for x in clock.log).split("s")
    marks = [len(r) for r in runs if r]
    assert all(m % per_rep == 0 for m in marks)  # marks between two synchronisations: whole repetitions
    assert max(marks) == 10 * per_rep  # 0.1 s batches of 10 ms repetitions: 10 enqueued per wait


def test_bf16_profile_times_a_real_optimizer_step(one_rank):
    """bf16 keeps gradients on the bf16 copies: the timed step must move them to the fp32 masters first,
    or Adam finds no gradient and the profile records a step of nothing."""
    import torch

    from profiler.compute import LayerProfiler

    prof = LayerProfiler(get_model("tiny-gpt"), tp_group=one_rank, device=torch.device("cpu"), dtype="bf16", **QUICK)
    prof.measure(1)
    for opt in prof.optimizers:
        stepped = [n for n in opt.master if n in opt.state and int(opt.state[n].step) > 0]
        assert len(stepped) == len(opt.master) > 0


# ---------------------------------------------------------------------------- monotonicity

def test_violations_allow_gaps_inside_the_spreads_and_name_both_points():
    from profiler.monotonic import ModelTotals, violations
    ok = [ModelTotals(1, (0.045, 0.052), (0.01, 0.01)), ModelTotals(2, (0.066, 0.088), (0.05, 0.05)),
          ModelTotals(4, (0.063, 0.119), (0.03, 0.03))]  # 3 ms below, 3.3 + 1.9 ms of spread: noise
    assert violations(ok) == {}
    tight = [ModelTotals(1, (0.045, 0.052), (0.01, 0.01)), ModelTotals(2, (0.066, 0.088), (0.01, 0.01)),
             ModelTotals(4, (0.063, 0.119), (0.01, 0.01)), ModelTotals(8, (0.105, 0.203))]
    found = violations(tight)
    assert set(found) == {2, 4}
    assert found[4].startswith("not monotonic: forward 63 ms at mbs 4 is below 66 ms at mbs 2")
    assert "backward" not in found[4] and found[2] == found[4]
    assert violations([ModelTotals(1, (0.01, 0.02)), ModelTotals(2, (0.0099, 0.02))])  # no spread recorded: 0


def _synthetic_points(monkeypatch, low: dict[int, int]):
    """LayerProfiler.measure_point replaced by points of 1 ms x mbs per layer (1 % spread), except that the
    first ``low[mbs]`` measurements of a size come out at a tenth: calls are counted per size."""
    from profiler.compute import LayerProfiler, PointResult
    from sailor_hpc.core.archive import PointSpread
    calls: dict[int, int] = {}

    def fake(self, mbs):
        calls[mbs] = calls.get(mbs, 0) + 1
        scale = 0.1 if calls[mbs] <= low.get(mbs, 0) else 1.0
        L = self.spec.num_pipeline_layers
        return PointResult(mbs=mbs, times=np.full((L, 3), 1e-3 * mbs * scale),
                           spread=PointSpread(np.full((L, 3), 0.01), (0.01, 0.01), 20), info={"warmup_reps": 3})

    monkeypatch.setattr(LayerProfiler, "measure_point", fake)
    return calls


def test_a_non_monotonic_point_is_measured_again_and_kept_when_it_recovers(one_rank, monkeypatch):
    import torch

    from profiler.compute import profile_compute
    calls = _synthetic_points(monkeypatch, {4: 1})  # mbs 4's first measurement is an outlier
    res = profile_compute(get_model("tiny-gpt"), [1, 2, 4], tp_group=one_rank, device=torch.device("cpu"), **QUICK)
    assert calls == {1: 2, 2: 2, 4: 2}  # mbs 4 is below 1 and 2: all three points measured once more
    assert all(p.info.get("remeasured") and not p.flag for p in res.points)
    assert res.extra["timing"] == "chain"


def test_a_point_that_stays_non_monotonic_is_flagged(one_rank, monkeypatch):
    import torch

    from profiler.compute import profile_compute
    calls = _synthetic_points(monkeypatch, {2: 99})  # mbs 2 always below mbs 1
    res = profile_compute(get_model("tiny-gpt"), [1, 2, 4], tp_group=one_rank, device=torch.device("cpu"), **QUICK)
    assert calls == {1: 2, 2: 2, 4: 1}
    flags = {p.mbs: p.flag for p in res.points}
    assert flags[4] == "" and flags[1] == flags[2] and flags[2].startswith("not monotonic: forward")
    calls.clear()
    res = profile_compute(get_model("tiny-gpt"), [1, 2], tp_group=one_rank, device=torch.device("cpu"),
                          remeasure=False, **QUICK)
    assert calls == {1: 1, 2: 1} and all(p.flag for p in res.points)  # re-runs of the sweep driver: flag only


def _noisy_points(monkeypatch, loud: dict[int, int]):
    """Synthetic points of 1 ms x mbs per layer whose first ``loud[mbs]`` measurements have a 60 % spread (a
    busy node) and a median 3x too slow; the later ones 2 %."""
    from profiler.compute import LayerProfiler, PointResult
    from sailor_hpc.core.archive import PointSpread
    calls: dict[int, int] = {}

    def fake(self, mbs):
        calls[mbs] = calls.get(mbs, 0) + 1
        busy = calls[mbs] <= loud.get(mbs, 0)
        L, s = self.spec.num_pipeline_layers, 0.6 if busy else 0.02
        return PointResult(mbs=mbs, times=np.full((L, 3), 1e-3 * mbs * (3.0 if busy else 1.0)),
                           spread=PointSpread(np.full((L, 3), s), (s, s), 20), info={"warmup_reps": 3})

    monkeypatch.setattr(LayerProfiler, "measure_point", fake)
    return calls


def test_a_noisy_point_is_measured_again_and_the_quiet_measurement_kept(one_rank, monkeypatch):
    import torch

    from profiler.compute import profile_compute
    calls = _noisy_points(monkeypatch, {2: 1})  # mbs 2's first measurement ran beside other work
    res = profile_compute(get_model("tiny-gpt"), [1, 2, 4], tp_group=one_rank, device=torch.device("cpu"), **QUICK)
    assert calls == {1: 1, 2: 2, 4: 1}
    points = {p.mbs: p for p in res.points}
    assert points[2].times[0, 0] == 2e-3 and points[2].spread.model == (0.02, 0.02) and not points[2].flag
    assert points[2].info["measurements"] == 2 and "measurements" not in points[1].info


def test_a_point_that_stays_noisy_is_measured_three_times_then_flagged(one_rank, monkeypatch):
    import torch

    from profiler.compute import profile_compute
    from profiler.noise import NOISY, QUIET_RETRIES, flag_parts
    calls = _noisy_points(monkeypatch, {1: 99})
    res = profile_compute(get_model("tiny-gpt"), [1, 2], tp_group=one_rank, device=torch.device("cpu"), **QUICK)
    assert calls == {1: 1 + QUIET_RETRIES, 2: 1} == {1: 3, 2: 1}  # bounded: three measurements in all
    points = {p.mbs: p for p in res.points}
    assert points[1].flag == ("noisy: spread forward 60 %, backward 60 % over 20 repetitions, above 20 %: the node "
                              "was busy (other work on its cores or GPU), so the median may be off by as much")
    assert set(flag_parts(points[1].flag)) == {NOISY} and points[1].info["measurements"] == 3 and not points[2].flag


def test_flag_parts_of_both_kinds_are_kept_apart():
    from profiler.noise import NOISY, flag_parts, with_flag
    both = with_flag("noisy: spread forward 60 %", "not monotonic: forward 1 ms at mbs 2 is below", "not monotonic")
    assert flag_parts(both) == {NOISY: "noisy: spread forward 60 %",
                                "not monotonic": "not monotonic: forward 1 ms at mbs 2 is below"}
    assert with_flag(both, "", NOISY) == "not monotonic: forward 1 ms at mbs 2 is below"
    assert with_flag("", "", NOISY) == ""


def _fake_point_rank(job_id: int, task) -> None:
    """A TP-1 profiling job (compute_job itself, its archive writes included) whose mbs-2 point is always
    below mbs 1 (the synthetic points above), in a process of its own."""
    import os

    import pytest as _pytest
    os.environ.update(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_JOB_ID=str(job_id), OMP_NUM_THREADS="1")
    with _pytest.MonkeyPatch.context() as mp:
        _synthetic_points(mp, {2: 99})
        from profiler.jobs import compute_job
        compute_job(task)


def test_the_flag_and_the_spread_reach_the_archive_and_profiles_show(tmp_path):
    import json
    import multiprocessing as mp

    from profiler.jobs import ComputeTask
    archive = tmp_path / "a.h5"
    task = ComputeTask(model="tiny-gpt", partition="a100", gpu_key="cpu-A100-40", tp=1, mbs=(1, 2, 4),
                       archive=str(archive), cpu=True, sweep="test", warmup=1, iters=3, min_time_s=0.0)
    proc = mp.get_context("spawn").Process(target=_fake_point_rank, args=(_free_job_id(), task))
    proc.start()
    proc.join(240)
    assert proc.exitcode == 0
    points = read_archive(archive).compute_points("tiny-gpt", "cpu-A100-40")
    assert points[(2, 1)].flag.startswith("not monotonic") and points[(1, 1)].flag and not points[(4, 1)].flag
    assert all(e.spread is not None and e.spread.repetitions == 20 and e.spread.layers.shape == (6, 3)
               for e in points.values())
    assert points[(2, 1)].provenance["remeasured"] and points[(2, 1)].provenance["timing"] == "chain"
    base = ["profiles", "show", "tiny-gpt", "cpu-A100-40", "--archive", str(archive)]
    shown = json.loads(CliRunner().invoke(main, base + ["--json"]).output)
    rows = {r["mbs"]: r for r in shown["points"]}
    assert rows[2]["flag"] == points[(2, 1)].flag and rows[4]["flag"] == ""
    assert rows[4]["spread"] == {"fwd": 0.01, "bwd": 0.01, "repetitions": 20}
    text = CliRunner().invoke(main, base).output
    line = next(x for x in text.splitlines() if x.startswith("2 "))
    assert "NOT MONOTONIC" in line and "1.0 %" in line and " 20 " in line
    assert f"flagged: mbs 2 tp 1: {points[(2, 1)].flag}" in text and "flagged: mbs 4" not in text


# ---------------------------------------------------------------------------- paths and options of a sweep

def test_net_sizes_below_three_distinct_are_refused_before_any_job(tmp_path, monkeypatch):
    import profiler.sweep as sweep

    def no_jobs(*_a, **_k):
        raise AssertionError("a job was submitted")

    monkeypatch.setattr(sweep, "make_executor", no_jobs)
    base = ["profile", "--site", str(LOCAL_LAB), "--model", "tiny-gpt", "--cpu", "--archive", str(tmp_path / "a.h5"),
            "--folder", str(tmp_path / "f")]
    for sizes in ("16,20", "16,20,20", "24"):
        res = CliRunner().invoke(main, base + ["--net-sizes", sizes])
        assert res.exit_code == 2 and "--net-sizes" in res.output and "at least 3" in res.output, res.output
    assert not (tmp_path / "f").exists() and not (tmp_path / "a.h5").exists()
    with pytest.raises(SailorError, match="3 distinct"):
        fit_bandwidth([2.0 ** 16, 2.0 ** 16, 2.0 ** 20], [1.0, 1.1, 2.0])


def test_a_symlink_to_a_protected_archive_is_still_refused(tmp_path):
    from dataclasses import replace

    link = tmp_path / "looks-mine.h5"
    link.symlink_to(EMBEDDED_ARCHIVE)
    with pytest.raises(SailorError, match="embedded"):
        check_config(_cfg(tmp_path, archive=link))
    shared = tmp_path / "site" / "shared.h5"
    shared.parent.mkdir()
    shared.touch()
    (tmp_path / "alias").symlink_to(shared.parent)
    site = replace(load_site(LOCAL_LAB), archive=str(shared))
    with pytest.raises(SailorError, match="shared archive"):
        check_config(SweepConfig(site=site, model="tiny-gpt", archive=tmp_path / "alias" / "shared.h5", cpu=True))


class _FakeExecutor:
    """Records what the sweep hands to its jobs instead of submitting them."""

    tasks: list = []

    def submit(self, fn, task):
        self.tasks.append(task)
        return type("Job", (), {"job_id": str(len(self.tasks))})()

    def map_array(self, fn, tasks):
        return [self.submit(fn, t) for t in tasks]


class _EndAtOnce:
    """A watcher whose jobs all end, without a result, at the first poll."""

    def __init__(self, **_kw):
        self.ids: list[str] = []

    def add(self, by_job):
        self.ids = list(by_job)

    @property
    def open(self):
        return list(self.ids)

    def poll(self):
        from types import SimpleNamespace
        ended, self.ids = self.ids, []
        return {j: SimpleNamespace(final=True, state="FAILED") for j in ended}

    def status(self, _jid):
        return None


def test_jobs_get_real_paths_from_a_relative_path_through_a_symlink(tmp_path, monkeypatch):
    """Jobs run elsewhere (another working directory, another node's view of the login node's symlinks):
    the archive and folders they get must be the real paths, so every job writes the same file."""
    import profiler.sweep as sweep
    from profiler.sweep import run_sweep

    real = (tmp_path / "real").resolve()
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    monkeypatch.chdir(tmp_path)
    _FakeExecutor.tasks = []
    monkeypatch.setattr(sweep, "make_executor", lambda *a, **k: _FakeExecutor())
    monkeypatch.setattr(sweep, "shared_hosts", lambda _partitions: {})  # no Slurm to ask
    monkeypatch.setattr(sweep, "JobWatcher", _EndAtOnce)
    monkeypatch.setattr(sweep, "job_result", lambda folder, jid, st: (None, f"job {jid} FAILED"))
    cfg = SweepConfig(site=load_site(LOCAL_LAB), model="tiny-gpt", archive=Path("link/../link/a.h5"),
                      folder=Path("link/sweep"), partitions=("a100",), mbs=(1,), tp=(1,), cpu=True,
                      network=("intra",), senders=(2,), poll_s=0.01)
    report = run_sweep(cfg, progress=Progress(0, stream=io.StringIO(), tty=False))
    compute = [t for t in _FakeExecutor.tasks if hasattr(t, "mbs")]
    network = [t for t in _FakeExecutor.tasks if hasattr(t, "sizes")]
    assert compute and network
    for task in compute + network:
        assert task.archive == str(real / "a.h5") and task.sweep == str(real / "sweep")
    assert all(t.folder == str(real / "sweep") for t in network)
    assert report.archive == real / "a.h5" and report.folder == real / "sweep"
    assert (real / "sweep" / "sweep-state.json").exists()
    assert read_archive(real / "a.h5").failed  # the ended job's points are recorded, in the real file


# ---------------------------------------------------------------------------- a failure on one TP rank

def _compute_rank(rank: int, job_id: int, task, env: dict) -> None:
    """One task of a TP-2 profiling job, as Slurm would start it (CPU, gloo)."""
    import os

    os.environ.update(env, SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_JOB_ID=str(job_id),
                      SLURM_CPUS_PER_TASK="1", OMP_NUM_THREADS="1")
    from profiler.jobs import compute_job
    compute_job(task)


def _free_job_id() -> int:
    """A Slurm job id whose rendezvous port (dist_env.job_port) is free here."""
    import random
    import socket

    from sailor_hpc.core.dist_env import JOB_PORT_SPAN, job_port
    for job_id in random.sample(range(JOB_PORT_SPAN), 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", job_port(job_id)))
            except OSError:
                continue
        return job_id
    raise RuntimeError("no free port in the rendezvous range")


def test_a_failure_on_one_tp_rank_fails_that_point_on_every_rank_and_the_job_goes_on(tmp_path):
    """Rank 1 fails at micro-batch 2 just before a block's forward, while rank 0 enters that block's TP
    all-reduce: rank 0 must not wait for it forever, both ranks must record micro-batch 2 as failed with
    rank 1's reason, and micro-batch 4 must still be measured (on a fresh group)."""
    import multiprocessing as mp

    from profiler.compute import FAIL_ENV
    from profiler.jobs import ComputeTask

    archive = tmp_path / "cpu.h5"
    task = ComputeTask(model="tiny-gpt", partition="a100", gpu_key="cpu-A100-40", tp=2, mbs=(1, 2, 4),
                       archive=str(archive), cpu=True, sweep="test", warmup=1, iters=2, collective_timeout_s=5)
    ctx = mp.get_context("spawn")
    job_id = _free_job_id()
    ranks = [ctx.Process(target=_compute_rank, args=(r, job_id, task, {FAIL_ENV: "1:2"})) for r in (0, 1)]
    t0 = time.monotonic()
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(240)
    alive = [p for p in ranks if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank still waits for the failed one"
    assert [p.exitcode for p in ranks] == [0, 0]
    a = read_archive(archive)
    assert sorted(a.compute[("tiny-gpt", "cpu-A100-40", "fp32")]) == [(1, 2), (4, 2)]
    (failed,) = a.failed[("tiny-gpt", "cpu-A100-40", "fp32")].values()
    assert (failed.mbs, failed.tp) == (2, 2)
    assert failed.reason.startswith("micro-batch 2: rank 1: RuntimeError: injected failure"), failed.reason
    assert 2 in a.memory["tiny-gpt"] and a.overhead["cpu-A100-40"].by_tp[2] > 0
    assert time.monotonic() - t0 < 200


def test_the_memory_table_is_taken_after_a_warm_up_pass(one_rank, monkeypatch):
    """One-time allocations of the first pass (cuBLAS workspace, cached masks, gradient buffers) must not be
    counted as a layer's activations: every measured layer has run forward and backward once before the
    first retained-bytes measurement. (The allocator path itself needs a GPU.)"""
    import torch

    import profiler.compute as compute

    prof = compute.LayerProfiler(get_model("tiny-gpt"), tp_group=one_rank, device=torch.device("cpu"),
                                 warmup=1, iters=1)
    runs: list[int] = []
    first_measured_after: list[int] = []
    real_run, real_retained = compute._Stage.run, compute._retained_bytes

    def counting_run(self, layer, *args):
        runs.append(layer)
        return real_run(self, layer, *args)

    def retained(fn, exclude, device):
        if not first_measured_after:
            first_measured_after.append(len(runs))
        return real_retained(fn, exclude, device)

    monkeypatch.setattr(compute._Stage, "run", counting_run)
    monkeypatch.setattr(compute, "_retained_bytes", retained)
    table = prof.memory_table()
    assert sorted(runs[:first_measured_after[0]]) == sorted(prof.measured)
    assert table.shape == (get_model("tiny-gpt").num_pipeline_layers, 4) and (table[:, 3] > 0).all()


def test_het_profiling_jobs_give_every_component_the_sites_per_component_options(tmp_path):
    """sbatch copies --account/--qos to later het components but not --constraint or --exclusive: the
    network job's second component must carry them itself; job-wide options stay in the first only."""
    import dataclasses

    from profiler.executors import Allocation, JobSettings, make_executor
    site = load_site(LOCAL_LAB)
    slurm = dataclasses.replace(site.slurm, constraint="ib", extra_sbatch=("--exclusive", "--mail-type=END"))
    site = dataclasses.replace(site, slurm=slurm)
    part = site.partitions[0]
    settings = JobSettings(folder=tmp_path, python="python3", time_min=5, site=site)
    ex = make_executor(settings, Allocation(part, 1, 1), job_name="net", het=Allocation(part, 1, 1))
    text = ex._make_submission_file_text("true", "uid")
    first, _, second = text.partition("#SBATCH hetjob")
    for head in (first, second):
        assert "#SBATCH --constraint=ib" in head and "#SBATCH --exclusive" in head.split("\n")
    assert "--mail-type=END" in first and "--mail-type" not in second


def test_a_point_the_job_flagged_is_reported_as_the_sweep_hears_of_it():
    """A job's summary names a point measured but doubted (its node was busy): the sweep says so at once and
    keeps it in the unit's note, so the report shows it, not a plain 'ok'."""
    from profiler.keys import ComputePoint
    from profiler.sweep import Unit, _tell, apply_result
    units = [Unit(f"compute:a100:mbs{b}:tp1", point=ComputePoint("a100", "cpu-A100-40", b, 1)) for b in (1, 2)]
    busy = "noisy: spread forward 60 % over 20 repetitions, above 20 %: the node was busy"
    apply_result(units, {"points": [{"mbs": 1, "ok": True, "reason": "", "flag": ""},
                                    {"mbs": 2, "ok": True, "reason": "", "flag": busy}]}, "")
    assert [(u.status, u.reason) for u in units] == [("ok", ""), ("ok", f"flagged: {busy}")]
    out = io.StringIO()
    _tell(units, Progress(2, stream=out, tty=False))
    assert out.getvalue().strip() == f"flagged: compute:a100:mbs2:tp1: {busy}"


def test_measuring_jobs_own_their_nodes_and_queue_one_at_a_time_on_a_shared_machine(tmp_path):
    """Every component of a measuring job asks for its nodes alone (--exclusive); where Slurm's nodes are one
    machine, the sweep's Queue makes each job wait for the one before and an array run element by element."""
    from profiler.executors import Allocation, JobSettings, make_executor
    from profiler.sweep import Queue
    site = load_site(LOCAL_LAB)
    a100, v100 = site.partitions
    settings = JobSettings(folder=tmp_path, python="python3", time_min=5, site=site)
    compute = make_executor(settings, Allocation(a100, 1, 2), job_name="compute")
    lines = compute._make_submission_file_text("true", "uid").split("\n")
    assert "#SBATCH --exclusive" in lines and not any("--dependency" in x for x in lines)
    het = make_executor(settings, Allocation(a100, 1, 1), job_name="net", one_task=True, het=Allocation(v100, 1, 1))
    first, _, second = het._make_submission_file_text("true", "uid").partition("#SBATCH hetjob")
    assert "#SBATCH --exclusive" in first.split("\n") and "#SBATCH --exclusive" in second.split("\n")

    queue = Queue({"localhost": ["a100-1", "a100-2", "v100-1", "v100-2"]})
    assert queue.options() == {"after": (), "one_at_a_time": True}  # the first job waits for nothing
    queue.submitted("41_2")  # an array: the next job waits for all of it
    array = make_executor(settings, Allocation(a100, 1, 1), job_name="compute", **queue.options())
    array.parameters["map_count"] = 3  # what submitit sets when it submits an array of 3
    lines = array._make_submission_file_text("true", "uid").split("\n")
    assert "#SBATCH --dependency=afterany:41" in lines and "#SBATCH --array=0-2%1" in lines
    assert "#SBATCH --exclusive" in lines
    assert "a100-1, a100-2, v100-1, v100-2 on localhost" in queue.why()
    apart = Queue()  # nodes that are machines of their own: no ordering beyond --exclusive
    apart.submitted("41")
    assert apart.options() == {} and not apart.serial


def test_the_sweep_measures_a_pair_across_jobs_again_then_flags_it(tmp_path, monkeypatch):
    """Two jobs measured mbs 1 and mbs 2 (one point each, so neither could compare them): the driver finds
    mbs 2 below mbs 1, submits both once more in one job that may not measure a third time, and flags both
    in the archive when the new numbers still disagree; a consistent point is left alone."""
    import profiler.sweep as sweep
    from profiler.keys import ComputePoint
    from profiler.sweep import Unit, recheck_monotonic
    from sailor_hpc.core.archive import ComputeEntry, PointSpread, make_provenance, write_entries

    cfg = _cfg(tmp_path, cpu=True, mbs=(1, 2, 4), tp=(1,))
    spread = PointSpread(np.full((6, 3), 0.01), (0.01, 0.01), 20)

    def write(mbs: int, per_layer: float) -> None:
        write_entries(cfg.archive, [ComputeEntry("tiny-gpt", "cpu-A100-40", mbs, 1, np.full((6, 3), per_layer),
                                                 make_provenance("test"), spread=spread)])

    for mbs, per_layer in ((1, 1e-3), (2, 0.5e-3), (4, 4e-3)):
        write(mbs, per_layer)
    units = [Unit(f"compute:a100:mbs{b}:tp1", point=ComputePoint("a100", "cpu-A100-40", b, 1), status="ok")
             for b in (1, 2, 4)]
    submitted: list = []

    def resubmit(cfg_, todo, *, remeasure, queue=None):
        submitted.append(([u.point.mbs for u in todo], remeasure, cfg_.points_per_job))
        for u in todo:
            u.status, u.job_id = "queued", "77"

    def finish(cfg_, units_, progress, deadline):
        for u in units_:
            if u.status == "queued":
                write(u.point.mbs, {1: 1e-3, 2: 0.6e-3}[u.point.mbs])  # measured again: still below
                u.status = "ok"

    monkeypatch.setattr(sweep, "submit_compute", resubmit)
    monkeypatch.setattr(sweep, "_watch", finish)
    out = io.StringIO()
    recheck_monotonic(cfg, units, Progress(3, stream=out, tty=False), None)
    assert submitted == [([1, 2], False, 2)]  # one job for the pair, told not to measure a third time
    points = read_archive(cfg.archive).compute_points("tiny-gpt", "cpu-A100-40")
    assert points[(2, 1)].flag.startswith("not monotonic: forward") and points[(1, 1)].flag == points[(2, 1)].flag
    assert points[(4, 1)].flag == "" and points[(2, 1)].times[0, 0] == 0.6e-3
    assert [u.status for u in units] == ["ok"] * 3 and units[1].reason.startswith("flagged: not monotonic")
    assert "measuring again: compute:a100:mbs2:tp1" in out.getvalue() and "flagged: compute:a100:mbs1:tp1" in out.getvalue()
    submitted.clear()  # flagged points are not measured again by a later sweep (--resume)
    recheck_monotonic(cfg, units, Progress(3, stream=io.StringIO(), tty=False), None)
    assert submitted == []


def test_the_simulator_takes_chain_timed_layers_as_they_are():
    """A point whose layers are slices of one chain needs no chain-timing correction, even asked for one and
    even carrying an older profiler's stack figures; an older point's correction still applies."""
    from sailor_hpc.core.archive import ComputeEntry, MemoryEntry, ProfileArchive
    from simulator.tables import ProfileTables

    spec = get_model("tiny-gpt")
    times = np.tile([[1e-3, 2e-3, 1e-4]], (6, 1))
    def stack(mbs: int) -> dict:  # the 4 measured layers' chain 0.3 ms faster forward: 0.1 ms per boundary
        return {"stack_layers": 4, "stack_fwd_s": 4e-3 * mbs - 3e-4, "stack_bwd_s": 8e-3 * mbs}

    archive = ProfileArchive()
    archive.add(MemoryEntry("tiny-gpt", 1, np.ones((6, 4)), {}))
    for mbs, prov in ((1, {"timing": "chain", **stack(1)}), (2, stack(2))):
        archive.add(ComputeEntry("tiny-gpt", "G", mbs, 1, times * mbs, prov))
    tables = ProfileTables(archive, spec)
    assert tables.compute("G", 1, 1, chain_timing=True).fwd(0, 5) == pytest.approx(6e-3)
    assert tables.compute("G", 2, 1, chain_timing=True).fwd(0, 5) == pytest.approx(12e-3 - 5 * 1e-4)


def test_a_network_result_keeps_its_streamed_and_issued_latencies(tmp_path: Path) -> None:
    """The latencies profiler.netbench reports reach the archive's fit by name; a result from before the issued
    latency was measured records none (0: the simulator prices with the streamed one)."""
    sizes = [2 ** 16, 2 ** 18, 2 ** 20]
    base = {"sizes": sizes, "p2p_gbps": [0.2, 0.4, 0.5], "allreduce_busbw_gbps": [0.1, 0.3, 0.4], "pairs": [[0, 1]],
            "hosts": ["h", "h"], "device": "cpu", "backend": "gloo", "world": 2, "versions": {},
            "all_reduce_latency_s": 1e-4, "all_gather_latency_s": 3e-4}
    for name, issued in (("new", {"all_reduce_issued_latency_s": 4e-4, "all_gather_issued_latency_s": 9e-4}),
                         ("old", {})):
        task = NetworkTask("lab", "intra", "cpu", "cpu", 2, 1, tuple(sizes), str(tmp_path / f"{name}.h5"), True,
                           "test", str(tmp_path), "python")
        record_network(task, {**base, **issued})
        (entry,) = read_archive(tmp_path / f"{name}.h5").network["lab"]
        assert (entry.fit.collective_latency_s, entry.fit.gather_latency_s) == (1e-4, 3e-4)
        assert (entry.fit.issued_latency_s, entry.fit.issued_gather_latency_s) == ((4e-4, 9e-4) if issued else (0, 0))
        assert entry.provenance["issued_latency_s"] == entry.fit.issued_latency_s
