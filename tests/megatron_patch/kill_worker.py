"""``python -m megatron_patch.launch`` that SIGKILLs itself in the middle of saving a checkpoint.

Rank 0 dies at ``FAULT`` while writing the checkpoint of step ``FAULT_STEP`` (test code only; the
runtime has no fault hooks):

- ``mid_file``: half of a layer file written, nothing fsynced, no manifest;
- ``before_commit``: every file and the manifest written in the temporary directory, not yet renamed.

The other ranks then hang in the save's collectives until the launcher kills them, as a node failure
or ``scancel`` would leave them.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from megatron_patch import launch
from sailor_hpc.core import checkpoint


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _armed(path: Path) -> bool:
    return os.environ.get("RANK") == "0" and f"step_{int(os.environ['FAULT_STEP']):08d}" in str(path)


def main() -> int:
    fault = os.environ["FAULT"]
    write_file, commit = checkpoint.write_file, checkpoint._commit

    def torn_write(path: Path, data: bytes) -> dict[str, Any]:
        if fault == "mid_file" and _armed(path):
            with open(path, "wb") as fh:
                fh.write(data[: len(data) // 2])
            _die()
        return write_file(path, data)

    def killed_commit(tmp: Path, final: Path) -> None:
        if fault == "before_commit" and _armed(final):
            _die()
        commit(tmp, final)

    checkpoint.write_file = torn_write
    checkpoint._commit = killed_commit
    return launch.main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
