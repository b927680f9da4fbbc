"""Several clusters and network islands in one site: who they are and the links between them.

A site may span several Slurm clusters (of one centre, a consortium, or a cloud's zones) and, inside a
cluster, network islands (partitions on different fabrics or dragonfly groups). Planning across them needs
what a single-cluster site never did: the measured links *between* clusters and islands (much slower than
inside one), with their latency, and the price of every byte that leaves a cluster (cloud egress, or a
consortium's accounting). ``[[clusters]]`` declares the clusters and how to reach each one's Slurm; a
partition names its ``cluster`` and optionally its ``island``; ``[[network.between]]`` entries name two
partitions, two islands or two clusters (the latter with ``cost_per_gb``).

A site without ``[[clusters]]`` is one cluster, as before, and reads unchanged.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sailor_hpc.core.fields import Fields
from sailor_hpc.core.network import LinkTable
from sailor_hpc.core.sbatch_values import slurm_word

_KINDS = ("partitions", "islands", "clusters")


@dataclass(frozen=True)
class Cluster:
    """One Slurm cluster of the site and how a job reaches it."""

    name: str
    slurm_cluster: str = ""  # `sbatch -M NAME` (a federation / multi-cluster set-up sharing one slurmdbd)
    slurm_conf: str = ""  # its own SLURM_CONF, for a cluster the login node's Slurm does not know

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name}
        if self.slurm_cluster:
            d["slurm_cluster"] = self.slurm_cluster
        if self.slurm_conf:
            d["slurm_conf"] = self.slurm_conf
        return d


@dataclass(frozen=True)
class Links:
    """Measured links between two partitions, two islands or two clusters, and egress prices."""

    partitions: dict[frozenset[str], LinkTable] = field(default_factory=dict)
    islands: dict[frozenset[str], LinkTable] = field(default_factory=dict)
    clusters: dict[frozenset[str], LinkTable] = field(default_factory=dict)
    cost_per_gb: dict[frozenset[str], float] = field(default_factory=dict)  # between clusters, site cost unit

    def to_list(self) -> list[dict[str, Any]]:
        """The ``[[network.between]]`` entries these links are written as."""
        out = []
        for kind in _KINDS:
            table: dict[frozenset[str], LinkTable] = getattr(self, kind)
            for pair, links in sorted(table.items(), key=lambda kv: sorted(kv[0])):
                d: dict[str, Any] = {kind: sorted(pair)}
                if links.latency_s:
                    d["latency_us"] = links.latency_s * 1e6
                if kind == "clusters" and pair in self.cost_per_gb:
                    d["cost_per_gb"] = self.cost_per_gb[pair]
                d["links"] = links.to_dict()
                out.append(d)
        return out


def parse_clusters(f: Fields, raw: list[Any], source: object | None) -> tuple[Cluster, ...]:
    """The ``[[clusters]]`` tables: unique names, at most one way to reach each Slurm."""
    out: list[Cluster] = []
    for i, entry in enumerate(raw):
        c = f.sub(f"clusters[{i}]", entry)
        name = c.req("name", str)
        slurm_word(name, c.name("name"), file=c.file)
        if name in {x.name for x in out}:
            raise c.error("name", f"cluster {name!r} is declared twice", fix="give every cluster its own name")
        cluster = c.opt("slurm_cluster", str, "")
        conf = c.opt("slurm_conf", str, "")
        c.done()
        if cluster and conf:
            raise c.error("slurm_conf", "give slurm_cluster (sbatch -M) or slurm_conf, not both",
                          fix="slurm_cluster when one slurmdbd knows every cluster, else slurm_conf")
        if cluster:
            slurm_word(cluster, c.name("slurm_cluster"), file=c.file)
        if conf and source is not None and not Path(conf).is_absolute():
            conf = str((Path(str(source)).parent / conf).resolve())
        out.append(Cluster(name=name, slurm_cluster=cluster, slurm_conf=conf))
    return tuple(out)


def parse_between(net: Fields, raw: list[Any], members: dict[str, set[str]], island_cluster: dict[str, str]) -> Links:
    """The ``[[network.between]]`` entries. ``members``: declared names per kind (partitions, islands,
    clusters); ``island_cluster``: each island's cluster (a link between islands stays inside one)."""
    tables: dict[str, dict[frozenset[str], LinkTable]] = {k: {} for k in _KINDS}
    prices: dict[frozenset[str], float] = {}
    for i, entry in enumerate(raw):
        b = net.sub(f"between[{i}]", entry)
        given = [k for k in _KINDS if k in b.data]
        if len(given) != 1:
            raise b.error(None, f"needs exactly one of {', '.join(_KINDS)} = [\"a\", \"b\"], got {given or 'none'}",
                          fix="name the two partitions, islands or clusters the link joins")
        kind = given[0]
        pair = b.req(kind, list)
        if len(pair) != 2 or not all(isinstance(p, str) and p in members[kind] for p in pair) or pair[0] == pair[1]:
            raise b.error(kind, f"must name two different declared {kind}, got {pair!r}",
                          fix=f"use two of {', '.join(sorted(members[kind])) or '(none declared)'}")
        if kind == "islands" and island_cluster[pair[0]] != island_cluster[pair[1]]:
            raise b.error(kind, f"islands {pair[0]!r} and {pair[1]!r} are in different clusters",
                          fix="describe the link between their clusters with clusters = [...]")
        key = frozenset(pair)
        if key in tables[kind]:
            raise b.error(kind, f"the link between {sorted(pair)} is given twice", fix="keep one entry")
        latency_us = b.opt("latency_us", float, 0.0)
        if latency_us < 0:
            raise b.error("latency_us", f"must be >= 0, got {latency_us}", fix="the measured one-way latency in µs")
        price = b.opt("cost_per_gb", float)
        if price is not None:
            if kind != "clusters":
                raise b.error("cost_per_gb", "is a price of bytes between clusters",
                              fix="move it to the entry with clusters = [...]")
            if price < 0:
                raise b.error("cost_per_gb", f"must be >= 0, got {price}", fix="give the price in the site's cost_unit")
            prices[key] = price
        tables[kind][key] = LinkTable.parse(b.sub("links", b.req("links", dict)), latency_s=latency_us * 1e-6)
        b.done()
    return Links(partitions=tables["partitions"], islands=tables["islands"], clusters=tables["clusters"],
                 cost_per_gb=prices)


def check_cluster_links(net: Fields, clusters: Sequence[Cluster], links: Links, used: set[str]) -> None:
    """Every two clusters holding partitions need a measured link: a plan across them is timed on it, and
    no partition's own network says anything about a WAN."""
    names = [c.name for c in clusters if c.name in used]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if frozenset((a, b)) not in links.clusters:
                raise net.error("between", f"no link between clusters {a!r} and {b!r}",
                                fix=f'measure it and add [[network.between]] with clusters = ["{a}", "{b}"], '
                                    'latency_us, cost_per_gb and its [network.between.links] fits')
