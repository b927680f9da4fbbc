"""The GPU check: profile models on this machine's GPU, simulate a 1-GPU plan from each profile, train it
with megatron_patch and megatron-core's own path, and compare step time, peak memory and MFU with the targets.

Run by ``benchmarks/gpu_check.sh`` on a machine with one NVIDIA GPU (no network: megatron-core and submitit
arrive as wheels in ``.whl/`` beside the checkout). ``--smoke`` runs the same code path on the CPU with two
tiny models in fp32 (MFU is then meaningless), which is how the script is kept working without a GPU.

GPU time is short, so ``--budget-s`` (default 480) bounds the whole check from its start (imports and wheel
install included). Models run smallest first (OPT-350M, GPT-1.3B, GPT-Neo-2.7B); before each model and each
phase the time it needs is estimated (:class:`Estimator`) and it is skipped, with a line saying so, when it
does not fit in what is left; child processes get the time left as their timeout. ``$OUT/gpu_check.json``
is rewritten (atomically) after every phase, so a kill still leaves every finished figure.

Phases, each what a user of sailor-hpc runs, each in a process of its own so that this process never holds
GPU memory (it would count in the next phase's device memory) and a crash or timeout ends only that phase:

0. ``setup`` (once): the torch build and device, the training data.
1. ``profile``: ``profiler.jobs.compute_job``, the profiling job's own function (TP 1), into a fresh archive.
2. ``plan`` (here, no torch): a one-partition, one-node site of this GPU **without any network section**,
   the planner on 1 GPU, the simulator's predicted step time and peak memory of the chosen plan.
3. ``train``: ``python -m megatron_patch.launch`` trains the plan ``--steps`` steps; the median step time
   after ``--warmup`` steps and the step events' peak memory are the measurement.
4. ``baseline``: megatron-core's own path on the same model, micro-batch size and count (its ``GPTModel``
   with its local layer spec and the same SDPA core attention as ours, ``Float16Module``, its DDP with
   overlapped reduction, its mixed-precision optimizer): median step time and peak memory.

MFU = model FLOPs per step (3 x the forward's matrix products, attention scores included, no recompute)
/ (step time x the GPU's dense peak in the plan's dtype).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# the budget counts from the start of the check: gpu_check.sh's start (the wheel install included) when it
# exports GPU_CHECK_STARTED, else this interpreter's (stdlib imports above take milliseconds)
STARTED = float(os.environ.get("GPU_CHECK_STARTED") or time.time())

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner import PlanRequest  # noqa: E402
from planner.search import search  # noqa: E402
from sailor_hpc.core.archive import read_archive  # noqa: E402
from sailor_hpc.core.models import ModelSpec, get_model  # noqa: E402
from sailor_hpc.core.site import Site, load_site_dict  # noqa: E402
from simulator import SimOptions, simulate  # noqa: E402

# dense tensor-core peak, TFLOP/s, by dtype (vendor data sheets, SXM parts)
PEAK_TFLOPS = {"H100": {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7},
               "H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7},
               "GH200": {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7},
               "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}}
# issue 23's targets, printed beside the figures
TIME_TARGET_PCT, MEMORY_TARGET_PCT, RATE_TARGET = 3.0, 5.0, 1.0
# (global batch, micro-batch sizes to profile), smallest model first; sized for one 80 GB GPU in bf16
GPU_RUNS = {"OPT-350M": (32, (1, 2, 4, 8)), "GPT-1.3B": (32, (1, 2, 4, 8)), "GPT-Neo-2.7B": (16, (1, 2, 4))}
SMOKE_RUNS = {"tiny-llama": (4, (1, 2)), "tiny-gpt": (4, (1, 2))}
PHASES = ("profile", "plan", "train", "baseline")
RESERVE_S = 5.0  # kept back from every phase's timeout: writing the JSON and printing the tables
SAFETY = 1.2  # an estimate from another model (or machine) is a guess: ask for this much more
GIB = 2.0**30


@dataclass(frozen=True)
class Device:
    kind: str  # "cuda" or "cpu"
    gpu_type: str  # the site's (and archive's) name for it
    name: str  # as the driver says
    memory_gib: float
    peak_tflops: float | None


@dataclass(frozen=True)
class ModelRun:
    """One model's share of the check: what is profiled and trained."""

    spec: ModelSpec
    gbs: int
    mbs: tuple[int, ...]
    steps: int


