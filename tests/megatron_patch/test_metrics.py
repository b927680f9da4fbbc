"""Rank 0's run log: the human line by hand, the metrics file appended across jobs, TensorBoard optional."""
from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import pytest

from megatron_patch.metrics import RunLog, human_line, open_tensorboard
from sailor_hpc.core.errors import SailorError


def test_human_line_with_and_without_the_prediction() -> None:
    rec = {"step": 12, "loss": 5.23456, "lr": 3e-4, "grad_norm": 1.2345, "tokens_per_s": 12345.0,
           "consumed_samples": 96, "step_s": 0.81, "predicted_s": 0.75}
    assert human_line(rec, 100) == ("step     12/100 | loss 5.2346 | lr 3.00e-04 | grad 1.234 | 12.3k tok/s | "
                                    "96 samples | 0.810 s (sim 0.750 s, +8%)")
    rec.update(predicted_s=None, grad_norm=None, tokens_per_s=512.0)
    assert human_line(rec, 100).endswith("grad skipped | 512 tok/s | 96 samples | 0.810 s")


def test_metrics_file_is_appended_by_each_job_and_lines_follow_the_interval(tmp_path: Path) -> None:
    path = tmp_path / "ckpt" / "metrics.jsonl"
    for first, last in ((1, 3), (4, 5)):  # a job, then the job that resumed it
        out = io.StringIO()
        log = RunLog(True, steps=5, tokens_per_step=64, log_interval=2, metrics_file=str(path), predicted_s=0.5,
                     stream=out)
        for step in range(first, last + 1):
            log.train(step, 1.0 / step, 1e-3, 2.0, 0.25, 8 * step)
        log.evaluation(last, 0.5, 2, 0.1)
        log.close()
        printed = [int(line.split("/")[0].split()[-1]) for line in out.getvalue().splitlines() if "| loss" in line]
        assert printed == [s for s in range(first, last + 1) if s % 2 == 0 or s == 5]
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records] == [("train", 1), ("train", 2), ("train", 3), ("eval", 3),
                                                         ("train", 4), ("train", 5), ("eval", 5)]
    assert records[0]["tokens_per_s"] == 256.0 and records[0]["predicted_s"] == 0.5


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    out = io.StringIO()
    log = RunLog(False, steps=1, tokens_per_step=1, metrics_file=str(tmp_path / "m.jsonl"), stream=out,
                 tensorboard_dir=str(tmp_path / "tb"))
    log.train(1, 1.0, 1.0, 1.0, 1.0, 1)
    log.close()
    assert out.getvalue() == "" and not list(tmp_path.iterdir())


def test_tensorboard_is_optional(tmp_path: Path) -> None:
    """Without the tensorboard package the option is refused with the fix; with it, scalars are written."""
    pytest.importorskip("torch")
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(SailorError) as err:
            open_tensorboard(None)
        assert err.value.field == "--tensorboard-dir" and "pip install tensorboard" in str(err.value)
        return
    log = RunLog(True, steps=1, tokens_per_step=1, tensorboard_dir=str(tmp_path / "tb"), stream=io.StringIO())
    log.train(1, 1.0, 1.0, 1.0, 1.0, 1)
    log.close()
    assert any((tmp_path / "tb").iterdir())
