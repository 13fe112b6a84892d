r"""dp_accounting's ``from_gaussian_mechanism`` (connect-the-dots, pessimistic), vectorised.

dp_accounting 0.6 builds the PLD of the (Poisson-subsampled) Gaussian mechanism on the grid
:math:`\varepsilon_k = k\,d` by evaluating, for every grid point, the hockey-stick divergence
:math:`\delta(\varepsilon_k) = \mu_{\rm upper}(x_k) - e^{\varepsilon_k}\mu_{\rm lower}(x_k)` at
the inverse privacy loss :math:`x_k = L^{-1}(\varepsilon_k)`, then hands the
:math:`\delta_k` to ``create_pmf_pessimistic_connect_dots_fixed_gap``. The inverse is computed
one grid point at a time in Python (``MonotonePrivacyLoss.get_delta_for_epsilon``): at
σ = 1 and d = 1e-4 a sensitivity-2 branch has ~190,000 points and took 2.5–6 s, which made
truncated Poisson's default ``max_batch_size`` search in ``make_private`` take minutes
(issue 41).

:func:`gaussian_pld` is the same algorithm with :math:`x_k` computed as numpy arrays, by the
same formulas in the same order of operations (``_inverse_*`` below mirror
``GaussianPrivacyLoss._inverse_privacy_loss_{add,remove,replace}`` and ``common.
log_a_times_exp_b_plus_c`` / ``log_sinh`` / ``asinh_exp``, including their ``isclose`` edge
cases and their refusals). The CDFs of the pair (``mu_upper_cdf``, ``mu_lower_log_cdf``) are
dp_accounting's formulas over ``special.ndtr`` / ``log_ndtr``, which is what its
``scipy.stats.norm`` calls evaluate, without its per-call argument handling (masks, copies
and ``place``: about 40 % of their time at 190,000 points; ``_mu_*`` below). The grid bounds (``connect_dots_bounds``) and the clipping are
dp_accounting's own code, the connect-the-dots PMF its arithmetic
(:func:`.dense_pmf.connect_dots_fixed_gap`, without the dictionary round trip). The tests
compare the δ grid, the PMFs and ε with ``from_gaussian_mechanism`` itself
(tests/test_gaussian_branch.py); array and scalar transcendental functions may differ in the
last bit, which moves a δ by ~1e-16 relative and has left every ε we compared unchanged.
"""

from __future__ import annotations

import math

import numpy as np
from dp_accounting import NeighboringRelation
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_mechanism as plm
from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution
from scipy import special

from .._validation import check_positive, check_probability
from . import dense_pmf

__all__ = ["gaussian_pld", "delta_grid"]

_ADD, _REMOVE, _REPLACE = (plm.AdjacencyType.ADD, plm.AdjacencyType.REMOVE,
                           plm.AdjacencyType.REPLACE)


def _isclose(a: np.ndarray, b: float) -> np.ndarray:
    """``math.isclose(a, b)`` element-wise (rel_tol=1e-9, abs_tol=0)."""
    return np.abs(a - b) <= 1e-9 * np.maximum(np.abs(a), abs(b))


def _log_a_times_exp_b_plus_c(a: float, b: np.ndarray, c: float) -> np.ndarray:
    """``common.log_a_times_exp_b_plus_c`` for a > 0, c < 0 (the subsampled case, q < 1)."""
    out = np.empty_like(b)
    zero = b == 0
    out[zero] = np.log(a + c)
    d = b[~zero] + np.log(a)
    log_minus_c = np.log(-c)
    if np.any(log_minus_c >= d):
        bad = d[log_minus_c >= d][0]
        raise ValueError(f'a must be greater than b. Got a={bad} and b={log_minus_c}.')
    out[~zero] = d + np.log1p(-np.exp(log_minus_c - d))
    return out


def _inverse_without_subsampling_remove(loss, privacy_loss: np.ndarray) -> np.ndarray:
    s, sigma = loss.sensitivity, loss.standard_deviation
    return -0.5 * s - privacy_loss * (sigma ** 2) / s


