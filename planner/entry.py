"""The planner's one public entry (exported as :func:`planner.plan_search`), which every caller uses
(``sailor-hpc plan``, ``plan --sbatch``, the controller's re-plans, through :mod:`planner.on_queue`): it
chooses the search that fits the request and the site, so the choice is made in one place.

- ``runtime="deepspeed"``: only plans DeepSpeed's engine runs, with ZeRO as a dimension
  (:func:`planner.deepspeed_space.deepspeed_search`);
- a site of several clusters: also the plans whose pipelines cross them (:func:`planner.geo.geo_search`);
- otherwise the single-cluster search (:func:`planner.search.search`).
"""
from __future__ import annotations

from planner.candidates import Progress, SearchResult
from planner.deepspeed_space import deepspeed_search
from planner.geo import geo_search
from planner.request import PlanRequest
from planner.search import search
from sailor_hpc.core.archive import ProfileArchive
from sailor_hpc.core.site import Site


def search_kind(site: Site, request: PlanRequest) -> str:
    """Which search :func:`plan_search` runs: ``deepspeed``, ``geo`` or ``single`` (reported by callers)."""
    if request.runtime == "deepspeed":
        return "deepspeed"
    return "geo" if len(site.clusters) > 1 else "single"


def plan_search(site: Site, archive: ProfileArchive, request: PlanRequest, *,
                progress: Progress | None = None) -> SearchResult:
    """The best plans for ``request`` on ``site``, best first (a SailorError when none is feasible).
    ``progress`` gets ``(done, total)`` callbacks from the searches that report them (not DeepSpeed's)."""
    kind = search_kind(site, request)
    if kind == "deepspeed":
        return deepspeed_search(site, archive, request)
    if kind == "geo":
        return geo_search(site, archive, request, progress=progress)
    return search(site, archive, request, progress=progress)


__all__ = ["plan_search", "search_kind"]