@dataclass
class PhaseRecord:
    name: str
    status: str  # ok | failed | timeout | skipped
    seconds: float  # wall time (0 when skipped)
    estimate_s: float  # what the budget logic expected it to take
    fixed_s: float = 0.0  # start-up part (imports, model build), which does not grow with the phase's work
    detail: str = ""


@dataclass
class Memory:
    """Peak memory, bytes; None where not measured (on the CPU, or by a runtime without the field)."""

    allocated: float | None = None  # max_memory_allocated
    reserved: float | None = None  # max_memory_reserved
    device: float | None = None  # reserved peak + memory outside PyTorch: what decides out-of-memory
    rss: float | None = None  # the process's peak resident set (CPU)


@dataclass
class ModelResult:
    model: str
    dtype: str
    gbs: int
    mbs_profiled: list[int]
    steps: int
    warmup: int
    phases: list[PhaseRecord] = field(default_factory=list)
    profiled: list[dict[str, Any]] = field(default_factory=list)
    mbs: int | None = None  # the plan's micro-batch size and count
    micro_batches: int | None = None
    predicted_s: float | None = None
    predicted: Memory = field(default_factory=Memory)  # simulator: device and allocated peaks
    measured_s: float | None = None
    measured: Memory = field(default_factory=Memory)
    megatron_s: float | None = None
    megatron: Memory = field(default_factory=Memory)
    losses: dict[str, list[float]] = field(default_factory=dict)  # first and last step loss of each side
    attention: dict[str, str] = field(default_factory=dict)  # core attention of each side
    error_pct: float | None = None  # (predicted - measured) / measured step time
    memory_error_pct: float | None = None  # the same for peak device memory
    mfu_ours: float | None = None
    mfu_megatron: float | None = None
    rate_ratio: float | None = None  # megatron_patch's step rate / megatron-core's


@dataclass
class Skip:
    model: str
    phase: str  # "all": the whole model
    need_s: float
    left_s: float


