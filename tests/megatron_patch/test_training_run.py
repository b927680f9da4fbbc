"""A researcher's run, resized mid-schedule, trains exactly what one process trains.

Warm-up + cosine decay (in steps), a gradient clip small enough that every step clips, weight decay,
a 0.7/0.3 blend of two prefixes with a 90/10 train/valid split and a validation loss every 2 steps:
plan A (4 gloo ranks: 2|1 stages, TP 2 in one pipeline) trains to step 4 and saves; plan B (TP2 -> TP1
inside a pipeline, other micro-batch counts) loads that checkpoint and trains to step 7. The
reference (``megatron_patch.reference``: megatron's GPTModel, one process, the whole global batch,
``clip_grad_norm_``) trains steps 1..7 uninterrupted with the same options. Parameters, Adam moments,
per-step losses, learning rates and validation losses must agree to fp32 precision (1e-6).

Also here: the vocabulary check (a bad token id stops every rank with exit code 2 and an error naming
the file, the id and its position) and the refusal to resume under another schedule.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from sailor_hpc.core.checkpoint import step_dir
from sailor_hpc.core.plan import Pipeline, Plan, Stage
from tests.megatron_patch.conftest import (
    ADAM,
    GLOBAL_BATCH,
    MODEL,
    Env,
    add_plan,
    events,
    launch,
    max_diff,
    python,
)
from tests.shared_inputs import build_data

TOL = 1e-6
CLIP = 0.05
LR, MIN_LR, WARMUP, DECAY = 3e-3, 3e-4, 2, 8
OPTS = ["--lr", str(LR), "--min-lr", str(MIN_LR), "--lr-decay-style", "cosine", "--lr-warmup-iters", str(WARMUP),
        "--lr-decay-iters", str(DECAY), "--clip-grad", str(CLIP), "--split", "90,10,0", "--eval-interval", "2",
        "--eval-iters", "1"]
RESIZE_AT, STEPS = 4, 7


def expected_lr(step: int) -> float:
    """Megatron's schedule by hand: step k runs at the samples consumed before it, (k - 1) * batch."""
    n, warm, decay = (step - 1) * GLOBAL_BATCH, WARMUP * GLOBAL_BATCH, DECAY * GLOBAL_BATCH
    if n <= warm:
        return LR * n / warm
    return MIN_LR + 0.5 * (1 + math.cos(math.pi * (n - warm) / (decay - warm))) * (LR - MIN_LR)


@pytest.fixture(scope="module")
def blend(runtime_env: Env) -> list[str]:
    """``--data 0.7 SHIPPED 0.3 SYNTHETIC``: the second prefix from a .jsonl through the raw-text tool."""
    root = runtime_env.root / "blend"
    root.mkdir()
    lines = [json.dumps({"text": " ".join(f"w{(i * 7 + j) % 53}={i * j}" for j in range(60))}) for i in range(120)]
    (root / "b.jsonl").write_text("\n".join(lines) + "\n")
    return ["--data", "0.7", runtime_env.data, "0.3", build_data(root / "B", str(root / "b.jsonl"))]


@pytest.fixture(scope="module")
def run(runtime_env: Env, blend: list[str]) -> dict:
    ref = runtime_env.root / "ref-schedule"
    res = python("-m", "megatron_patch.reference", "--model", MODEL, *blend, "--global-batch", str(GLOBAL_BATCH),
                 "--steps", str(STEPS), "--out", str(ref), *ADAM, *OPTS, fork=True)
    assert res.returncode == 0, res.stderr[-3000:]
    root = runtime_env.root / "schedule-run"
    logs = launch(runtime_env, "A", RESIZE_AT, root, *blend, *OPTS)
    logs += launch(runtime_env, "B", STEPS, root, "--load", str(root), *blend, *OPTS)
    return {"root": root, "ref": ref, "logs": logs}


def test_resized_run_equals_the_uninterrupted_reference(run: dict) -> None:
    diff = max_diff(step_dir(run["root"], STEPS), run["ref"] / f"ref_step_{STEPS}.pt")
    print(f"plan A to step {RESIZE_AT}, plan B to step {STEPS} vs one process: max |delta| {diff}")
    assert max(diff.values()) <= TOL


