"""What ``sailor-hpc logs`` shows of a job's log, where srun merged every rank's output.

A person reads one rank's lines (rank 0's by default: the only rank that logs steps, losses, throughput,
saves and loads; every rank logs its own warnings and errors), labelled ``[rank N] `` by the runtime
(:mod:`megatron_patch.rank_output`), with the job's own lines no rank labels: the batch script's and
Slurm's messages, and output from before a rank's runtime started (an interpreter that cannot import it).
The runtime's JSON events (``--json``) are for programs: every rank's, or one rank's.
"""
from __future__ import annotations

import json

from sailor_hpc.core.runtime_events import unlabelled


def _json_rank(line: str) -> tuple[bool, int | None]:
    """Whether the line is a JSON object (an event), and the rank it names."""
    if not line.startswith("{"):
        return False, None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return False, None  # two ranks' lines run together, or not the runtime's: text for a person
    if not isinstance(obj, dict):
        return False, None
    rank = obj.get("rank")
    return True, rank if isinstance(rank, int) else None


def log_lines(text: str, *, rank: int | None, events: bool) -> list[str]:
    """The lines of a job's log to show: with ``events`` the JSON events (of ``rank``; None: of every rank), else
    the human lines of ``rank`` (None: rank 0) without their label, and the lines no rank labelled."""
    out = []
    for line in text.splitlines():
        is_event, event_rank = _json_rank(line)
        if events:
            if is_event and (rank is None or event_rank == rank):
                out.append(line)
            continue
        if is_event:
            continue
        label, said = unlabelled(line)
        if label is None or label == (rank or 0):
            out.append(said)
    return out
