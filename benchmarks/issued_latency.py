"""The gloo link's latency per ring step of a one-element all-reduce and all-gather, streamed back to back
and issued alone after bursts of compute of several lengths (``profiler.netbench``'s two measurements; the
profiler takes the issued one after :data:`profiler.netbench.BURST_S`), on two ranks of this machine.

Why a benchmark: the issued latency is what the simulator charges each of DeepSpeed's collectives, and on
this repository's 2-core host it depends on how long the ranks computed before it, which no single burst
length captures; this prints that dependence (timings: never asserted by a test).

    .venv/bin/python benchmarks/issued_latency.py [--rounds 25]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_patch import local  # noqa: E402

BURSTS_S = (0.0005, 0.003, 0.02)  # compute before each issued collective; the profiler's is 3 ms


def rank_main() -> None:
    import torch
    import torch.distributed as dist

    from profiler.netbench import collective_latency_s, issued_latency_s

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cpu, rounds = torch.device("cpu"), int(os.environ["BENCH_ROUNDS"])
    out = {k: {"streamed": collective_latency_s(k, 9, 2, cpu),
               "issued": {str(b): issued_latency_s(k, rounds, 3, cpu, burst_s=b) for b in BURSTS_S}}
           for k in ("all_reduce", "all_gather")}
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=25, help="issued collectives per burst length (median)")
    args = ap.parse_args()
    res = local.run([str(Path(__file__).resolve())], 2, {"BENCH_ROUNDS": str(args.rounds), "BENCH_RANK_MAIN": "1"},
                    timeout=600)
    bad = [r for r in res if r.returncode != 0]
    if bad:
        raise RuntimeError(bad[0].stderr[-3000:])
    measured = json.loads(res[0].stdout.strip().splitlines()[-1])
    load = os.getloadavg()
    print(f"gloo, 2 ranks, latency per ring step in us (load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
          f"on {os.cpu_count()} cores)")
    print(f"{'collective':>11}{'streamed':>10}" + "".join(f"{f'after {b * 1e3:g} ms':>14}" for b in BURSTS_S))
    for kind, m in measured.items():
        print(f"{kind:>11}{m['streamed'] * 1e6:>10.0f}"
              + "".join(f"{m['issued'][str(b)] * 1e6:>14.0f}" for b in BURSTS_S))
    return 0


if __name__ == "__main__":
    local.self_launching(main, rank_main)
