"""Co-optimise allocation and heterogeneous plan: which GPUs, and how to run the model on them.

Public API: :func:`planner.search.search` with a :class:`planner.request.PlanRequest`; the simulator's
public API (:mod:`simulator`) is the only cost model. No torch, no Slurm: availability comes in as
GPU counts per partition (the CLI reads them from the site or from ``sinfo``).
"""
from planner.request import Constraints, PlanRequest
from planner.search import Candidate, SearchResult, SearchSettings, search

__all__ = ["Constraints", "PlanRequest", "Candidate", "SearchResult", "SearchSettings", "search"]
