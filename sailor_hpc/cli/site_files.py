"""Site files that commands write: an edit of the file the user gave (comments, names, order and numbers
kept; :mod:`sailor_hpc.core.site_edit`), and a report of every field that changed, old -> new."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sailor_hpc.core.fields import read_text
from sailor_hpc.core.site import Site
from sailor_hpc.core.site_edit import Change, load_site_text, write_site_edit


def write_site_file(target: Path, source: Path, new: Site, *,
                    renamed_gpu_types: Mapping[str, str] | None = None) -> tuple[Change, ...]:
    """``new`` written to ``target`` as an edit of ``source``'s text (``target`` may be ``source``)."""
    text = read_text(source, missing_fix="pass the path of a site TOML (see site_configs/)")
    return write_site_edit(target, text, load_site_text(text, target), new, renamed_gpu_types=renamed_gpu_types)


def written_lines(target: Path, source: Path | None, changes: Sequence[Change]) -> list[str]:
    """What a person reads after a site was written: the file, what it came from, and each change."""
    origin = "" if source is None or Path(source).resolve() == Path(target).resolve() else f" (edited from {source})"
    if not changes:
        return [f"wrote {target}{origin}: no field changed"]
    return [f"wrote {target}{origin}: {len(changes)} field(s) changed",
            *(f"  {c.describe()}" for c in changes)]


def written_json(target: Path, source: Path | None, changes: Sequence[Change]) -> dict[str, Any]:
    return {"file": str(target), "from": None if source is None else str(source),
            "changes": [{"field": c.field, "old": c.old, "new": c.new} for c in changes]}
