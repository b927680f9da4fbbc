"""Site TOML: every shipped site config, mutated, through ``load_site`` and ``sailor-hpc site show``."""
from __future__ import annotations

import tomllib
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from sailor_hpc.core.site import load_site
from sailor_hpc.core.toml_writer import dump_toml
from tests.data import SITE_CONFIGS
from tests.fuzz.harness import cli_exits_cleanly, count, examples, loads_or_refuses, mutated_bytes, mutated_doc, scratch

SITES = {p.name: p for p in sorted(SITE_CONFIGS.glob("*.toml"))}
DOCS = {name: tomllib.loads(p.read_text()) for name, p in SITES.items()}
LAB_TEXT = SITES["local-lab.toml"].read_bytes()


def _as_toml(doc: dict[str, Any]) -> bytes:
    return dump_toml(doc).encode()


#: a shipped site, its TOML mutated field by field (then written as TOML) or byte by byte
site_files = st.one_of(
    st.sampled_from(sorted(DOCS)).flatmap(lambda n: mutated_doc(DOCS[n], keep_root_table=True)).map(_as_toml),
    st.sampled_from(sorted(SITES)).flatmap(lambda n: mutated_bytes(SITES[n].read_bytes())),
)


@settings(max_examples=examples(250))
@given(site_files)
@example(LAB_TEXT.replace(b"memory_gib = 16", b"memory_gib = 1e308"))  # was an OverflowError
def test_load_site_loads_or_names_the_file(data: bytes) -> None:
    count("site TOML")
    with scratch({"site.toml": data}) as root, loads_or_refuses("site TOML", root / "site.toml"):
        load_site(root / "site.toml").to_dict()  # the document `site show --json` prints


@settings(max_examples=examples(60))
@given(site_files)
def test_site_show_exits_0_or_2_naming_the_file(data: bytes) -> None:
    count("site TOML (CLI)")
    with scratch({"site.toml": data}) as root:
        cli_exits_cleanly("site TOML (CLI)", ["site", "show", str(root / "site.toml")], root / "site.toml")
