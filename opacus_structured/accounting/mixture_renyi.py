r"""The Rényi divergence of a two-sided Gaussian-mixture dominating pair, bounded in x-space.

Structured subsampling's bounds with a Poisson bottom level (Schuchardt et al., ICML 2025,
Theorem E.8 per epoch, Theorem F.2 per step) and with several windows per series (Theorems
E.1 / F.1) are dominating pairs of mixtures with a common scale,

.. math::
   P = \sum_i w_i\,\mathcal N(a_i, \sigma^2), \qquad Q = \sum_j v_j\,\mathcal N(b_j, \sigma^2)

(E.8: :math:`a = -\mu`, :math:`b = \mu`, :math:`\mu_i = i`, :math:`w = v =
\mathrm{Binomial}(k, r)`), possibly behind a top level: the weighted profile
:math:`(1-\rho)\max(0, 1-\alpha) + \rho H_\alpha(P\|Q)` of F.1/F.2 is the profile of the pair
:math:`P' = (1-\rho)\,\delta_\star + \rho P`, :math:`Q' = (1-\rho)\,\delta_\star + \rho Q`
(an atom :math:`\star` off the line carrying the same mass under both), whose moment is
:math:`\mathbb E_{Q'}[(P'/Q')^\lambda] = 1 - \rho + \rho\,\mathbb E_Q[(P/Q)^\lambda]`. The
theorems bound the hockey-stick curve at every real ε, so every neighbouring pair of outputs,
in either order, is a post-processing of :math:`(P', Q')` (Blackwell; Dong, Roth & Su 2022,
Thm 2.10) and its Rényi divergence is at most the larger of :math:`D_\lambda(P'\|Q')` and
:math:`D_\lambda(Q'\|P')`: :func:`profile_worlds` bounds that larger value from above.

The pessimistic PLD of these profiles does not serve here (its connect-the-dots grid puts mass
at very low losses where the two-sided profile is steep: :math:`\sum p\,e^{-\ell} = 6062` for
E.8 in issue 47's setting, which :func:`~opacus_structured.accounting.private_selection.
pld_renyi` rejects), so the moment :math:`M_\lambda = \int p^\lambda q^{1-\lambda}\,dx` is
bounded **directly in x**.

**Why the bound holds.** The log-integrand is
:math:`g(x) = \lambda\log p - (\lambda-1)\log q = -x^2/(2\sigma^2) + \psi(x)` with
:math:`\psi'(x) = (\lambda\bar a(x) - (\lambda-1)\bar b(x))/\sigma^2`, where
:math:`\bar a(x)`, :math:`\bar b(x)` are the posterior means of the component means of
:math:`P` and :math:`Q` given :math:`x`: each is **non-decreasing** in :math:`x` (its
derivative is a posterior variance over :math:`\sigma^2`). On a cell :math:`[a, b]`
therefore :math:`s^- \le \psi' \le s^+` with
:math:`s^- = (\lambda\bar a(a) - (\lambda-1)\bar b(b))/\sigma^2`,
:math:`s^+ = (\lambda\bar a(b) - (\lambda-1)\bar b(a))/\sigma^2`, and

.. math::
   g(x) \le \min\big(g(b) - \tfrac{x^2 - b^2}{2\sigma^2} - s^-(b - x),\;
   g(a) - \tfrac{x^2 - a^2}{2\sigma^2} + s^+(x - a)\big),

(the lower bound swaps :math:`s^-` and :math:`s^+` and takes the larger). Each side is a
Gaussian in :math:`x` and integrates in closed form,
:math:`\int_0^w e^{-y^2/(2\sigma^2) + \beta y}dy = e^{\beta^2\sigma^2/2}\sigma\sqrt{2\pi}
[\Phi(w/\sigma - \beta\sigma) - \Phi(-\beta\sigma)]`, evaluated through ``erfcx`` so that no
large exponents cancel (:func:`_log_gauss_cell`). Beyond the grid's ends the same argument
with :math:`\bar a \ge \min_i a_i`, :math:`\bar b(x) \le \bar b(x_0)` left of :math:`x_0` (and
:math:`\bar a \le \max_i a_i`, :math:`\bar b(x) \ge \bar b(x_1)` right of :math:`x_1`) gives
Gaussian tails. Every term is an upper bound whatever the grid, which decides only how tight it
is; the Gaussian factor is exact, so the gap comes from the posterior means' drift alone and
is quadratic in the cell width. The grid: per order a scan (cells of at most σ) spanning
:math:`[\lambda\min a - (\lambda-1)\max b,\ \lambda\max a - (\lambda-1)\min b]` widened by
12 σ, outside which :math:`g` falls like a Gaussian; a lattice of cells of
:math:`2^j\sigma/1024` (:math:`j \le 9`) where the scanned :math:`g` is within 60 of its
maximum, :math:`j` chosen from the scanned drift so that the gap stays near
:math:`10^{-3}\max(\log M_\lambda, 10^{-3})` (:func:`log_moment_bounds` returns the lower
bound too: the tests check the gap). Floating-point rounding is covered by an allowance of
:math:`10^{-9}` on the moment plus :math:`10^{-12}\lambda(1 + 2\max(|\log p|, |\log q|))` in
its logarithm. Any real order :math:`\lambda > 1` is computed the same way (no chord between
integers); a bound that exceeds a higher order's is replaced by it (Rényi divergences are
non-decreasing in the order).

**Tail cuts** (:func:`truncate`), as for the PLD route: the most extreme components (weight
:math:`\beta_P` of :math:`P`, :math:`\beta_Q` of :math:`Q`, each at most a cut) leave the
pair, which is renormalised; a coupling of a trial with the cut pair differs with probability
at most :math:`\beta_P + \beta_Q`, which the selection charges to δ
(:func:`~opacus_structured.accounting.private_selection.epsilon_with_tail`). The extreme
components carry the large losses (E.8 with :math:`k = 15`: :math:`\mathrm{Binomial}(15 \mid
15, 1/46) \approx 10^{-25}` at distance 30), so a cut lowers the curve at moderate orders.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
from scipy import special

from .mixture import GaussianMixture, MixturePair
from .profiles import PairProfile, PerfectPrivacyProfile, PrivacyProfile, WeightedProfile

__all__ = ["log_moment_bounds", "pair_log_moments", "truncate", "profile_pairs", "profile_worlds"]

_LATTICE = 1.0 / 1024  # finest cells, in units of σ, where the integrand is large
_MAX_LEVEL = 9  # coarsest lattice: 2^9 _LATTICE σ = σ/2
_TOLERANCE = 1e-3  # aimed gap in log M_λ, relative (at least 1e-7 absolute)
_COARSE_CELLS = 128  # cells of the scan over the whole range, at least
_MAX_SCAN_CELLS = 1024  # and at most
_SPAN = 60.0  # log-units below the integrand's maximum still gridded finely
_EDGE_SIGMAS = 12.0  # the grid's ends beyond the tilted centre and the means
_ROUNDING = 1e-9  # relative allowance on the moment (module docstring)
_LOSS_ROUNDING = 1e-12  # relative allowance on the log-integrand
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
_SQRT1_2 = math.sqrt(0.5)


def _posterior(mix: GaussianMixture, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(log density, posterior mean of the component means)`` at ``x``."""
    z = (x[:, None] - mix.means[None, :]) / mix.sigma
    logc = -0.5 * z * z + np.log(mix.weights)[None, :]
    top = logc.max(axis=1, keepdims=True)
    r = np.exp(logc - top)
    total = r.sum(axis=1)
    mean = (r @ mix.means) / total
    logpdf = top[:, 0] + np.log(total) - math.log(mix.sigma) - _LOG_SQRT_2PI
    return logpdf, mean


