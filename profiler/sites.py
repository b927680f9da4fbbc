"""A site whose network fits come from a sweep's measurements (torch-free), for the simulator and planner.

The simulator reads bandwidth from the site (``site.intra_node_fit`` / ``inter_node_fit``); a sweep stores
its fits in the archive (``network/<site key>/...``). :func:`measured_site` lays the measured fits over
the site's own (a measured (link, k) replaces the configured one; links not measured keep theirs), and,
for a CPU sweep, renames the GPU types to the ``cpu-`` keys the compute profiles were recorded under,
so ``simulate(plan, measured_site(...), archive)`` prices a plan entirely from CPU measurements. The site
keeps its name: the planner reads fits from the site, never by the site's name from the archive.
``sailor-hpc profile --write-site FILE`` writes the result as an edit of the site's TOML
(:mod:`sailor_hpc.core.site_edit`).
"""
from __future__ import annotations

from dataclasses import replace

from profiler.keys import device_key, network_site_key
from sailor_hpc.core.archive import ProfileArchive
from sailor_hpc.core.network import LinkTable, NetworkFit
from sailor_hpc.core.site import Site


def _overlay(table: LinkTable | None, fits: dict[int, NetworkFit]) -> LinkTable | None:
    """``fits`` over ``table``'s (no fits: the table as it is, None included)."""
    return _laid_over(table, fits) if fits else table


def _laid_over(table: LinkTable | None, fits: dict[int, NetworkFit]) -> LinkTable:
    return LinkTable({**(table.fits if table is not None else {}), **fits})


def measured_site(site: Site, archive: ProfileArchive, *, cpu: bool) -> Site:
    key = network_site_key(site.name, cpu)
    intra: dict[str, dict[int, NetworkFit]] = {}
    inter: dict[str, dict[int, NetworkFit]] = {}
    between: dict[frozenset[str], dict[int, NetworkFit]] = {}
    for e in archive.network.get(key, []):
        if e.kind == "intra":
            intra.setdefault(e.a, {})[e.senders] = e.fit
        elif e.a == e.b:
            inter.setdefault(e.a, {})[e.senders] = e.fit
        else:
            between.setdefault(frozenset((e.a, e.b)), {})[e.senders] = e.fit
    gpu_types = {device_key(n, cpu): (replace(g, name=device_key(n, cpu), aliases=()) if cpu else g)
                 for n, g in site.gpu_types.items()}
    parts = tuple(replace(p, gpu_type=device_key(p.gpu_type, cpu), intra_node=_overlay(p.intra_node, intra.get(p.name, {})),
                          inter_node=_overlay(p.inter_node, inter.get(p.name, {}))) for p in site.partitions)
    links = dict(site.between)
    for pair, fits in between.items():
        links[pair] = _laid_over(links.get(pair), fits)  # a measured pair has at least one fit
    return replace(site, gpu_types=gpu_types, partitions=parts,
                   links=replace(site.links, partitions=links))

