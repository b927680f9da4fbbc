"""Write a changed site back into its TOML text the way a person left it.

A site file is edited by people: comments explain a number, keys sit in an order that reads well, a GPU
type is spelled by an alias, a memory is written ``39.43``. A command that updates the site (measured
network fits, GPU types renamed to the keys a CPU sweep recorded under, the archive it filled) must change
those fields and nothing else, and say what it changed. :func:`edit_site_text` does this over a tomlkit
round trip: the old and the new site are compared as documents (:meth:`Site.to_dict`), and only the
fields whose value differs are rewritten in the original text (a replaced value keeps its comment);
fields added go to the end of their table, fields removed are deleted. The result is read back and must
load to the new site, field for field, before :func:`write_site_edit` replaces the file (atomically).

Numbers keep the precision they carry: a memory as the fewest decimals that load to the same bytes
(:func:`sailor_hpc.core.site.memory_gib`), a measured fit as the archive holds it, so that the site's
fit and the archive's are the same number.
"""
from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import tomlkit
from tomlkit.container import Container
from tomlkit.items import AoT, InlineTable, KeyType, SingleKey, Table, Whitespace

from sailor_hpc.core.atomic import atomic_write_text
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.site import Site, load_site_dict

_ABSENT = object()
_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# keys whose values are bandwidth fits keyed by the number of senders: written inline, one line per fit,
# as the shipped sites write them
_FIT_TABLES = frozenset({"intra_node", "inter_node", "links"})


@dataclass(frozen=True)
class Change:
    """One field that a write changed: its path in the document, and the value before and after (None:
    absent)."""

    field: str
    old: Any
    new: Any

    def describe(self) -> str:
        return f"{self.field}: {_show(self.old)} -> {_show(self.new)}"


@dataclass(frozen=True)
class SiteEdit:
    text: str
    changes: tuple[Change, ...]


def _show(value: Any) -> str:
    """A value for a person: floats to 4 significant digits (the file keeps every digit)."""
    if value is None or value is _ABSENT:
        return "(absent)"
    if isinstance(value, float):
        return f"{value:.0f}" if value.is_integer() and abs(value) < 1e15 else f"{value:.4g}"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_label('', k, None)} = {_show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, Sequence):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return str(value)


