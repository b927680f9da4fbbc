"""A user's own DeepSpeed entry point, as a DeepSpeed user writes one: DeepSpeed's config arguments,
``deepspeed.initialize(args=...)``, torch.distributed from the environment. It trains nothing: each rank
writes what DeepSpeed and torch.distributed saw (``--out DIR/rank<N>.json``)."""
from __future__ import annotations

import argparse
import importlib
import json
import os
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # a CPU-only machine: no probing for GPUs

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# the test host only: on the CPU, DeepSpeed compiles its shared-memory all-reduce op (inference only, never
# used here) with the C++ compiler at its start, ~80 s of CPU; megatron_patch's DeepSpeed launch skips it alike
vars(importlib.import_module("deepspeed.comm.torch"))["build_shm_op"] = lambda: None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", default="")
    deepspeed.add_config_arguments(ap)
    args = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    model = torch.nn.Linear(4, 4)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    ranks = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(ranks)  # the group is real: every rank sees the sum of all ranks
    record = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "local_rank": int(os.environ["LOCAL_RANK"]),
              "node": os.environ.get("SLURMD_NODENAME"), "train_batch_size": engine.train_batch_size(),
              "micro_batch": engine.train_micro_batch_size_per_gpu(),
              "accumulation": engine.gradient_accumulation_steps(), "zero_stage": engine.zero_optimization_stage(),
              "dp_world_size": engine.dp_world_size, "rank_sum": ranks.item(), "tag": args.tag,
              "plan": os.environ["SAILOR_PLAN"], "config": args.deepspeed_config,
              "env_config": os.environ["SAILOR_DS_CONFIG"]}
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
