r"""The Rényi curve of a *switching* two-component dominating pair, without a PLD grid.

Structured subsampling's tight per-unit results (Schuchardt et al., ICML 2025: Theorem 4.4
per step, Theorem 4.2 per epoch) and the augmentation bounds (Theorem 4.5 / G.1, per step) all
have one form: the **switching** profile of

.. math::
   P = (1-p)\,\mathcal N(0, \sigma^2) + p\,\mathcal N(m, \sigma^2), \qquad Q = \mathcal N(0, \sigma^2),

:math:`\tilde H(\alpha) = H_\alpha(P\|Q)` for :math:`\alpha \ge 1` and
:math:`H_\alpha(Q\|P)` for :math:`\alpha < 1` (:math:`m = 2`, :math:`p = \rho r` for Theorem
4.4, :math:`p = r` for 4.2, :math:`p = p_2` for G.1). Scaled by :math:`1/m` this is the
Poisson-subsampled Gaussian of noise multiplier :math:`s = \sigma/m`, sensitivity 1 and rate
:math:`p` (the *equivalent event*: dp_accounting's
``PoissonSampledDpEvent(p, GaussianDpEvent(s))``): its remove pair for
:math:`\varepsilon \ge 0`, its add pair for :math:`\varepsilon < 0`.

**What the theorem prices, in Rényi terms.** The theorems bound the mechanism's hockey-stick
curve by :math:`\tilde H`, which is convex, symmetric
(:math:`\tilde H(\alpha) = 1 - \alpha + \alpha\tilde H(1/\alpha)`) and is therefore the
profile of a symmetric dominating pair :math:`(P^*, Q^*)`; every neighbouring pair of outputs,
in either order, is a post-processing of :math:`(P^*, Q^*)` (Blackwell; Dong, Roth & Su 2022,
Thm 2.10), so its Rényi divergence is at most :math:`D_\lambda(P^*\|Q^*)`. For
:math:`f(t) = t^\lambda` (:math:`\lambda > 1`) every pair satisfies

.. math::
   \mathbb E_Q\big[(P/Q)^\lambda\big] = 1 + \lambda(\lambda-1)\int_0^\infty \gamma^{\lambda-2}
   \big[H_\gamma(P\|Q) - (1-\gamma)_+\big]\,d\gamma

(Taylor's formula with integral remainder, :math:`f(t) = f(1) + f'(0^+)(t-1) +
\int_0^\infty f''(\gamma)[(t-\gamma)_+ - (1-\gamma)_+]\,d\gamma`, taken in expectation under
:math:`Q`). Writing :math:`\delta_{\rm rem}(\varepsilon) = H_{e^\varepsilon}(P\|Q)` and
:math:`\delta_{\rm add}(\varepsilon) = H_{e^\varepsilon}(Q\|P)` for :math:`\varepsilon \ge 0`
and using :math:`H_\gamma(Q\|P) = 1 - \gamma + \gamma H_{1/\gamma}(P\|Q)` below
:math:`\gamma = 1`, the switching pair and the plain pair :math:`(P, Q)` differ only there:

.. math::
   e^{(\lambda-1)D_\lambda(P^*\|Q^*)} = e^{(\lambda-1)A_\lambda}
   + \lambda(\lambda-1)\int_0^\infty e^{-\lambda\varepsilon}
     \big[\delta_{\rm rem}(\varepsilon) - \delta_{\rm add}(\varepsilon)\big]\,d\varepsilon,

where :math:`A_\lambda = D_\lambda(P\|Q)` is **the equivalent event's Rényi curve**
(dp_accounting's RDP of the Poisson-subsampled Gaussian, Mironov, Talwar & Zhang 2019, which
also covers :math:`D_\lambda(Q\|P)`). So :math:`D_\lambda(P^*\|Q^*) \ge A_\lambda`, with a
correction of the order of :math:`A_\lambda` itself at low orders (:math:`O(p^2)`; up to
1.6 × :math:`A_\lambda` in the issue-47 setting) that vanishes at high orders (the factor
:math:`e^{-\lambda\varepsilon}`); the profile alone does not allow less (the switching pair
*is* a pair with the theorem's profile). :func:`switching_rdp` returns this
:math:`D_\lambda(P^*\|Q^*)` (the ``"switching-pair"`` route of
:func:`~opacus_structured.tuning.selection_epsilon`).

**The correction, bounded from above.** In :math:`\gamma = e^\varepsilon` the correction is
:math:`C_\lambda = \int_1^\infty \gamma^{-\lambda-1}[H_\gamma(P\|Q) - H_\gamma(Q\|P)]\,d\gamma`.
Both hockey-stick curves are convex and non-increasing in :math:`\gamma`, with closed forms for
their values (:func:`switching_delta`; :math:`H_\gamma(Q\|P) = 0` for
:math:`\gamma \ge 1/(1-p)`, as :math:`Q/P \le 1/(1-p)`) and their slopes (minus the other
law's mass where the likelihood ratio exceeds :math:`\gamma`). On each cell of a grid the chord
lies above a convex curve and the tangent at the cell's left end below it, and both integrate
exactly against :math:`\gamma^{-\lambda-1}`: the chord of :math:`H_\gamma(P\|Q)` minus the
tangent of :math:`H_\gamma(Q\|P)` bounds :math:`C_\lambda` from above, and beyond the grid's
end :math:`H_\gamma(P\|Q)` is charged at its value there. That is an upper bound, never an
estimate; :func:`switching_correction_bounds` also returns the matching lower bound, so the gap
is known (on the default grid it moves :math:`D_\lambda` by less than 0.2 % down to
:math:`p = 10^{-6}`). A relative allowance of :math:`10^{-9}` of the summed terms covers
floating-point rounding in the closed forms.

**Orders.** At integer orders :math:`A_\lambda` is a finite sum (:func:`equivalent_event_rdp`,
equal to dp_accounting's to 1e-12). At a fractional order the bound is the chord of the
log-moment :math:`(\lambda-1)D_\lambda`, convex in :math:`\lambda`, between the neighbouring
integers (:func:`switching_rdp`).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
from scipy import special

from .._validation import check_positive, check_probability
from .profiles import PrivacyProfile, SwitchingProfile

__all__ = ["equivalent_subsampled_gaussian", "switching_delta", "equivalent_event_rdp",
           "switching_correction_bounds", "switching_rdp"]

#: Cells of the correction's grid: on the add curve's support, and from there to the far end
#: (the D-bound's relative gap stays below 0.2 % down to rates of 1e-6, below 0.03 % in the
#: forecast job's settings; ``switching_correction_bounds`` returns both ends).
_FINE_POINTS = 1024
_COARSE_POINTS = 1024
_ROUNDING = 1e-9  # relative allowance for rounding in the closed forms (module docstring)
_LOG_ROUNDING = 1e-12  # the same for the integer-order sum (in log space)


def equivalent_subsampled_gaussian(profile: PrivacyProfile) -> Optional[tuple[float, float]]:
    r"""``(s, p)`` when ``profile`` is the switching profile of
    :math:`(1-p)\mathcal N(0,\sigma) + p\,\mathcal N(m,\sigma)` versus
    :math:`\mathcal N(0, \sigma)` (:math:`m > 0`): the equivalent Poisson-subsampled Gaussian
    has noise multiplier :math:`s = \sigma/m` and rate :math:`p`. ``None`` for any other
    profile (two-sided pairs, weighted profiles, more components)."""
    if not isinstance(profile, SwitchingProfile):
        return None
    upper, lower = profile.pair.upper, profile.pair.lower
    if len(lower.means) != 1 or lower.means[0] != 0.0:
        return None
    means, weights = np.asarray(upper.means), np.asarray(upper.weights)
    keep = weights > 0
    means, weights = means[keep], weights[keep]
    if len(means) == 1:  # p = 0 (only the 0 mean) or p = 1 (only m)
        if means[0] == 0.0:
            return float(upper.sigma), 0.0
        return (float(upper.sigma / means[0]), 1.0) if means[0] > 0 else None
    if len(means) != 2 or means.min() != 0.0 or means.max() <= 0:
        return None
    m = float(means.max())
    return float(upper.sigma / m), float(weights[means == m].sum())


def switching_delta(epsilon, noise_multiplier: float, rate: float, *,
                    direction: str = "remove") -> np.ndarray:
    r"""Closed forms of the equivalent event's hockey-stick curves at :math:`\varepsilon \ge 0`
    (noise multiplier :math:`s`, sensitivity 1, rate :math:`p`; :math:`\alpha = e^\varepsilon`):

    * ``"remove"``, :math:`H_\alpha(P\|Q)` with :math:`x^* = \tfrac12 + s^2\log
      \frac{\alpha - 1 + p}{p}`: :math:`p\,\bar\Phi\big(\frac{x^*-1}{s}\big) - (\alpha - 1 + p)
      \bar\Phi\big(\frac{x^*}{s}\big)`;
    * ``"add"``, :math:`H_\alpha(Q\|P)`, zero for :math:`\alpha \ge 1/(1-p)`, else with
      :math:`x^{**} = \tfrac12 + s^2\log\frac{1/\alpha - 1 + p}{p}`:
      :math:`(1 - \alpha(1-p))\Phi\big(\frac{x^{**}}{s}\big) - \alpha p\,
      \Phi\big(\frac{x^{**}-1}{s}\big)`.
    """
    s = check_positive("noise_multiplier", noise_multiplier)
    p = check_probability("rate", rate, allow_zero=True)
    eps = np.asarray(epsilon, dtype=np.float64)
    if np.any(np.isnan(eps)) or np.any(eps < 0):
        raise ValueError("epsilon must be >= 0 (the curves of epsilon < 0 follow by symmetry)")
    if direction not in ("remove", "add"):
        raise ValueError(f"direction must be 'remove' or 'add', got {direction!r}")
    if p == 0.0:
        return np.zeros_like(eps)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        x, ok = _threshold(eps, s, p, direction)
        if direction == "remove":
            hit = math.log(p) + special.log_ndtr(-(x - 1.0) / s)
            miss = np.log(np.expm1(eps) + p) + special.log_ndtr(-x / s)
            out = np.exp(hit) - np.exp(miss)
        else:
            out = np.zeros_like(eps)
            alpha = np.exp(eps[ok])
            lead = -np.expm1(eps[ok]) + alpha * p  # 1 - alpha (1 - p)
            out[ok] = (lead * special.ndtr(x / s)
                       - alpha * p * special.ndtr((x - 1.0) / s))
    return np.clip(np.nan_to_num(out, nan=0.0), 0.0, 1.0)


def _threshold(eps: np.ndarray, s: float, p: float, direction: str
               ) -> tuple[np.ndarray, Optional[np.ndarray]]:
    r"""``(x, ok)``: where the likelihood ratio crosses :math:`\alpha = e^\varepsilon`,
    :math:`x^* = \tfrac12 + s^2\log\frac{\alpha - 1 + p}{p}` (``"remove"``, at every ε;
    ``ok`` is ``None``) or :math:`x^{**} = \tfrac12 + s^2\log\frac{1/\alpha - 1 + p}{p}`
    at the ε of the mask ``ok`` only, where :math:`1/\alpha - 1 + p > 0` (``"add"``: the
    add curve is 0 elsewhere). Call under ``np.errstate`` (ε = 0 with p = 0 divides)."""
    if direction == "remove":
        # log((alpha - 1 + p)/p), alpha - 1 = expm1(eps)
        return 0.5 + s * s * (np.log(np.expm1(eps) + p) - math.log(p)), None
    inside = np.exp(-eps) - 1.0 + p  # 1/alpha - 1 + p
    ok = inside > 0
    return 0.5 + s * s * (np.log(inside[ok]) - math.log(p)), ok


def equivalent_event_rdp(orders: Sequence[float], noise_multiplier: float,
                         rate: float) -> np.ndarray:
    r"""The equivalent event's Rényi curve :math:`A_\lambda` at **integer** orders, exactly
    (Mironov, Talwar & Zhang 2019, the integer-order sum; what dp_accounting's RDP of
    ``PoissonSampledDpEvent(rate, GaussianDpEvent(noise_multiplier))`` computes there):

    .. math::
       e^{(\lambda-1)A_\lambda} = \sum_{k=0}^{\lambda}\binom{\lambda}{k}(1-p)^{\lambda-k}p^k
       \exp\Big(\frac{k^2-k}{2s^2}\Big),

    summed in log space. Raises for a non-integer order (see :func:`switching_rdp`)."""
    orders = np.asarray(orders, dtype=np.float64)
    if orders.ndim != 1 or np.any(orders < 2) or np.any(orders != np.round(orders)):
        raise ValueError("orders must be integers >= 2 (the closed form is a finite sum)")
    s = check_positive("noise_multiplier", noise_multiplier)
    p = check_probability("rate", rate, allow_zero=True)
    if p == 0.0:
        return np.zeros_like(orders)
    out = np.empty_like(orders)
    log_p = math.log(p)
    log_1mp = math.log1p(-p) if p < 1 else -math.inf
    for i, lam in enumerate(orders):
        # e^{(λ-1)A} - 1 = Σ_{k>=2} Binom(k | λ, p) (exp((k²-k)/2s²) - 1): no cancellation
        k = np.arange(2, int(lam) + 1, dtype=np.float64)
        x = (k * k - k) / (2 * s * s)
        with np.errstate(invalid="ignore", divide="ignore"):
            log_gain = np.where(x > 30, x + np.log1p(-np.exp(-np.minimum(x, 700))),
                                np.log(np.expm1(np.minimum(x, 30))))
            terms = (special.gammaln(lam + 1) - special.gammaln(k + 1)
                     - special.gammaln(lam - k + 1) + k * log_p
                     + np.where(k < lam, (lam - k) * log_1mp, 0.0) + log_gain)
        top = float(np.max(terms))
        if top == -math.inf:
            out[i] = 0.0
            continue
        log_excess = top + math.log(float(np.sum(np.exp(terms - top)))) + _LOG_ROUNDING
        out[i] = float(np.logaddexp(0.0, log_excess)) / (lam - 1)
    return out


def _grid(s: float, p: float) -> np.ndarray:
    """Cell ends in ε: fine on the add curve's support [0, -log(1-p)] (its end is a cell end)
    and near 0, then spread out to where the remove curve's mass is negligible (the tail
    beyond is charged exactly)."""
    eps_add = -math.log1p(-p) if p < 1 else math.inf
    # remove curve: L > ε needs x > 1/2 + s² log((e^ε - 1 + p)/p); at the end chosen here
    # Φ̄((x - 1)/s) < 1e-44, so the tail term is negligible (but still charged).
    x_end = 1.0 + 14.0 * s
    eps_end = max(math.log1p(p * math.expm1(min((x_end - 0.5) / (s * s), 700.0))), 1e-6)
    near = min(eps_add, eps_end)
    fine = np.linspace(0.0, near, _FINE_POINTS + 1)
    if eps_end <= near:
        return fine
    far = near + (eps_end - near) * np.linspace(0.0, 1.0, _COARSE_POINTS + 1)[1:] ** 2
    return np.concatenate([fine, far])


def _slope(epsilon: np.ndarray, s: float, p: float, direction: str) -> np.ndarray:
    r""":math:`dH_\gamma/d\gamma` at :math:`\gamma = e^\varepsilon` (a hockey-stick divergence's
    derivative is minus the mass of the other law where the likelihood ratio exceeds γ):
    :math:`-\bar\Phi(x^*/s)` (remove), :math:`-[(1-p)\Phi(x^{**}/s) + p\Phi((x^{**}-1)/s)]`
    (add; 0 where :math:`\gamma \ge 1/(1-p)`)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        x, ok = _threshold(epsilon, s, p, direction)
        if direction == "remove":
            return -special.ndtr(-x / s)
        out = np.zeros_like(epsilon)
        out[ok] = -((1.0 - p) * special.ndtr(x / s) + p * special.ndtr((x - 1.0) / s))
        return out