def _log_erfcx(u: np.ndarray) -> np.ndarray:
    """log erfcx(u), also where erfcx overflows (u < -26)."""
    u = np.asarray(u, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        low = u < -20
        return np.where(low, u * u + np.log(special.erfc(np.where(low, u, 0.0))),
                        np.log(special.erfcx(np.where(low, 0.0, u))))


def _log_gauss_cell(width: np.ndarray, beta: np.ndarray, sigma: float) -> np.ndarray:
    r""":math:`\log\int_0^w \exp(-y^2/(2\sigma^2) + \beta y)\,dy` (``width`` may be
    :math:`\infty`), broadcast. With :math:`u_0 = -\beta\sigma`, :math:`u_1 = w/\sigma + u_0` it is
    :math:`\beta^2\sigma^2/2 + \log\sigma\sqrt{2\pi} + \log[\Phi(u_1) - \Phi(u_0)]`, taken in
    one of three forms that cancel no large exponent: the Gaussian's centre
    :math:`\beta\sigma^2` right of the cell (``erfcx`` at :math:`u_1`), left of it (``erfcx`` at
    :math:`u_0`), or inside (``ndtr``)."""
    width, beta = np.broadcast_arrays(np.asarray(width, dtype=np.float64),
                                      np.asarray(beta, dtype=np.float64))
    u0 = -beta * sigma
    out = np.empty(u0.shape)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        u1 = width / sigma + u0
        right = u1 <= 0  # finite width only
        if np.any(right):
            v0, v1, w = u0[right], u1[right], width[right]
            log_e1 = _log_erfcx(-v1 * _SQRT1_2)
            # log Φ(u0) − log Φ(u1), with u0² − u1² = −(w/σ)(u0 + u1)
            gap = _log_erfcx(-v0 * _SQRT1_2) - log_e1 + 0.5 * (w / sigma) * (v0 + v1)
            out[right] = (-0.5 * (w / sigma) * (v0 + v1) + log_e1
                          + np.log(-np.expm1(np.minimum(gap, 0.0))))
        left = (u0 >= 0) & ~right
        if np.any(left):
            v0, v1 = u0[left], u1[left]
            log_e0 = _log_erfcx(v0 * _SQRT1_2)
            gap = np.full(v0.shape, -np.inf)  # log Φ(−u1) − log Φ(−u0)
            fin = np.isfinite(v1)
            gap[fin] = (_log_erfcx(v1[fin] * _SQRT1_2) - log_e0[fin]
                        - 0.5 * (v1[fin] - v0[fin]) * (v1[fin] + v0[fin]))
            out[left] = log_e0 + np.log(-np.expm1(np.minimum(gap, 0.0)))
        mid = ~(left | right)
        if np.any(mid):
            v0, v1 = u0[mid], u1[mid]
            out[mid] = (0.5 * v0 * v0 + math.log(2.0)
                        + np.log(special.ndtr(v1) - special.ndtr(v0)))
    return out + math.log(sigma) + _LOG_SQRT_2PI - math.log(2.0)


def _scans(p: GaussianMixture, q: GaussianMixture, orders: np.ndarray) -> list[tuple]:
    r"""A scan of each order's range, ``(x, log p, ā_P, log q, ā_Q)`` per order. The
    log-integrand :math:`g = -x^2/(2\sigma^2) + \psi`, :math:`\psi' \in [\lambda\min a -
    (\lambda-1)\max b,\ \lambda\max a - (\lambda-1)\min b]/\sigma^2`, falls off like a Gaussian
    outside that interval of x, so the scan spans it, ``_EDGE_SIGMAS`` σ wider on each side
    (and P's means), with cells of at most σ (``_COARSE_CELLS`` at least, ``_MAX_SCAN_CELLS``
    at most)."""
    sigma = p.sigma
    a_lo, a_hi, b_lo, b_hi = p.means.min(), p.means.max(), q.means.min(), q.means.max()
    points = []
    for lam in orders:
        x0 = min(lam * a_lo - (lam - 1.0) * b_hi, a_lo) - _EDGE_SIGMAS * sigma
        x1 = max(lam * a_hi - (lam - 1.0) * b_lo, a_hi) + _EDGE_SIGMAS * sigma
        cells = min(max(_COARSE_CELLS, math.ceil((x1 - x0) / sigma)), _MAX_SCAN_CELLS)
        points.append(np.linspace(x0, x1, cells + 1))
    flat = np.concatenate(points)
    values = (flat, *_posterior(p, flat), *_posterior(q, flat))
    ends = np.cumsum([len(x) for x in points])[:-1]
    return list(zip(*(np.split(v, ends) for v in values), strict=True))


def _regions(scans: list, orders: np.ndarray, h: float, var: float) -> list[np.ndarray]:
    """Per order, the lattice indices (base spacing ``h``) gridded finely: where the scanned
    log-integrand is within ``_SPAN`` of its maximum (one scan cell wider on each side), every
    :math:`2^j`-th index. The cell width :math:`w` sets the gap between the upper and lower
    bounds: at most :math:`\\nu w^2/2` in the exponent, with :math:`\\nu` the rate at which
    :math:`(\\lambda\\bar a_P + (\\lambda-1)\\bar a_Q)/\\sigma^2` grows (estimated on the scan);
    :math:`j` is the largest (at most ``_MAX_LEVEL``) keeping that below ``_TOLERANCE`` times
    :math:`\\max(\\log M_\\lambda, 10^{-3})`, the moment also estimated on the scan."""
    out = []
    for lam, (x, log_p, mean_p, log_q, mean_q) in zip(orders, scans, strict=True):
        g = lam * log_p + (1.0 - lam) * log_q
        dx = x[1] - x[0]
        estimate = float(special.logsumexp(g)) + math.log(dx)
        drift = np.diff(lam * mean_p + (lam - 1.0) * mean_q) / (dx * var)
        big = np.nonzero(g >= g.max() - _SPAN)[0]
        first, last = max(big.min() - 1, 0), min(big.max() + 1, len(x) - 1)
        nu = float(np.max(drift[first:last], initial=0.0))
        allowed = 2.0 * _TOLERANCE * max(estimate, 1e-3)
        level = _MAX_LEVEL if nu <= 0 else int(np.clip(
            math.floor(0.5 * math.log2(allowed / nu) - math.log2(h)), 0, _MAX_LEVEL))
        step = 1 << level
        out.append(np.arange(math.floor(x[first] / h / step),
                             math.ceil(x[last] / h / step) + 1) * step)
    return out


def _orders_bounds(p: GaussianMixture, q: GaussianMixture, orders: np.ndarray,
                   lower: bool = True) -> tuple[Optional[np.ndarray], np.ndarray]:
    """``(lower, upper)`` of log M_λ per order: each order's cells are its scan's outside its
    region and the shared lattice (spacing ``_LATTICE`` σ, evaluated once over the union of
    the regions) inside; all orders' cells are bounded in one pass. ``lower=False`` skips
    the lower bound (``None``): pricing needs the upper one only."""
    sigma = p.sigma
    var = sigma ** 2
    h = _LATTICE * sigma
    scans = _scans(p, q, orders)
    wanted = _regions(scans, orders, h, var)
    index = np.unique(np.concatenate(wanted))
    lattice = (index * h, *_posterior(p, index * h), *_posterior(q, index * h))
    parts, sizes = [], []
    for i, inner in enumerate(wanted):
        at = np.searchsorted(index, inner)
        lo_x, hi_x = lattice[0][at[0]], lattice[0][at[-1]]
        # scan points off the lattice's span by at least half a lattice cell (no sliver cells)
        below, above = scans[i][0] < lo_x - h / 2, scans[i][0] > hi_x + h / 2
        parts.append([np.concatenate([s[below], lat[at], s[above]])
                      for s, lat in zip(scans[i], lattice, strict=True)])
        sizes.append(len(parts[-1][0]))
    x, log_p, mp, log_q, mq = (np.concatenate([part[j] for part in parts]) for j in range(5))
    sizes = np.asarray(sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    lam = np.repeat(orders, sizes)
    k = lam - 1.0
    g = lam * log_p - k * log_q  # log of the integrand p^λ q^(1-λ)
    # cells [x_j, x_{j+1}] within one order's points
    cell = np.ones(len(x) - 1, dtype=bool)
    cell[starts[1:] - 1] = False
    j = np.nonzero(cell)[0]
    lam_c, k_c = lam[j], k[j]
    width = x[j + 1] - x[j]
    # g = −x²/(2σ²) + ψ with ψ' = (λ ā_P − (λ−1) ā_Q)/σ² between these on a cell (the
    # posterior means are non-decreasing in x)
    slope_lo = (lam_c * mp[j] - k_c * mq[j + 1]) / var
    slope_hi = (lam_c * mp[j + 1] - k_c * mq[j]) / var
    upper = np.minimum(g[j + 1] + _log_gauss_cell(width, x[j + 1] / var - slope_lo, sigma),
                       g[j] + _log_gauss_cell(width, slope_hi - x[j] / var, sigma))
    # tails: ψ' >= (λ min a − (λ−1) ā_Q(x0))/σ² left of x0 and <= (λ max a − (λ−1) ā_Q(x1))/σ²
    # right of x1, each a Gaussian tail
    first, last = starts, starts + sizes - 1
    left = g[first] + _log_gauss_cell(
        np.inf, (x[first] - orders * p.means.min() + (orders - 1.0) * mq[first]) / var, sigma)
    right = g[last] + _log_gauss_cell(
        np.inf, (orders * p.means.max() - (orders - 1.0) * mq[last] - x[last]) / var, sigma)
    owner = np.repeat(np.arange(len(orders)), sizes - 1)
    log_upper = _segment_logsumexp(upper, owner, len(orders))
    log_upper = np.logaddexp(log_upper, np.logaddexp(left, right))
    size = np.maximum.reduceat(np.maximum(np.abs(log_p), np.abs(log_q)), starts)
    slack = _ROUNDING + _LOSS_ROUNDING * orders * (1.0 + 2.0 * size)
    if not lower:
        return None, log_upper + slack
    cells = np.maximum(g[j + 1] + _log_gauss_cell(width, x[j + 1] / var - slope_hi, sigma),
                       g[j] + _log_gauss_cell(width, slope_lo - x[j] / var, sigma))
    return _segment_logsumexp(cells, owner, len(orders)), log_upper + slack


def _segment_logsumexp(values: np.ndarray, owner: np.ndarray, n: int) -> np.ndarray:
    """logsumexp of ``values`` grouped by ``owner`` (sorted, every group non-empty)."""
    starts = np.searchsorted(owner, np.arange(n))
    top = np.maximum.reduceat(values, starts)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return np.log(np.add.reduceat(np.exp(values - safe[owner]), starts)) + safe


def _check_orders(orders) -> np.ndarray:
    orders = np.asarray(orders, dtype=np.float64)
    if orders.ndim != 1 or not np.all(np.isfinite(orders)) or np.any(orders <= 1):
        raise ValueError("orders must be a 1-d sequence of finite values > 1")
    return orders


def log_moment_bounds(pair: MixturePair, orders: Sequence[float]
                      ) -> tuple[np.ndarray, np.ndarray]:
    r"""``(lower, upper)`` bounds of :math:`\log\mathbb E_Q[(P/Q)^\lambda] = \log\int
    p^\lambda q^{1-\lambda}dx` for a :class:`~opacus_structured.accounting.mixture.MixturePair`
    at each order :math:`\lambda > 1` (module docstring; the argument does not use the
    separation of the means). The upper bound holds whatever the grid; the lower one shows
    how tight it is (both are clipped at 0, the moment being at least 1)."""
    return _log_moments(pair, _check_orders(orders), lower=True)


def _log_moments(pair: MixturePair, orders: np.ndarray, lower: bool
                 ) -> tuple[Optional[np.ndarray], np.ndarray]:
    """:func:`log_moment_bounds` on checked orders; the lower bound ``None`` unless
    ``lower``."""
    if not isinstance(pair, MixturePair):
        raise TypeError(f"pair must be a MixturePair, got {type(pair).__name__}")
    if pair.is_trivial():
        zero = np.zeros_like(orders)
        return zero, zero
    log_lower, log_upper = _orders_bounds(pair.upper, pair.lower, orders, lower)
    return (None if log_lower is None else np.maximum(log_lower, 0.0)), log_upper


def truncate(pair: MixturePair, cut: float) -> tuple[MixturePair, float, float]:
    r"""``(pair_f, β_P, β_Q)``: the pair without its most extreme components, renormalised.
    From :math:`P` the components farthest from :math:`Q` (the highest losses), from
    :math:`Q` those farthest from :math:`P`, each while their summed weight stays
    :math:`\le` ``cut``; :math:`P = (1-\beta_P)P_f + \beta_P P_t` and likewise :math:`Q`, so a
    coupling of a trial with its finite part differs with probability at most :math:`\beta_P`
    (resp. :math:`\beta_Q`) (:mod:`~opacus_structured.accounting.private_selection` charges
    that to δ). ``cut = 0`` returns the pair itself."""
    if not (cut >= 0 and math.isfinite(cut)):
        raise ValueError(f"cut must be a finite mass >= 0, got {cut!r}")
    p, q = pair.upper, pair.lower
    left = p.means.max() <= q.means.min()  # P's extreme components are its smallest means

    def keep(mix: GaussianMixture, from_low: bool) -> tuple[GaussianMixture, float]:
        order = np.argsort(mix.means, kind="stable")
        if not from_low:
            order = order[::-1]
        removed = np.cumsum(mix.weights[order]) <= cut
        removed[-1] = False  # keep one component at least
        drop = int(np.sum(np.cumsum(~removed) == 0))  # a prefix only
        kept = np.sort(order[drop:])
        beta = float(np.sum(mix.weights[order[:drop]]))
        if drop == 0:
            return mix, 0.0
        w = mix.weights[kept]
        return GaussianMixture(mix.means[kept], w / w.sum(), mix.sigma), beta

    p_f, beta_p = keep(p, left)
    q_f, beta_q = keep(q, not left)
    if beta_p == 0.0 and beta_q == 0.0:
        return pair, 0.0, 0.0
    return MixturePair(p_f, q_f), beta_p, beta_q


def _is_mirror(pair: MixturePair) -> bool:
    """True when x → −x maps (P, Q) onto (Q, P): then D_λ(Q‖P) = D_λ(P‖Q) exactly."""
    p, q = pair.upper, pair.lower
    if len(p.means) != len(q.means):
        return False
    i, j = np.argsort(p.means), np.argsort(-q.means)
    return bool(np.array_equal(p.means[i], -q.means[j])
                and np.array_equal(p.weights[i], q.weights[j]))


def pair_log_moments(pair: MixturePair, orders: Sequence[float]) -> np.ndarray:
    r"""Upper bounds of :math:`\log\mathbb E_Q[(P/Q)^\lambda]` and :math:`\log\mathbb
    E_P[(Q/P)^\lambda]`, the larger at each order (both directions of the pair; one
    computation where the pair is its own mirror image, as Theorems E.1/E.8's are)."""
    orders = _check_orders(orders)
    forward = _log_moments(pair, orders, lower=False)[1]
    if _is_mirror(pair):
        return forward
    return np.maximum(forward, _log_moments(pair.reversed(), orders, lower=False)[1])


def profile_pairs(profile: PrivacyProfile) -> Optional[list[tuple[float, MixturePair]]]:
    r"""``[(weight, pair)]`` when ``profile`` is the profile of one two-sided mixture pair
    (:class:`~opacus_structured.accounting.profiles.PairProfile`) or a convex combination of
    such profiles and of perfect privacy (:class:`~opacus_structured.accounting.profiles.
    WeightedProfile`: Theorems F.1/F.2); ``None`` for any other profile (a switching profile
    is not the profile of its pair: :mod:`~opacus_structured.accounting.switching_renyi`)."""
    if isinstance(profile, PairProfile):
        return [(1.0, profile.pair)]
    if not isinstance(profile, WeightedProfile):
        return None
    out = []
    for weight, part in zip(profile.weights, profile.profiles, strict=True):
        if weight == 0 or isinstance(part, PerfectPrivacyProfile):
            continue
        inner = profile_pairs(part)
        if inner is None:
            return None
        out.extend((weight * w, pair) for w, pair in inner)
    return out


def profile_worlds(profile: PrivacyProfile, orders: Sequence[float],
                   cuts: Sequence[float] = (0.0,)) -> Optional[list[tuple[np.ndarray, float]]]:
    r"""``[(rdp, tail_mass)]``, one per ``cut``, for the pair :math:`(P', Q')` whose profile is
    ``profile`` (:func:`profile_pairs`: the disjoint union of its pairs, weights :math:`c_k`,
    and of an atom carrying the rest): ``rdp`` bounds :math:`\max(D_\lambda(P'_f\|Q'_f),
    D_\lambda(Q'_f\|P'_f))` from above, with :math:`\mathbb E_{Q'}[(P'/Q')^\lambda] = 1 - \sum_k
    c_k + \sum_k c_k M_{\lambda,k}` and each pair truncated at ``cut``
    (:func:`truncate`), ``tail_mass`` = :math:`\sum_k c_k(\beta_{P,k} + \beta_{Q,k})`, the
    :math:`\beta_P + \beta_Q` of :func:`~opacus_structured.accounting.private_selection.
    epsilon_with_tail`. ``None`` when the profile is not of that form. A truncation met twice
    is computed once."""
    orders = _check_orders(orders)
    parts = profile_pairs(profile)
    if parts is None:
        return None
    rest = max(1.0 - sum(w for w, _ in parts), 0.0)
    known: dict = {}
    worlds = []
    for cut in cuts:
        terms = [np.full_like(orders, math.log(rest) if rest > 0 else -np.inf)]
        tail = 0.0
        for k, (weight, pair) in enumerate(parts):
            finite, beta_p, beta_q = truncate(pair, cut)
            key = (k, beta_p, beta_q)
            if key not in known:
                known[key] = pair_log_moments(finite, orders)
            terms.append(math.log(weight) + known[key])
            tail += weight * (beta_p + beta_q)
        log_m = np.logaddexp.reduce(np.stack(terms), axis=0)
        rdp = np.maximum(log_m, 0.0) / (orders - 1.0)
        worlds.append((_non_decreasing(orders, np.where(np.isnan(rdp), np.inf, rdp)), tail))
    return worlds


def _non_decreasing(orders: np.ndarray, rdp: np.ndarray) -> np.ndarray:
    """Each order takes the smallest bound of the orders at or above it (a Rényi divergence
    is non-decreasing in the order, so a higher order's bound holds at a lower one)."""
    rank = np.argsort(orders, kind="stable")
    out = np.empty_like(rdp)
    out[rank] = np.minimum.accumulate(rdp[rank][::-1])[::-1]
    return out
