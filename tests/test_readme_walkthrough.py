"""The README's laptop walk-through, run as written, and each of its results checked against a reference
of its own.

The blocks marked ``<!-- walkthrough -->`` in README.md run in order, each in a fresh ``bash`` with
``set -euo pipefail``, in one empty folder, with this venv first on ``PATH`` and ``REPO`` = the clone (what
the README tells a user to set). A fresh shell per block means no block leans on another's shell
variables, so pasting them all into one shell runs the same commands. Then:

- the datasets hold the files' bytes (read from the ``.bin`` as uint16, split at the end-of-document 0);
- the archive holds the profiled points (CPU, wall-clock, under ``cpu-core``) and the link, whose fit is
  numpy's quadratic fit of the series its provenance records;
- both plans load and validate against the measured site, on 2 ranks and on 1;
- the loss fell, validation ran at every interval, and each step's learning rate is the warm-up + cosine
  schedule computed here by hand from the samples consumed before it (across the resume);
- the resumed run loaded step 20 (160 samples) and trained steps 21..40 on one rank;
- the exported model in ``transformers``, on the runtime's own validation batches, gives the runtime's
  validation loss at step 40 (the batches come from the runtime's sample functions; the loss from
  transformers' forward and a plain cross-entropy).
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.data import REPO

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

MARK = "<!-- walkthrough -->"
MODEL, GBS, SEQ = "tiny-llama", 8, 32
# the schedule the README's training block asks for
LR, MIN_LR, WARMUP_STEPS, DECAY_STEPS = 3e-3, 3e-4, 5, 40


def walkthrough_blocks(readme: str) -> list[str]:
    """The fenced ``sh`` block after each marker, verbatim."""
    lines = readme.split("\n")
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() == MARK:
            assert lines[i + 1].strip() == "```sh", f"README.md:{i + 2}: a {MARK} marker must precede a ```sh block"
            end = lines.index("```", i + 2)
            blocks.append("\n".join(lines[i + 2:end]) + "\n")
    return blocks


def corpus() -> dict[str, list[bytes]]:
    """The files the README's data block reads, per dataset (what its globs match)."""
    files = {"prose": [REPO / "README.md", *(REPO / "docs").glob("*.md")],
             "code": list((REPO / "megatron_patch").glob("*.py"))}
    return {name: [f.read_bytes() for f in paths] for name, paths in files.items()}


@dataclass(frozen=True)
class Walk:
    folder: Path
    outputs: list[str]  # each block's stdout
    seconds: list[float]
    texts: dict[str, list[bytes]]  # the data block's input files, read just before it ran


@pytest.fixture(scope="module")
def walk(tmp_path_factory: pytest.TempPathFactory) -> Walk:
    blocks = walkthrough_blocks((REPO / "README.md").read_text())
    assert len(blocks) >= 4, "README.md lost its marked walk-through blocks"
    folder = tmp_path_factory.mktemp("walk")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", REPO=str(REPO),
               PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])]))
    outputs, seconds = [], []
    texts = corpus()
    for n, block in enumerate(blocks, 1):
        t0 = time.monotonic()
        proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + block], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=600)
        seconds.append(time.monotonic() - t0)
        (folder / f"block{n}.log").write_text(proc.stdout + proc.stderr)
        assert proc.returncode == 0, f"walk-through block {n} exited {proc.returncode}:\n{block}\n" \
                                     f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        outputs.append(proc.stdout)
    print("\nwalk-through seconds per block: " + ", ".join(f"{s:.1f}" for s in seconds) + f"; {sum(seconds):.1f} total")
    return Walk(folder, outputs, seconds, texts)


def _documents(prefix: Path) -> list[bytes]:
    """A byte-token dataset's documents, straight from the .bin (uint16 ids, each document ending in 0)."""
    tokens = np.fromfile(f"{prefix}.bin", dtype=np.uint16)
    assert tokens.size and tokens[-1] == 0 and int(tokens.max()) < 256
    return [bytes(d[:-1].astype(np.uint8)) for d in np.split(tokens, np.flatnonzero(tokens == 0) + 1)[:-1]]


def test_datasets_hold_the_files_bytes(walk: Walk) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for name, texts in walk.texts.items():
        prefix = walk.folder / "data" / name
        assert sorted(_documents(prefix)) == sorted(texts), name
        assert len(IndexedDataset(str(prefix))) == len(texts)  # the .idx indexes every document


def test_archive_has_the_profiled_points_and_the_link(walk: Walk) -> None:
    from sailor_hpc.core.archive import read_archive
    from sailor_hpc.core.models import get_model

    a = read_archive(walk.folder / "profiles.h5")
    assert sorted(a.compute) == [(MODEL, "cpu-core", "fp32")] and not a.failed
    points = a.compute[(MODEL, "cpu-core", "fp32")]
    assert sorted(points) == [(1, 1), (2, 1)]
    L = get_model(MODEL).num_pipeline_layers
    for e in points.values():
        assert e.times.shape == (L, 3) and np.isfinite(e.times).all() and (e.times > 0).all()
        assert e.provenance["device"] == "cpu" and e.provenance["method"] == "wall-clock"
        assert e.provenance.get("slurm_job") is None  # measured here, not in a job
        assert e.spread is not None and e.spread.repetitions >= 5
    (link,) = a.network["cpu-laptop"]
    assert link.path == "network/cpu-laptop/intra:cpu:cpu:2"
    sizes, gbps = link.provenance["sizes"], link.provenance["p2p_gbps"]
    assert sizes == [2 ** 16, 2 ** 18, 2 ** 20] and min(gbps) > 0
    assert np.allclose(link.fit.coeffs, np.polyfit(np.log2(np.asarray(sizes) / 1e6), gbps, 2))
    assert set(a.overhead) == {"cpu-core"}


