"""Bandwidth fits: how long a message of a given size takes on a link.

Sailor fits measured bandwidth (GB/s) as a quadratic in u = log2(message bytes / 1e6). The fit is only
trustworthy inside the measured range of message sizes, and a quadratic can turn negative outside it,
so sizes are clamped to the fitted range before evaluating (a quirk of Sailor we do not inherit), and
the result is clamped to ``[1 MB/s, max observed]``.

Inside the range a least-squares quadratic still bends down at the small end (Clariden's GH-96 fit is
negative below ~100 kB), which would make a 20 kB message take longer than a 1 MB one. A link cannot do
that (the small message could be padded), so a transfer takes at most as long as any larger message:
:meth:`NetworkFit.transfer_time` is the fit's time made non-decreasing in size, which turns the bent-down
end into the latency floor the measurements imply (tens of microseconds on Clariden).

A link between clusters or network islands may also carry a measured one-way latency (``latency_us`` of
its ``[[network.between]]`` entry): every message then pays it on top of the fit's time, because a
bandwidth fit taken over MB-sized messages inside a machine room says nothing about a WAN's round trip.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace
from functools import cached_property

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.fields import Fields

DEFAULT_MIN_BYTES = 2**16
DEFAULT_MAX_BYTES = 2**30
_MIN_BANDWIDTH = 1e6  # bytes/s floor so a bad fit can never yield zero or negative bandwidth
_GRID_PER_OCTAVE = 8  # message sizes per doubling on which the monotone envelope is tabulated


@dataclass(frozen=True)
class NetworkFit:
    """Aggregate bandwidth of one link kind, as a quadratic fit or a constant."""

    coeffs: tuple[float, float, float] | None = None  # GB/s = a*u^2 + b*u + c
    constant_gbps: float | None = None
    max_gbps: float | None = None  # highest bandwidth observed (GB/s = 1e9 B/s)
    min_bytes: float = DEFAULT_MIN_BYTES
    max_bytes: float = DEFAULT_MAX_BYTES
    latency_s: float = 0.0  # added to every non-empty message (set from the link entry's latency_us)
    # measured by the profiler (a partition's collective_latency_us / gather_latency_us): the latency per ring
    # step of a one-element all-reduce and all-gather. Not added to a message (the fit's times hold one each);
    # the simulator charges them per collective a runtime issues beyond those whose bytes it prices
    collective_latency_s: float = 0.0
    gather_latency_s: float = 0.0  # 0: collective_latency_s
    # the same two, each collective issued alone after a burst of compute (as a training step issues them): the
    # ranks' communication threads and the peer must be woken first, which a back-to-back stream never pays.
    # 0: not measured (older archives and sites), the streamed latency stands in
    issued_latency_s: float = 0.0
    issued_gather_latency_s: float = 0.0
    # measured by the profiler over the link's ranks: how far replicas doing the same work drift apart, as a
    # partition's replica_jitter (the simulator takes the larger of the two); 0: not measured
    replica_jitter: float = 0.0

    def fitted_bandwidth(self, nbytes: float) -> float:
        """Bytes per second the quadratic gives at ``nbytes`` (clamped to the range and the peak)."""
        if self.constant_gbps is not None:
            return self.constant_gbps * 1e9
        assert self.coeffs is not None
        x = min(max(nbytes, self.min_bytes), self.max_bytes)
        u = math.log2(x / 1e6)
        a, b, c = self.coeffs
        bw = (a * u * u + b * u + c) * 1e9
        if self.max_gbps is not None:
            bw = min(bw, self.max_gbps * 1e9)
        return max(bw, _MIN_BANDWIDTH)

    def _fitted_time(self, nbytes: float) -> float:
        return min(max(nbytes, self.min_bytes), self.max_bytes) / self.fitted_bandwidth(nbytes)

    @cached_property
    def _envelope(self) -> tuple[list[float], list[float]]:
        """Sizes on a log grid over the range and, per size, the least time of any size at or above it."""
        octaves = math.log2(self.max_bytes / self.min_bytes)
        n = max(2, int(math.ceil(octaves * _GRID_PER_OCTAVE)) + 1)
        sizes = [self.min_bytes * 2 ** (octaves * i / (n - 1)) for i in range(n)]
        times = [self._fitted_time(x) for x in sizes]
        for i in range(n - 2, -1, -1):
            times[i] = min(times[i], times[i + 1])
        return sizes, times

    def transfer_time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` over the link (0 for an empty message).

        Below the range: the smallest message's time (latency-bound); above it: the edge bandwidth;
        inside it: the fit's time, but never more than that of a larger message.
        """
        if nbytes <= 0:
            return 0.0
        if self.constant_gbps is not None:
            return self.latency_s + nbytes / (self.constant_gbps * 1e9)
        if nbytes >= self.max_bytes:
            return self.latency_s + nbytes / self.fitted_bandwidth(self.max_bytes)
        sizes, times = self._envelope
        i = bisect.bisect_left(sizes, nbytes)
        return self.latency_s + min(self._fitted_time(nbytes), times[i])

    def bandwidth(self, nbytes: float) -> float:
        """Effective bytes per second for a message of ``nbytes`` (size / :meth:`transfer_time`)."""
        nbytes = max(nbytes, 1.0)
        return nbytes / self.transfer_time(nbytes)

    @property
    def peak_bytes_per_s(self) -> float:
        if self.max_gbps is not None:
            return self.max_gbps * 1e9
        return self.fitted_bandwidth(self.max_bytes)

    def to_dict(self) -> dict[str, object]:
        if self.constant_gbps is not None:
            return {"constant_gbps": self.constant_gbps}
        d: dict[str, object] = {"coeffs": list(self.coeffs or ())}
        if self.max_gbps is not None:
            d["max_gbps"] = self.max_gbps
        if (self.min_bytes, self.max_bytes) != (DEFAULT_MIN_BYTES, DEFAULT_MAX_BYTES):
            d["range_bytes"] = [self.min_bytes, self.max_bytes]
        return d

    @classmethod
    def from_sailor(cls, entry: list) -> NetworkFit:
        """Sailor's ``[[a, b, c], max_bytes_per_s]`` entry."""
        (a, b, c), max_bps = entry
        return cls(coeffs=(float(a), float(b), float(c)), max_gbps=float(max_bps) / 1e9)

    @classmethod
    def parse(cls, f: Fields) -> NetworkFit:
        coeffs = f.opt("coeffs", list)
        constant = f.opt("constant_gbps", float)
        max_gbps = f.opt("max_gbps", float)
        rng = f.opt("range_bytes", list, [DEFAULT_MIN_BYTES, DEFAULT_MAX_BYTES])
        f.done()
        if (coeffs is None) == (constant is None):
            raise f.error(None, "needs exactly one of coeffs = [a, b, c] or constant_gbps = <GB/s>")
        if coeffs is not None and (len(coeffs) != 3 or not all(isinstance(c, (int, float)) and not isinstance(c, bool)
                                                               and math.isfinite(c) for c in coeffs)):
            raise f.error("coeffs", f"must be three numbers [a, b, c] (GB/s = a*u^2 + b*u + c), got {coeffs!r}")
        if constant is not None and constant <= 0:
            raise f.error("constant_gbps", f"must be positive, got {constant}")
        if max_gbps is not None and max_gbps <= 0:
            raise f.error("max_gbps", f"must be positive, got {max_gbps}")
        if (len(rng) != 2 or not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in rng)
                or not 0 < rng[0] < rng[1] < math.inf):
            raise f.error("range_bytes", f"must be [min, max] message bytes with 0 < min < max, got {rng!r}")
        if coeffs is not None:
            a, b, c = (float(x) for x in coeffs)
            lo, hi = math.log2(rng[0] / 1e6), math.log2(rng[1] / 1e6)
            if max(a * u * u + b * u + c for u in (lo + (hi - lo) * i / 64 for i in range(65))) <= 0:
                raise f.error("coeffs", f"{coeffs!r} gives no positive bandwidth over range_bytes {rng!r}",
                              fix="give the fit of measured GB/s over log2(message MB), or constant_gbps")
        return cls(coeffs=(a, b, c) if coeffs is not None else None, constant_gbps=constant,
                   max_gbps=max_gbps, min_bytes=float(rng[0]), max_bytes=float(rng[1]))