def _inverse_add(loss, eps: np.ndarray) -> np.ndarray:
    q = loss.sampling_prob
    if q == 1.0:
        return loss.sensitivity + _inverse_without_subsampling_remove(loss, eps)
    top = -math.log(1 - q)
    if np.any(eps > top):
        raise ValueError(f'privacy_loss ({eps[eps > top][0]}) is larger than '
                         f'-log(1 - sampling_prob) ({top}).')
    close = _isclose(eps, top)
    without = -_log_a_times_exp_b_plus_c(1 / q, -eps[~close], 1 - 1 / q)
    out = np.empty_like(eps)
    out[close] = loss.sensitivity + _inverse_without_subsampling_remove(loss, np.array(math.inf))
    out[~close] = loss.sensitivity + _inverse_without_subsampling_remove(loss, without)
    return out


def _inverse_remove(loss, eps: np.ndarray) -> np.ndarray:
    q = loss.sampling_prob
    if q == 1.0:
        return _inverse_without_subsampling_remove(loss, eps)
    bottom = math.log(1 - q)
    close = _isclose(eps, bottom)
    if np.any(~close & (eps <= bottom)):
        raise ValueError(f'privacy_loss ({eps[~close & (eps <= bottom)][0]}) is smaller than '
                         f'log(1 - sampling_prob) ({bottom}).')
    without = _log_a_times_exp_b_plus_c(1 / q, eps[~close], 1 - 1 / q)
    out = np.empty_like(eps)
    out[close] = _inverse_without_subsampling_remove(loss, np.array(-math.inf))
    out[~close] = _inverse_without_subsampling_remove(loss, without)
    return out


def _log_sinh(a: np.ndarray) -> np.ndarray:
    """``common.log_sinh`` for a >= 0."""
    out = np.zeros_like(a)
    pos = a != 0
    out[pos] = a[pos] + np.log1p(-np.exp(-2 * a[pos])) - math.log(2)
    return out