def test_plans_are_valid_on_the_measured_site(walk: Walk) -> None:
    from sailor_hpc.core.plan_io import load_plan
    from sailor_hpc.core.site import load_site

    site = load_site(walk.folder / "laptop-measured.toml")
    assert [p.gpu_type for p in site.partitions] == ["cpu-core"] and site.intra_node_fit("cpu", 2) is not None
    for name, gpus in (("plan-2.json", 2), ("plan-1.json", 1)):
        plan = load_plan(walk.folder / name, site=site)  # validated against the site: GPU types, placement
        assert plan.model == MODEL and plan.global_batch_size == GBS and plan.num_gpus == gpus, name
        assert {s.gpu_type for p in plan.pipelines for s in p.stages} == {"cpu-core"}


def _records(path: Path) -> list[dict]:
    """The JSON objects of a file, in order. Ranks sharing one stdout file (torchrun's workers) each write
    whole records, but a record's newline is a write of its own, so two records may share a line."""
    text, at, out = path.read_text(), 0, []
    decoder = json.JSONDecoder()
    while (at := text.find("{", at)) >= 0:
        record, at = decoder.raw_decode(text, at)
        out.append(record)
    return out


def _schedule_lr(consumed: int) -> float:
    """Megatron's linear warm-up then cosine decay, by samples (what --lr-*-iters turn into)."""
    warmup, decay = WARMUP_STEPS * GBS, DECAY_STEPS * GBS
    if consumed < warmup:
        return LR * consumed / warmup
    ratio = min(1.0, (consumed - warmup) / (decay - warmup))
    return MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * ratio))


def test_training_lowered_the_loss_on_schedule_and_evaluated(walk: Walk) -> None:
    metrics = _records(walk.folder / "ckpt" / "metrics.jsonl")
    train = [r for r in metrics if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 41))
    losses = [r["loss"] for r in train]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0, losses  # from ~ln 256 = 5.5 towards the text's
    for r in train:
        assert r["lr"] == pytest.approx(_schedule_lr((r["step"] - 1) * GBS), rel=1e-9, abs=1e-12), r
    evals = {r["step"]: r["loss"] for r in metrics if r["kind"] == "eval"}
    assert set(evals) == {10, 20, 30, 40} and all(math.isfinite(v) for v in evals.values())
    assert evals[40] < evals[10]


def test_resume_began_at_the_checkpoint_step_under_the_other_plan(walk: Walk) -> None:
    first, resumed = _records(walk.folder / "run-2.jsonl"), _records(walk.folder / "run-1.jsonl")
    assert sorted(e["rank"] for e in first if e["event"] == "start") == [0, 1]
    assert {e["world_size"] for e in first if e["event"] == "start"} == {2}
    assert not [e for e in first if e["event"] == "loaded"]  # a fresh start
    assert max(e["step"] for e in first if e["event"] == "step") == 20
    assert [e["world_size"] for e in resumed if e["event"] == "start"] == [1]
    (loaded,) = [e for e in resumed if e["event"] == "loaded"]
    assert loaded["step"] == 20 and loaded["consumed_samples"] == 20 * GBS
    steps = [e["step"] for e in resumed if e["event"] == "step"]
    assert steps == list(range(21, 41))


def test_export_gives_the_runtime_validation_loss_in_transformers(walk: Walk) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_patch.data import build_samples
    from sailor_hpc.core.training import DataBlend, parse_split

    model = AutoModelForCausalLM.from_pretrained(walk.folder / "hf-model").float().eval()
    data = walk.folder / "data"
    blend = DataBlend.parse(f"0.7 {data / 'prose'} 0.3 {data / 'code'}")
    valid = build_samples(blend, SEQ, 1234, parse_split("80,20,0"))["valid"]  # launch's default --seed
    assert valid is not None
    losses = []
    with torch.no_grad():
        for k in range(2):  # --eval-iters 2: the same first global batches at every evaluation
            batch = valid.batch(k * GBS, GBS)
            logits = model(batch[:, :-1]).logits
            losses.append(float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                                  batch[:, 1:].reshape(-1))))
    runtime = [r for r in _records(walk.folder / "ckpt" / "metrics.jsonl") if r["kind"] == "eval"][-1]
    assert runtime["step"] == 40
    print(f"\nvalidation loss at step 40: runtime {runtime['loss']:.7f}, transformers {np.mean(losses):.7f}")
    assert abs(np.mean(losses) - runtime["loss"]) <= 1e-5
    # the README's own snippet printed a finite loss and a next byte
    assert re.search(r"^loss \d+\.\d+ on '.*'; next byte b'.*'$", walk.outputs[-1], re.M), walk.outputs[-1]
