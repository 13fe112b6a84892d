r"""Privacy loss distributions built from privacy profiles, on dp_accounting's PLD.

:func:`pld_from_profile` discretises a profile with dp_accounting's *pessimistic*
connect-the-dots algorithm (``create_pmf_pessimistic_connect_dots_fixed_gap``, Doroshenko et al.
2022, Algorithm 1) on the grid :math:`\varepsilon_k = k\,d`, and wraps the result in a
``dp_accounting.pld.PrivacyLossDistribution``. Composition (FFT convolution with pessimistic tail
truncation), :math:`\varepsilon(\delta)` and :math:`\delta(\varepsilon)` are dp_accounting's
(self-composition and :math:`\varepsilon(\delta)` of dense PMFs replayed without its Python
loops, bit for bit: :mod:`.dense_pmf`); this module adds argument checks, the grid choice and
a few conveniences.

Every composition records its numerical error on the result (FFT round-off floor, truncated
mass; :mod:`.numerics`), and :func:`epsilon_for_delta` returns ε only where δ clears that floor
by :data:`.numerics.CERTIFY_FACTOR`, read at δ minus the floor (else it raises
:class:`.numerics.NumericalPrecisionError` and the scheme picks a certified route or refuses).

The remove and add directions of an add/remove relation are kept as two PMFs (dp_accounting
reports the worse of the two); a substitution relation uses one symmetric PMF.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution

from .._defaults import DEFAULT_DISCRETIZATION
from .._validation import check_finite, check_int, check_open_unit, check_positive
from . import dense_pmf, numerics, resource_guard
from .profiles import PrivacyProfile

__all__ = [
    "DEFAULT_DISCRETIZATION",
    "TAIL_MASS_TRUNCATION",
    "pld_from_profile",
    "compose",
    "self_compose",
    "epsilon_at_most",
    "epsilon_for_delta",
    "delta_for_epsilon",
    "privacy_profile_curve",
]

TAIL_MASS_TRUNCATION = resource_guard.TAIL_MASS_TRUNCATION
_GRID_TAIL = 1e-18  # delta below which the grid stops; the rest is kept as infinity mass
_MAX_GRID = 5_000_000


def _pmf_from_profile(profile: PrivacyProfile, discretization: float) -> pld_pmf.PLDPmf:
    lo, hi = profile.epsilon_range()
    k_lo = math.floor(lo / discretization)
    k_hi = math.ceil(hi / discretization)
    if k_hi < k_lo:
        k_lo, k_hi = k_hi, k_lo
    if k_hi - k_lo + 1 > _MAX_GRID:
        raise ValueError(
            f"privacy-loss range [{lo:.3g}, {hi:.3g}] needs {k_hi - k_lo + 1} grid points at "
            f"discretization={discretization}; use a coarser discretization or more noise")
    eps = np.arange(k_lo, k_hi + 1, dtype=np.float64) * discretization
    deltas = np.asarray(profile.delta(eps), dtype=np.float64)
    if np.any(~np.isfinite(deltas)):
        raise FloatingPointError(f"non-finite delta in profile {profile!r}")
    # Pessimistic monotone repair of rounding noise: raise each value to the largest later one.
    deltas = np.maximum.accumulate(deltas[::-1])[::-1]
    deltas = np.clip(deltas, 0.0, 1.0)
    # Stop the grid once delta is negligible; what is left becomes infinity mass (pessimistic).
    small = np.nonzero(deltas <= _GRID_TAIL)[0]
    if len(small) and small[0] < len(deltas) - 1:
        cut = max(int(small[0]), 1)
        deltas = deltas[: cut + 1]
        k_hi = k_lo + cut
    return dense_pmf.connect_dots_fixed_gap(discretization, k_lo, k_hi, deltas)


def pld_from_profile(remove: PrivacyProfile, add: PrivacyProfile | None = None, *,
                     discretization: float = DEFAULT_DISCRETIZATION) -> PrivacyLossDistribution:
    """A pessimistic PLD whose remove (and optional add) direction dominates the profile(s).

    Args:
        remove: profile of the remove direction, or the only one for a symmetric relation.
        add: profile of the add direction; ``None`` makes the PLD symmetric.
        discretization: value discretisation interval of the privacy-loss grid. Coarser is
            faster and still an upper bound (1e-3 is fine for unit tests, 1e-4 for reports).
    """
    discretization = check_positive("discretization", discretization)
    pmf_remove = _pmf_from_profile(remove, discretization)
    pmf_add = None if add is None else _pmf_from_profile(add, discretization)
    return PrivacyLossDistribution(pmf_remove, pmf_add)


def self_compose(pld: PrivacyLossDistribution, count: int) -> PrivacyLossDistribution | None:
    """``count``-fold composition; ``None`` for zero compositions (no privacy spent).

    Raises:
        ResourceBudgetError: (a ``ValueError``) when the composed grid would exceed the memory
            budget of :mod:`.resource_guard`; nothing large has been allocated then.
    """
    count = check_int("count", count, minimum=0)
    if count == 0:
        return None
    if count == 1:
        return pld
    # Estimate the composed grid first: raise ResourceBudgetError instead of allocating past
    # the memory budget (see :mod:`.resource_guard`).
    # The truncation windows are computed once: the guard sizes the grid from them, and the
    # composition (dp_accounting's, vectorised: :mod:`.dense_pmf`) cuts them out.
    bounds = dense_pmf.composition_bounds(pld, count, TAIL_MASS_TRUNCATION)
    resource_guard.check_self_compose(pld, count, bounds=bounds)
    composed = dense_pmf.self_compose(pld, count, TAIL_MASS_TRUNCATION, bounds=bounds)
    # Record the FFT round-off and truncation (see :mod:`.numerics`) on the result.
    return numerics.after_self_compose(composed, pld, count, TAIL_MASS_TRUNCATION)


def epsilon_at_most(pld: PrivacyLossDistribution, count: int, delta: float,
                    threshold: float) -> tuple[bool, Callable[[], float]]:
    """``(epsilon_for_delta(self_compose(pld, count), delta) <= threshold, that ε)``, the ε as a
    function computing it on first call: the same decision and the same ε (bits included),
    cheaper when only the decision is needed.

    The round-off floor e (:func:`.numerics.after_self_compose`) costs one FFT of the composed
    grid per direction. It is bracketed first without them (:func:`.numerics.roundoff_bounds`:
    ``lo <= e <= hi``); ε(δ − e) lies between ε(δ − hi) and ε(δ − lo) (non-increasing in δ), so
    when ε(δ − hi) is below the threshold, or ε(δ − lo) above it, by more than 1e-9 (relative:
    far above the few units in the last place by which the computed ε can stray from
    monotone), that is the decision. Otherwise, and whenever δ < CERTIFY_FACTOR × hi (where the
    certificate might refuse), the floor is computed and ε read exactly as
    :func:`epsilon_for_delta` does, raising what it raises.
    """
    count = check_int("count", count, minimum=0)
    delta = check_open_unit("delta", delta)
    if count <= 1:
        eps = epsilon_for_delta(self_compose(pld, count), delta)
        return eps <= threshold, lambda: eps
    bounds = dense_pmf.composition_bounds(pld, count, TAIL_MASS_TRUNCATION)
    resource_guard.check_self_compose(pld, count, bounds=bounds)
    raw = dense_pmf.self_compose(pld, count, TAIL_MASS_TRUNCATION, bounds=bounds)
    read = dense_pmf.epsilon_reader(raw)
    cache: list = []

    def exact() -> float:
        if not cache:
            composed = numerics.after_self_compose(raw, pld, count, TAIL_MASS_TRUNCATION)
            cache.append(_certified_epsilon(composed, delta, read))
        return cache[0]

    lo, hi = numerics.roundoff_bounds(raw, pld, count)
    if delta >= numerics.CERTIFY_FACTOR * hi:
        tol = 1e-9 * max(1.0, abs(threshold))
        if max(float(read(delta - hi)), 0.0) <= threshold - tol:
            return True, exact
        if max(float(read(delta - lo)), 0.0) > threshold + tol:
            return False, exact
    return exact() <= threshold, exact


def compose(parts: Iterable[tuple[PrivacyLossDistribution, int]]) -> PrivacyLossDistribution | None:
    """Heterogeneous composition of ``(pld, count)`` parts; ``None`` if nothing was composed."""
    result = None
    for pld, count in parts:
        composed = self_compose(pld, count)
        if composed is None:
            continue
        if result is None:
            result = composed
            continue
        resource_guard.check_compose(result, composed)
        result = numerics.after_compose(
            result.compose(composed, tail_mass_truncation=TAIL_MASS_TRUNCATION), result,
            composed, TAIL_MASS_TRUNCATION)
    return result


def epsilon_for_delta(pld: PrivacyLossDistribution | None, delta: float) -> float:
    r"""Smallest ε such that the PLD is (ε, δ)-DP, certified against round-off; 0 for ``None``.

    Reads ε at :math:`\delta - e`, where :math:`e` is the composition's round-off floor
    (:func:`.numerics.certify`), and returns a
    :class:`~.resource_guard.PricedEpsilon` with ``route="pld"`` whose details are the
    certificate (round-off, infinity mass, truncated mass, compositions, smallest certified δ).

    Raises:
        NumericalPrecisionError: (a ``ValueError``) when δ is within
            :data:`.numerics.CERTIFY_FACTOR` of the round-off floor: the PLD's ε would be
            round-off there. Schemes catch it and move to a certified route, or let it through.
    """
    delta = check_open_unit("delta", delta)
    if pld is None:
        return 0.0
    return _certified_epsilon(pld, delta, dense_pmf.epsilon_reader(pld))


def _certified_epsilon(pld: PrivacyLossDistribution, delta: float,
                       read: Callable[[float], float]) -> float:
    """:func:`epsilon_for_delta` with ``read = dense_pmf.epsilon_reader(pld)`` given."""
    cert = numerics.certify(pld, delta)
    eps = max(float(read(delta - cert.roundoff)), 0.0)
    return resource_guard.PricedEpsilon(eps, "pld", "", **cert.record())


def delta_for_epsilon(pld: PrivacyLossDistribution | None, epsilon):
    """δ(ε) of the PLD plus its round-off floor (:mod:`.numerics`; an upper bound, at most 1);
    accepts a scalar or a sequence (converted to floats)."""
    eps = np.asarray(epsilon, dtype=np.float64)  # dp_accounting mis-handles integer arrays
    if np.any(np.isnan(eps)):
        raise ValueError("epsilon must not be NaN")
    if pld is None:
        out = np.maximum(0.0, -np.expm1(np.minimum(eps, 0.0)))
    elif eps.ndim == 0:
        out = np.asarray(pld.get_delta_for_epsilon(float(eps)))
    else:
        out = np.asarray(pld.get_delta_for_epsilon(eps.tolist()), dtype=np.float64)
    if pld is not None:
        out = np.minimum(out + numerics.numerics_of(pld).roundoff, 1.0)
    return float(out) if out.ndim == 0 else out


def privacy_profile_curve(pld: PrivacyLossDistribution | None,
                          epsilons: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """``(epsilons, deltas)`` arrays of the composed profile, for tables and plots."""
    eps = np.asarray([check_finite("epsilon", e) for e in epsilons], dtype=np.float64)
    return eps, np.atleast_1d(delta_for_epsilon(pld, eps))
