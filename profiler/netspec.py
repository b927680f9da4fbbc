"""What a network benchmark step measures (:mod:`profiler.netbench`), apart from the benchmark itself:
the network job's driver writes it without importing torch, which only the benchmark's ranks need."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class NetSpec:
    kind: str  # "intra" or "inter"
    senders: int
    sizes: tuple[int, ...]  # message bytes
    iters: int = 5
    warmup: int = 2
    device: str = "auto"  # "auto", "cpu" or "cuda"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> NetSpec:
        d = json.loads(text)
        d["sizes"] = tuple(d["sizes"])
        return cls(**d)
