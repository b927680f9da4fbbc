"""Host memory of this process (torch-free): current and peak RSS, and resetting the peak.

Why RSS and not allocator counters: on the CPU path torch keeps no allocation statistics, and memory
maps (checkpoint files read with ``mmap``) count only as far as their pages are touched, which is
exactly what a rank pays. Linux's ``/proc/self/clear_refs`` resets the high-water mark, so one
process can measure several phases (tests, benchmarks); elsewhere the peak is since process start.
"""
from __future__ import annotations

import re
import resource
from pathlib import Path

_STATUS = Path("/proc/self/status")


def _status_kib(key: str) -> int | None:
    try:
        m = re.search(rf"^{key}:\s+(\d+) kB", _STATUS.read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def rss() -> int:
    """Resident bytes now."""
    kib = _status_kib("VmRSS")
    return 1024 * kib if kib is not None else peak_rss()


def private_rss() -> int:
    """Resident anonymous bytes now (Linux ``RssAnon``): memory this process materialised itself, unlike
    the file pages a memory map shows in RSS (shared page cache, reclaimable); 0 where unknown."""
    return 1024 * (_status_kib("RssAnon") or 0)


def peak_rss() -> int:
    """Highest resident bytes since process start or the last :func:`reset_peak`."""
    kib = _status_kib("VmHWM")
    return 1024 * (kib if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def reset_peak() -> bool:
    """Make the peak the current RSS (Linux); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True
