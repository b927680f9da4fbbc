"""The resize scenario on the real local Slurm cluster, shared by tests/controller and benchmarks/resize_latency.

tiny-gpt, global batch 64, at most 2 GPUs (2 CPU ranks): the planner then picks 1 A100 + 1 V100 when
one A100 GPU is idle, 2 V100 when none is, and 2 A100 when two are (see test_policy.py). Blocker jobs
(``sleep``, never requeued) shape what is idle; ``scontrol update nodename=... state=down|resume`` makes
the allocation change. The controller runs as ``sailor-hpc run`` in a subprocess, as a user would run it.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from sailor_hpc.controller import RunDir, RunSpec, new_run_id
from sailor_hpc.controller.journal import Journal, read_journal
from sailor_hpc.controller.records import Record, RunStarted, SubmitIntent, encode
from sailor_hpc.controller.state import job_name
from tests.data.tiny_archive import write_tiny_archive
from tests.shared_inputs import build_data, shipped_dataset

if TYPE_CHECKING:
    from megatron_patch.local import RankProcess

REPO = Path(__file__).resolve().parents[2]
LOCAL_LAB = REPO / "site_configs" / "local-lab.toml"
MODEL, GBS = "tiny-gpt", 64
ADAM = ["--adam-eps", "1e-5"]  # see tests/megatron_patch/test_exactness.py: exactness tests Adam with eps 1e-5


def started_run(root: Path, steps: int) -> tuple[RunDir, Journal]:
    """A run directory on the local lab whose journal holds the intent to submit attempt 1 (one V100), as a
    controller killed right after ``sbatch`` leaves it; the journal stays open for more records."""
    spec = RunSpec.of(run_id=new_run_id(), site=str(LOCAL_LAB), model=MODEL, objective="throughput",
                   data=str(root / "d"), save=str(root / "ckpt"), steps=steps, gbs=GBS,
                   profiles=str(write_tiny_archive(root / "tiny.h5")))
    rd = RunDir.create(root / "run", spec)
    j = Journal(rd.journal_file)
    j.append(RunStarted(run_id=spec.run_id))
    j.append(SubmitIntent(attempt=1, job_name=job_name(spec.run_id, 1), plan_file="p", script="s",
             reason="start", gpus={"v100": 1}, throughput=1.0, cost_per_hour=0.5))
    return rd, j


def build_inputs(factory: pytest.TempPathFactory | None, root: Path) -> tuple[str, Path]:
    """The dataset (the project's shipped text, built once per test session; a benchmark without one builds it
    under ``root``) and the tiny-gpt profile archive."""
    data = shipped_dataset(factory) if factory is not None else build_data(root / "data" / "shipped")
    return data, write_tiny_archive(root / "tiny.h5")


def start_reference(root: Path, data: str, steps: int) -> RankProcess:
    """The single-process reference run of the same global steps (megatron_patch.reference), in the background,
    output in ``root/reference.log``; it also keeps the step before the last (a negative control: one step apart
    is far above the tolerance). Forked from this process's zygote (``megatron_patch.zygote``: the same program
    without a new interpreter's 3-4 s of imports, for every story after the first)."""
    from megatron_patch import local
    out = open(root / "reference.log", "w")
    # one rank: port 0, bound by its store at once (a port picked free here could be taken meanwhile: EADDRINUSE
    # was seen with several stories and their jobs running)
    env = local.rank_env(0, 1, 0)
    argv = ["-m", "megatron_patch.reference", "--model", MODEL, "--data", data, "--global-batch", str(GBS),
            "--steps", str(steps), "--snapshots", f"{steps - 1},{steps}", "--out", str(root / "ref"), *ADAM]
    return local.zygote_for(env).start(argv, env, local.REPO, out, out)


def one_gpu_a100_site(root: Path) -> Path:
    """local-lab, with the A100 partition declared as one GPU (and CPU) per node."""
    return one_gpu_site(root, ("a100",), "one-gpu-a100.toml")