class PhaseStop(Exception):
    """A phase ended without its figures: ``status`` is "failed" or "timeout"."""

    def __init__(self, status: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


# ---------------------------------------------------------------- budget

@dataclass(frozen=True)
class Budget:
    total_s: float
    started: float  # time.time() at the check's start

    def elapsed(self) -> float:
        return time.time() - self.started

    def left(self) -> float:
        """Seconds a phase may still use (the reserve for the final writes taken off)."""
        return self.total_s - self.elapsed() - RESERVE_S


def step_flops(spec: ModelSpec, tokens: int) -> float:
    """Training FLOPs of ``tokens`` tokens: 3 x (2 x weights' multiply-adds + attention scores and mixing)."""
    h, f, s, v = spec.hidden_size, spec.ffn_hidden_size, spec.seq_len, spec.vocab_size
    kv = (spec.num_kv_heads or spec.num_heads) * spec.head_dim
    per_layer = 2 * (h * (h + 2 * kv) + h * h + (3 if spec.family == "llama" else 2) * h * f) + 4 * s * h
    return 3.0 * tokens * (spec.num_layers * per_layer + 2 * h * v)


def phase_work(phase: str, run: ModelRun) -> float:
    """What a phase's time grows with: the FLOPs it computes (setup and the 1-GPU plan search do not grow)."""
    seq = run.spec.seq_len
    if phase == "profile":
        return step_flops(run.spec, seq * sum(run.mbs))
    if phase in ("train", "baseline"):
        return step_flops(run.spec, seq * run.gbs) * run.steps
    return 1.0


@dataclass(frozen=True)
class PhaseCost:
    """A phase's time split into start-up (fixed) and the part proportional to its work."""

    seconds: float
    fixed_s: float
    work: float

    def scaled(self, work: float) -> float:
        return self.fixed_s + max(0.0, self.seconds - self.fixed_s) * work / self.work


def reference_costs(kind: str) -> dict[str, PhaseCost]:
    """First guesses, before any model has run on this machine. cuda: the first H100 run (GPT-1.3B, global
    batch 32, micro-batches 1,2,4,8, 30 steps of ~1.16 s: ~150 s for profile + train + baseline), rounded
    up, start-ups in their own processes added; cpu: tiny-gpt's smoke phases on a busy 2-core machine."""
    if kind == "cuda":
        ref = ModelRun(get_model("GPT-1.3B"), 32, (1, 2, 4, 8), 30)
        table = {"setup": (20, 20), "profile": (70, 20), "plan": (10, 10), "train": (55, 20), "baseline": (60, 25)}
    else:
        ref = ModelRun(get_model("tiny-gpt"), 4, (1, 2), 4)
        table = {"setup": (12, 12), "profile": (18, 14), "plan": (2, 2), "train": (16, 12), "baseline": (16, 12)}
    return {p: PhaseCost(s, fixed, phase_work(p, ref)) for p, (s, fixed) in table.items()}


class Estimator:
    """How long a phase of a model will take: the last finished model's same phase, its start-up kept and the
    rest scaled by the work (FLOPs, i.e. parameters x tokens) ratio; before any, the reference run's, never
    less than the reference (a fresh machine may be slower). Both times :data:`SAFETY`."""

    def __init__(self, kind: str) -> None:
        self.reference = reference_costs(kind)
        self.measured: dict[str, PhaseCost] = {}

    def record(self, phase: str, run: ModelRun, seconds: float, fixed_s: float) -> None:
        self.measured[phase] = PhaseCost(seconds, min(fixed_s, seconds), phase_work(phase, run))

    def estimate(self, phase: str, run: ModelRun) -> float:
        work = phase_work(phase, run)
        if phase in self.measured:
            return SAFETY * self.measured[phase].scaled(work)
        ref = self.reference[phase]
        return SAFETY * max(ref.seconds, ref.scaled(work))

    def model(self, run: ModelRun) -> float:
        return sum(self.estimate(p, run) for p in PHASES)


# ---------------------------------------------------------------- the check's phases

def child_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def run_child(cmd: list[str], timeout_s: float, log: Path, env: dict[str, str] | None = None) -> str:
    """Run ``cmd`` with stdout and stderr in ``log``.out/.err; its stdout, or :class:`PhaseStop` when it fails
    or runs past ``timeout_s`` (its whole process group is killed then: a launch's ranks included)."""
    if timeout_s <= 1:
        raise PhaseStop("timeout", "no time left to start it")
    out_path, err_path = log.with_suffix(".out"), log.with_suffix(".err")
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env or child_env(), stdout=out, stderr=err,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise PhaseStop("timeout", f"killed after {timeout_s:.0f} s, the time the budget left it") from None
    if rc != 0:
        tail = err_path.read_text(errors="replace")[-3000:]
        raise PhaseStop("failed", f"exit {rc}: {tail.strip().splitlines()[-1] if tail.strip() else ''}\n{tail}")
    return out_path.read_text()


def last_json(stdout: str) -> dict[str, Any]:
    """A child's result: its last stdout line."""
    return json.loads(stdout.strip().splitlines()[-1])


def self_child(mode: str, args: dict[str, Any]) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", mode, json.dumps(args)]


def site_dict(dev: Device) -> dict[str, Any]:
    """One partition, one node, one GPU and no network section: a plan on it never crosses a link."""
    return {"name": "gpu-check", "gpu_types": {dev.gpu_type: {"memory_gib": dev.memory_gib,
                                                              "dtypes": ["fp32", "bf16", "fp16"]}},
            "partitions": [{"name": "gpu", "gpu_type": dev.gpu_type, "gres": "gpu:gpu", "nodes": 1,
                            "gpus_per_node": 1, "cost_per_gpu_hour": 1.0}]}


def site_of(dev: Device) -> Site:
    return load_site_dict(site_dict(dev), source="<gpu-check>")


def median_after(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:] if len(times) > warmup else times)


def peak(events: list[dict[str, Any]], key: str) -> float | None:
    """The largest ``key`` over the step events; None when the runtime does not report it."""
    values = [e[key] for e in events if e.get(key) is not None]
    return float(max(values)) if values else None


def step_memory(steps: list[dict[str, Any]], cuda: bool) -> Memory:
    """megatron_patch.launch's step events' peaks, from runtimes before and after their CUDA memory fields.

    ``mem_bytes`` is ``max_memory_allocated`` on CUDA and peak RSS on the CPU; the newer CUDA fields give the
    allocated and reserved peaks and the device peak (reserved peak + outside PyTorch), else the device
    memory in use (total - free)."""
    return Memory(allocated=peak(steps, "mem_allocated_bytes") or (peak(steps, "mem_bytes") if cuda else None),
                  reserved=peak(steps, "mem_reserved_bytes"),
                  device=peak(steps, "mem_device_peak_bytes") or peak(steps, "mem_device_bytes"),
                  rss=None if cuda else peak(steps, "mem_bytes"))


