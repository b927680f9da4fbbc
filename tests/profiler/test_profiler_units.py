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
        for _ in range(9):
            t0 = time.perf_counter()
            whole(tokens, tokens).sum().backward()
            ref.append(time.perf_counter() - t0)
            one = prof.measure(2)
            sums.append(float(one[:, 0].sum() + one[:, 1].sum()))
    finally:
        torch.set_num_threads(threads)
    # minima, not medians: other processes on a shared CPU only ever add time, so the least of several
    # samples is the estimate of the work itself that contention cannot move
    reference, per_layer = min(ref[2:]), min(sums[2:])
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
    assert min(alone) / 3 < min(chained) < min(alone) * 3, (alone, chained)


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
    """A Slurm job id whose profiling port (jobs.PORT_BASE + id % PORT_SPAN) is free here."""
    import socket

    from profiler.jobs import PORT_BASE, PORT_SPAN
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if PORT_BASE <= port < PORT_BASE + PORT_SPAN:
            return port - PORT_BASE
    raise RuntimeError("no free port in the profiling range")


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
