"""Site configs: the partitions of a SLURM site, their GPUs, network and cost (``site_configs/*.toml``).

A site is read with :func:`load_site` (TOML via tomllib) and validated field by field; every error
names the file and the field. ``docs/site-and-formats.md`` documents the format; ``site_configs/`` has examples.
"""
from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sailor_hpc.core.clusters import Cluster, Links, check_cluster_links, parse_between, parse_clusters
from sailor_hpc.core.container import Container, parse_container
from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.fields import Fields, read_text
from sailor_hpc.core.network import MAX_JITTER, LinkTable, NetworkFit, require_table
from sailor_hpc.core.precision import DTYPES, default_dtypes
from sailor_hpc.core.sbatch_values import constraint, parse_sbatch_option, slurm_word

SITE_SCHEMA_VERSION = 1
GIB = 1024**3
_MAX_MEMORY_GIB = 1e6  # far above any GPU's memory; bounds the byte count a typo could make
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_SLURM_TIME = re.compile(r"^(?:(?P<d>\d+)-)?(?P<rest>\d+(?::\d+){0,2})$")
#: what Slurm prints for a time without limit
UNLIMITED_TIMES = frozenset({"UNLIMITED", "INFINITE", "NONE", "N/A", ""})


def slurm_time_seconds(text: str) -> int | None:
    """Slurm time text in seconds; None for no limit (``UNLIMITED``, ``INFINITE``). The one parser of Slurm
    times in sailor-hpc: site configs, ``scontrol``'s partition limits and ``--time`` all go through it.

    Slurm's forms: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``. Raises ValueError otherwise."""
    t = text.strip()
    if t.upper() in UNLIMITED_TIMES:
        return None
    m = _SLURM_TIME.match(t)
    if not m:
        raise ValueError(f"{text!r} is not a Slurm time")
    parts = [int(x) for x in m.group("rest").split(":")]
    if m.group("d") is not None:  # D-H, D-H:M, D-H:M:S
        h, mi, s = (parts + [0, 0])[:3]
    elif len(parts) == 1:  # minutes
        h, mi, s = 0, parts[0], 0
    elif len(parts) == 2:  # M:S
        h, mi, s = 0, parts[0], parts[1]
    else:
        h, mi, s = parts
    return ((int(m.group("d") or 0) * 24 + h) * 60 + mi) * 60 + s


