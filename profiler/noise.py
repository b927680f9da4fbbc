"""Was a compute point measured on a quiet node? Its spread says.

A point's spread is the interquartile range of its whole-model forward and backward over the repetitions,
divided by the median (:class:`sailor_hpc.core.archive.PointSpread`). Alone on a GPU, repetitions of the
same work differ by clock jitter: a few per cent. Where another job's work shares the node's cores or GPU,
repetitions are slowed by whatever ran beside them: on a 2-core test lab running 13 measuring jobs at once,
spreads of 50-180 % came with medians 3-7x the time training then measured. A spread above
:data:`NOISY_SPREAD` (20 %: a quarter of the repetitions at least 10 % from the median, several times what
clock jitter gives) is such a node: the median cannot be trusted to the precision the planner compares
micro-batch sizes and GPU types at (consecutive sizes often differ by less than that), nor can the spread
itself tell a real ordering of two points from noise (:mod:`profiler.monotonic` allows gaps up to the
spreads). So a profiling job measures a noisy point again, up to :data:`QUIET_RETRIES` times, keeps the
quietest measurement, and flags the point in the archive when none was quiet; ``sailor-hpc profiles show``
warns about every noisy point, flagged or not (archives written before this check).

Torch-free: the profiling job, the sweep driver and the CLI use it.
"""
from __future__ import annotations

from sailor_hpc.core.archive import PointSpread

NOISY_SPREAD = 0.20
QUIET_RETRIES = 2  # measurements after the first: three in all, then the point is flagged
NOISY = "noisy"  # the flag part of a point that stayed noisy (beside profiler.monotonic's "not monotonic")
_DIRECTIONS = ("forward", "backward")


def worst_spread(spread: PointSpread | None) -> float:
    """The larger of a point's whole-model forward and backward spreads (0: none recorded)."""
    return 0.0 if spread is None else max(spread.model)


def noisy(spread: PointSpread | None) -> str:
    """Why a point's spread says its node was busy ("" when it does not, or when none was recorded)."""
    if spread is None:
        return ""
    loud = [f"{name} {100 * s:.0f} %" for name, s in zip(_DIRECTIONS, spread.model) if s > NOISY_SPREAD]
    if not loud:
        return ""
    return (f"{NOISY}: spread {', '.join(loud)} over {spread.repetitions} repetitions, above {100 * NOISY_SPREAD:.0f} %: "
            "the node was busy (other work on its cores or GPU), so the median may be off by as much")


def flag_parts(flag: str) -> dict[str, str]:
    """A point's flag as its parts by kind ("noisy", "not monotonic"); a flag of one unnamed part is kept whole."""
    parts: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in flag.split(" | "))):
        kind = part.split(":", 1)[0] if ":" in part else ""
        parts[kind] = part
    return parts


def with_flag(flag: str, part: str, kind: str) -> str:
    """``flag`` with its part of ``kind`` replaced by ``part`` ("" removes it); the other parts kept."""
    parts = flag_parts(flag)
    parts.pop(kind, None)
    if part:
        parts[kind] = part
    return " | ".join(parts.values())
