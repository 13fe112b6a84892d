r"""Dominating pairs given as univariate mixtures of Gaussians with a common scale.

Every tight result of the five papers reduces a mechanism to a pair

.. math::

    P = \sum_i w_i\,\mathcal{N}(a_i, \sigma^2), \qquad Q = \sum_j v_j\,\mathcal{N}(b_j, \sigma^2)

(means in units of the clipping norm, :math:`\sigma` the noise multiplier). When the two sets of
means are *separated* (:math:`\max_i a_i \le \min_j b_j` or :math:`\min_i a_i \ge \max_j b_j`)
the privacy loss :math:`L(x) = \log p(x) - \log q(x)` is monotone in :math:`x`: its derivative
is a difference of two averages of the means, one taken over each side. The hockey-stick
divergence is then attained on a half line,

.. math::

    H_{e^\varepsilon}(P\,\|\,Q) = P(S_\varepsilon) - e^\varepsilon Q(S_\varepsilon),
    \qquad S_\varepsilon = \{x : L(x) > \varepsilon\},

and is evaluated exactly with the normal survival function after solving :math:`L(x^*) = \varepsilon`
(bracketed on a grid, then Newton steps). Both the one-sided pairs of structured subsampling (mixture versus
:math:`\mathcal{N}(0, \sigma^2)`) and the two-sided "double mixture" pairs (Theorems E.1 and E.8:
:math:`\mathrm{MoG}(-\mu, p)` versus :math:`\mathrm{MoG}(+\mu, p)`) are of this form.

An inexact threshold can only *lower* :math:`P(S) - e^\varepsilon Q(S)` (the exact set maximises
it), so the solver is refined until the stationarity error is far below double precision;
tests compare against numerical integration of :math:`\max(p - e^\varepsilon q, 0)`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy import special

from .._validation import check_positive

__all__ = ["GaussianMixture", "MixturePair"]

_TAIL_SIGMAS = 9.0  # Phi(-9) ~ 1e-19: mass outside mean range +- 9 sigma is negligible


def _logsumexp_last(a: np.ndarray, b: np.ndarray):
    """``scipy.special.logsumexp(a, b=b, axis=-1)`` for real ``a`` and weights ``b > 0``.

    The same numpy operations, in the same order, as scipy's implementation (1.15 and later:
    the largest term is taken out of the sum and added back through ``log1p``), without its
    array-API dispatch: ~3x faster on the small arrays the threshold solver passes thousands of
    times per PLD (issue 41). With ``b > 0`` and real ``a`` scipy's sign and zero-weight
    branches never apply. ``tests/test_accounting_core.py`` checks the result bit for bit
    against scipy (finite, infinite and NaN entries, ties, shapes).
    """
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        a_max = np.max(a, axis=-1, keepdims=True)
        at_max = a == a_max
        rest = np.where(at_max, -np.inf, a)
        m = np.sum(b * at_max.astype(a.dtype), axis=-1, keepdims=True, dtype=a.dtype)
        s = np.sum(b * np.exp(rest - a_max), axis=-1, keepdims=True, dtype=a.dtype)
        s = np.where(s == 0, s, s / m)
        out = np.log1p(s) + np.log(m) + a_max
        finite = np.isfinite(out)
        if not finite.all():  # scipy's direct sum where the shifted one is not finite
            out = np.where(finite, out, np.log(np.sum(b * np.exp(a), axis=-1, keepdims=True)))
    out = np.squeeze(out, axis=-1)
    return out[()] if out.ndim == 0 else out


@dataclasses.dataclass(frozen=True, eq=False)
class GaussianMixture:
    r"""A univariate mixture :math:`\sum_i w_i \mathcal{N}(m_i, \sigma^2)`.

    Components with zero weight are dropped; weights must be non-negative and sum to one
    (within 1e-9, then renormalised).
    """

    means: np.ndarray
    weights: np.ndarray
    sigma: float

    def __post_init__(self):
        means = np.atleast_1d(np.asarray(self.means, dtype=np.float64))
        weights = np.atleast_1d(np.asarray(self.weights, dtype=np.float64))
        sigma = check_positive("sigma", self.sigma)
        if means.ndim != 1 or means.shape != weights.shape:
            raise ValueError(
                f"means and weights must be 1-d of equal length, got shapes {means.shape} and "
                f"{weights.shape}")
        if not np.all(np.isfinite(means)):
            raise ValueError("mixture means must be finite")
        if not np.all(np.isfinite(weights)) or np.any(weights < 0):
            raise ValueError("mixture weights must be finite and >= 0")
        total = weights.sum()
        if abs(total - 1.0) > 1e-9:
            raise ValueError(f"mixture weights must sum to 1, got {total!r}")
        keep = weights > 0
        object.__setattr__(self, "means", means[keep])
        object.__setattr__(self, "weights", weights[keep] / weights[keep].sum())
        object.__setattr__(self, "sigma", sigma)

    @classmethod
    def gaussian(cls, mean: float, sigma: float) -> "GaussianMixture":
        return cls(np.array([mean]), np.array([1.0]), sigma)

    def __eq__(self, other):
        return (isinstance(other, GaussianMixture) and self.sigma == other.sigma
                and np.array_equal(self.means, other.means)
                and np.array_equal(self.weights, other.weights))

    def __hash__(self):
        return hash((self.sigma, self.means.tobytes(), self.weights.tobytes()))

    def _z(self, x: np.ndarray) -> np.ndarray:
        return (np.asarray(x, dtype=np.float64)[..., None] - self.means) / self.sigma

    def logpdf(self, x) -> np.ndarray:
        z = self._z(x)
        return _logsumexp_last(-0.5 * z * z, self.weights) - math.log(
            self.sigma * math.sqrt(2 * math.pi))

    def pdf(self, x) -> np.ndarray:
        return np.exp(self.logpdf(x))

    def sf(self, x) -> np.ndarray:
        """P(X > x)."""
        return special.ndtr(-self._z(x)) @ self.weights

    def cdf(self, x) -> np.ndarray:
        """P(X <= x)."""
        return special.ndtr(self._z(x)) @ self.weights

    def dlogpdf(self, x) -> np.ndarray:
        """d/dx log p(x)."""
        z = self._z(x)
        logc = -0.5 * z * z + np.log(self.weights)
        r = np.exp(logc - logc.max(axis=-1, keepdims=True))
        return -(r * z).sum(axis=-1) / r.sum(axis=-1) / self.sigma

    def support_range(self) -> tuple[float, float]:
        """Interval outside of which the mixture has mass below ~1e-19."""
        return (float(self.means.min() - _TAIL_SIGMAS * self.sigma),
                float(self.means.max() + _TAIL_SIGMAS * self.sigma))


@dataclasses.dataclass(frozen=True, eq=False)
class MixturePair:
    r"""A pair :math:`(P, Q)` of Gaussian mixtures with separated means.

    ``delta(eps)`` is :math:`H_{e^\varepsilon}(P\|Q)` for every real :math:`\varepsilon`
    (negative values included: then it is at least :math:`1 - e^\varepsilon`).
    """

    upper: GaussianMixture  # P
    lower: GaussianMixture  # Q

    def __post_init__(self):
        if self.upper.sigma != self.lower.sigma:
            raise ValueError(
                f"both mixtures must share sigma, got {self.upper.sigma} and {self.lower.sigma}")
        a, b = self.upper.means, self.lower.means
        if a.max() <= b.min():
            direction = -1  # loss decreasing in x
        elif a.min() >= b.max():
            direction = 1  # loss increasing in x
        else:
            raise ValueError(
                "MixturePair needs separated means (max(P means) <= min(Q means) or the "
                f"reverse) for a monotone privacy loss; got P means {a} and Q means {b}")
        object.__setattr__(self, "_direction", direction)
        object.__setattr__(self, "_closed", self._closed_form())

    @classmethod
    def from_components(cls, upper_means, upper_weights, lower_means, lower_weights,
                        sigma: float) -> "MixturePair":
        return cls(GaussianMixture(upper_means, upper_weights, sigma),
                   GaussianMixture(lower_means, lower_weights, sigma))

    @property
    def sigma(self) -> float:
        return self.upper.sigma

    def reversed(self) -> "MixturePair":
        """The pair (Q, P)."""
        return MixturePair(self.lower, self.upper)

    def is_trivial(self) -> bool:
        """True when P == Q (perfect privacy)."""
        return self.upper == self.lower

    def privacy_loss(self, x) -> np.ndarray:
        return self.upper.logpdf(x) - self.lower.logpdf(x)

    def _dloss(self, x) -> np.ndarray:
        return self.upper.dlogpdf(x) - self.lower.dlogpdf(x)

    def x_range(self) -> tuple[float, float]:
        lo1, hi1 = self.upper.support_range()
        lo2, hi2 = self.lower.support_range()
        return min(lo1, lo2), max(hi1, hi2)

    def loss_range(self) -> tuple[float, float]:
        """Range of the privacy loss over the region holding all but ~1e-19 of the mass."""
        lo, hi = self.x_range()
        vals = self.privacy_loss(np.array([lo, hi]))
        return float(vals.min()), float(vals.max())

    def _closed_form(self):
        r"""``(mid, scale, w1, sign)`` when :math:`L(x) = \mathrm{sign}\cdot\log(1 + w_1
        (e^{u} - 1))` with :math:`u = (x - \mathrm{mid})/\mathrm{scale}` (the pair solves in
        closed form), else ``None``.

        That is the case of the Poisson-subsampled Gaussian and of the Gaussian mechanism: one
        side a single Gaussian :math:`\mathcal{N}(m, \sigma^2)`, the other
        :math:`w_0\mathcal{N}(m, \sigma^2) + w_1\mathcal{N}(m_1, \sigma^2)` (or a single
        Gaussian, :math:`w_1 = 1`). Then :math:`p/q = w_0 + w_1 e^{u}` with
        :math:`u = (m_1 - m)(x - (m + m_1)/2)/\sigma^2`, and ``sign`` is +1 when the mixture is
        :math:`P`, -1 when it is :math:`Q`."""
        up, low = self.upper, self.lower
        for sign, single, other in ((1, low, up), (-1, up, low)):
            if len(single.means) != 1:
                continue
            m = float(single.means[0])
            if len(other.means) == 1:
                m1, w1 = float(other.means[0]), 1.0
            elif len(other.means) == 2 and m in (float(other.means[0]), float(other.means[1])):
                k = 1 if float(other.means[0]) == m else 0
                m1, w1 = float(other.means[k]), float(other.weights[k])
            else:
                continue
            if m1 == m:
                return None
            return 0.5 * (m + m1), self.sigma ** 2 / (m1 - m), w1, sign
        return None

    def _threshold(self, eps: np.ndarray) -> np.ndarray:
        r"""Solve L(x) = eps for x (L monotone); eps inside the loss range of the grid.

        In closed form where the pair allows it (:meth:`_closed_form`:
        :math:`u = \log(1 + (e^{\mathrm{sign}\,\varepsilon} - 1)/w_1)`, exact up to
        rounding); otherwise bracketed on a grid, then safeguarded Newton steps."""
        if self._closed is not None:
            mid, scale, w1, sign = self._closed
            with np.errstate(divide="ignore", invalid="ignore"):
                x = mid + scale * np.log1p(np.expm1(sign * eps) / w1)
            if np.all(np.isfinite(x)):
                return x
        lo, hi = self.x_range()
        pad = 4.0 * self.sigma
        grid = np.linspace(lo - pad, hi + pad, 4097)
        loss = self.privacy_loss(grid)
        if self._direction < 0:  # make it increasing for searchsorted
            grid, loss = grid[::-1], loss[::-1]
        loss = np.maximum.accumulate(loss)
        idx = np.clip(np.searchsorted(loss, eps), 1, len(grid) - 1)
        x0, x1 = grid[idx - 1], grid[idx]
        l0, l1 = loss[idx - 1], loss[idx]
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(l1 > l0, (eps - l0) / (l1 - l0), 0.5)
        t = np.clip(t, 0.0, 1.0)
        x = x0 + t * (x1 - x0)
        a, b = np.minimum(x0, x1), np.maximum(x0, x1)
        for _ in range(6):  # safeguarded Newton
            f = self.privacy_loss(x) - eps
            d = self._dloss(x)
            with np.errstate(divide="ignore", invalid="ignore"):
                step = np.where(np.abs(d) > 0, f / d, 0.0)
            x = np.clip(x - step, a, b)
        return x

    def delta(self, epsilon) -> np.ndarray:
        r"""Exact hockey-stick divergence :math:`H_{e^\varepsilon}(P\|Q)` (vectorised)."""
        eps = np.asarray(epsilon, dtype=np.float64)
        if np.any(np.isnan(eps)):
            raise ValueError("epsilon must not be NaN")
        scalar = eps.ndim == 0
        eps = np.atleast_1d(eps)
        out = np.empty_like(eps)
        if self.is_trivial():
            out[:] = np.maximum(0.0, -np.expm1(np.minimum(eps, 0.0)))
            return float(out[0]) if scalar else out
        lmin, lmax = self.loss_range()
        above = eps >= lmax  # no mass with loss > eps (up to ~1e-19): delta ~ tail
        below = eps <= lmin  # whole line: delta = 1 - e^eps
        mid = ~(above | below)
        lo, hi = self.x_range()
        if np.any(below):
            # delta = (1 - e^eps) + int (e^eps q - p)_+ over {L < eps}, which lies beyond the
            # range on the low-loss side: bound that term by e^eps * Q(that tail).
            q_tail = float(self.lower.cdf(lo) if self._direction > 0 else self.lower.sf(hi))
            out[below] = -np.expm1(eps[below]) + np.exp(eps[below]) * q_tail
        if np.any(above):
            # {L > eps} lies beyond the range on the high-loss side: delta <= P(that tail).
            p_tail = float(self.upper.sf(hi) if self._direction > 0 else self.upper.cdf(lo))
            out[above] = p_tail
        if np.any(mid):
            e = eps[mid]
            x = self._threshold(e)
            if self._direction > 0:  # S = (x, inf)
                p_s, q_s = self.upper.sf(x), self.lower.sf(x)
            else:  # S = (-inf, x)
                p_s, q_s = self.upper.cdf(x), self.lower.cdf(x)
            val = p_s - np.exp(e) * q_s
            out[mid] = val
        out = np.clip(out, 0.0, 1.0)
        # A hockey-stick divergence is non-increasing in eps; enforce it against rounding.
        return float(out[0]) if scalar else out