def format_slurm_time(seconds: int) -> str:
    """Seconds as Slurm prints a time: ``D-HH:MM:SS``, or ``HH:MM:SS`` under a day."""
    days, rest = divmod(int(seconds), 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text


def parse_walltime(text: str) -> int:
    """A limited Slurm time (``D-HH:MM:SS``, ``HH:MM:SS``, minutes, ...) in seconds; ValueError otherwise."""
    seconds = slurm_time_seconds(text)
    if seconds is None:
        raise ValueError(f"{text!r} is no time limit")
    return seconds


def memory_gib(memory_bytes: int) -> float:
    """A GPU's memory in GiB as a person writes it: the fewest decimals that read back to the same bytes
    (39.43, not the 39.42999999970198 that bytes / GiB gives after loading truncated 39.43 GiB to bytes)."""
    exact = memory_bytes / GIB
    for digits in range(10):
        if int(round(exact, digits) * GIB) == memory_bytes:
            return round(exact, digits)
    return exact


@dataclass(frozen=True)
class GpuType:
    name: str  # the key used in profile archives (e.g. "A100-40")
    memory_bytes: int
    aliases: tuple[str, ...] = ()
    peak_tflops: float | None = None
    dtypes: tuple[str, ...] = DTYPES  # what it trains in (site's `dtypes`, else from its name)


@dataclass(frozen=True)
class Partition:
    name: str
    gpu_type: str
    nodes: int
    gpus_per_node: int
    gres: str  # Slurm gres name, e.g. "gpu:a100"
    cpus_per_node: int
    memory_per_node_mb: int
    max_nodes_per_job: int
    cost_per_gpu_hour: float
    max_walltime: str | None = None
    intra_node: LinkTable | None = None
    inter_node: LinkTable | None = None
    # Coefficient of variation of one replica's compute time from node to node. Replicas that meet in
    # a gradient all-reduce wait for the slowest, so the wait grows with their number (the simulator's
    # straggler term). 0 = not measured: no wait modelled.
    replica_jitter: float = 0.0
    cluster: str = ""  # the [[clusters]] entry it belongs to ("" = the site is one cluster)
    island: str = ""  # network island inside its cluster ("" = none declared)

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def max_walltime_s(self) -> int | None:
        return None if self.max_walltime is None else parse_walltime(self.max_walltime)


@dataclass(frozen=True)
class SlurmDefaults:
    account: str = ""
    qos: str = ""
    constraint: str = ""
    extra_sbatch: tuple[str, ...] = ()


@dataclass(frozen=True)
class Site:
    name: str
    partitions: tuple[Partition, ...]
    gpu_types: dict[str, GpuType]
    cost_unit: str = "GPU-hours"
    slurm: SlurmDefaults = SlurmDefaults()
    prelude: tuple[str, ...] = ()
    container: Container | None = None  # the image every job's ranks run in (None: the nodes' own system)
    archive: str = ""  # path of the shared profile archive ("" = embedded default)
    source: str | None = None  # file it was read from
    clusters: tuple[Cluster, ...] = ()  # empty: one cluster, the default Slurm
    # measured links between partitions, islands and clusters, with egress prices
    links: Links = field(default_factory=Links)

    @property
    def between(self) -> dict[frozenset[str], LinkTable]:
        """The measured links between partition pairs."""
        return self.links.partitions

    def cluster_of(self, partition: str) -> str:
        """The cluster a partition belongs to ("" on a one-cluster site)."""
        return self.partition(partition).cluster

    def cluster(self, name: str) -> Cluster:
        for c in self.clusters:
            if c.name == name:
                return c
        raise SailorError(f"no cluster {name!r} in site {self.name!r}", file=self.source, field="clusters",
                          fix=f"use one of {', '.join(c.name for c in self.clusters) or '(none declared)'}")

    def egress_cost_per_gb(self, a: str, b: str) -> float:
        """Price (site cost unit) of one GB sent from partition a to partition b: 0 inside a cluster."""
        ca, cb = self.cluster_of(a), self.cluster_of(b)
        return 0.0 if ca == cb else self.links.cost_per_gb.get(frozenset((ca, cb)), 0.0)

    def partition(self, name: str) -> Partition:
        for p in self.partitions:
            if p.name == name:
                return p
        raise SailorError(f"no partition {name!r} in site {self.name!r}", file=self.source, field="partitions",
                          fix=f"use one of {', '.join(p.name for p in self.partitions)}")

    def gpu(self, name: str) -> GpuType:
        """A GPU type by name or alias."""
        for g in self.gpu_types.values():
            if name == g.name or name in g.aliases:
                return g
        raise SailorError(f"unknown GPU type {name!r}", file=self.source, field="gpu_types",
                          fix=f"declare it under [gpu_types] or use one of {', '.join(self.gpu_types)}")

    def partitions_with_gpu(self, gpu_type: str) -> list[Partition]:
        name = self.gpu(gpu_type).name
        return [p for p in self.partitions if p.gpu_type == name]

    def intra_node_fit(self, partition: str, senders: int) -> NetworkFit:
        p = self.partition(partition)
        return require_table(p.intra_node, f"partitions[{p.name}].network.intra_node", self.source).for_senders(senders)

    def inter_node_table(self, a: str, b: str) -> LinkTable:
        """Link between nodes of partitions a and b (same partition: its inter-node network)."""
        if a == b:
            p = self.partition(a)
            return require_table(p.inter_node, f"partitions[{p.name}].network.inter_node", self.source)
        explicit = self.between.get(frozenset((a, b)))
        if explicit is not None:
            return explicit
        pa, pb = self.partition(a), self.partition(b)
        if pa.cluster != pb.cluster:  # validated at load: every two clusters have a measured link
            return self.links.clusters[frozenset((pa.cluster, pb.cluster))]
        if pa.island and pb.island and pa.island != pb.island:
            table = self.links.islands.get(frozenset((pa.island, pb.island)))
            if table is not None:
                return table
        # no measured cross-partition link: the slower of the two partitions' own networks
        return self.inter_node_table(a, a).slowest(self.inter_node_table(b, b))

    def inter_node_fit(self, a: str, b: str, senders: int) -> NetworkFit:
        return self.inter_node_table(a, b).for_senders(senders)

    def to_dict(self) -> dict[str, Any]:
        """The TOML document this site would be written as (used by ``site show --json``)."""
        doc: dict[str, Any] = {"schema_version": SITE_SCHEMA_VERSION, "name": self.name, "cost_unit": self.cost_unit}
        doc["slurm"] = {"account": self.slurm.account, "qos": self.slurm.qos, "constraint": self.slurm.constraint,
                        "extra_sbatch": list(self.slurm.extra_sbatch)}
        doc["environment"] = {"prelude": list(self.prelude)}
        if self.container is not None:
            doc["environment"]["container"] = self.container.to_dict()
        doc["profiles"] = {"archive": self.archive}
        doc["gpu_types"] = {g.name: {"memory_gib": memory_gib(g.memory_bytes), "aliases": list(g.aliases),
                                     **({"peak_tflops": g.peak_tflops} if g.peak_tflops else {}),
                                     **({"dtypes": list(g.dtypes)} if g.dtypes != default_dtypes(g.name) else {})}
                            for g in self.gpu_types.values()}
        parts = []
        for p in self.partitions:
            d: dict[str, Any] = {k: getattr(p, k) for k in (
                "name", "gpu_type", "gres", "nodes", "gpus_per_node", "cpus_per_node", "memory_per_node_mb",
                "max_nodes_per_job", "cost_per_gpu_hour")}
            if p.max_walltime:
                d["max_walltime"] = p.max_walltime
            if p.replica_jitter:
                d["replica_jitter"] = p.replica_jitter
            for key in ("cluster", "island"):
                if getattr(p, key):
                    d[key] = getattr(p, key)
            net = {k: getattr(p, k).to_site_dict() for k in ("intra_node", "inter_node") if getattr(p, k)}
            if net:
                d["network"] = net
            parts.append(d)
        if self.clusters:
            doc["clusters"] = [c.to_dict() for c in self.clusters]
        doc["partitions"] = parts
        between = self.links.to_list()
        if between:
            doc["network"] = {"between": between}
        return doc


def _parse_gpu_types(f: Fields) -> dict[str, GpuType]:
    out: dict[str, GpuType] = {}
    for name, value in f.data.items():
        f.seen.add(name)
        if not _NAME.match(name):  # it names HDF5 groups in the shared profile archive and Slurm gres
            raise f.error(name, f"{name!r} is not a valid GPU type name",
                          fix="letters, digits, '_', '-', '.' (e.g. \"A100-40\"); put other spellings in aliases")
        g = f.sub(name, value)
        mem = g.req("memory_gib", float)
        if not 0 < mem <= _MAX_MEMORY_GIB:  # a typo of 1e308 would overflow the byte count
            raise g.error("memory_gib", f"must be positive and at most {_MAX_MEMORY_GIB:g} GiB, got {mem}",
                          fix="give the memory one GPU has, in GiB (e.g. 39.43 for an A100-40)")
        aliases = g.opt("aliases", list, [])
        peak = g.opt("peak_tflops", float)
        dtypes = g.opt("dtypes", list, list(default_dtypes(name)))
        g.done()
        if not all(isinstance(a, str) for a in aliases):
            raise g.error("aliases", "must be a list of strings")
        if not dtypes or any(d not in DTYPES for d in dtypes):
            raise g.error("dtypes", f"must list some of {', '.join(DTYPES)}, got {dtypes!r}",
                          fix=f"e.g. dtypes = {list(default_dtypes(name))!r}")
        out[name] = GpuType(name=name, memory_bytes=int(mem * GIB), aliases=tuple(aliases), peak_tflops=peak,
                            dtypes=tuple(d for d in DTYPES if d in dtypes))
    _check_aliases(f, out)
    return out


def _check_aliases(f: Fields, gpu_types: dict[str, GpuType]) -> None:
    """Every name a GPU type answers to must mean that type only. :meth:`Site.gpu` and a partition's
    ``gpu_type`` take the first type that answers, so an alias shared by two types, or equal to another
    type's name, would silently give a plan or partition the other GPU's memory and profiles."""
    owner = {name: name for name in gpu_types}  # names first: an alias may not take one, declared before or after
    for g in gpu_types.values():
        for alias in g.aliases:
            other = owner.setdefault(alias, g.name)
            if other != g.name:
                what = "the name" if other == alias else "an alias"
                raise f.error(f"{g.name}.aliases", f"alias {alias!r} of {g.name!r} is already {what} of GPU type "
                              f"{other!r}", fix=f"remove {alias!r} from one of the two, or rename it")


def _parse_partition(f: Fields, gpu_types: dict[str, GpuType], clusters: tuple[Cluster, ...]) -> Partition:
    name = f.req("name", str)
    if not _NAME.match(name):
        raise f.error("name", f"{name!r} is not a valid Slurm partition name", fix="letters, digits, '_', '-', '.'")
    gpu = f.req("gpu_type", str)
    matches = [g.name for g in gpu_types.values() if gpu == g.name or gpu in g.aliases]
    if not matches:
        raise f.error("gpu_type", f"GPU type {gpu!r} is not declared",
                      fix=f"add [gpu_types.\"{gpu}\"] with memory_gib, or use one of {', '.join(gpu_types) or '(none)'}")
    nodes = f.positive("nodes")
    gres = f.opt("gres", str, "gpu")
    if not re.match(r"^[A-Za-z0-9_]+(:[A-Za-z0-9_.-]+)?$", gres):
        raise f.error("gres", f"{gres!r} is not a Slurm gres name", fix='e.g. "gpu" or "gpu:a100"')
    walltime = f.opt("max_walltime", str)
    if walltime is not None:
        try:
            parse_walltime(walltime)
        except ValueError:
            raise f.error("max_walltime", f"{walltime!r} is not a Slurm time",
                          fix='use "D-HH:MM:SS", "HH:MM:SS" or minutes') from None
    cost = f.opt("cost_per_gpu_hour", float, 1.0)
    if cost < 0:
        raise f.error("cost_per_gpu_hour", f"must be >= 0, got {cost}")
    jitter = f.opt("replica_jitter", float, 0.0)
    if not 0.0 <= jitter < MAX_JITTER:
        raise f.error("replica_jitter", f"must be a fraction in [0, {MAX_JITTER}), got {jitter}",
                      fix="give the coefficient of variation of a replica's step time, e.g. 0.013 for 1.3 %")
    cluster = f.opt("cluster", str, "")
    names = [c.name for c in clusters]
    if clusters and cluster not in names:
        raise f.error("cluster", f"{cluster!r} is not a declared cluster" if cluster else "is missing",
                      fix=f"name the partition's cluster: one of {', '.join(names)}")
    if cluster and not clusters:
        raise f.error("cluster", f"names cluster {cluster!r} but the site declares no [[clusters]]",
                      fix=f'add [[clusters]] with name = "{cluster}", or remove the field')
    island = f.opt("island", str, "")
    if island and not _NAME.match(island):
        raise f.error("island", f"{island!r} is not a valid island name", fix="letters, digits, '_', '-', '.'")
    net = f.opt("network", dict, {})
    nf = f.sub("network", net)
    intra = nf.opt("intra_node", dict)
    inter = nf.opt("inter_node", dict)
    nf.done()
    part = Partition(
        name=name, gpu_type=matches[0], nodes=nodes, gpus_per_node=f.positive("gpus_per_node"), gres=gres,
        cpus_per_node=f.positive("cpus_per_node", 1), memory_per_node_mb=f.positive("memory_per_node_mb", 1),
        max_nodes_per_job=f.positive("max_nodes_per_job", nodes), cost_per_gpu_hour=cost, max_walltime=walltime,
        replica_jitter=jitter, cluster=cluster, island=island,
        intra_node=LinkTable.parse(nf.sub("intra_node", intra)) if intra is not None else None,
        inter_node=LinkTable.parse(nf.sub("inter_node", inter)) if inter is not None else None,
    )
    f.done()
    if part.max_nodes_per_job > part.nodes:
        raise f.error("max_nodes_per_job", f"{part.max_nodes_per_job} exceeds the partition's {part.nodes} nodes")
    return part


def _parse_slurm(f: Fields) -> SlurmDefaults:
    """The ``[slurm]`` defaults, checked with the job header's own rules (:mod:`sailor_hpc.core.sbatch_values`)
    now: every job of the site writes them into its ``#SBATCH`` lines, so a bad one is the site's error,
    reported by ``site validate``, not a surprise of the first render."""
    def checked(key: str, check: Callable[..., str]) -> str:
        value = f.opt(key, str, "")
        return check(value, f.name(key), file=f.file) if value else value

    account, qos = checked("account", slurm_word), checked("qos", slurm_word)
    feature = checked("constraint", constraint)
    extra = f.opt("extra_sbatch", list, [])
    for i, opt in enumerate(extra):
        parse_sbatch_option(opt, f.name(f"extra_sbatch[{i}]"), file=f.file)
    f.done()
    return SlurmDefaults(account=account, qos=qos, constraint=feature, extra_sbatch=tuple(extra))


def load_site_dict(data: dict[str, Any], source: object | None = None) -> Site:
    """Validate a parsed site document (TOML tables) and build a :class:`Site`."""
    f = Fields(data, file=source, path="")
    version = f.opt("schema_version", int, SITE_SCHEMA_VERSION)
    if version != SITE_SCHEMA_VERSION:
        raise f.error("schema_version", f"version {version} is not supported",
                      fix=f"this sailor-hpc reads schema_version = {SITE_SCHEMA_VERSION}")
    name = f.req("name", str)
    if not _NAME.match(name):
        raise f.error("name", f"{name!r} is not a valid site name", fix="letters, digits, '_', '-', '.'")
    gpu_types = _parse_gpu_types(f.sub("gpu_types", f.req("gpu_types", dict)))
    raw_parts = f.req("partitions", list)
    if not raw_parts:
        raise f.error("partitions", "is empty", fix="add at least one [[partitions]] table")
    clusters = parse_clusters(f, f.opt("clusters", list, []), source)
    parts = tuple(_parse_partition(f.sub(f"partitions[{i}]", p), gpu_types, clusters) for i, p in enumerate(raw_parts))
    seen: set[str] = set()
    for i, p in enumerate(parts):
        if p.name in seen:
            raise f.error(f"partitions[{i}].name", f"partition {p.name!r} is declared twice")
        seen.add(p.name)
    defaults = _parse_slurm(f.sub("slurm", f.opt("slurm", dict, {})))
    env = f.sub("environment", f.opt("environment", dict, {}))
    prelude = env.opt("prelude", list, [])
    raw_container = env.opt("container", dict)
    container = None if raw_container is None else parse_container(env.sub("container", raw_container), source)
    env.done()
    if not all(isinstance(line, str) for line in prelude):
        raise f.error("environment.prelude", "must be a list of shell lines (strings)")
    prof = f.sub("profiles", f.opt("profiles", dict, {}))
    archive = prof.opt("archive", str, "")
    prof.done()
    if archive and source is not None and not Path(archive).is_absolute():
        archive = str((Path(str(source)).parent / archive).resolve())
    island_cluster = _island_clusters(f, parts)
    net = f.sub("network", f.opt("network", dict, {}))
    links = parse_between(net, net.opt("between", list, []),
                          {"partitions": seen, "islands": set(island_cluster), "clusters": {c.name for c in clusters}},
                          island_cluster)
    check_cluster_links(net, clusters, links, {p.cluster for p in parts})
    net.done()
    cost_unit = f.opt("cost_unit", str, "GPU-hours")
    f.done()
    return Site(name=name, partitions=parts, gpu_types=gpu_types, cost_unit=cost_unit,
                slurm=defaults, prelude=tuple(prelude), container=container, archive=archive,
                source=None if source is None else str(source), clusters=clusters, links=links)


def _island_clusters(f: Fields, parts: tuple[Partition, ...]) -> dict[str, str]:
    """Each island's cluster; an island is a fabric inside one cluster, so it cannot span two."""
    out: dict[str, str] = {}
    for i, p in enumerate(parts):
        if p.island and out.setdefault(p.island, p.cluster) != p.cluster:
            raise f.error(f"partitions[{i}].island", f"island {p.island!r} is already in cluster {out[p.island]!r}, "
                          f"not {p.cluster!r}", fix="name islands per cluster (e.g. \"<cluster>-fabric1\")")
    return out


def load_site(path: str | Path) -> Site:
    """Read and validate a site TOML file."""
    path = Path(path)
    try:
        data = tomllib.loads(read_text(path, missing_fix="pass the path of a site TOML (see site_configs/)"))
    except tomllib.TOMLDecodeError as exc:
        raise SailorError(f"not valid TOML: {exc}", file=path, fix="fix the TOML syntax") from None
    return load_site_dict(data, source=path)
