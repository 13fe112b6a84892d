"""dp_accounting's Rényi-DP calls without their per-order log flood.

dp_accounting logs (through absl) one warning per fractional order below 2 whose series does not
converge ("_compute_log_a_frac failed to converge ... Excluding this order"): the order is left
out of the minimum (``nan`` in the curve), so ε stays an upper bound, and a 20-step run printed
104 such lines (issue 41). They are silenced here, and only here: :func:`quiet_rdp_orders`
around a call, and :func:`subsampled_gaussian_rdp` for the one-step curve every Poisson
accountant and the dataset budget read.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Optional, Sequence

import numpy as np

__all__ = ["quiet_rdp_orders", "subsampled_gaussian_rdp"]


@contextlib.contextmanager
def quiet_rdp_orders():
    """Raise the ``absl`` logger's level to ERROR for the block (module docstring)."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def subsampled_gaussian_rdp(q: float, noise_multiplier: float,
                            orders: Sequence[float]) -> Optional[np.ndarray]:
    """dp_accounting's RDP curve of one Poisson-subsampled Gaussian step on ``orders``, as its
    ``RdpAccountant`` adds it per composed event (``_compute_rdp_poisson_subsampled_gaussian``;
    ``nan`` where an order's series fails), float64; ``None`` where this dp_accounting has no
    such function."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    curve_of = getattr(rdp, "_compute_rdp_poisson_subsampled_gaussian", None)
    if curve_of is None:
        return None
    with quiet_rdp_orders():
        return np.asarray(curve_of(q=q, noise_multiplier=noise_multiplier,
                                   orders=np.asarray(orders)), dtype=np.float64)
