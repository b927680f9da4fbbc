"""The merge of an archive's files: per entry (per TP row of an overhead table) a measured compute point
beats a failed one, else the newest ``written`` stamp wins, ties broken by content. Commutative,
associative and idempotent, so reading a file twice, or an old copy beside a new one, never changes the
result (:mod:`sailor_hpc.core.archive.shards` rests its concurrency on this)."""
from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable
from dataclasses import dataclass

from sailor_hpc.core.archive.entries import ComputeEntry, Entry, OverheadEntry


@dataclass(frozen=True)
class Atom:
    """The unit of the merge: one entry (of an overhead table, one TP row) with the stamp of its write."""

    key: str  # the HDF5 path (an overhead row: path#tp<T>)
    rank: int  # 1 for a measured compute point: it beats a failed one whatever their stamps
    stamp: str
    entry: Entry

    def beats(self, other: Atom) -> bool:
        if (self.rank, self.stamp) != (other.rank, other.stamp):
            return (self.rank, self.stamp) > (other.rank, other.stamp)
        return self._digest() >= other._digest()  # equal stamps: the same write, or two unstamped copies

    @property
    def row(self) -> int:
        """The TP degree of an overhead row (the order of a table's rows)."""
        return min(self.entry.by_tp) if isinstance(self.entry, OverheadEntry) else 0

    def _digest(self) -> str:
        return hashlib.sha256(pickle.dumps(self.entry, protocol=4)).hexdigest()


View = dict[str, Atom]


def join(view: View, atoms: Iterable[Atom]) -> None:
    for atom in atoms:
        held = view.get(atom.key)
        if held is None or atom.beats(held):
            view[atom.key] = atom


def merged_entries(view: View) -> list[Entry]:
    """The merged entries; an overhead table's rows gathered again (provenance: its newest row's)."""
    out: list[Entry] = []
    tables: dict[str, list[tuple[int, str, OverheadEntry]]] = {}
    for atom in view.values():
        if isinstance(atom.entry, OverheadEntry):
            tables.setdefault(atom.entry.gpu, []).append((atom.row, atom.stamp, atom.entry))
        else:
            out.append(atom.entry)
    for gpu, rows in tables.items():
        newest = max(rows, key=lambda r: r[1])[2]
        by_tp = {tp: e.by_tp[tp] for tp, _, e in sorted(rows, key=lambda r: r[0])}
        out.append(OverheadEntry(gpu, by_tp, newest.provenance))
    return out


def entry_atoms(entry: Entry, seq: str) -> list[Atom]:
    """An entry as merge atoms, stamped with its place in the write (the write's id is added when its shard is stamped)."""
    if isinstance(entry, OverheadEntry):
        return [Atom(f"{entry.path}#tp{tp}", 0, seq, OverheadEntry(entry.gpu, {int(tp): float(b)}, entry.provenance))
                for tp, b in entry.by_tp.items()]
    return [Atom(entry.path, int(isinstance(entry, ComputeEntry) and entry.status == "ok"), seq, entry)]
