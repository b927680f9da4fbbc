"""A run's training options (torch-free): Megatron's LR schedule by hand, splits, blends, checks, and the
launch arguments the CLI renders parsing back to the same values in ``megatron_patch.launch``."""
from __future__ import annotations

import math
from fractions import Fraction

import pytest

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.training import (
    DEFAULTS,
    DataBlend,
    LrSchedule,
    check_values,
    eval_due,
    launch_args,
    parse_split,
    split_bounds,
)


def test_cosine_schedule_by_hand_in_steps() -> None:
    """Megatron's get_lr at the samples consumed before each step: 2 warm-up steps, decay to step 8."""
    s = LrSchedule.resolve({"lr": 3e-3, "min_lr": 3e-4, "lr_decay_style": "cosine", "lr_warmup_iters": 2,
                            "lr_decay_iters": 8}, global_batch=8, steps=100)
    assert (s.warmup, s.decay) == (16, 64)
    got = [s.lr_at(8 * k) for k in range(10)]
    assert got[:3] == [0.0, 1.5e-3, 3e-3]  # warm-up from 0, as Megatron (its first step runs at lr 0)
    for k in range(3, 9):
        ratio = (8 * k - 16) / 48
        assert got[k] == pytest.approx(3e-4 + 0.5 * (1 + math.cos(math.pi * ratio)) * 2.7e-3, abs=1e-15)
    assert got[8] == pytest.approx(3e-4) and got[9] == 3e-4  # min_lr after the decay


def test_linear_and_constant_in_samples() -> None:
    lin = LrSchedule.resolve({"lr": 1.0, "lr_decay_style": "linear", "lr_warmup_samples": 10,
                              "lr_decay_samples": 110}, global_batch=4, steps=5)
    assert [lin.lr_at(n) for n in (5, 10, 60, 110, 200)] == [0.5, 1.0, 0.5, 0.0, 0.0]
    const = LrSchedule.resolve({"lr": 2.0}, global_batch=4, steps=5)
    assert [const.lr_at(n) for n in (0, 100)] == [2.0, 2.0]
    # a constant schedule does not depend on the step a run goes to (legs of a run may differ)
    assert const == LrSchedule.resolve({"lr": 2.0}, global_batch=4, steps=50)


def test_decay_defaults_to_the_run_and_must_end_after_the_warmup() -> None:
    s = LrSchedule.resolve({"lr_decay_style": "cosine"}, global_batch=4, steps=25)
    assert s.decay == 100 and s.lr == DEFAULTS["lr"]
    with pytest.raises(SailorError, match="decay ends at sample 8"):
        LrSchedule.resolve({"lr_decay_style": "cosine", "lr_warmup_iters": 3}, global_batch=4, steps=2)


def test_split_as_megatron() -> None:
    assert parse_split("949,50,1") == pytest.approx((0.949, 0.05, 0.001))
    assert parse_split("99,1") == (0.99, 0.01, 0.0)
    # 52 documents at 90/10/0: round(46.8) = 47 train, round(5.2) = 5 valid, none to test
    assert split_bounds(parse_split("90,10,0"), 52) == [(0, 47), (47, 52), (52, 52)]
    # rounding up past the end is taken back from the last splits' ends (Megatron's diff)
    assert split_bounds((0.5, 0.5, 0.0), 3) == [(0, 1), (1, 3), (3, 3)]  # 2 + 2 rounded, one taken back
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(SailorError, match="--split"):
            parse_split(bad)


def test_split_bounds_cover_every_document_once() -> None:
    for docs in (1, 3, 7, 52, 1000):
        for split in ("949,50,1", "1,1,1", "90,10,0", "2,1"):
            b = split_bounds(parse_split(split), docs)
            assert b[0][0] == 0 and b[-1][1] == docs
            assert all(b[k][1] == b[k + 1][0] and b[k][0] <= b[k][1] for k in range(2))


def test_data_blend_parsing() -> None:
    assert DataBlend.parse("/d/one prefix").prefixes == ("/d/one prefix",)  # not pairs: one path with a space
    b = DataBlend.parse("0.7 /d/A 0.3 /d/B")
    assert b.prefixes == ("/d/A", "/d/B") and b.fractions() == [Fraction(7, 10), Fraction(3, 10)]
    assert DataBlend.parse(b.tokens()) == b and DataBlend.parse(b.text()) == b
    assert DataBlend.parse(["/d/A"]).tokens() == ["/d/A"]
    assert DataBlend.parse(["0.7 /d/A 0.3 /d/B"]) == b  # one quoted argument: the same blend as the string
    assert DataBlend.parse(["/d/one prefix"]).prefixes == ("/d/one prefix",)
    for bad in (["0.7", "/d/A", "/d/B"], ["x", "/d/A", "0.3", "/d/B"], ["0", "/d/A", "0", "/d/B"],
                ["1", "/d/A", "2", "/d/A"]):
        with pytest.raises(SailorError, match="--data"):
            DataBlend.parse(bad)


def test_checks_name_the_flag() -> None:
    cases = {"--lr-decay-style": {"lr_decay_style": "exp"}, "--clip-grad": {"clip_grad": -1.0},
             "--min-lr": {"lr": 1e-4, "min_lr": 1e-3}, "--eval-iters": {"eval_iters": 0},
             "--lr-warmup-samples": {"lr_warmup_iters": 2, "lr_warmup_samples": 10},
             "--split": {"eval_interval": 5}}  # evaluation without a valid split
    for flag, values in cases.items():
        with pytest.raises(SailorError) as err:
            check_values(values)
        assert err.value.field == flag, (flag, err.value)


def test_launch_args_parse_back_in_the_runtime() -> None:
    """What the CLI puts into a job script is what the ranks train with (launch's own parser)."""
    from megatron_patch.launch import parse_args
    values = {"lr": 3e-4, "min_lr": 3e-5, "lr_decay_style": "cosine", "lr_warmup_iters": 100,
              "lr_decay_iters": 5000, "clip_grad": 0.5, "split": "949,50,1", "eval_interval": 200,
              "eval_iters": 10, "log_interval": 5, "tensorboard_dir": None}
    args = launch_args(values)
    assert "--tensorboard-dir" not in args  # not given: the runtime's default
    parsed = parse_args(["--plan", "p.json", "--model", "tiny-gpt", "--steps", "1", *args])
    assert {k: getattr(parsed, k) for k in values} == values


def test_eval_due() -> None:
    assert [s for s in range(1, 12) if eval_due(s, 4, 11)] == [4, 8, 11]
    assert not any(eval_due(s, 0, 11) for s in range(1, 12))
