"""What the simulator assumes of gloo, the backend megatron_patch communicates over without CUDA: a send
stages nothing, so it completes only when the receiver has posted its receive, at any size
(``simulator.runtimes.STAGING_BYTES["gloo"] == 0``: every gloo transfer is blocking).

Two gloo ranks, sent and received as the runtime's p2p sends them (``batch_isend_irecv``, then wait).
The receiver posts ``LATE_S`` after the sender; the sender's wait must last about as long, for a 64 B
message as for a 16 MiB one. The control is the same exchange with the receiver on time.
"""
from __future__ import annotations

import json

import pytest

from megatron_patch import local
from simulator.runtimes import STAGING_BYTES

LATE_S = 0.4
SIZES = (64, 32 * 1024, 16 * 2**20)
RANK = f"""
import json, os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, out = dist.get_rank(), {{}}
for late in (0.0, {LATE_S}):
    for nbytes in {SIZES}:
        t = torch.ones(nbytes // 4)
        dist.barrier()
        if rank == 0:
            start = time.perf_counter()
            for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 1)]):
                req.wait()
            out[f"{{late}} {{nbytes}}"] = time.perf_counter() - start
        else:
            time.sleep(late)
            for req in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, 0)]):
                req.wait()
dist.barrier()
if rank == 0:
    print(json.dumps(out), flush=True)
"""


def test_a_gloo_send_waits_for_its_receiver_at_any_size() -> None:
    pytest.importorskip("torch")
    results = local.run(["-c", RANK], 2, timeout=120, fork=True)
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    waited = json.loads(results[0].stdout.strip().splitlines()[-1])
    print(waited)
    for nbytes in SIZES:
        on_time, late = waited[f"0.0 {nbytes}"], waited[f"{LATE_S} {nbytes}"]
        assert late >= 0.6 * LATE_S, (nbytes, late)  # blocked until the receive was posted (less the barrier skew)
        assert on_time < 0.3 * LATE_S, (nbytes, on_time)  # the control: nothing else made it slow
    assert STAGING_BYTES["gloo"] == 0