def _cell_integrals(eps: np.ndarray, orders: np.ndarray):
    r"""Per order and cell :math:`[a, b] = [e^{\varepsilon_i}, e^{\varepsilon_{i+1}}]`:
    :math:`I_0 = \int_a^b \gamma^{-\lambda-1}d\gamma` and
    :math:`J = \int_a^b \gamma^{-\lambda-1}(\gamma - a)\,d\gamma` (both ≥ 0, computed
    without cancelling the leading terms)."""
    lam = orders[:, None]
    h = np.diff(eps)[None, :]
    start = eps[None, :-1]
    i0 = np.exp(-lam * start) * -np.expm1(-lam * h) / lam
    # J = a^{1-λ} [f(λ-1) - f(λ)], f(c) = (1 - e^{-c h})/c; for small h use the series
    # f(λ-1) - f(λ) = h²/2 - (2λ-1) h³/6 + (3λ²-3λ+1) h⁴/24 - ...
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        direct = -np.expm1(-(lam - 1) * h) / (lam - 1) + np.expm1(-lam * h) / lam
        series = (h * h / 2 - (2 * lam - 1) * h ** 3 / 6
                  + (3 * lam * lam - 3 * lam + 1) * h ** 4 / 24)
    small = lam * h < 1e-3
    diff = np.where(small, series, direct)
    j = np.exp(-(lam - 1) * start) * np.maximum(diff, 0.0)
    return i0, j