def test_every_step_clips_and_logs_the_reference_loss_and_the_schedules_lr(run: dict) -> None:
    ref = json.loads((run["ref"] / "losses.json").read_text())
    steps: dict[int, set[tuple[float, float]]] = {}
    for result in run["logs"]:
        for e in events(result, "step"):
            assert abs(e["loss"] - ref[e["step"] - 1]) <= TOL, e
            assert e["lr"] == pytest.approx(expected_lr(e["step"]), rel=1e-12, abs=1e-18)
            assert e["grad_norm"] > CLIP  # the clip is active on every step of both plans
            steps.setdefault(e["step"], set()).add((e["loss"], e["lr"]))
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert all(len(v) == 1 for v in steps.values()), "ranks disagree"


def test_validation_losses_equal_the_reference(run: dict) -> None:
    ref = {int(k): v for k, v in json.loads((run["ref"] / "eval_losses.json").read_text()).items()}
    assert sorted(ref) == [2, 4, 6, 7]  # every 2 steps and after the last
    got = {(e["step"], round(e["loss"], 12)) for r in run["logs"] for e in events(r, "eval")}
    assert sorted({s for s, _ in got}) == [2, 4, 6, 7] and len(got) == 4  # all ranks log the same
    for step, loss in got:
        assert abs(loss - ref[step]) <= TOL, (step, loss, ref[step])


def test_metrics_file_and_human_lines(run: dict) -> None:
    records = [json.loads(line) for line in (run["root"] / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))  # the resumed job appended to the file
    assert [r["consumed_samples"] for r in train] == [GLOBAL_BATCH * s for s in range(1, STEPS + 1)]
    assert all(r["tokens_per_s"] > 0 and r["lr"] == pytest.approx(expected_lr(r["step"])) for r in train)
    assert [r["step"] for r in records if r["kind"] == "eval"] == [2, 4, 6, 7]
    rank0 = [r for r in run["logs"] if r.rank == 0]
    assert "step      7/7 | loss " in rank0[-1].stderr and "| valid loss " in rank0[-1].stderr
    assert "| loss " not in run["logs"][1].stderr  # one log for a person: rank 0's


def test_resuming_under_another_schedule_is_refused(run: dict, runtime_env: Env, blend: list[str]) -> None:
    """Checked at load, by every plan alike: one rank shows it."""
    add_plan(runtime_env, "one", Plan(MODEL, GLOBAL_BATCH, (Pipeline(GLOBAL_BATCH, 1, (Stage(0, 5, 1, "A100-40"),)),)))
    opts = [*OPTS[:OPTS.index("--lr-decay-iters")], "--lr-decay-iters", "9", *OPTS[OPTS.index("--lr-decay-iters") + 2:]]
    logs = launch(runtime_env, "one", STEPS + 1, runtime_env.root / "elsewhere", "--load", str(run["root"]), *blend,
                  *opts, expect=2)
    assert "another learning-rate schedule (decay 64 -> 72" in logs[0].stderr


def test_out_of_vocabulary_token_stops_every_rank(runtime_env: Env, tmp_path: Path) -> None:
    """One id past tiny-gpt's 256 in a copy of the data: both ranks exit 2 before training (rank 0 reads
    the data, rank 1 learns the verdict from it)."""
    bad = tmp_path / "bad"
    for suffix in (".bin", ".idx"):
        shutil.copy(runtime_env.data + suffix, str(bad) + suffix)
    tokens = np.memmap(f"{bad}.bin", dtype=np.uint16, mode="r+")
    tokens[123_457] = 256
    tokens.flush()
    logs = launch(runtime_env, "2", 1, tmp_path / "ckpt", "--data", str(bad), expect=2)
    assert f"{bad}.bin: --data: token id 256 at token 123457" in logs[0].stderr
    assert "vocabulary of 256 ids" in logs[0].stderr
    assert not any(events(r, "step") for r in logs) and not (tmp_path / "ckpt").exists()


def test_weight_decay_groups_follow_megatrons_rule() -> None:
    """Megatron's default groups (``_get_param_groups``): no decay where ``name.endswith(".bias")`` or the
    parameter is 1-D (norms), decay elsewhere (embeddings and matrices), for every catalog model."""
    pytest.importorskip("torch")
    from megatron_patch.layout import param_layout
    from sailor_hpc.core.models import CATALOG

    for spec in CATALOG:
        for info in param_layout(spec, spec.vocab_size):
            assert info.decay == (not info.name.endswith(".bias") and len(info.shape) > 1), (spec.name, info.name)