def pct(predicted: float | None, measured: float | None) -> float | None:
    return (predicted - measured) / measured * 100 if predicted is not None and measured else None


@dataclass
class Check:
    """The whole check: budget, estimates, results, the JSON after every phase."""

    budget: Budget
    smoke: bool
    dtype: str
    warmup: int
    work: Path
    json_path: Path
    peak_tflops: float | None
    estimator: Estimator
    device: Device | None = None
    setup: PhaseRecord | None = None
    attention: dict[str, str] = field(default_factory=dict)
    results: list[ModelResult] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)
    failed: bool = False

    def say(self, text: str) -> None:
        print(f"[{self.budget.elapsed():6.1f} s] {text}", flush=True)

    def write(self) -> None:
        """The JSON so far, atomically (a kill between phases leaves the previous complete file)."""
        doc = {"format": "gpu-check", "version": 2, "budget_s": self.budget.total_s,
               "elapsed_s": self.budget.elapsed(), "smoke": self.smoke, "dtype": self.dtype,
               "device": asdict(self.device) if self.device else None,
               "site": site_of(self.device).to_dict() if self.device else None,
               "setup": asdict(self.setup) if self.setup else None, "attention": self.attention,
               "models": [asdict(r) for r in self.results], "skipped": [asdict(s) for s in self.skipped]}
        tmp = self.json_path.with_name(f".{self.json_path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, self.json_path)

    def fits(self, what: str, model: str, phase: str, need_s: float) -> bool:
        left = self.budget.left()
        if need_s <= left:
            return True
        self.say(f"skipped {what}: needs ~{need_s:.0f} s, {max(0.0, left):.0f} s left")
        self.skipped.append(Skip(model, phase, round(need_s, 1), round(max(0.0, left), 1)))
        return False

    def phase(self, name: str, model: str, estimate_s: float, body: Callable[[float], float],
              into: list[PhaseRecord]) -> bool:
        """Run ``body(timeout_s) -> fixed_s`` as ``model``'s phase ``name`` ("" for the check's own), with start
        and end lines; False when it did not finish (skipped, failed or timed out): later phases need it."""
        label = f"{model} {name}".strip()
        if not self.fits(label, model, name, estimate_s):
            into.append(PhaseRecord(name, "skipped", 0.0, round(estimate_s, 3)))
            self.write()
            return False
        self.say(f"{label}: start (estimate ~{estimate_s:.0f} s, {self.budget.left():.0f} s left)")
        t0 = time.time()
        try:
            fixed, status, detail = body(self.budget.left()), "ok", ""
        except PhaseStop as stop:
            fixed, status, detail = 0.0, stop.status, stop.detail
        except Exception as exc:  # one model's error must not cost the others their device time
            fixed, status, detail = 0.0, "failed", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        seconds = time.time() - t0
        into.append(PhaseRecord(name, status, seconds, round(estimate_s, 3), fixed, detail[-3000:]))
        self.failed |= status == "failed"
        first = detail.splitlines()[0] if detail else ""
        self.say(f"{label}: {'done' if status == 'ok' else status} in {seconds:.1f} s" + (f" ({first})" if first else ""))
        self.write()
        return status == "ok"


def detect_device(smoke: bool, dtype: str, peak_tflops: float | None, found: dict[str, Any]) -> Device:
    """The device from the setup child's report (this process never touches CUDA)."""
    if smoke:
        return Device("cpu", "cpu-smoke", found["name"], 16.0, peak_tflops)
    if found["kind"] != "cuda":
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --smoke for the CPU check")
    name, total = found["name"], found["memory_bytes"] / GIB
    family = next((k for k in sorted(PEAK_TFLOPS, key=len, reverse=True) if k in name.upper()), None)
    return Device("cuda", f"{family or 'GPU'}-{round(total)}", name, total,
                  peak_tflops or (PEAK_TFLOPS[family][dtype] if family else None))


def do_setup(check: Check, timeout_s: float) -> float:
    t0 = time.time()
    out = last_json(run_child(self_child("setup", {"smoke": check.smoke, "data": str(check.work / "data")}),
                              timeout_s, check.work / "setup"))
    print("torch", out["torch"], "cuda", out["cuda"], out["name"] if out["kind"] == "cuda" else "no GPU", flush=True)
    check.device = detect_device(check.smoke, check.dtype, check.peak_tflops, out)
    te = "installed, not used (megatron_patch refuses the te spec)" if out["transformer_engine"] else "not installed"
    check.attention = {"megatron_patch": "SdpaAttention (torch scaled_dot_product_attention)",
                       "megatron-core": "the same SdpaAttention in its local layer spec",
                       "why": f"TransformerEngine {te}: the same kernel on both sides, so the ratio measures the "
                              "runtime, not the attention kernel (the local spec's DotProductAttention would "
                              "materialise the s x s scores)"}
    return time.time() - t0 - out["seconds"]


def do_profile(check: Check, run: ModelRun, res: ModelResult, archive: Path, timeout_s: float) -> float:
    assert check.device is not None
    t0 = time.time()
    out = last_json(run_child(self_child("profile", {"model": run.spec.name, "gpu_key": check.device.gpu_type,
                                                     "mbs": list(run.mbs), "archive": str(archive),
                                                     "cpu": check.device.kind == "cpu", "dtype": check.dtype}),
                              timeout_s, check.work / f"{run.spec.name}-profile"))
    res.profiled = out["points"]
    if not any(p["ok"] for p in res.profiled):
        raise PhaseStop("failed", "no micro-batch size could be profiled: "
                        + "; ".join(f"mbs {p['mbs']}: {p['reason']}" for p in res.profiled))
    return time.time() - t0 - float(out.get("seconds") or 0.0)  # its measuring time grows with the model


def do_plan(check: Check, run: ModelRun, res: ModelResult, archive: Path, plan_path: Path) -> float:
    """Plan and simulate here (the planner and simulator need no torch); all of it counts as fixed time."""
    assert check.device is not None
    t0 = time.time()
    site, profiles = site_of(check.device), read_archive(archive)
    found = search(site, profiles, PlanRequest(model=run.spec.name, global_batch_size=run.gbs, dtype=check.dtype,
                                               available={"gpu": 1}, top_k=1)).candidates
    if not found:
        raise PhaseStop("failed", f"no plan of {run.spec.name} fits one {check.device.gpu_type}")
    plan = found[0].plan
    plan.save(plan_path)
    res.mbs, res.micro_batches = plan.pipelines[0].micro_batch_size, plan.pipelines[0].num_micro_batches
    sim = simulate(plan, site, profiles, options=SimOptions.megatron_patch())  # the runtime's model
    res.predicted_s = sim.iteration_time_s
    # agreed names: peak_memory_bytes = reserved + outside PyTorch; peak_allocated_bytes is new (may be absent)
    res.predicted = Memory(allocated=getattr(sim, "peak_allocated_bytes", None), device=sim.peak_memory_bytes)
    return time.time() - t0


def do_train(check: Check, run: ModelRun, res: ModelResult, plan_path: Path, timeout_s: float) -> float:
    from megatron_patch.local import free_port
    assert check.device is not None
    cmd = [sys.executable, "-m", "megatron_patch.launch", "--plan", str(plan_path), "--model", run.spec.name,
           "--data", str(check.work / "data"), "--steps", str(run.steps), "--device", check.device.kind]
    t0 = time.time()
    out = run_child(cmd, timeout_s, check.work / f"{run.spec.name}-train",
                    child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())))
    steps = [e for e in map(json.loads, (ln for ln in out.splitlines() if ln.startswith("{")))
             if e.get("event") == "step"]
    if not steps:
        raise PhaseStop("failed", "megatron_patch.launch reported no step")
    res.measured_s = median_after([e["iter_s"] for e in steps], check.warmup)
    res.measured = step_memory(steps, check.device.kind == "cuda")
    res.losses["megatron_patch"] = [steps[0]["loss"], steps[-1]["loss"]]
    return time.time() - t0 - sum(e["iter_s"] for e in steps)


