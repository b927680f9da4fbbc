"""The bandwidth fit the simulator reads: GB/s = a*u^2 + b*u + c, u = log2(message bytes / 1e6) (Sailor's
form, fitted with a degree-2 least-squares polynomial as Sailor's ``fit_func.py`` does), valid over the
measured message sizes and capped at the highest bandwidth observed (:class:`sailor_hpc.core.network.NetworkFit`
clamps both). Torch-free."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sailor_hpc.core.errors import SailorError
from sailor_hpc.core.network import NetworkFit


def check_message_sizes(sizes: Sequence[float]) -> None:
    """The fit is quadratic in log message size: fewer than three distinct sizes cannot determine it
    (repeats add nothing). The sweep checks ``--net-sizes`` with this before any job runs, where the
    network jobs would otherwise fail only after their allocation ran."""
    distinct = sorted(set(sizes))
    if len(distinct) < 3:
        shown = ", ".join(_size_text(s) for s in distinct)
        raise SailorError(f"the bandwidth fit is quadratic in log message size and needs at least 3 distinct "
                          f"message sizes, got {len(distinct)} ({shown} bytes)", field="--net-sizes",
                          fix="give at least three log2 sizes, e.g. --net-sizes 16,20,24 (or leave the default)")


def _size_text(nbytes: float) -> str:
    """``2^k`` for a power of two, else the number."""
    n = int(nbytes)
    return f"2^{n.bit_length() - 1}" if n == nbytes and n > 0 and n & (n - 1) == 0 else f"{nbytes:g}"


def fit_bandwidth(sizes: Sequence[float], gbps: Sequence[float]) -> NetworkFit:
    """Quadratic fit of measured bandwidth (GB/s) over message sizes (bytes)."""
    x = np.asarray(sizes, dtype=np.float64)
    y = np.asarray(gbps, dtype=np.float64)
    if x.size != y.size:
        raise SailorError(f"{x.size} message sizes but {y.size} bandwidths", field="network",
                          fix="re-run the network job")
    check_message_sizes(sizes)
    if not (np.isfinite(y).all() and (y > 0).all() and (x > 0).all()):
        raise SailorError("measured bandwidths must be positive and finite", field="network",
                          fix="re-run the network job")
    u = np.log2(x / 1e6)
    a, b, c = np.polyfit(u, y, 2)
    return NetworkFit(coeffs=(float(a), float(b), float(c)), max_gbps=float(y.max()),
                      min_bytes=float(x.min()), max_bytes=float(x.max()))
