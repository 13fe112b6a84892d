r"""A privacy filter over Rényi-DP curves: one (ε, δ) cap for adaptively chosen releases.

The problem (issue 46, "one privacy budget per dataset"). Several releases touch one private
dataset: a private search, the retrain of its winner, two forecast runs, two engines. Each
release is chosen *after* seeing the outputs of the earlier ones (which model to retrain,
whether to train longer, at which σ), so their privacy parameters are themselves random.
Composition theorems that fix the parameters in advance do not cover that; a **privacy
filter** does (Rogers, Roth, Ullman & Vadhan 2016): a stopping rule, fixed up front with the
cap :math:`(\varepsilon, \delta)`, that refuses any release that would take the total past it,
such that the whole interaction — however the releases were chosen — is
:math:`(\varepsilon, \delta)`-DP.

**The route: a Rényi filter (Feldman & Zrnic 2021) at each of a fixed grid of orders, joined
by a union bound over the orders.** For one order :math:`\alpha > 1`, Feldman & Zrnic
("Individual privacy accounting via a Rényi filter", NeurIPS 2021, Thm 3.1; also Lécuyer 2021,
"Practical privacy filters and odometers with Rényi DP") show that releases whose RDP
parameters :math:`\rho_t(\alpha)` are chosen adaptively (predictably: known before release
:math:`t`) compose as long as :math:`\sum_t \rho_t(\alpha) \le B`. The argument, which we need
in a slightly stronger form: with :math:`L_t` the privacy loss of the first :math:`t`
outputs (under the dataset :math:`x`, against a neighbour :math:`x'`) and
:math:`R_t(\alpha) = \sum_{s \le t}\rho_s(\alpha)`,

.. math:: M_t^\alpha = \exp\big((\alpha-1)(L_t - R_t(\alpha))\big)

is a non-negative supermartingale with :math:`M_0 = 1`, because
:math:`\mathbb E[e^{(\alpha-1)\ell_t}\mid\mathcal F_{t-1}] = e^{(\alpha-1)D_\alpha(P_t\|Q_t)}
\le e^{(\alpha-1)\rho_t(\alpha)}` whatever the mechanism chosen at step :math:`t`. Hence
:math:`\mathbb E[M_T^\alpha] \le 1` at any stopping time :math:`T` (optional stopping and
Fatou).

* **Conversion to (ε, δ) (Canonne, Kamath & Steinke 2020, Prop. 12)**, pointwise: for every
  real :math:`x`, :math:`(1-e^{\varepsilon-x})_+ \le c_\alpha(\varepsilon)\,e^{(\alpha-1)x}`
  with :math:`c_\alpha(\varepsilon) = \tfrac1\alpha(1-\tfrac1\alpha)^{\alpha-1}
  e^{-(\alpha-1)\varepsilon}` (the maximum of the ratio, at
  :math:`e^x = \alpha e^\varepsilon/(\alpha-1)`). The hockey-stick divergence of the whole
  interaction is :math:`\delta(\varepsilon) = \mathbb E_x[(1-e^{\varepsilon-L_T})_+]`.
* **Several orders: a union bound.** The filter keeps going while *some* order
  :math:`\alpha \in \Lambda` has :math:`R_T(\alpha) \le B_\alpha`. The final transcript then
  lies in :math:`\bigcup_\alpha A_\alpha`, :math:`A_\alpha = \{R_T(\alpha) \le B_\alpha\}`, and

  .. math::
     \delta(\varepsilon) \le \sum_{\alpha\in\Lambda} \mathbb E\big[(1-e^{\varepsilon-L_T})_+
     \mathbf 1_{A_\alpha}\big] \le \sum_\alpha c_\alpha(\varepsilon)\, e^{(\alpha-1)B_\alpha}
     \,\mathbb E[M_T^\alpha] \le \sum_\alpha c_\alpha(\varepsilon)\,e^{(\alpha-1)B_\alpha}.

  With :math:`B_\alpha = \varepsilon - \mathrm{off}_\alpha`,
  :math:`\mathrm{off}_\alpha = \log(1-1/\alpha) - (\log\delta' + \log\alpha)/(\alpha-1)` and
  :math:`\delta' = \delta_{\rm rdp}/|\Lambda|`, each term is :math:`\delta'`: the total is
  :math:`\delta_{\rm rdp}`. (Taking the best order *after* the fact, at the full δ, is what a
  non-adaptive RDP accountant does; under full adaptivity the best order is itself random, and
  we do not rely on an unproven shortcut: the union bound costs :math:`\log|\Lambda|/(\alpha-1)`
  in ε, e.g. 0.15 at α = 21 with the 21 default orders.)
* **Tail masses** (releases priced from a pessimistic PLD whose grid leaves mass
  :math:`\beta_P` where :math:`Q` has none, and :math:`\beta_Q` the reverse;
  :mod:`~opacus_structured.accounting.private_selection`): release :math:`t`'s laws are
  :math:`P_t = (1-\beta_{P,t})P_{f,t} + \beta_{P,t}P_{\infty,t}` and
  :math:`Q_t = (1-\beta_{Q,t})Q_{f,t} + \beta_{Q,t}Q_{\infty,t}`, and the curve charged is the
  Rényi divergence of the finite parts. A fixed share of δ (:data:`TAIL_SHARE`, 1 %),
  :math:`B = \text{tail\_share}\cdot\delta`, bounds the tail masses: the filter also refuses a
  release that would take :math:`\sum_t(\beta_{P,t}+\beta_{Q,t})` past :math:`B`, so along
  every transcript both sums stay :math:`\le B` (the β are predictable). Then, for any set
  :math:`S` of transcripts, :math:`P(S) \le P_f(S) + B` (the transcript leaves the finite parts
  with probability :math:`\le B`) and :math:`Q(S) \ge (1-B)\,Q_f(S)` (transcript by transcript,
  :math:`\prod_t(1-\beta_{Q,t}) \ge 1-B`); with the finite parts
  :math:`(\varepsilon, \delta_{\rm rdp})`-close as above,
  :math:`P(S) \le \tfrac{e^\varepsilon}{1-B}Q(S) + \delta_{\rm rdp} + B`. So a total with a tail
  is reported at :math:`\varepsilon + \log\tfrac{1}{1-B}` (:math:`B \approx 10^{-7}`: in the
  seventh decimal) and δ is :math:`\delta_{\rm rdp} + B = \delta`. Poisson-subsampled Gaussian
  and Gaussian releases have exact RDP curves and no tail.

**Why not the other filters the issue names.** Smith & Thakurta's fully adaptive GDP
composition (:mod:`~opacus_structured.accounting.individual_gdp`, Thm 2 of the seeds' paper 002)
needs every release to be μ-GDP; a Poisson-subsampled Gaussian step has no finite μ that bounds
it at every δ (its CLT limit is no bound), so DP-SGD steps could not be charged. Whitehouse et
al. (ICML 2023) give filters that match advanced composition for releases described by
:math:`(\varepsilon_t, \delta_t)`, and an approximate-zCDP filter (one order); for DP-SGD's
many amplified steps an (ε, δ) description per step composes far worse than RDP, and zCDP is a
single line through the RDP curve. The Rényi filter takes the exact RDP curve of each step
(dp_accounting's ``RdpAccountant`` for the Poisson-subsampled Gaussian) at every order.

**What is reported.** :meth:`RenyiFilter.epsilon` of a total curve is
:math:`\min_\alpha (R(\alpha) + \mathrm{off}_\alpha)`: the smallest cap whose filter would have
admitted every release so far (rounded up). It is ≥ the non-adaptive RDP ε of the same
releases (dp_accounting's conversion at the full δ), hence ≥ their true ε. The guarantee of the
whole interaction is the cap (ε, δ); when the releases were not chosen adaptively, the reported
value is also a valid ε of what ran.

This module is pure math (numpy, dp_accounting; no torch, no files): the file-backed budget is
:class:`opacus_structured.dataset_budget.DatasetBudget`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence

import numpy as np

from .._validation import check_finite, check_open_unit, check_positive
from .private_selection import pld_renyi
from .quiet_rdp import subsampled_gaussian_rdp

__all__ = ["DEFAULT_ORDERS", "TAIL_SHARE", "RenyiFilter", "route_label", "check_curve",
           "gaussian_rdp", "poisson_gaussian_rdp", "pld_rdp", "event_rdp", "rdp_at_orders"]

#: Rényi orders of the filter: 21 orders from 1.25 to 256 (the union bound costs
#: :math:`\log 21/(\alpha-1)` in ε; a finer grid is tighter at its best order and costlier
#: everywhere). Covers the optimal orders of ε from ~0.3 (α ~ 64) to ~30 (α ~ 1.25) at
#: δ = 1e-5.
DEFAULT_ORDERS: tuple = (1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0,
                         16.0, 20.0, 24.0, 32.0, 48.0, 64.0, 128.0, 256.0)

#: Share of δ set aside for the tail masses of releases priced from pessimistic PLDs.
TAIL_SHARE = 0.01


def route_label(orders: Sequence[float]) -> str:
    """The route's label, stored in the budget file (``budget.route``)."""
    lo, hi = min(orders), max(orders)
    return (f"rdp-filter (Feldman & Zrnic 2021; union bound over {len(orders)} orders "
            f"{lo:g}..{hi:g}; Canonne-Kamath-Steinke conversion)")