def do_baseline(check: Check, run: ModelRun, res: ModelResult, timeout_s: float) -> float:
    assert check.device is not None and res.mbs is not None and res.micro_batches is not None
    t0 = time.time()
    out = last_json(run_child(self_child("baseline", {"model": run.spec.name, "data": str(check.work / "data"),
                                                      "mbs": res.mbs, "micro": res.micro_batches, "steps": run.steps,
                                                      "device": check.device.kind, "dtype": check.dtype}),
                              timeout_s, check.work / f"{run.spec.name}-baseline"))
    res.megatron_s = median_after(out["times"], check.warmup)
    res.megatron = Memory(**out["memory"])
    res.losses["megatron-core"] = out["losses"]
    return time.time() - t0 - sum(out["times"])


def finish(check: Check, run: ModelRun, res: ModelResult) -> None:
    """The derived figures: errors against the prediction, MFU, the step-rate ratio."""
    assert check.device is not None
    flops, peak_flops = step_flops(run.spec, run.gbs * run.spec.seq_len), check.device.peak_tflops
    res.error_pct = pct(res.predicted_s, res.measured_s)
    res.memory_error_pct = pct(res.predicted.device, res.measured.device)
    if peak_flops:
        res.mfu_ours = flops / res.measured_s / (peak_flops * 1e12) if res.measured_s else None
        res.mfu_megatron = flops / res.megatron_s / (peak_flops * 1e12) if res.megatron_s else None
    res.rate_ratio = res.megatron_s / res.measured_s if res.measured_s and res.megatron_s else None


