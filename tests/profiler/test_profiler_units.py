"""Profiler parts that need no cluster: the bandwidth fit, the grid, the checks, the progress bar, and the
per-layer measurement itself (one process, gloo), against hand-computed shapes and a whole-model run."""
from __future__ import annotations

import io
import math
import statistics
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from profiler.fit import fit_bandwidth
from profiler.keys import device_key
from profiler.netbench import stream_pairs
from profiler.progress import Progress
from profiler.sweep import SweepConfig, check_config, grid
from sailor_hpc.archive import EMBEDDED_ARCHIVE
from sailor_hpc.cli import main
from sailor_hpc.errors import SailorError
from sailor_hpc.models import get_model
from sailor_hpc.site import load_site

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


def test_layer_profiler_on_tiny_gpt(one_rank):
    import torch

    from megatron_patch.model import build_stage_module
    from profiler.compute import LayerProfiler, layer_params

    spec = get_model("tiny-gpt")
    h, f, s, L = spec.hidden_size, spec.ffn_hidden_size, spec.seq_len, spec.num_pipeline_layers
    torch.manual_seed(0)
    prof = LayerProfiler(spec, tp_group=one_rank, device=torch.device("cpu"), warmup=2, iters=7)
    mem = prof.memory_table()
    assert mem.shape == (L, 4)
    assert list(mem[:, 0]) == _hand_params(h, f, 256, s, 1)
    assert list(layer_params(spec, 2, 256)) == _hand_params(h, f, 256, s, 2)
    assert list(mem[:, 1]) == [s * h] * 5 + [s]  # hidden states out of every layer, the loss [1, s] out of the head
    assert list(mem[:, 2]) == [2 * s] + [s * h] * 5  # token + position ids into the embedding
    # a block keeps more than its output for the backward, and blocks 3, 4 copy block 2 (profiled_blocks = 2)
    assert mem[1, 3] > mem[1, 1] * 4 and mem[3, 3] == mem[4, 3] == mem[2, 3]
    times = prof.measure(2)
    assert times.shape == (L, 3) and np.isfinite(times).all() and (times > 0).all()
    assert (times[:, 2] == times[0, 2]).all()  # the profiled model's optimizer step, on every row
    assert (times[3] == times[2]).all() and (times[4] == times[2]).all()
    # independent reference: a whole tiny-gpt (one stage, all layers) forward + backward at micro-batch 2.
    # This machine is shared, so the two are measured interleaved (same load) and compared by medians.
    whole = build_stage_module(spec, 0, L - 1, tp_group=one_rank, device="cpu", seed=None)
    tokens = torch.randint(0, spec.vocab_size, (2, s))
    prof.warmup, prof.iters = 0, 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref, sums = [], []
        for i in range(9):
            t0 = time.perf_counter()
            whole(tokens, tokens).sum().backward()
            ref.append(time.perf_counter() - t0)
            one = prof.measure(2)
            sums.append(float(one[:, 0].sum() + one[:, 1].sum()))
    finally:
        torch.set_num_threads(threads)
    reference, per_layer = statistics.median(ref[2:]), statistics.median(sums[2:])
    assert reference / 3 < per_layer < reference * 3, (per_layer, reference, sums, ref)
    # the chain timing runs the measured layers (embedding, 2 blocks, head) as one stage would: on CPU
    # there is no launch overlap to win, so it stays near the sum of those layers timed alone
    prof.warmup, prof.iters = 1, 5
    assert prof.measured == [0, 1, 2, L - 1]
    alone, chained = [], []
    for _ in range(5):
        one = prof.measure(2)
        alone.append(float(one[prof.measured, :2].sum()))
        chained.append(sum(prof.measure_stack(2)))
    assert statistics.median(alone) / 3 < statistics.median(chained) < statistics.median(alone) * 3, (alone, chained)


def test_bf16_profile_times_a_real_optimizer_step(one_rank):
    """bf16 keeps gradients on the bf16 copies: the timed step must move them to the fp32 masters first,
    or Adam finds no gradient and the profile records a step of nothing."""
    import torch

    from profiler.compute import LayerProfiler

    prof = LayerProfiler(get_model("tiny-gpt"), tp_group=one_rank, device=torch.device("cpu"), dtype="bf16",
                         warmup=1, iters=2)
    prof.measure(1)
    for opt in prof.optimizers:
        stepped = [m for m in opt.master.values() if opt.adam.state.get(m, {}).get("step", 0) > 0]
        assert len(stepped) == len(opt.master) > 0


def test_chain_timing_out_of_memory_keeps_the_per_layer_point(one_rank, monkeypatch):
    import torch

    from profiler.compute import LayerProfiler, profile_compute

    def chain_oom(self, mbs):  # the chain holds every measured layer's activations: it fails first
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(LayerProfiler, "measure_stack", chain_oom)
    res = profile_compute(get_model("tiny-gpt"), [1], tp_group=one_rank, device=torch.device("cpu"), warmup=1, iters=2)
    (point,) = res.points
    assert point.times is not None and point.stack is None and not point.reason