def _check_orders(orders) -> tuple:
    values = tuple(check_finite("orders", o) for o in orders)
    if not values:
        raise ValueError("orders must hold at least one Renyi order")
    if any(o <= 1 for o in values):
        raise ValueError(f"Renyi orders must be > 1, got {min(values)!r}")
    if len(set(values)) != len(values) or list(values) != sorted(values):
        raise ValueError("orders must be increasing, without repeats")
    return values


def check_curve(name: str, curve, orders: Sequence[float]) -> np.ndarray:
    """A per-order RDP curve as a float64 array of ``len(orders)`` values in [0, inf]
    (``inf`` where an order has no finite bound); raises ``ValueError`` naming ``name``."""
    try:
        values = np.asarray(curve, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a sequence of {len(orders)} numbers (one per Renyi "
                         f"order), got {curve!r}") from None
    if values.shape != (len(orders),):
        raise ValueError(f"{name} must hold one value per Renyi order ({len(orders)}), got "
                         f"{values.size}")
    if np.any(np.isnan(values)) or np.any(values < 0):
        raise ValueError(f"{name} must be >= 0 at every order (inf allowed), got {curve!r}")
    return values


@dataclasses.dataclass(frozen=True)
class RenyiFilter:
    r"""The Rényi filter of cap ``(epsilon, delta)`` over ``orders`` (module docstring).

    Args:
        epsilon: the cap ε > 0.
        delta: the cap δ in (0, 1).
        orders: Rényi orders (> 1, increasing); default :data:`DEFAULT_ORDERS`.
        tail_share: share of δ set aside for tail masses, in [0, 1).
    """

    epsilon: float
    delta: float
    orders: tuple = DEFAULT_ORDERS
    tail_share: float = TAIL_SHARE

    def __post_init__(self):
        object.__setattr__(self, "epsilon", check_positive("epsilon", self.epsilon))
        object.__setattr__(self, "delta", check_open_unit("delta", self.delta))
        object.__setattr__(self, "orders", _check_orders(self.orders))
        share = check_finite("tail_share", self.tail_share)
        if not 0 <= share < 1:
            raise ValueError(f"tail_share must be in [0, 1), got {self.tail_share!r}")
        object.__setattr__(self, "tail_share", share)

    @property
    def route(self) -> str:
        return route_label(self.orders)

    @property
    def order_array(self) -> np.ndarray:
        return np.asarray(self.orders, dtype=np.float64)

    @property
    def rdp_delta(self) -> float:
        r"""δ of the RDP part, :math:`(1-\text{tail\_share})\delta`."""
        return self.delta * (1.0 - self.tail_share)

    @property
    def tail_budget(self) -> float:
        r"""δ set aside for tail masses, :math:`\text{tail\_share}\cdot\delta`."""
        return self.delta * self.tail_share

    def offsets(self) -> np.ndarray:
        r""":math:`\mathrm{off}_\alpha = \log(1-1/\alpha) - (\log\delta'+\log\alpha)/(\alpha-1)`
        with :math:`\delta' = \delta_{\rm rdp}/|\Lambda|`: ε of order α is
        :math:`R(\alpha) + \mathrm{off}_\alpha`."""
        a = self.order_array
        log_delta = math.log(self.rdp_delta) - math.log(len(a))
        return np.log1p(-1.0 / a) - (log_delta + np.log(a)) / (a - 1.0)

    def budgets(self) -> np.ndarray:
        r"""Per-order RDP budgets :math:`B_\alpha = \varepsilon - \mathrm{off}_\alpha` (the
        filter admits a total while some order is within its budget)."""
        return self.epsilon - self.offsets()

    def tail_epsilon(self) -> float:
        r"""What a total with a tail adds to ε: :math:`\log\frac{1}{1-B}`, :math:`B` the tail
        budget (module docstring)."""
        return -math.log1p(-self.tail_budget)

    def epsilon_of(self, curve, tail_mass: float = 0.0) -> float:
        r"""ε reported for a total ``curve`` (per order) and total ``tail_mass``:
        :math:`\max(0, \min_\alpha R(\alpha) + \mathrm{off}_\alpha)`, plus
        :meth:`tail_epsilon` when ``tail_mass`` > 0, rounded up by a relative :math:`10^{-12}`
        (never below the exact value); ``inf`` when no order is finite or the tail mass is over
        its share of δ; 0 for nothing charged."""
        values = check_curve("curve", curve, self.orders)
        tail_mass = check_finite("tail_mass", tail_mass)
        if tail_mass < 0:
            raise ValueError(f"tail_mass must be >= 0, got {tail_mass!r}")
        if tail_mass == 0 and not np.any(values):
            return 0.0  # nothing released: no privacy loss (the conversion's floor is not one)
        if tail_mass > self.tail_budget:
            return math.inf
        eps = values + self.offsets()
        best = float(np.min(eps))
        if not math.isfinite(best):
            return math.inf
        best = max(best, 0.0) + (self.tail_epsilon() if tail_mass > 0 else 0.0)
        return best + 1e-12 * max(abs(best), 1e-300) if best > 0 else 0.0

    def admits(self, curve, tail_mass: float = 0.0) -> bool:
        """Whether a total ``curve`` (and ``tail_mass``) is within the cap: the filter lets the
        release that brings the total there go ahead."""
        return self.epsilon_of(curve, tail_mass) <= self.epsilon

    def best_order(self, curve) -> Optional[float]:
        """The order attaining :meth:`epsilon_of` (``None`` if none is finite)."""
        eps = check_curve("curve", curve, self.orders) + self.offsets()
        if not np.any(np.isfinite(eps)):
            return None
        return float(self.orders[int(np.argmin(eps))])


# ---- per-release curves ---------------------------------------------------------------------
def gaussian_rdp(noise_multiplier: float, orders: Sequence[float]) -> np.ndarray:
    r"""RDP of one Gaussian mechanism of sensitivity 1 and noise multiplier σ:
    :math:`\alpha/(2\sigma^2)` (Mironov 2017, Prop. 7), exact; μ-GDP is σ = 1/μ."""
    sigma = check_positive("noise_multiplier", noise_multiplier)
    return np.asarray(orders, dtype=np.float64) / (2.0 * sigma * sigma)


def poisson_gaussian_rdp(sample_rate: float, noise_multiplier: float,
                         orders: Sequence[float]) -> np.ndarray:
    r"""RDP of one Poisson-subsampled Gaussian step (add/remove relation, both directions),
    by dp_accounting's ``RdpAccountant`` (Mironov, Talwar & Zhang 2019: the exact Rényi
    divergence of the dominating mixture pair, in log space). An order whose series does not
    converge is ``inf`` (left out: the curve stays an upper bound). ``sample_rate`` = 1 is the
    Gaussian mechanism. Cached per ``(q, σ, orders)`` (read-only array)."""
    q = check_finite("sample_rate", sample_rate)
    if not 0 < q <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    sigma = check_positive("noise_multiplier", noise_multiplier)
    return _poisson_curve(q, sigma, tuple(float(o) for o in orders))


@functools.lru_cache(maxsize=256)
def _poisson_curve(q: float, sigma: float, orders: tuple) -> np.ndarray:
    if q == 1.0:
        values = gaussian_rdp(sigma, orders)
    else:  # an order whose series fails (nan) is inf here
        values = subsampled_gaussian_rdp(q, sigma, orders)
        if values is None:
            raise RuntimeError("this dp_accounting has no _compute_rdp_poisson_subsampled_"
                               "gaussian: install the version setup.cfg pins")
        values = _upper_curve(values)
    values.setflags(write=False)
    return values


def event_rdp(event, orders: Sequence[float]) -> np.ndarray:
    """RDP curve of a dp_accounting ``DpEvent`` on ``orders`` (its ``RdpAccountant``; raises
    ``ValueError`` for an event that accountant cannot price)."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    accountant = rdp.RdpAccountant(list(map(float, orders)))
    if not accountant.supports(event):
        raise ValueError(f"dp_accounting's RdpAccountant cannot price the event {event!r}; "
                         f"charge an RDP curve (rdp=...) instead")
    accountant.compose(event)
    return _upper_curve(accountant._rdp)  # noqa: SLF001


def _upper_curve(values) -> np.ndarray:
    """dp_accounting's curve as an upper bound: an order whose series failed (``nan``) is
    ``inf``, a negative value (rounding) is 0; float64, flat."""
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    return np.maximum(np.where(np.isnan(values), np.inf, values), 0.0)


def pld_rdp(pld, orders: Sequence[float]) -> tuple[np.ndarray, float]:
    r"""``(curve, tail_mass)`` of one release from its pessimistic dp_accounting PLD: the
    Rényi divergences (both directions) of the PLD pair's finite parts and the pair's tail
    mass :math:`\beta_P + \beta_Q` (:func:`~opacus_structured.accounting.private_selection.
    pld_renyi`, which proves it an upper bound). An add/remove PLD offers two worlds (each
    valid on its own, never mixed order by order); the one with the smaller total over the
    orders is used."""
    worlds = pld_renyi(pld, np.asarray(orders, dtype=np.float64))
    curve, tail = min(worlds, key=lambda w: (float(np.sum(np.minimum(w[0], 1e300))), w[1]))
    return np.asarray(curve, dtype=np.float64), float(tail)


def rdp_at_orders(source_orders: Sequence[float], source_rdp: Sequence[float],
                  orders: Sequence[float]) -> np.ndarray:
    r"""An RDP bound given at ``source_orders`` carried to ``orders``: Rényi divergence is
    non-decreasing in the order, so order α takes the bound of the smallest source order
    :math:`\ge \alpha` (``inf`` where there is none)."""
    src = np.asarray(source_orders, dtype=np.float64)
    vals = np.asarray(source_rdp, dtype=np.float64)
    sort = np.argsort(src)
    src, vals = src[sort], vals[sort]
    # the bound at a source order also holds at every lower order: suffix minimum
    vals = np.minimum.accumulate(vals[::-1])[::-1]
    out = np.full(len(orders), np.inf)
    for i, a in enumerate(np.asarray(orders, dtype=np.float64)):
        j = int(np.searchsorted(src, a - 1e-12, side="left"))
        if j < len(src):
            out[i] = vals[j]
    return out