def one_gpu_site(root: Path, partitions: tuple[str, ...] = ("a100", "v100"), name: str = "one-gpu.toml") -> Path:
    """local-lab, with ``partitions`` declared as one GPU (and CPU) per node: a plan of N such GPUs spans N nodes
    (Slurm's nodes keep their GPUs, so a job growing beside the running one still fits)."""
    text = LOCAL_LAB.read_text()
    for part in partitions:
        at = text.index(f'name = "{part}"')
        head, tail = text[:at], text[at:]
        gpus = re.search(r"gpus_per_node = \d+", tail)
        cpus = re.search(r"cpus_per_node = \d+", tail)
        assert gpus is not None and cpus is not None, part
        tail = tail.replace(gpus.group(0), "gpus_per_node = 1", 1).replace(cpus.group(0), "cpus_per_node = 1", 1)
        text = head + tail
    site = root / name
    site.write_text(text)
    return site


@dataclass
class Scenario:
    cluster: Any  # tests.slurm.cluster.SlurmCluster
    root: Path
    data: str
    archive: Path
    steps: int = 60
    save_interval: int = 5
    poll_s: float = 0.5
    blockers: list[str] = field(default_factory=list)
    downed: set[str] = field(default_factory=set)
    proc: subprocess.Popen | None = None
    outputs: list[Path] = field(default_factory=list)
    site: Path = LOCAL_LAB
    extra_args: list[str] = field(default_factory=list)  # more `sailor-hpc run` options

    @property
    def env(self) -> dict[str, str]:
        env = dict(self.cluster.env)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env["SAILOR_HPC_STATE_DIR"] = str(self.root / "job-records")
        env["OMP_NUM_THREADS"] = "1"
        return env

    @property
    def save(self) -> Path:
        return self.root / "ckpt"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    # ------------------------------------------------------------------------------------------ the cluster

    def slurm(self, *args: str) -> str:
        proc = self.cluster.run(list(args))
        assert proc.returncode == 0, f"{' '.join(args)}: {proc.stderr}"
        return proc.stdout

    def blocker(self, node: str, gpus: int) -> str:
        """A job holding ``gpus`` GPUs of ``node`` (never requeued: a lost node ends it)."""
        part = node.split("-")[0]
        job = self.cluster.sbatch(["-p", part, "-w", node, f"--gres=gpu:{part}:{gpus}", "--no-requeue", "-o", "/dev/null",
                                   "-J", f"blocker-{node}", "--wrap", "sleep 3000"])
        self.blockers.append(job)
        deadline = time.monotonic() + 60
        while self.cluster.job_states(job) != ["RUNNING"]:
            assert time.monotonic() < deadline, f"blocker {job} on {node} did not start"
            time.sleep(0.2)
        return job

    def set_node(self, node: str, state: str) -> float:
        """``scontrol update nodename=NODE state=down|drain|resume``; returns the wall time it took effect."""
        taken = state in ("down", "drain")
        self.slurm("scontrol", "update", f"nodename={node}", f"state={state}", *(["reason=resize-test"] if taken else []))
        t = time.time()
        (self.downed.add if taken else self.downed.discard)(node)
        return t

    def plan_file(self, attempt: int) -> Path:
        """The plan job ``attempt`` was submitted with."""
        return self.run_dir / "plans" / f"attempt-{attempt:03d}.json"

    def cleanup(self) -> None:
        """Stop the controller, cancel the run's jobs and the blockers, bring nodes back (idempotent)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        names = self.cluster.run(["squeue", "-h", "-o", "%i %j"]).stdout.split("\n")
        prefix = self._job_prefix()
        ours = {parts[0].split("+")[0] for parts in map(str.split, names)
                if len(parts) == 2 and prefix and parts[1].startswith(prefix)}
        for job in [*ours, *self.blockers]:
            self.cluster.run(["scancel", job])
        for job in ours:  # gone before the caller removes the directories its ranks write to
            self.cluster.wait_job(job, timeout=120)
        for node in list(self.downed):
            self.set_node(node, "resume")

    def _job_prefix(self) -> str | None:
        spec = self.run_dir / "run.json"
        return f"sailor-{json.loads(spec.read_text())['run_id']}-" if spec.exists() else None

    # --------------------------------------------------------------------------------------- the controller

    def command(self, resume: bool = False) -> list[str]:
        if resume:
            return ["sailor-hpc", "run", "--resume", str(self.run_dir)]
        return ["sailor-hpc", "run", "--site", str(self.site), "--profiles", str(self.archive), "--model", MODEL,
                "--objective", "throughput", "--gbs", str(GBS), "--max-gpus", "2", "--max-stages", "2",
                "--data", self.data, "--save", str(self.save), "--run-dir", str(self.run_dir),
                "--steps", str(self.steps), "--save-interval", str(self.save_interval), "--poll", str(self.poll_s),
                "--replan-interval", "1", "--min-gain", "10%", "--time", "00:30:00", "--backoff", "2",
                *[f"--train-arg={a}" for a in ADAM], *self.extra_args]

    def start_controller(self, resume: bool = False) -> subprocess.Popen:
        out = self.root / f"controller-{len(self.outputs)}.out"
        self.outputs.append(out)
        self.proc = subprocess.Popen(self.command(resume), cwd=self.cluster.shared, env=self.env,
                                     stdout=open(out, "w"), stderr=subprocess.STDOUT)
        return self.proc

    def kill_controller(self) -> float:
        """SIGKILL: no goodbye record, lock released by the kernel."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        return time.time()

    def records(self) -> list[dict[str, Any]]:
        return wire(read_journal(self.run_dir / "journal.jsonl"))

    def controller_output(self) -> str:
        return "".join(f"--- {p.name}\n{p.read_text()}" for p in self.outputs if p.exists())

    def wait_for(self, what: str, pred: Callable[[dict[str, Any]], bool], timeout: float = 120.0) -> dict[str, Any]:
        """The first journal record matching ``pred`` (waits; fails early if the controller died)."""
        deadline = time.monotonic() + timeout
        while True:
            for rec in self.records():
                if pred(rec):
                    return rec
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"controller exited {self.proc.returncode} before {what}:\n{self.controller_output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} after {timeout} s:\n{self.controller_output()}")
            time.sleep(0.1)

    def wait_exit(self, timeout: float = 240.0) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"controller still running after {timeout} s:\n{self.controller_output()}") from None