# a partition's link table may carry what the profiler measured beside its fits (µs per ring step): key -> field
_LATENCY_KEYS = {"collective_latency_us": "collective_latency_s", "gather_latency_us": "gather_latency_s",
                 "issued_latency_us": "issued_latency_s", "issued_gather_latency_us": "issued_gather_latency_s"}
JITTER_KEY = "replica_jitter"  # ... and the replicas' drift measured over the link (a fraction, as a partition's)
MAX_JITTER = 0.5  # a coefficient of variation of a step's time at or above this is a broken node, not jitter
# what a profile keeps of a larger measured drift (an oversubscribed host's), so that its site still loads
MAX_JITTER_KEPT = 0.9 * MAX_JITTER


@dataclass(frozen=True)
class LinkTable:
    """Fits of one link kind keyed by k, the number of GPUs sending at once (aggregate bandwidth)."""

    fits: dict[int, NetworkFit]

    @property
    def latency_s(self) -> float:
        """The link's one-way latency (every fit of a table carries the same one)."""
        return max(f.latency_s for f in self.fits.values())

    def for_senders(self, k: int) -> NetworkFit:
        """The fit measured with k senders, else the nearest measured k below (then above)."""
        if k in self.fits:
            return self.fits[k]
        lower = [j for j in self.fits if j <= k]
        return self.fits[max(lower)] if lower else self.fits[min(self.fits)]

    def slowest(self, other: LinkTable) -> LinkTable:
        """Of two tables, the one whose peak bandwidth is lower (Sailor's rule for mixed links)."""
        mine = max(f.peak_bytes_per_s for f in self.fits.values())
        theirs = max(f.peak_bytes_per_s for f in other.fits.values())
        return self if mine <= theirs else other

    def to_dict(self) -> dict[str, object]:
        return {str(k): fit.to_dict() for k, fit in sorted(self.fits.items())}

    @property
    def collective_latency_s(self) -> float:
        """A small collective's latency per ring step, as measured (0: not measured)."""
        return max(f.collective_latency_s for f in self.fits.values())

    @property
    def gather_latency_s(self) -> float:
        """An all-gather's latency per ring step (the collective latency where none was measured)."""
        return max(f.gather_latency_s or f.collective_latency_s for f in self.fits.values())

    @property
    def issued_latency_s(self) -> float:
        """A small all-reduce's latency per ring step when issued alone after computing (the streamed one where
        that was not measured)."""
        return max(f.issued_latency_s for f in self.fits.values()) or self.collective_latency_s

    @property
    def issued_gather_latency_s(self) -> float:
        """A small all-gather's latency per ring step when issued alone after computing (the streamed one where
        that was not measured)."""
        return max(f.issued_gather_latency_s for f in self.fits.values()) or self.gather_latency_s

    @property
    def replica_jitter(self) -> float:
        """How far replicas drift apart over this link, as measured (0: not measured)."""
        return max(f.replica_jitter for f in self.fits.values())

    def to_site_dict(self) -> dict[str, object]:
        """The table as a partition's network writes it: its fits and, when measured, its latencies and the
        replicas' drift."""
        lat = {key: round(max(getattr(f, field) for f in self.fits.values()) * 1e6, 3)
               for key, field in _LATENCY_KEYS.items()}
        lat[JITTER_KEY] = round(self.replica_jitter, 4)
        return {**self.to_dict(), **{k: v for k, v in lat.items() if v}}

    @classmethod
    def parse(cls, f: Fields, latency_s: float = 0.0) -> LinkTable:
        """``latency_s``: the one-way latency of the link entry holding the table. A table may carry what the
        profiler measured beside its fits: ``collective_latency_us`` and ``gather_latency_us``, a small
        all-reduce's and all-gather's latency per ring step back to back, and ``issued_latency_us`` and
        ``issued_gather_latency_us``, the same issued one at a time after computing; and ``replica_jitter``,
        how far replicas drift apart (:func:`profiler.netbench.replica_jitter`)."""
        fits = {}
        latencies: dict[str, float] = {}
        if JITTER_KEY in f.data:
            f.seen.add(JITTER_KEY)
            value = f.data[JITTER_KEY]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < MAX_JITTER:
                raise f.error(JITTER_KEY, f"must be a fraction in [0, {MAX_JITTER}), got {value!r}",
                              fix="the drift `sailor-hpc profile` measured over this link, e.g. replica_jitter = 0.02")
            latencies[JITTER_KEY] = float(value)
        for key, field in _LATENCY_KEYS.items():
            if key not in f.data:
                continue
            f.seen.add(key)
            value = f.data[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise f.error(key, f"must be a latency in µs >= 0, got {value!r}",
                              fix=f"the measured latency per ring step, e.g. {key} = 25")
            latencies[field] = float(value) * 1e-6
        for key, value in f.data.items():
            if key in _LATENCY_KEYS or key == JITTER_KEY:
                continue
            f.seen.add(key)
            if not (str(key).isascii() and str(key).isdigit()) or int(key) <= 0:
                raise f.error(str(key), "keys must be the number of GPUs sending at once (\"1\", \"2\", ...)")
            fits[int(key)] = replace(NetworkFit.parse(f.sub(str(key), value)), latency_s=latency_s,
                                     collective_latency_s=latencies.get("collective_latency_s", 0.0),
                                     gather_latency_s=latencies.get("gather_latency_s", 0.0),
                                     issued_latency_s=latencies.get("issued_latency_s", 0.0),
                                     issued_gather_latency_s=latencies.get("issued_gather_latency_s", 0.0),
                                     replica_jitter=latencies.get(JITTER_KEY, 0.0))
        if not fits:
            raise f.error(None, "is empty", fix="give at least one fit, e.g. \"1\" = { constant_gbps = 10 }")
        return cls(fits)


def require_table(table: LinkTable | None, what: str, file: object | None) -> LinkTable:
    if table is None:
        raise SailorError(f"no {what} bandwidth in the site config", file=file, field=what,
                          fix="add a fit (coeffs or constant_gbps) or measure one with `sailor-hpc profile`")
    return table
