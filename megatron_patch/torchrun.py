"""torchrun, quiet after the runtime's clean error: ``python -m megatron_patch.torchrun [torchrun options] ...``.

Same options and elastic agent as ``torchrun`` (``torch.distributed.run``'s own parser and launcher). The one
difference: when the ranks fail with the runtime's clean error (a :class:`SailorError`, one line per rank,
exit 2), torchrun would follow those lines with its own ``ChildFailedError`` traceback and failure report
and exit 1; this launcher adds nothing and exits 2, as a Slurm job's ``srun`` leaves them. Any other
failure keeps torchrun's full report and exit status.
"""
from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Mapping

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure, record
from torch.distributed.run import parse_args
from torch.distributed.run import run as torchrun

from sailor_hpc.core.dist_env import EXIT_BAD_INPUT

# the agent's logger that says which rank failed and which ranks it stopped
PROCESS_LOGGER = "torch.distributed.elastic.multiprocessing.api"
# once one rank failed, the agent ends the others with SIGTERM, then SIGKILL past its timeout
STOPPED_BY_AGENT = (-signal.SIGTERM, -signal.SIGKILL)


def is_clean_error(failures: Mapping[int, ProcessFailure]) -> bool:
    """Some rank exited 2, and every other failed rank exited 2 too or was ended by the agent.

    The ranks check their input independently and exit within moments of each other; a rank still
    starting when the agent saw the first exit is stopped by it, and has nothing of its own to report.
    (Which rank failed first is not told apart: the agent's failure times are whole seconds.)
    """
    codes = [f.exitcode for f in failures.values()]
    return EXIT_BAD_INPUT in codes and all(c == EXIT_BAD_INPUT or c in STOPPED_BY_AGENT for c in codes)


class HeldBack(logging.Filter):
    """Holds the agent's process records until the launch's outcome is known: dropped after a clean
    error, replayed otherwise. That logger speaks only when ranks fail or are stopped, so nothing waits."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


def launch(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default: this process's arguments); 0, or 2 after a clean error."""
    args = parse_args(argv)
    logger, held = logging.getLogger(PROCESS_LOGGER), HeldBack()
    logger.addFilter(held)
    clean = False
    try:
        torchrun(args)
    except ChildFailedError as e:
        clean = is_clean_error(e.failures)
        if not clean:
            raise
    finally:
        logger.removeFilter(held)
        if not clean:
            for held_record in held.records:
                logger.handle(held_record)
    return EXIT_BAD_INPUT if clean else 0


# torchrun's own error handling (``@record``) for every other failure: error files, the failure report
main = record(launch)

if __name__ == "__main__":
    sys.exit(main())