def _same(a: Any, b: Any) -> bool:
    """Equal as a site reads them: an int and the float of the same value are one number."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _is_table_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, Mapping) for v in value)


def _label(path: str, key: str | int, item: Any) -> str:
    """A field's path as the site's errors name it: ``partitions[a100].network.intra_node."2"``."""
    if isinstance(key, int):
        name = item.get("name") if isinstance(item, Mapping) else None
        return f"{path}[{name if name else key}]"
    text = key if key.replace("_", "").replace("-", "").isalnum() and not key.isdigit() else f'"{key}"'
    return f"{path}.{text}" if path else text


def _table_key(i: int, table: Mapping[str, Any]) -> Any:
    """Which table of an array of tables one is: its name ([[partitions]]), else its place."""
    return table.get("name", i)


def _is_fit(value: Any) -> bool:
    return isinstance(value, Mapping) and ("coeffs" in value or "constant_gbps" in value)


def _diff(old: Any, new: Any, path: str, out: list[Change]) -> None:
    """Leaf-level changes from ``old`` to ``new`` (documents of :meth:`Site.to_dict`); a fit is one leaf."""
    if _same(old, new):
        return
    if old is _ABSENT and isinstance(new, Mapping) and new and not _is_fit(new):
        old = {}
    if new is _ABSENT and isinstance(old, Mapping) and old and not _is_fit(old):
        new = {}
    if isinstance(old, Mapping) and isinstance(new, Mapping) and not (_is_fit(old) or _is_fit(new)):
        for k in new:
            _diff(old.get(k, _ABSENT), new[k], _label(path, k, None), out)
        for k in old:
            if k not in new:
                _diff(old[k], _ABSENT, _label(path, k, None), out)
        return
    if _is_table_list(old) and _is_table_list(new):  # matched as _apply_tables matches them
        before = {_table_key(i, t): t for i, t in enumerate(old)}
        after = {_table_key(i, t): t for i, t in enumerate(new)}
        for i, t in enumerate(new):
            k = _table_key(i, t)
            if k in before:
                _diff(before[k], t, _label(path, i, t), out)
            else:
                out.append(Change(_label(path, i, t), None, t))
        out += [Change(_label(path, i, t), t, None) for i, t in enumerate(old) if _table_key(i, t) not in after]
        return
    out.append(Change(path, None if old is _ABSENT else old, None if new is _ABSENT else new))


def _inline(value: Mapping[str, Any]) -> InlineTable:
    t = tomlkit.inline_table()
    t.update({k: v for k, v in value.items()})
    return t


def _key(name: str) -> str | SingleKey:
    """A key as the shipped sites write it: quoted unless it is a plain word ("2", "A100-40", but nodes)."""
    return name if _WORD.match(name) else SingleKey(name, t=KeyType.Basic)


def _item(key: str, value: Any) -> Any:
    """A new value as tomlkit writes it: fits inline, other tables as tables, lists of tables as [[...]]."""
    if isinstance(value, Mapping):
        if key in _FIT_TABLES:
            t = tomlkit.table(is_super_table=False)
            for k, v in value.items():  # fits inline; a table's measured latencies are plain numbers
                t[_key(k)] = _inline(v) if isinstance(v, Mapping) else v
            return t
        t = tomlkit.table(is_super_table=bool(value) and all(isinstance(v, Mapping) for v in value.values()))
        for k, v in value.items():
            t[_key(k)] = _item(k, v)
        if not t.is_super_table():
            t.add(tomlkit.nl())  # a blank line before the next table, as people write them
        return t
    if _is_table_list(value):
        aot = tomlkit.aot()
        for v in value:
            aot.append(_item("", v))
        return aot
    return value


def _rename(table: Table, old: str, new: str) -> None:
    """Rename a sub-table in place, keeping its position, comments and the quoting of its header.

    tomlkit has no public rename; ``Container._replace`` (kept since tomlkit 0.7) replaces a key at its
    position, but adds a blank line after the table, which is taken off again here."""
    sub = table[old]
    assert isinstance(sub, Table)
    had_blank = bool(sub.value.body) and isinstance(sub.value.body[-1][1], Whitespace)
    shown = sub.display_name or ""
    quoted = shown.endswith(f'"{old}"')
    sub.name = new
    sub.display_name = (shown[: -len(old) - 2] + f'"{new}"' if quoted else None) if shown else None
    container: Container = table.value
    container._replace(old, new, sub)
    body = sub.value.body
    if not had_blank and body and isinstance(body[-1][1], Whitespace) and body[-1][0] is None:
        body.pop()


def _apply(table: Any, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    """Rewrite in ``table`` (a tomlkit table or document) the fields that differ from ``old`` to ``new``."""
    for key, value in new.items():
        before = old.get(key, _ABSENT)
        if _same(before, value):
            continue
        here = table.get(key) if key in table else None
        if isinstance(value, Mapping) and isinstance(before, Mapping) and isinstance(here, Table | InlineTable):
            if key in _FIT_TABLES or isinstance(here, InlineTable):
                _apply_fits(here, before, value)
            else:
                _apply(here, before, value)
        elif _is_table_list(value) and _is_table_list(before) and isinstance(here, AoT) and len(here) == len(before):
            _apply_tables(here, before, value)
        else:
            table[_key(key)] = _item(key, value)
    for key in old:
        if key not in new and key in table:
            del table[key]


def _apply_tables(tables: AoT, old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> None:
    """An array of tables ([[partitions]]): a table that stays (the same name, or the same place where the
    tables have no names) is edited in place, a new one appended, one that went deleted."""
    key = _table_key
    before = {key(i, t): (i, t) for i, t in enumerate(old)}
    after = {key(i, t) for i, t in enumerate(new)}
    for k in sorted((k for k in before if k not in after), key=lambda k: -before[k][0]):
        del tables[before[k][0]]
    for i, t in enumerate(new):
        k = key(i, t)
        if k in before:
            at = sorted(j for j, _ in before.values() if key(j, old[j]) in after).index(before[k][0])
            _apply(tables[at], before[k][1], t)
        else:
            last = tables[-1].value.body if len(tables) else []
            if last and not isinstance(last[-1][1], Whitespace):
                tables[-1].add(tomlkit.nl())  # a blank line between the last table and the new one
            tables.append(_item("", t))


def _apply_fits(table: Table | InlineTable, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    """A table of fits: a changed fit is written whole, inline, in its line."""
    for key, value in new.items():
        if not _same(old.get(key, _ABSENT), value):
            table[_key(key)] = _inline(value) if isinstance(value, Mapping) else value
    for key in old:
        if key not in new and key in table:
            del table[key]


def edit_site_text(text: str, old: Site, new: Site, *, renamed_gpu_types: Mapping[str, str] | None = None,
                   path_text: Mapping[str, str] | None = None) -> SiteEdit:
    """``text`` (the TOML of ``old``) changed into ``new``'s, keeping everything of ``text`` that did not change.

    ``renamed_gpu_types``: old name -> new name of GPU types that ``new`` renamed (their tables keep their place
    and comments). ``path_text``: how to write path fields that changed (``profiles.archive``: relative to
    the file where it is under the file's folder), by the absolute path ``new`` holds."""
    renamed = dict(renamed_gpu_types or {})
    doc = tomlkit.parse(text)
    before = old.to_dict()
    after = new.to_dict()
    for a, b in renamed.items():  # the old document under the new names: only real changes remain
        if a in before["gpu_types"] and a != b:
            before["gpu_types"] = {(b if k == a else k): v for k, v in before["gpu_types"].items()}
            types = doc.get("gpu_types")
            if isinstance(types, Table) and a in types:
                _rename(types, a, b)
    changes = [Change(f"{_label('gpu_types', a, None)} (renamed)", a, b) for a, b in renamed.items() if a != b]
    written = dict(after)
    if path_text and "profiles" in after:
        archive = after["profiles"].get("archive", "")
        written["profiles"] = {**after["profiles"], "archive": path_text.get(archive, archive)}
    diff: list[Change] = []
    _diff(before, after, "", diff)
    changes += [replace(c, new=written["profiles"]["archive"]) if c.field == "profiles.archive" else c for c in diff]
    _apply(doc, before, written)
    return SiteEdit(tomlkit.dumps(doc), tuple(changes))


def archive_text(archive: str, site_file: Path) -> str:
    """How a site at ``site_file`` names ``archive``: relative to the site's folder when it is inside it
    (the site and its archive move together), else absolute."""
    if not archive:
        return archive
    folder = Path(os.path.realpath(site_file)).parent
    path = Path(os.path.realpath(archive))
    return str(path.relative_to(folder)) if path.is_relative_to(folder) else str(path)


def write_site_edit(target: Path, source_text: str, old: Site, new: Site, *,
                    renamed_gpu_types: Mapping[str, str] | None = None) -> tuple[Change, ...]:
    """Write ``new`` into ``target`` as an edit of ``source_text`` (the TOML of ``old``, read as if it were at
    ``target``, so that relative paths mean the same); atomic. Returns what changed.

    The written text must load to ``new`` (every field of :meth:`Site.to_dict`): a write that would not is
    refused, and nothing is written."""
    edit = edit_site_text(source_text, old, new, renamed_gpu_types=renamed_gpu_types,
                          path_text={new.archive: archive_text(new.archive, target)})
    try:
        back = load_site_dict(tomllib.loads(edit.text), source=target)
    except (tomllib.TOMLDecodeError, SailorError) as exc:  # a bug of the edit, not of the user's input
        raise RuntimeError(f"the edited site does not load ({exc}); nothing was written to {target}") from exc
    if not _same(back.to_dict(), new.to_dict()):
        raise RuntimeError(f"the edited site does not read back as the site to write; nothing was written to {target}")
    atomic_write_text(target, edit.text)
    return edit.changes


def load_site_text(text: str, at: Path) -> Site:
    """The site of ``text`` as if its file were ``at`` (relative archive paths resolve against ``at``'s folder)."""
    return load_site_dict(tomllib.loads(text), source=at)