def wire(records: list[Record]) -> list[dict[str, Any]]:
    """Journal records as their lines' JSON objects (``encode``): what the story tests read, as on disk."""
    return [encode(r) for r in records]


def kind(k: str, **match: Any) -> Callable[[dict[str, Any]], bool]:
    """A journal predicate: record kind ``k`` whose fields equal ``match``."""
    return lambda r: r["kind"] == k and all(r.get(key) == v for key, v in match.items())


def step_events(log: Path) -> list[dict[str, Any]]:
    """The runtime's JSON records in a job log."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def finish(sc: Scenario, reference: RankProcess) -> subprocess.CompletedProcess:
    """Wait for the controller to finish the run (exit 0) and for the reference run; the run's status."""
    rc = sc.wait_exit(timeout=300)
    assert rc == 0, sc.controller_output()
    assert reference.wait(timeout=300) == 0, (sc.root / "reference.log").read_text()[-3000:]
    return sc.cluster.run(["sailor-hpc", "run", "status", str(sc.run_dir)], env=sc.env)


@contextlib.contextmanager
def cleaned_up(sc: Scenario, reference: RankProcess) -> Iterator[Scenario]:
    """The scenario, with its controller, jobs, blockers, nodes and reference run put back whatever happens."""
    try:
        yield sc
    finally:
        if reference.poll() is None:
            reference.kill()
        sc.cleanup()


def records_of(story: dict[str, Any], k: str) -> list[dict[str, Any]]:
    """The story's journal records of kind ``k``."""
    return [r for r in story["records"] if r["kind"] == k]
