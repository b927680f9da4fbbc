"""Co-optimise allocation and heterogeneous plan: which GPUs, and how to run the model on them.

Public API: :func:`plan_search` (:mod:`planner.entry`), the one entry every caller uses, with a
:class:`PlanRequest`; it chooses the search the request and the site need and answers a
:class:`SearchResult` of :class:`Candidate` plans, best first (:mod:`planner.candidates`: the vocabulary
every search shares). Planning on a queue's state (the GPUs free now, or the queue a job would wait in) is
:func:`planner.on_queue.plan_on_state`, which builds the time goal around :func:`plan_search`. The searches
themselves (:mod:`planner.search`, :mod:`planner.geo`, :mod:`planner.deepspeed_space`) are for benchmarks
and tests that measure one of them. The simulator's public API (:mod:`simulator`) is the only cost model.
No torch, no Slurm: availability comes in as GPU counts per partition and the queue as a snapshot (the CLI
and the controller read them from the site, ``sinfo`` or ``squeue``).
"""
from planner.candidates import Candidate, SearchResult
from planner.entry import plan_search, search_kind
from planner.request import Constraints, PlanRequest

__all__ = ["Constraints", "PlanRequest", "Candidate", "SearchResult", "plan_search", "search_kind"]
