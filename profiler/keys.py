"""What a sweep measures and under which archive keys (torch-free: the driver runs on a login node).

CPU measurements never hide GPU profiles. On the local test cluster the partitions' GPU types
(A100-40, V100-16) are labels on CPU nodes, so a sweep run with ``--cpu``

- records compute and overhead under ``cpu-<GPU type>`` (e.g. ``cpu-A100-40``) and network fits under
  the site name ``cpu-<site>``, with ``device = "cpu"`` in every provenance;
- must write to an explicit ``--archive`` that is neither the site's shared archive nor the embedded one
  (memory tables are keyed by model and TP only, so this is what keeps them apart).

To plan or simulate with CPU profiles, use :func:`profiler.sites.measured_site` (GPU types renamed to
the ``cpu-`` keys, network fits from the measurements).
"""
from __future__ import annotations

from dataclasses import dataclass

CPU_PREFIX = "cpu-"


def device_key(gpu_type: str, cpu: bool) -> str:
    """The archive's GPU key for measurements of ``gpu_type`` nodes (``cpu-`` prefixed on CPU)."""
    return f"{CPU_PREFIX}{gpu_type}" if cpu else gpu_type


def network_site_key(site_name: str, cpu: bool) -> str:
    return f"{CPU_PREFIX}{site_name}" if cpu else site_name


@dataclass(frozen=True)
class ComputePoint:
    partition: str
    gpu_key: str
    mbs: int
    tp: int

    @property
    def key(self) -> str:
        return f"compute:{self.partition}:mbs{self.mbs}:tp{self.tp}"


@dataclass(frozen=True)
class NetworkLink:
    """One network measurement: ``intra`` inside a node of a, ``inter`` between nodes of a and b (a == b:
    two nodes of one partition; a != b: a het job over both partitions); ``senders`` streams at once."""

    kind: str
    a: str
    b: str
    senders: int

    @property
    def key(self) -> str:
        return f"network:{self.kind}:{self.a}:{self.b}:k{self.senders}"

    @property
    def het(self) -> bool:
        return self.a != self.b