def check_model(check: Check, run: ModelRun) -> None:
    """The four phases of one model; a phase that does not finish ends the model (the later ones need it)."""
    res = ModelResult(run.spec.name, check.dtype, run.gbs, list(run.mbs), run.steps, check.warmup,
                      attention=check.attention)
    check.results.append(res)
    archive, plan_path = check.work / f"{run.spec.name}-profiles.h5", check.work / f"{run.spec.name}-plan.json"
    archive.unlink(missing_ok=True)  # a fresh archive: this run's profile, not an earlier one's
    bodies: dict[str, Callable[[float], float]] = {
        "profile": lambda t: do_profile(check, run, res, archive, t),
        "plan": lambda t: do_plan(check, run, res, archive, plan_path),
        "train": lambda t: do_train(check, run, res, plan_path, t),
        "baseline": lambda t: do_baseline(check, run, res, t)}
    for name in PHASES:
        ok = check.phase(name, run.spec.name, check.estimator.estimate(name, run), bodies[name], res.phases)
        if not ok:
            break
        rec = res.phases[-1]
        check.estimator.record(name, run, rec.seconds, rec.fixed_s)
    finish(check, run, res)
    check.write()
    print_table(check, run, res)


# ---------------------------------------------------------------- the tables

def fmt(value: float | None, spec: str = "9.3f", scale: float = 1.0) -> str:
    width = int(spec.split(".")[0].lstrip("+") or 0)
    return f"{value / scale:{spec}}" if value is not None else f"{'n/a':>{width}}"


def verdict(error: float | None, target: float) -> str:
    return "n/a" if error is None else ("ok" if abs(error) <= target else "MISS")


def print_table(check: Check, run: ModelRun, res: ModelResult) -> None:
    assert check.device is not None
    print(f"\n{res.model} on 1 x {check.device.gpu_type} ({check.device.kind}), {res.dtype}, global batch {res.gbs}"
          + (f" = {res.micro_batches} x micro-batch {res.mbs}" if res.mbs else "")
          + f", median of steps {res.warmup + 1}..{res.steps}")
    print("phases: " + ", ".join(f"{p.name} {p.seconds:.1f} s" + ("" if p.status == "ok" else f" ({p.status})")
                                 for p in res.phases))
    print(f"{'':30}{'predicted':>10}{'measured':>10}{'error':>9}{'target':>8}")
    rows = (("step time s", res.predicted_s, res.measured_s, 1.0, TIME_TARGET_PCT),
            ("peak device memory GiB", res.predicted.device, res.measured.device, GIB, MEMORY_TARGET_PCT),
            ("peak allocated GiB", res.predicted.allocated, res.measured.allocated, GIB, None))
    for label, predicted, measured, scale, target in rows:
        err = pct(predicted, measured)
        print(f"{label:30}{fmt(predicted, '10.3f', scale)}{fmt(measured, '10.3f', scale)}"
              + (f"{err:+7.1f} %" if err is not None else f"{'n/a':>9}")
              + (f"{target:6.0f} % {verdict(err, target)}" if target else ""))
    if res.measured.rss is not None:
        print(f"{'peak RSS GiB (CPU process)':30}{'':10}{fmt(res.measured.rss, '10.3f', GIB)}")
    print(f"{'':30}{'step s':>10}{'MFU':>10}{'alloc GiB':>10}{'device GiB':>11}")
    for label, step_s, mfu, mem in (("megatron_patch", res.measured_s, res.mfu_ours, res.measured),
                                    ("megatron-core own path", res.megatron_s, res.mfu_megatron, res.megatron)):
        print(f"{label:30}{fmt(step_s, '10.3f')}{fmt(mfu, '10.3f')}{fmt(mem.allocated, '10.2f', GIB)}"
              f"{fmt(mem.device, '11.2f', GIB)}")
    ratio = res.rate_ratio
    print(f"step rate megatron_patch / megatron-core: {fmt(ratio, '.2f')}x (target >= {RATE_TARGET:.1f}x "
          f"{'n/a' if ratio is None else ('ok' if ratio >= RATE_TARGET else 'MISS')})", flush=True)