def _integral_bounds(eps, values, slopes, orders, cells):
    r"""``(lower, upper)`` of :math:`\int_1^\infty \gamma^{-\lambda-1}H(\gamma)\,d\gamma`
    for a convex, non-increasing :math:`H` known at the cell ends (values and slopes): chords
    above, the tangent at each cell's left end below; the tail beyond the last end takes
    :math:`H` there (upper) or 0 (lower)."""
    i0, j = cells
    gamma = np.exp(eps)
    chord = np.diff(values) / np.diff(gamma)
    upper = i0 @ values[:-1] + (j * chord[None, :]).sum(axis=1)
    lower = i0 @ values[:-1] + (j * slopes[None, :-1]).sum(axis=1)
    upper = upper + values[-1] * np.exp(-orders * eps[-1]) / orders
    return np.maximum(lower, 0.0), upper


def switching_correction_bounds(orders: Sequence[float], noise_multiplier: float,
                                rate: float, *, grid: Optional[np.ndarray] = None
                                ) -> tuple[np.ndarray, np.ndarray]:
    r"""``(lower, upper)`` bounds of :math:`C_\lambda = \int_0^\infty e^{-\lambda\varepsilon}
    [\delta_{\rm rem} - \delta_{\rm add}](\varepsilon)\,d\varepsilon
    = \int_1^\infty \gamma^{-\lambda-1}[H_\gamma(P\|Q) - H_\gamma(Q\|P)]\,d\gamma` at each
    order (module docstring). Both hockey-stick curves are convex and non-increasing in
    :math:`\gamma`: on each cell the chord lies above the curve and the tangent below, and
    both integrate exactly against :math:`\gamma^{-\lambda-1}`; ``grid`` (cell ends in ε,
    starting at 0) defaults to one fine on the add curve's support."""
    s = check_positive("noise_multiplier", noise_multiplier)
    p = check_probability("rate", rate, allow_zero=True)
    orders = np.asarray(orders, dtype=np.float64)
    if orders.ndim != 1 or np.any(orders <= 1):
        raise ValueError("orders must be a 1-d sequence of values > 1")
    if p == 0.0:
        zero = np.zeros_like(orders)
        return zero, zero
    eps = _grid(s, p) if grid is None else np.asarray(grid, dtype=np.float64)
    if eps.ndim != 1 or len(eps) < 2 or eps[0] != 0.0 or np.any(np.diff(eps) <= 0):
        raise ValueError("grid must be increasing cell ends in epsilon, starting at 0")
    cells = _cell_integrals(eps, orders)
    parts = {}
    for direction in ("remove", "add"):
        values = switching_delta(eps, s, p, direction=direction)
        slopes = _slope(eps, s, p, direction)
        parts[direction] = _integral_bounds(eps, values, slopes, orders, cells)
    (rem_lo, rem_hi), (add_lo, add_hi) = parts["remove"], parts["add"]
    slack = _ROUNDING * (rem_hi + add_hi)
    return np.maximum(rem_lo - add_hi - slack, 0.0), rem_hi - add_lo + slack


