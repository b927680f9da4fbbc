"""An archive's content in memory and the questions the simulator, planner and profiler ask of it: which
models, GPU types and dtypes were profiled, a profile's points, a memory table, a GPU type's fixed overhead.
Every missing answer is a SailorError naming the archive and the command that fills the gap."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from sailor_hpc.core.archive.entries import ComputeEntry, ComputeKey, Entry, MemoryEntry, NetworkEntry, OverheadEntry
from sailor_hpc.core.errors import SailorError


@dataclass
class ProfileArchive:
    """An archive's content in memory (archives are small: a few MB for every model and GPU)."""

    # a profile per (model, GPU type, dtype): the simulator never takes one dtype's times for another's
    compute: dict[ComputeKey, dict[tuple[int, int], ComputeEntry]] = field(default_factory=dict)
    failed: dict[ComputeKey, dict[tuple[int, int], ComputeEntry]] = field(default_factory=dict)
    memory: dict[str, dict[int, MemoryEntry]] = field(default_factory=dict)
    overhead: dict[str, OverheadEntry] = field(default_factory=dict)
    network: dict[str, list[NetworkEntry]] = field(default_factory=dict)
    sources: tuple[str, ...] = ()

    # ------------------------------------------------------------------ queries
    def models(self) -> list[str]:
        return sorted({m for m, _, _ in self.compute} | set(self.memory))

    def gpus(self, model: str, dtype: str | None = None) -> list[str]:
        """GPU types with a compute profile of ``model`` (in ``dtype``, or in any)."""
        return sorted({g for m, g, d in self.compute if m == model and dtype in (None, d)})

    def dtypes(self, model: str, gpu: str) -> list[str]:
        """The dtypes ``model`` was profiled in on ``gpu``."""
        return sorted(d for m, g, d in self.compute if (m, g) == (model, gpu))

    def has_compute(self, model: str, gpu: str, dtype: str = "fp32") -> bool:
        return (model, gpu, dtype) in self.compute

    def compute_points(self, model: str, gpu: str, dtype: str = "fp32") -> dict[tuple[int, int], ComputeEntry]:
        """(mbs, tp) -> entry of every measured point; raises if the triple was never profiled."""
        try:
            return self.compute[(model, gpu, dtype)]
        except KeyError:
            other = self.dtypes(model, gpu)
            if other:
                raise SailorError(f"{model} on {gpu} is profiled in {', '.join(other)}, not {dtype}", file=self.where,
                                  field=f"compute/{model}/{gpu}",
                                  fix=f"profile {dtype} (`sailor-hpc profile --model {model} --dtype {dtype}`) "
                                      f"or plan in {' or '.join(other)} (--dtype)") from None
            have = ", ".join(self.gpus(model)) or "none"
            raise SailorError(f"no compute profile for model {model} on {gpu} (profiled GPUs: {have})",
                              file=self.where, field=f"compute/{model}/{gpu}",
                              fix=f"run `sailor-hpc profile --model {model}` on a {gpu} partition") from None

    def memory_table(self, model: str, tp: int) -> MemoryEntry:
        tables = self.memory.get(model)
        if not tables:
            raise SailorError(f"no memory profile for model {model}", file=self.where, field=f"memory/{model}",
                              fix=f"run `sailor-hpc profile --model {model}`")
        if tp not in tables:
            raise SailorError(f"no memory profile for {model} at TP {tp} (have TP {sorted(tables)})",
                              file=self.where, field=f"memory/{model}/tp{tp}",
                              fix=f"profile TP {tp} (`sailor-hpc profile --tp {tp}`) or use a profiled TP")
        return tables[tp]

    def overhead_tp(self, gpu: str, tp: int) -> int:
        """The measured TP degree whose fixed overhead stands for ``tp`` on ``gpu``.

        The rule: ``tp`` itself if it was measured, else the largest measured degree below it, else (``tp``
        below every measured degree) the smallest measured one. Why: the fixed memory grows with TP (a TP
        group adds its communicator's buffers, a larger group more channels), so the nearest degree below
        is the closest measurement of the same kind of set-up, and where there is none below, the next one
        above errs on the safe side (a plan is refused, never sent out of memory). A GPU type without any
        recorded overhead is an error (never 0): its plans would look smaller than they are.

        The table of one GPU type comes whole from one archive: every profiling job adds its TP degree to
        the GPU's table in its archive (:func:`~sailor_hpc.core.archive.shards.write_entries`), and a front
        archive's table hides the embedded estimates of that GPU type entirely, so measured and estimated
        degrees are never mixed (Sailor's estimates include other ranks' CUDA contexts that a runtime binding
        its devices first does not pay).
        """
        entry = self.overhead.get(gpu)
        if entry is None or not entry.by_tp:
            raise SailorError(f"no fixed memory overhead recorded for {gpu}", file=self.where,
                              field=f"overhead/{gpu}", fix=f"run `sailor-hpc profile` on a {gpu} partition")
        below = [t for t in entry.by_tp if t <= tp]
        return max(below) if below else min(entry.by_tp)

    def overhead_bytes(self, gpu: str, tp: int) -> float:
        """Fixed per-GPU memory (bytes) of one GPU of a TP-``tp`` group, by the rule of :meth:`overhead_tp`."""
        measured = self.overhead_tp(gpu, tp)
        return self.overhead[gpu].by_tp[measured]

    @property
    def where(self) -> str:
        return " + ".join(self.sources) or "<empty archive>"

    def entries(self) -> Iterable[Entry]:
        for table in (self.compute, self.failed):
            for points in table.values():
                yield from points.values()
        for tables in self.memory.values():
            yield from tables.values()
        yield from self.overhead.values()
        for links in self.network.values():
            yield from links

    # ------------------------------------------------------------------ building
    def add(self, entry: Entry, *, override: bool = True) -> None:
        if isinstance(entry, ComputeEntry):
            key = entry.key
            good, bad = self.compute.setdefault(key, {}), self.failed.setdefault(key, {})
            point = (entry.mbs, entry.tp)
            if not override and (point in good or point in bad):
                return
            good.pop(point, None)
            bad.pop(point, None)
            (good if entry.status == "ok" else bad)[point] = entry
            if not bad:
                del self.failed[key]
            if not good:
                del self.compute[key]
        elif isinstance(entry, MemoryEntry):
            tables = self.memory.setdefault(entry.model, {})
            if override or entry.tp not in tables:
                tables[entry.tp] = entry
        elif isinstance(entry, OverheadEntry):
            if override or entry.gpu not in self.overhead:
                self.overhead[entry.gpu] = entry
        else:
            links = self.network.setdefault(entry.site, [])
            same = [e for e in links if e.path == entry.path]
            if same and not override:
                return
            links[:] = [e for e in links if e.path != entry.path] + [entry]