def print_summary(check: Check) -> None:
    """One line per model, last, so the end of a GPU run's output holds every figure against its target."""
    print(f"\nsummary (targets: step time within {TIME_TARGET_PCT:.0f} %, peak device memory within "
          f"{MEMORY_TARGET_PCT:.0f} %, step rate >= {RATE_TARGET:.1f}x megatron-core's)")
    print(f"{'model':14}{'pred s':>8}{'meas s':>8}{'err %':>7}{'pred GiB':>9}{'meas GiB':>9}{'err %':>7}"
          f"{'MFU':>7}{'mcore':>7}{'rate':>6}")
    for r in check.results:
        print(f"{r.model:14}{fmt(r.predicted_s, '8.3f')}{fmt(r.measured_s, '8.3f')}{fmt(r.error_pct, '+7.1f')}"
              f"{fmt(r.predicted.device, '9.2f', GIB)}{fmt(r.measured.device, '9.2f', GIB)}"
              f"{fmt(r.memory_error_pct, '+7.1f')}{fmt(r.mfu_ours, '7.3f')}{fmt(r.mfu_megatron, '7.3f')}"
              f"{fmt(r.rate_ratio, '6.2f')}" + "".join(f"  {p.name} {p.status}" for p in r.phases if p.status != "ok"))
    for skip in check.skipped:
        print(f"{skip.model or '(setup)':14}skipped{'' if skip.phase == 'all' else ' at ' + skip.phase}: needs "
              f"~{skip.need_s:.0f} s, {skip.left_s:.0f} s left")
    sys.stdout.flush()


# ---------------------------------------------------------------- child processes

def child_setup(a: dict[str, Any]) -> dict[str, Any]:
    """The torch build and device (in a child: the check's own process keeps off the GPU) and the data."""
    import torch

    from megatron_patch.data import build_dataset, shipped_texts
    t0 = time.time()
    cuda = torch.cuda.is_available() and not a["smoke"]
    found = {"torch": torch.__version__, "cuda": torch.version.cuda, "kind": "cuda" if cuda else "cpu",
             "name": torch.cuda.get_device_name() if cuda else "cpu",
             "memory_bytes": torch.cuda.mem_get_info()[1] if cuda else 0,
             "transformer_engine": importlib.util.find_spec("transformer_engine") is not None}
    build_dataset(a["data"], shipped_texts())
    return {**found, "seconds": time.time() - t0}


def child_profile(a: dict[str, Any]) -> dict[str, Any]:
    from profiler.jobs import ComputeTask, compute_job
    # the profiling job's defaults: >= 20 repetitions and >= 1 s per point, the device warmed to steady clocks
    res = compute_job(ComputeTask(model=a["model"], partition="gpu", gpu_key=a["gpu_key"], tp=1, mbs=tuple(a["mbs"]),
                                  archive=a["archive"], cpu=a["cpu"], sweep="gpu-check", dtype=a["dtype"]))
    assert res is not None  # rank 0
    return res


def cuda_memory() -> Memory:
    """This process's peaks on its GPU; memory outside PyTorch (context, NCCL, cuBLAS workspaces) is what the
    device has in use beyond the allocator's reservation, added to the reserved peak."""
    import torch
    free, total = torch.cuda.mem_get_info()
    outside = total - free - torch.cuda.memory_reserved()
    reserved = torch.cuda.max_memory_reserved()
    return Memory(allocated=torch.cuda.max_memory_allocated(), reserved=reserved, device=reserved + outside)


