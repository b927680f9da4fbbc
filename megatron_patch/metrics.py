"""What a person and a plotting script read of a run: rank 0's log lines and metrics file.

Every rank's stdout stays JSON events (the tests and the controller parse them); this adds, on rank 0
only (every rank has the same all-reduced loss, so one copy suffices):

- a human line on stderr every ``--log-interval`` steps and at each evaluation::

      step   12/100 | loss 5.2345 | lr 3.00e-04 | grad 1.234 | 12.3k tok/s | 96 samples | 0.810 s (sim 0.750 s, +8%)

- a JSON-lines file (``--metrics-file``, default ``SAVE/metrics.jsonl``), appended to, so a resumed
  run continues the same file: ``{"kind": "train"|"eval", "step", "loss", ...}``;
- TensorBoard scalars when ``--tensorboard-dir`` is given and ``torch.utils.tensorboard`` imports
  (tensorboard is not a dependency: without it the option is refused at the start).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import IO, Any

from sailor_hpc.core.errors import SailorError


def open_tensorboard(directory: str | None) -> Any:
    """A SummaryWriter on ``directory`` (None: only check that TensorBoard imports; every rank does that
    before the rendezvous, so a missing package stops all of them with exit 2, not rank 0 alone)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise SailorError("TensorBoard is not installed in the runtime's environment", field="--tensorboard-dir",
                          fix="pip install tensorboard, or drop --tensorboard-dir (metrics.jsonl has the same "
                              "numbers)") from None
    return SummaryWriter(directory) if directory is not None else None


def human_line(rec: dict[str, Any], steps: int) -> str:
    """One training step for a person (``rec``: a ``train`` record of :class:`RunLog`)."""
    tps = rec["tokens_per_s"]
    tps_text = f"{tps / 1e3:.1f}k" if tps >= 1e3 else f"{tps:.0f}"
    grad = "skipped" if rec["grad_norm"] is None else f"{rec['grad_norm']:.3f}"
    line = (f"step {rec['step']:>6}/{steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | grad {grad} | "
            f"{tps_text} tok/s | {rec['consumed_samples']} samples | {rec['step_s']:.3f} s")
    if rec.get("predicted_s"):
        line += f" (sim {rec['predicted_s']:.3f} s, {rec['step_s'] / rec['predicted_s'] - 1:+.0%})"
    return line


class RunLog:
    """Rank 0's log lines, metrics file and TensorBoard writer (other ranks: a no-op)."""

    def __init__(self, active: bool, *, steps: int, tokens_per_step: int, log_interval: int = 1,
                 metrics_file: str | None = None, tensorboard_dir: str | None = None,
                 predicted_s: float | None = None, stream: IO[str] | None = None) -> None:
        self.active, self.steps, self.tokens_per_step = active, steps, tokens_per_step
        self.interval, self.predicted_s = log_interval, predicted_s
        self.stream = stream or sys.stderr
        self.file: IO[str] | None = None
        self.tb: Any = open_tensorboard(tensorboard_dir) if active and tensorboard_dir else None
        if active and metrics_file:
            Path(metrics_file).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(metrics_file, "a", encoding="utf-8")  # noqa: SIM115  (open for the whole run)

    def _write(self, rec: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(rec, sort_keys=True) + "\n")
            self.file.flush()
        if self.tb is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
                if rec.get(key) is not None:
                    self.tb.add_scalar(f"{rec['kind']}/{key}", rec[key], rec["step"])

    def train(self, step: int, loss: float, lr: float, grad_norm: float | None, seconds: float,
              consumed_samples: int) -> None:
        if not self.active:
            return
        rec = {"kind": "train", "t": time.time(), "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
               "step_s": seconds, "tokens_per_s": self.tokens_per_step / seconds if seconds > 0 else 0.0,
               "consumed_samples": consumed_samples, "predicted_s": self.predicted_s}
        self._write(rec)
        if step % self.interval == 0 or step == self.steps:
            print(human_line(rec, self.steps), file=self.stream, flush=True)

    def note(self, kind: str, text: str, **fields: Any) -> None:
        """A run event for a person (``text`` on stderr) and for the metrics file (``kind`` and ``fields``)."""
        if not self.active:
            return
        self._write({"kind": kind, "t": time.time(), **fields})
        print(text, file=self.stream, flush=True)

    def evaluation(self, step: int, loss: float, iters: int, seconds: float) -> None:
        if not self.active:
            return
        self._write({"kind": "eval", "t": time.time(), "step": step, "loss": loss, "iters": iters,
                     "eval_s": seconds})
        print(f"step {step:>6}/{self.steps} | valid loss {loss:.4f} ({iters} batches, {seconds:.2f} s)",
              file=self.stream, flush=True)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