def _asinh_exp(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``common.asinh_exp`` for b = ±1."""
    log_abs_b_times_exp_a = np.log(np.abs(b)) + a
    return np.sign(b) * np.logaddexp(0.5 * np.logaddexp(0, 2 * log_abs_b_times_exp_a),
                                     log_abs_b_times_exp_a)


def _inverse_replace(loss, eps: np.ndarray) -> np.ndarray:
    s, sigma, q = loss.sensitivity, loss.standard_deviation, loss.sampling_prob
    if q == 1.0:
        out = -eps * sigma ** 2 / s / 2
    else:
        sign = np.where(eps >= 0, 1.0, -1.0)
        log_alpha = 0.5 * (s / sigma) ** 2 + math.log1p(-q) - math.log(q)
        log_sinh_term = log_alpha + _log_sinh(np.abs(eps) / 2)
        out = sigma ** 2 / s * (_asinh_exp(log_sinh_term, -sign) - eps / 2)
    return np.where(eps == 0, 0.0, out)


def _noise_cdf(loss, x: np.ndarray) -> np.ndarray:
    """``loss.noise_cdf(x)``: ``stats.norm(scale=sigma).cdf(x)``, which is ``special.ndtr`` at
    ``(x - 0) / sigma`` for every x (1 at +inf, 0 at -inf, NaN at NaN), without scipy.stats'
    per-call argument handling."""
    return special.ndtr((x - 0) / loss.standard_deviation)


def _noise_log_cdf(loss, x: np.ndarray) -> np.ndarray:
    """``loss.noise_log_cdf(x)``: ``stats.norm(scale=sigma).logcdf(x)`` (``special.log_ndtr``
    at ``(x - 0) / sigma``; scipy.stats writes 0.0 at +inf itself)."""
    z = (x - 0) / loss.standard_deviation
    return np.where(z == math.inf, 0.0, special.log_ndtr(z))


def _mu_upper_cdf(loss, x: np.ndarray) -> np.ndarray:
    """``loss.mu_upper_cdf(x)`` with :func:`_noise_cdf`."""
    q, kind = loss.sampling_prob, loss.adjacency_type
    if kind == _ADD:
        return _noise_cdf(loss, x)
    if q == 1.0:
        return _noise_cdf(loss, np.add(x, loss.sensitivity))
    return ((1 - q) * _noise_cdf(loss, x)
            + q * _noise_cdf(loss, np.add(x, loss.sensitivity)))


def _mu_lower_log_cdf(loss, x: np.ndarray) -> np.ndarray:
    """``loss.mu_lower_log_cdf(x)`` with :func:`_noise_log_cdf`."""
    q, kind = loss.sampling_prob, loss.adjacency_type
    if kind == _REMOVE:
        return _noise_log_cdf(loss, x)
    if q == 1.0:
        return _noise_log_cdf(loss, np.add(x, -loss.sensitivity))
    return np.logaddexp(np.log1p(-q) + _noise_log_cdf(loss, x),
                        np.log(q) + _noise_log_cdf(loss, np.add(x, -loss.sensitivity)))


def delta_grid(loss: plm.GaussianPrivacyLoss, epsilons) -> np.ndarray:
    """``loss.get_delta_for_epsilon(epsilons)`` (dp_accounting's hockey-stick divergence on a
    grid) with the inverse privacy loss as arrays."""
    epsilons = np.asarray(epsilons, dtype=float)
    deltas = np.zeros_like(epsilons, dtype=float)
    q, kind = loss.sampling_prob, loss.adjacency_type
    if q == 1.0 or kind == _REPLACE:
        inverse = np.full_like(epsilons, True, dtype=bool)
    elif kind == _ADD:
        inverse = epsilons < -math.log1p(-q)
    elif kind == _REMOVE:
        inverse = epsilons > math.log1p(-q)
        deltas[~inverse] = -np.expm1(epsilons[~inverse])
    else:  # pragma: no cover - GaussianPrivacyLoss has no other adjacency type
        raise ValueError(f'{kind} adjacency type is not supported.')
    eps = epsilons[inverse]
    if kind == _REPLACE:
        x = _inverse_replace(loss, eps)
    elif kind == _ADD:
        x = _inverse_add(loss, eps)
    else:
        x = _inverse_remove(loss, eps)
    deltas[inverse] = _mu_upper_cdf(loss, x) - np.exp(eps + _mu_lower_log_cdf(loss, x))
    return np.clip(deltas, 0, 1)


def _pmf(loss: plm.GaussianPrivacyLoss, discretization: float) -> pld_pmf.PLDPmf:
    """``_create_pld_pmf_from_monotone_privacy_loss(loss, True, d, use_connect_dots=True)`` for
    a continuous mechanism."""
    bounds = loss.connect_dots_bounds()
    upper = math.ceil(bounds.epsilon_upper / discretization)
    lower = math.floor(bounds.epsilon_lower / discretization)
    rounded = np.arange(lower, upper + 1)
    deltas = delta_grid(loss, rounded * discretization)
    return dense_pmf.connect_dots_fixed_gap(discretization, lower, upper, deltas)


def gaussian_pld(standard_deviation: float, sensitivity: float = 1.0, *,
                 sampling_prob: float = 1.0, value_discretization_interval: float = 1e-4,
                 neighboring_relation: NeighboringRelation = (
                     NeighboringRelation.ADD_OR_REMOVE_ONE),
                 log_mass_truncation_bound: float = -50) -> PrivacyLossDistribution:
    """The PLD of ``dp_pld.from_gaussian_mechanism(standard_deviation, sensitivity,
    pessimistic_estimate=True, value_discretization_interval, log_mass_truncation_bound,
    sampling_prob, use_connect_dots=True, neighboring_relation)``, built with the vectorised
    :func:`delta_grid`."""
    sigma = check_positive("standard_deviation", standard_deviation)
    sens = check_positive("sensitivity", sensitivity)
    q = check_probability("sampling_prob", sampling_prob)
    d = check_positive("value_discretization_interval", value_discretization_interval)

    def pmf(kind) -> pld_pmf.PLDPmf:
        loss = plm.GaussianPrivacyLoss(sigma, sensitivity=sens, pessimistic_estimate=True,
                                       log_mass_truncation_bound=log_mass_truncation_bound,
                                       sampling_prob=q, adjacency_type=kind)
        return _pmf(loss, d)

    if neighboring_relation in (NeighboringRelation.ADD_OR_REMOVE_ONE,
                                NeighboringRelation.REPLACE_SPECIAL):
        if q == 1.0:
            return PrivacyLossDistribution(pmf(_REMOVE))
        return PrivacyLossDistribution(pmf(_REMOVE), pmf(_ADD))
    if neighboring_relation == NeighboringRelation.REPLACE_ONE:
        return PrivacyLossDistribution(pmf(_REPLACE))
    raise ValueError(f"neighboring_relation must be ADD_OR_REMOVE_ONE, REPLACE_SPECIAL or "
                     f"REPLACE_ONE, got {neighboring_relation!r}")
