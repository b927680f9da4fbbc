"""Rank program for test_grad_buckets.py: when do the gradient buckets launch, against the backward?

Trains ``--steps`` steps of a plan with a Trainer (as ``launch`` does) and times megatron's own
``backward_step`` (the real one, wrapped for its end time). Each rank prints one JSON line for the
last step: every bucket's launch time and whether the backward's hook launched it, and the end of
the last micro-batch's backward.
"""
from __future__ import annotations

import argparse
import json
import time
import warnings

import torch.distributed as dist

warnings.filterwarnings("ignore")

from megatron.core.pipeline_parallel import schedules  # noqa: E402

from megatron_patch.data import GlobalSamples  # noqa: E402
from megatron_patch.engine import Trainer  # noqa: E402
from megatron_patch.options import TrainOptions  # noqa: E402
from sailor_hpc.core.plan_io import load_plan  # noqa: E402

_ENDS: list[float] = []
_backward_step = schedules.backward_step


def _timed_backward_step(*args: object, **kwargs: object) -> object:
    out = _backward_step(*args, **kwargs)
    _ENDS.append(time.perf_counter())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--grad-bucket-mb", type=float, required=True)
    args = ap.parse_args()
    schedules.backward_step = _timed_backward_step
    dist.init_process_group("gloo")
    plan = load_plan(args.plan)
    trainer = Trainer(plan, GlobalSamples(args.data, plan.sequence_length, 1234),
                      TrainOptions(grad_bucket_mb=args.grad_bucket_mb))
    for _ in range(args.steps):
        _ENDS.clear()
        trainer.train_step()
    print(json.dumps({"rank": dist.get_rank(), "backward_end": _ENDS[-1],
                      "launches": [[list(x.ranks), x.index, x.at, x.by_hook] for x in trainer.sync.last_launches]}),
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
