"""Reading plan files: our format and Sailor's ``plan_config_*.json`` alike, optionally placed on a site."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.fields import read_json
from sailor_hpc.core.models import get_model
from sailor_hpc.core.placement import place_plan
from sailor_hpc.core.plan import Plan, plan_from_dict, validate_plan
from sailor_hpc.core.sailor_compat.plans import SailorRun, is_sailor_plan, plan_from_sailor
from sailor_hpc.core.site import Site


def _gpu_types_on(plan: Plan, site: Site, path: Path, field_of: Callable[[int, int], str]) -> None:
    """A stage's GPU type the site does not declare is the plan file's error (named there), not the site's."""
    for pi, pipe in enumerate(plan.pipelines):
        for si, stage in enumerate(pipe.stages):
            try:
                site.gpu(stage.gpu_type)
            except SailorError as exc:
                raise SailorError(f"{exc.message} on site {site.name!r} ({site.source or 'discovered'})", file=path,
                                  field=field_of(pi, si), fix=exc.fix) from None


def load_plan(path: str | Path, *, model: str | None = None, site: Site | None = None,
              validate: bool = True) -> Plan:
    """Read a plan in our format or Sailor's (``model`` is then required), optionally placed on ``site``."""
    return load_run(path, model=model, site=site, validate=validate).plan


def load_run(path: str | Path, *, model: str | None = None, site: Site | None = None,
             validate: bool = True) -> SailorRun:
    """Like :func:`load_plan`, keeping Sailor's measured time and memory when the file has them."""
    path = Path(path)
    data = read_json(path, missing_fix="pass the path of a plan JSON")
    if is_sailor_plan(data):
        if model is None:
            raise SailorError("a Sailor plan_config does not say which model it trains", file=path, field="model",
                              fix="pass --model (e.g. OPT-350M)")
        run = plan_from_sailor(data, model, source=path)
        if site is not None:
            _gpu_types_on(run.plan, site, path, lambda _p, s: f"pipeline_list[*].tmp_per_stage[{s}]")
            run = replace(run, plan=place_plan(run.plan, site))
    else:
        run = SailorRun(plan_from_dict(data, source=path), None, None)
        if model is not None:
            wanted = get_model(model).name
            try:
                have = get_model(run.plan.model).name
            except SailorError as exc:
                raise SailorError(exc.message, file=path, field="model", fix=exc.fix) from None
            if have != wanted:
                raise SailorError(f"plan is for {run.plan.model}, not {model}", file=path, field="model",
                                  fix=f"train {run.plan.model} (--model {run.plan.model}), or plan {model}")
    if validate:
        validate_plan(run.plan, site, source=path,
                      check_placement=site is not None and all(s.placement for p in run.plan.pipelines for s in p.stages))
    return run