def child_baseline(a: dict[str, Any]) -> dict[str, Any]:
    """One rank of megatron-core's own path (benchmarks/runtime_speed.py), with the same SDPA attention as ours."""
    import torch
    import torch.distributed as dist
    from runtime_speed import SEED, megatron_core_step  # the sibling benchmark (same folder)

    from megatron_patch import memory
    from megatron_patch.data import GlobalSamples
    from megatron_patch.local import free_port
    spec = get_model(a["model"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    cuda = a["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    step = megatron_core_step(spec, 1, GlobalSamples(a["data"], spec.seq_len, SEED), mbs=a["mbs"], micro=a["micro"],
                              device=a["device"], dtype=a["dtype"], attention="sdpa")
    times, losses = [], []
    for _ in range(a["steps"]):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(step())  # the loss as a float: the step has ended on the device
        times.append(time.perf_counter() - t0)
    mem = cuda_memory() if cuda else Memory(rss=memory.peak_rss())
    dist.destroy_process_group()
    return {"times": times, "losses": [losses[0], losses[-1]], "memory": asdict(mem)}


CHILDREN: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "setup": child_setup, "profile": child_profile, "baseline": child_baseline}


# ---------------------------------------------------------------- main

def model_runs(args: argparse.Namespace) -> list[ModelRun]:
    """The models to check, smallest first, with their batch sizes (``--gbs``/``--mbs`` override them all)."""
    defaults = SMOKE_RUNS if args.smoke else GPU_RUNS
    names = args.model.split(",") if args.model else list(defaults)
    runs = []
    for name in names:
        spec = get_model(name.strip())
        gbs, mbs = defaults.get(spec.name, (32, (1, 2, 4, 8)))
        runs.append(ModelRun(spec, args.gbs or gbs, tuple(int(x) for x in args.mbs.split(",")) if args.mbs else mbs,
                             args.steps))
    return sorted(runs, key=lambda r: step_flops(r.spec, 1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU in fp32 (keeps the script working)")
    ap.add_argument("--model", default=None, help="catalog model or comma list (default OPT-350M,GPT-1.3B,"
                                                  "GPT-Neo-2.7B; tiny-llama,tiny-gpt with --smoke)")
    ap.add_argument("--dtype", default=None, help="default bf16 (fp32 with --smoke)")
    ap.add_argument("--mbs", default=None, help="micro-batch sizes to profile, for every model (default per model)")
    ap.add_argument("--gbs", type=int, default=None, help="global batch, for every model (default per model)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="the whole check's time from its start; what would not fit is skipped")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense peak when it is not known")
    ap.add_argument("--workdir", type=Path, default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 3 and argv[0] == "--child":  # a phase's process: its result as the last stdout line
        print(json.dumps(CHILDREN[argv[1]](json.loads(argv[2]))), flush=True)
        return 0
    args = parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else work
    check = Check(Budget(args.budget_s, STARTED), args.smoke, args.dtype or ("fp32" if args.smoke else "bf16"),
                  args.warmup, work, out_dir / "gpu_check.json", args.peak_tflops,
                  Estimator("cpu" if args.smoke else "cuda"))
    runs = model_runs(args)
    check.say(f"gpu_check: {', '.join(r.spec.name for r in runs)}, budget {args.budget_s:.0f} s, work in {work}")
    records: list[PhaseRecord] = []
    ok = check.phase("setup", "", check.estimator.estimate("setup", runs[0]), lambda t: do_setup(check, t), records)
    check.setup = records[0]
    if ok:
        print("attention: megatron_patch " + check.attention["megatron_patch"] + "; megatron-core "
              + check.attention["megatron-core"] + ". " + check.attention["why"], flush=True)
        for run in runs:
            if check.fits(run.spec.name, run.spec.name, "all", check.estimator.model(run)):
                check_model(check, run)
            else:
                check.write()
    else:  # no device or data: every model is skipped
        left = round(max(0.0, check.budget.left()), 1)
        check.skipped.extend(Skip(r.spec.name, "all", round(check.estimator.model(r), 1), left) for r in runs)
        check.write()
    print_summary(check)
    check.say(f"gpu_check: done, {len(check.results)} model(s) checked, {len(check.skipped)} skip(s); "
              f"figures in {check.json_path}")
    return 1 if check.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
