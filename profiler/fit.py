"""The bandwidth fit the simulator reads: GB/s = a*u^2 + b*u + c, u = log2(message bytes / 1e6) (Sailor's
form, fitted with a degree-2 least-squares polynomial as Sailor's ``fit_func.py`` does), valid over the
measured message sizes and capped at the highest bandwidth observed (:class:`sailor_hpc.network.NetworkFit`
clamps both). Torch-free."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sailor_hpc.errors import SailorError
from sailor_hpc.network import NetworkFit


def fit_bandwidth(sizes: Sequence[float], gbps: Sequence[float]) -> NetworkFit:
    """Quadratic fit of measured bandwidth (GB/s) over message sizes (bytes)."""
    x = np.asarray(sizes, dtype=np.float64)
    y = np.asarray(gbps, dtype=np.float64)
    if x.size != y.size or np.unique(x).size < 3:  # three points fix a quadratic; repeats add none
        raise SailorError(f"a bandwidth fit needs at least 3 distinct message sizes, got {np.unique(x).size}",
                          field="--net-sizes", fix="measure at least three message sizes")
    if not (np.isfinite(y).all() and (y > 0).all() and (x > 0).all()):
        raise SailorError("measured bandwidths must be positive and finite", field="network",
                          fix="re-run the network job")
    u = np.log2(x / 1e6)
    a, b, c = np.polyfit(u, y, 2)
    return NetworkFit(coeffs=(float(a), float(b), float(c)), max_gbps=float(y.max()),
                      min_bytes=float(x.min()), max_bytes=float(x.max()))
