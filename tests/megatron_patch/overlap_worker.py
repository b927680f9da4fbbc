"""``python -m megatron_patch.launch`` that also reports when the gradient buckets launched (test_grad_buckets).

The run is the runtime's own (same arguments, checkpoint and logs); megatron's real ``backward_step`` is
wrapped for its end time. After training, each rank prints one more JSON line, ``"event": "overlap"``,
for the last step: every bucket's launch time and whether the backward's hook launched it, and the end
of the last micro-batch's backward.
"""
from __future__ import annotations

import json
import sys
import time
import warnings
from typing import Any

warnings.filterwarnings("ignore")

from megatron_patch import launch  # noqa: E402
from megatron_patch.engine import Trainer  # noqa: E402

_ENDS: list[float] = []
_LAST: list[dict[str, Any]] = []
_train_step = Trainer.train_step


def _recorded_train_step(self: Trainer, *args: Any, **kwargs: Any) -> Any:
    _ENDS.clear()
    res = _train_step(self, *args, **kwargs)
    _LAST[:] = [{"event": "overlap", "rank": self.role.rank, "backward_end": _ENDS[-1],
                 "launches": [[list(x.ranks), x.index, x.at, x.by_hook] for x in self.sync.last_launches]}]
    return res


def main() -> int:
    from megatron.core.pipeline_parallel import schedules  # after the runtime's modules: via mcore_import
    backward_step = schedules.backward_step

    def timed_backward_step(*args: Any, **kwargs: Any) -> Any:
        out = backward_step(*args, **kwargs)
        _ENDS.append(time.perf_counter())
        return out

    schedules.backward_step = timed_backward_step
    Trainer.train_step = _recorded_train_step  # type: ignore[method-assign]
    code = launch.main(sys.argv[1:])
    for record in _LAST:
        print(json.dumps(record), flush=True)
    return code


if __name__ == "__main__":
    launch.exit_now(main())
