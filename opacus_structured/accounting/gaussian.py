r"""Closed forms for the Gaussian mechanism and mu-Gaussian differential privacy.

A Gaussian mechanism with sensitivity :math:`\Delta` and noise standard deviation :math:`s` is
:math:`\mu`-GDP with :math:`\mu = \Delta / s` (Dong, Roth & Su 2022). Its exact privacy profile is

.. math::

    \delta(\varepsilon) = \Phi\!\left(-\frac{\varepsilon}{\mu} + \frac{\mu}{2}\right)
        - e^{\varepsilon}\,\Phi\!\left(-\frac{\varepsilon}{\mu} - \frac{\mu}{2}\right)

(Balle & Wang 2018, Theorem 8; Dong et al. Corollary 2.13), valid for every real
:math:`\varepsilon`. This module evaluates it stably in log space and inverts it in both
:math:`\varepsilon` (for a target :math:`\delta`) and :math:`\mu` (for a target
:math:`(\varepsilon, \delta)`). Pure numpy/scipy: no torch.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize, special

from .._validation import check_finite, check_nonnegative, check_open_unit, check_positive

__all__ = [
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu",
    "gaussian_delta",
    "gaussian_epsilon",
]


def _gdp_delta_array(eps: np.ndarray, mu: float) -> np.ndarray:
    if mu == 0:
        return np.maximum(0.0, -np.expm1(np.minimum(eps, 0.0)))
    a = -eps / mu + mu / 2.0
    b = -eps / mu - mu / 2.0
    log_first = special.log_ndtr(a)
    log_second = eps + special.log_ndtr(b)
    # delta = exp(log_first) * (1 - exp(log_second - log_first)); log_second <= log_first always.
    diff = np.minimum(log_second - log_first, 0.0)
    out = np.exp(log_first) * -np.expm1(diff)
    return np.clip(out, 0.0, 1.0)


def gdp_delta(epsilon, mu: float):
    r"""Exact :math:`\delta(\varepsilon)` of a :math:`\mu`-GDP mechanism.

    Args:
        epsilon: a real number or an array of them (negative values are allowed: the profile is
            defined on all of :math:`\mathbb{R}`).
        mu: the GDP parameter, :math:`\mu \ge 0`.

    Returns:
        A float, or an array with the shape of ``epsilon``.
    """
    mu = check_nonnegative("mu", mu)
    eps = np.asarray(epsilon, dtype=np.float64)
    if np.any(np.isnan(eps)):
        raise ValueError("epsilon must not be NaN")
    out = _gdp_delta_array(eps, mu)
    return float(out) if out.ndim == 0 else out


def gdp_epsilon(delta: float, mu: float) -> float:
    r"""Smallest :math:`\varepsilon \ge 0` with :math:`\delta(\varepsilon) \le` ``delta`` for
    :math:`\mu`-GDP.

    Solved by Brent's method on the monotone profile; the returned value is rounded up so that
    ``gdp_delta(result, mu) <= delta`` (never under-reports).
    """
    delta = check_open_unit("delta", delta)
    mu = check_nonnegative("mu", mu)
    if gdp_delta(0.0, mu) <= delta:
        return 0.0
    hi = max(1.0, mu * mu)
    while gdp_delta(hi, mu) > delta:
        hi *= 2.0
        if hi > 1e6:
            raise ValueError(f"epsilon for delta={delta} and mu={mu} exceeds 1e6")
    f = lambda e: math.log(max(gdp_delta(e, mu), 1e-300)) - math.log(delta)  # noqa: E731
    # Relative tolerance only: an absolute xtol would swamp tiny epsilons (1e-9 targets).
    eps = optimize.brentq(f, 0.0, hi, xtol=1e-300, rtol=1e-14, maxiter=500)
    # Round up until the guarantee holds exactly (Brent's root may sit a hair below).
    while gdp_delta(eps, mu) > delta:
        eps = max(math.nextafter(eps, math.inf), eps * (1.0 + 1e-13))
    return float(eps)


def gdp_mu(epsilon: float, delta: float) -> float:
    r"""Largest :math:`\mu` such that :math:`\mu`-GDP implies :math:`(\varepsilon, \delta)`-DP.

    Inverse of :func:`gdp_delta` in :math:`\mu` (the profile is increasing in :math:`\mu`). The
    result is rounded down so that ``gdp_delta(epsilon, result) <= delta``.
    """
    epsilon = check_nonnegative("epsilon", epsilon)
    delta = check_open_unit("delta", delta)
    hi = 1.0
    while gdp_delta(epsilon, hi) < delta:
        hi *= 2.0
        if hi > 1e6:
            raise ValueError(f"mu for epsilon={epsilon}, delta={delta} exceeds 1e6")
    f = lambda m: gdp_delta(epsilon, m) - delta  # noqa: E731
    mu = optimize.brentq(f, 0.0, hi, xtol=1e-14, rtol=1e-15, maxiter=500)
    while mu > 0 and gdp_delta(epsilon, mu) > delta:
        mu = math.nextafter(mu, 0.0)
    return float(mu)


def gaussian_delta(epsilon, noise_multiplier: float, sensitivity: float = 1.0):
    r"""Exact :math:`\delta(\varepsilon)` of the Gaussian mechanism (:math:`\mu = \Delta/\sigma`)."""
    noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
    sensitivity = check_nonnegative("sensitivity", sensitivity)
    return gdp_delta(epsilon, sensitivity / noise_multiplier)


def gaussian_epsilon(delta: float, noise_multiplier: float, sensitivity: float = 1.0,
                     steps: int = 1) -> float:
    r"""Exact :math:`\varepsilon(\delta)` of ``steps`` compositions of the Gaussian mechanism
    (:math:`\mu = \sqrt{T}\,\Delta/\sigma`)."""
    noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
    sensitivity = check_nonnegative("sensitivity", sensitivity)
    check_finite("steps", steps)
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    return gdp_epsilon(delta, math.sqrt(steps) * sensitivity / noise_multiplier)
