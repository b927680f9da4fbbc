"""Plan JSON: the job tests' plans (ours) and a published Sailor plan_config, mutated, through ``load_plan``
(alone and on the local test site, as ``plan validate --site`` reads them) and ``sailor-hpc plan validate``."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from sailor_hpc.core.plan_io import load_plan
from sailor_hpc.core.site import load_site
from tests.data import LOCAL_LAB, SAILOR_DATA
from tests.fuzz.harness import Doc, cli_exits_cleanly, count, examples, loads_or_refuses, mutated_bytes, mutated_doc, scratch
from tests.jobs.conftest import PLANS

LAB = load_site(LOCAL_LAB)
SAILOR_PLAN = SAILOR_DATA / "validation" / "mit" / "N4" / "plan_config_N4_D1.json"
DOCS: dict[str, Doc] = {**PLANS, "sailor": json.loads(SAILOR_PLAN.read_text())}


def _as_json(doc: Doc) -> bytes:
    return json.dumps(doc, indent=1).encode()  # NaN and Infinity as Python writes them: json.loads reads them


#: one plan, mutated field by field (then written as JSON) or byte by byte
plan_files = st.sampled_from(sorted(DOCS)).flatmap(lambda name: st.tuples(st.just(name), st.one_of(
    mutated_doc(DOCS[name]).map(_as_json), mutated_bytes(_as_json(DOCS[name])))))


@settings(max_examples=examples(250))
@given(plan_files)
def test_load_plan_loads_or_names_the_file(case: tuple[str, bytes]) -> None:
    name, data = case
    count("plan JSON")
    model = "OPT-350M" if name == "sailor" else None  # a Sailor plan_config does not name its model
    with scratch({"plan.json": data}) as root:
        path = root / "plan.json"
        with loads_or_refuses("plan JSON", path):
            load_plan(path, model=model).to_json()
        if name != "sailor":  # Sailor's GPU types are not the local site's
            count("plan JSON on a site")
            with loads_or_refuses("plan JSON on a site", path):
                load_plan(path, site=LAB).to_json()


@settings(max_examples=examples(60))
@given(plan_files)
def test_plan_validate_exits_0_or_2_naming_the_file(case: tuple[str, bytes]) -> None:
    name, data = case
    count("plan JSON (CLI)")
    with scratch({"plan.json": data}) as root:
        args = ["--model", "OPT-350M"] if name == "sailor" else ["--site", str(LOCAL_LAB)]
        cli_exits_cleanly("plan JSON (CLI)", ["plan", "validate", str(root / "plan.json"), *args], root / "plan.json")