def _integer_rdp(orders: np.ndarray, s: float, p: float) -> np.ndarray:
    r""":math:`D_\lambda(P^*\|Q^*)` bounded above at integer orders (module docstring)."""
    base = equivalent_event_rdp(orders, s, p)
    _, corr = switching_correction_bounds(orders, s, p)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        scaled = orders * (orders - 1) * corr * np.exp(-(orders - 1) * base)
        out = base + np.log1p(scaled) / (orders - 1)
    return np.where(np.isnan(out), np.inf, out)


def switching_rdp(orders: Sequence[float], noise_multiplier: float, rate: float) -> np.ndarray:
    r"""An upper bound on :math:`D_\lambda(P^*\|Q^*)`, the Rényi divergence of the switching
    pair of noise multiplier :math:`s` (sensitivity 1) and rate :math:`p` (module docstring).

    At an integer order: :math:`A_\lambda + \log\big(1 + \lambda(\lambda-1)\,C_\lambda\,
    e^{-(\lambda-1)A_\lambda}\big)/(\lambda-1)` with :math:`A_\lambda` the equivalent event's
    exact curve (:func:`equivalent_event_rdp`) and :math:`C_\lambda` the correction's upper
    bound. At a fractional order :math:`\lambda \in (n, n+1)`: the log-moment
    :math:`K(\lambda) = (\lambda-1)D_\lambda` is convex in :math:`\lambda` (a cumulant
    generating function; Hölder) with :math:`K(1) = 0`, so it lies below the chord between
    :math:`n` and :math:`n+1` (between 1 and 2 for :math:`\lambda < 2`): a sound bound that
    needs no series (dp_accounting's fractional-order series is slower and, at low orders, no
    tighter in practice; its orders that fail to converge are lost). Orders must be > 1."""
    orders = np.asarray(orders, dtype=np.float64)
    if orders.ndim != 1 or np.any(orders <= 1) or not np.all(np.isfinite(orders)):
        raise ValueError("orders must be a 1-d sequence of finite values > 1")
    s = check_positive("noise_multiplier", noise_multiplier)
    p = check_probability("rate", rate, allow_zero=True)
    integers = np.unique(np.concatenate([np.floor(orders[orders >= 2]), np.ceil(orders)]))
    at = dict(zip(integers.tolist(), _integer_rdp(integers, s, p).tolist(), strict=True))
    at[1.0] = 0.0
    out = np.empty_like(orders)
    for i, lam in enumerate(orders):
        lo, hi = math.floor(lam), math.ceil(lam)
        if lo == hi:
            out[i] = at[float(lo)]
            continue
        k_lo, k_hi = (lo - 1) * at[float(lo)], (hi - 1) * at[float(hi)]
        out[i] = ((hi - lam) * k_lo + (lam - lo) * k_hi) / (lam - 1)
    return out
