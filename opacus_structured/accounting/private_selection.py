r"""Private selection from private candidates: the Rényi DP of repeat-and-select.

A *trial* :math:`M` is one full DP training run plus a DP score of it. The selection procedure
:math:`A` draws a secret number of trials :math:`K` from a law :math:`\mathcal D`, runs
:math:`K` independent trials (each on a candidate drawn uniformly at random, *with
replacement*) and releases only the best one (its configuration and score). Its privacy
follows from the base trial's Rényi DP curve :math:`\rho(\lambda)`
(Papernot & Steinke, "Hyperparameter tuning with Rényi differential privacy", ICLR 2022):

* **Truncated negative binomial** :math:`\mathcal D_{\eta,\gamma}` (shape :math:`\eta > -1`;
  :math:`\eta = 0` logarithmic, :math:`\eta = 1` geometric), Theorem 2: for every
  :math:`\lambda > 1` and every :math:`\hat\lambda > 1`,

  .. math::
     \rho_A(\lambda) \le \rho(\lambda) + (1+\eta)\Big(1-\frac1{\hat\lambda}\Big)\rho(\hat\lambda)
     + \frac{(1+\eta)\log(1/\gamma)}{\hat\lambda} + \frac{\log \mathbb E[K]}{\lambda - 1},

  minimised over :math:`\hat\lambda` on the order grid; then RDP is monotone in the order,
  so each order also takes the smallest bound of the higher orders (exactly dp_accounting's
  ``_compute_rdp_repeat_and_select``).
* **Poisson** :math:`K \sim \mathrm{Poisson}(\mu)` (``eta=None``), Theorem 6: with
  :math:`\hat\varepsilon = \log(1 + 1/(\lambda-1))` and :math:`\hat\delta` the base's δ at
  :math:`\hat\varepsilon`,
  :math:`\rho_A(\lambda) \le \rho(\lambda) + \mu\hat\delta + \log(\mu)/(\lambda-1)`.

:math:`\gamma` is set from the requested mean :math:`\mathbb E[K] = \eta(1-\gamma) /
(\gamma(1-\gamma^\eta))` by bisection, returning the *smaller* end (a larger mean, a larger
:math:`\log(1/\gamma)`: the conservative side), as dp_accounting does. dp_accounting only takes
:math:`\eta \ge 0`; the theorem holds for :math:`\eta \in (-1, \infty)`, and so does this module.

**Pure ε-DP base** (:func:`pure_selection_epsilon`): with :math:`\rho \equiv \varepsilon` and
:math:`\lambda \to \infty`, Theorem 2 gives
:math:`\varepsilon_A = \varepsilon + (1+\eta)\min(\varepsilon, \log(1/\gamma)) \le (2+\eta)\varepsilon`
(its Corollary: :math:`(2+\eta)\varepsilon`); for the geometric law that is Liu & Talwar's
:math:`3\varepsilon` (STOC 2019, Theorem 3.4: stop after each trial with probability
:math:`\gamma`), :func:`liu_talwar_epsilon`.

**RDP from a privacy loss distribution** (:func:`pld_renyi`). For schemes priced by a
dominating pair, the trial's RDP curve comes from the pessimistic PLD of each accounting unit.
Why it is an upper bound: a pessimistic PLD's hockey-stick curve is at least the mechanism's at
every real ε, which by Blackwell's theorem (Dong, Roth & Su 2022, Thm 2.10) means the
mechanism's pair of output laws is a post-processing of the PLD's pair :math:`(P, Q)`, and
Rényi divergences only shrink under post-processing. The PLD's pair may put mass
:math:`\beta_P` on a point :math:`Q` never reaches (its "infinity mass", the tail the grid
stops at) and :math:`\beta_Q = 1 - \sum_\ell p_\ell e^{-\ell}` on a point :math:`P` never
reaches; there its Rényi divergence is infinite. (Where grid round-off or an
upper-bound profile makes :math:`m_Q = \sum_\ell p_\ell e^{-\ell}` exceed 1 — by up to
:math:`10^{-3}`, else it raises — :math:`Q_f` is normalised by it: the pair whose losses are
all raised by :math:`\log m_Q`, a larger hockey-stick curve.) The premise, as for every ε the
package reports from a PLD, is that the pessimistic PLD dominates the mechanism at every ε
down to the grid's lower end, below which the profile leaves at most ~1e-19 of mass. We therefore write
:math:`P = (1-\beta_P) P_f + \beta_P P_\infty`, :math:`Q = (1-\beta_Q) Q_f + \beta_Q Q_\infty`
and use the finite parts, whose divergences in both directions are (with
:math:`p_\ell` the PMF on the good set: the finite losses, optionally without the extreme
ones, whose mass then joins :math:`\beta_P` (top, P-mass) or :math:`\beta_Q` (bottom,
Q-mass); every choice of good set fixed in advance is a valid decomposition, so the smallest
resulting ε over a few is reported)

.. math::
   D_\lambda(P_f\|Q_f) = \tfrac{1}{\lambda-1}\Big[\log \textstyle\sum_\ell p_\ell
   e^{(\lambda-1)\ell} - \lambda \log m_P + (\lambda-1)\log m_Q\Big], \quad
   D_\lambda(Q_f\|P_f) = \tfrac{1}{\lambda-1}\Big[\log \textstyle\sum_\ell p_\ell
   e^{-\lambda\ell} - \lambda\log m_Q + (\lambda-1)\log m_P\Big]

(:math:`m_P = 1-\beta_P`, :math:`m_Q = 1-\beta_Q`). A coupling of each trial with its finite
part differs with probability at most :math:`\beta_P` (resp. :math:`\beta_Q`); over the
:math:`K` trials at most :math:`\mathbb E[K]\beta` (union bound). Hence if the finite-part
procedure is :math:`(\varepsilon, \delta')`-DP, the real one is
:math:`(\varepsilon, \delta' + \mathbb E[K](\beta_P + e^\varepsilon\beta_Q))`-DP, which
:func:`epsilon_with_tail` charges. Accounting units compose: RDP adds, tail masses add (union
bound). One dominating pair of a unit gives *both* orders of its neighbouring outputs
(:math:`A(x)` and :math:`A(x')` are the same procedure run on :math:`P` and on :math:`Q`
through one Blackwell kernel), so each world uses the larger of :math:`D_\lambda(P_f\|Q_f)`
and :math:`D_\lambda(Q_f\|P_f)`, whichever direction the theorem reads; an add/remove PLD
offers two worlds (its remove pair, its add pair reversed) and the smaller final ε of the two
is reported. The moments are computed from
each unit's PLD *before* composition, so no FFT round-off enters them.

**RDP → (ε, δ)** uses the same conversion as dp_accounting (Canonne, Kamath & Steinke 2020,
Prop. 12, with the KL shortcut), via ``dp_accounting.rdp.compute_epsilon``.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant as _rdp

from .._validation import check_finite, check_nonnegative, check_open_unit

__all__ = [
    "DEFAULT_ORDERS",
    "check_mean_trials",
    "check_eta",
    "tnb_mean",
    "tnb_gamma",
    "repeat_and_select_rdp",
    "rdp_epsilon",
    "rdp_delta",
    "pure_selection_epsilon",
    "liu_talwar_epsilon",
    "pure_dp_rdp",
    "pld_renyi",
    "epsilon_with_tail",
    "law_name",
]

#: Rényi orders: dp_accounting's defaults (so the event path and ours use one grid).
DEFAULT_ORDERS = np.asarray(_rdp.DEFAULT_RDP_ORDERS, dtype=np.float64)


def check_mean_trials(mean_trials) -> float:
    """``mean_trials`` = E[K], finite and >= 1 (K >= 1 always, so E[K] >= 1)."""
    value = check_finite("mean_trials", mean_trials)
    if value < 1:
        raise ValueError(f"mean_trials (the expected number of trials E[K]) must be >= 1, "
                         f"got {mean_trials!r}")
    return value


def check_eta(eta) -> Optional[float]:
    """``eta``: ``None`` (Poisson law) or the truncated negative binomial's shape in (-1, inf)."""
    if eta is None:
        return None
    value = check_finite("eta", eta)
    if value <= -1:
        raise ValueError(f"eta (the truncated negative binomial's shape) must be in (-1, inf), "
                         f"or None for the Poisson law; got {eta!r}")
    return value


def law_name(eta: Optional[float]) -> str:
    """Human name of the law of K."""
    if eta is None:
        return "Poisson"
    if eta == 0:
        return "logarithmic (eta=0)"
    if eta == 1:
        return "geometric (eta=1)"
    return f"truncated negative binomial (eta={eta:g})"


def tnb_mean(gamma: float, eta: float) -> float:
    r"""E[K] of the truncated negative binomial :math:`\mathcal D_{\eta,\gamma}`:
    :math:`\eta(1-\gamma)/(\gamma(1-\gamma^\eta))`, its limit :math:`(1-\gamma)/(\gamma
    \log(1/\gamma))` at :math:`\eta = 0` and 1 at :math:`\gamma = 1`."""
    if gamma >= 1:
        return 1.0
    log_g = math.log(gamma)
    # (1-g)/g / ((g**eta - 1)/(eta*log g) * (-log g)) written to stay stable near eta=0
    x = eta * log_g
    expm1_over_x = 1.0 if x == 0 else math.expm1(x) / x
    return (1 - gamma) / (gamma * expm1_over_x * (-log_g))


def drawn_mean_trials(mean_trials: float, eta: Optional[float]) -> float:
    """E[K] of the law actually drawn: the sampler uses :func:`tnb_gamma`'s γ, whose mean can
    exceed the asked one by the solver's tolerance, so the price takes the larger (the
    Poisson law is drawn at its mean exactly)."""
    if eta is None:
        return mean_trials
    return max(mean_trials, tnb_mean(tnb_gamma(mean_trials, eta), eta))


def tnb_gamma(mean_trials: float, eta: float, tolerance: float = 1e-12) -> float:
    r""":math:`\gamma` with :math:`\mathbb E[K] = ` ``mean_trials``; bisection returning the
    smaller end (the conservative side: a larger :math:`\log(1/\gamma)`)."""
    mean_trials = check_mean_trials(mean_trials)
    eta = check_eta(eta)
    if eta is None:
        raise ValueError("tnb_gamma needs a finite eta (None is the Poisson law)")
    if mean_trials == 1:
        return 1.0
    if eta == 1:
        return 1.0 / mean_trials
    lo, hi = 0.0, 1.0  # mean decreases in gamma: mean(0+) = inf, mean(1) = 1
    while hi > lo * (1 + tolerance):
        mid = (lo + hi) / 2
        if tnb_mean(mid, eta) < mean_trials:
            hi = mid
        else:
            lo = mid
    return lo


def repeat_and_select_rdp(orders: Sequence[float], rdp: Sequence[float], *,
                          mean_trials: float, eta: Optional[float],
                          delta_at: Optional[Callable[[float], float]] = None) -> np.ndarray:
    r"""RDP curve of repeat-and-select from the base trial's curve (module docstring).

    Args:
        orders, rdp: the base trial's RDP, :math:`\rho(\lambda_i)` (orders > 1 are used).
        mean_trials: E[K] >= 1.
        eta: the truncated negative binomial's shape (> -1), or ``None`` for Poisson.
        delta_at: Poisson law only: the base's δ at a given ε, if a tighter sound value than
            the RDP conversion is known; default the RDP conversion (dp_accounting's
            ``compute_delta``, what its ``RepeatAndSelectDpEvent`` uses).
    """
    mean_trials = check_mean_trials(mean_trials)
    eta = check_eta(eta)
    orders = np.asarray(orders, dtype=np.float64)
    rdp = np.asarray(rdp, dtype=np.float64)
    if orders.shape != rdp.shape or orders.ndim != 1:
        raise ValueError(f"orders and rdp must be 1-d of one length, got {orders.shape} and "
                         f"{rdp.shape}")
    if np.any(np.isnan(rdp)) or np.any(rdp < 0):
        raise ValueError("rdp values must be >= 0 (not NaN)")
    out = np.full_like(orders, np.inf)
    usable = orders > 1
    if eta is None:
        for i in np.nonzero(usable)[0]:
            eps_hat = math.log1p(1.0 / (orders[i] - 1))
            d_hat = (delta_at(eps_hat) if delta_at is not None
                     else _rdp.compute_delta(orders, rdp, eps_hat)[0])
            out[i] = rdp[i] + mean_trials * d_hat + math.log(mean_trials) / (orders[i] - 1)
        return out
    gamma = tnb_gamma(mean_trials, eta)
    mean_trials = drawn_mean_trials(mean_trials, eta)
    with np.errstate(invalid="ignore"):
        hat = (1 - 1 / orders[usable]) * rdp[usable] - math.log(gamma) / orders[usable]
    c = (1 + eta) * float(np.min(hat))
    out[usable] = rdp[usable] + math.log(mean_trials) / (orders[usable] - 1) + c
    # RDP is non-decreasing in the order: a higher order's bound holds at a lower one.
    return np.minimum.accumulate(out[::-1])[::-1] if np.all(np.diff(orders) > 0) else \
        np.array([min(out[j] for j in range(len(orders)) if orders[i] <= orders[j])
                  for i in range(len(orders))])


def rdp_epsilon(orders: Sequence[float], rdp: Sequence[float], delta: float) -> float:
    """ε(δ) from an RDP curve: dp_accounting's conversion (Canonne, Kamath & Steinke 2020,
    Prop. 12); ``inf`` when no order gives a finite value."""
    delta = check_open_unit("delta", delta)
    return float(_rdp.compute_epsilon(list(orders), list(rdp), delta)[0])


def rdp_delta(orders: Sequence[float], rdp: Sequence[float], epsilon: float) -> float:
    """δ(ε) from an RDP curve (dp_accounting's ``compute_delta``)."""
    epsilon = check_nonnegative("epsilon", epsilon)
    return float(_rdp.compute_delta(list(orders), list(rdp), epsilon)[0])


def pure_dp_rdp(epsilon: float, orders: Sequence[float]) -> np.ndarray:
    r"""RDP of an ε-DP mechanism: :math:`\min(\varepsilon, \lambda\varepsilon^2/2)` (the
    trivial bound and Bun & Steinke 2016, Prop. 3.3)."""
    epsilon = check_nonnegative("epsilon", epsilon)
    orders = np.asarray(orders, dtype=np.float64)
    return np.minimum(epsilon, orders * epsilon ** 2 / 2)


def pure_selection_epsilon(epsilon: float, *, mean_trials: float, eta: float) -> float:
    r"""Pure DP of repeat-and-select over an ε-DP base with K ~ TNB(η, γ): Theorem 2 of
    Papernot & Steinke at :math:`\lambda \to \infty` (so :math:`\rho \equiv \varepsilon`),
    the infimum over :math:`\hat\lambda > 1` taken in closed form:
    :math:`\varepsilon + (1+\eta)\min(\varepsilon, \log(1/\gamma)) \le (2+\eta)\varepsilon`.
    The Poisson law has no pure-DP form (its Theorem 6 needs a δ)."""
    epsilon = check_nonnegative("epsilon", epsilon)
    mean_trials = check_mean_trials(mean_trials)
    eta = check_eta(eta)
    if eta is None:
        raise ValueError("eta=None (the Poisson law) has no pure-DP selection bound; use a "
                         "truncated negative binomial (eta in (-1, inf)) or an (epsilon, "
                         "delta) target")
    gamma = tnb_gamma(mean_trials, eta)
    return epsilon + (1 + eta) * min(epsilon, -math.log(gamma))


def liu_talwar_epsilon(epsilon: float, stop_probability: float | None = None) -> float:
    r"""Liu & Talwar (STOC 2019, Thm 3.4): stopping after each trial of an ε-DP base with
    probability :math:`\gamma \in (0, 1]` (K geometric, mean :math:`1/\gamma`) is
    :math:`3\varepsilon`-DP, whatever :math:`\gamma`."""
    epsilon = check_nonnegative("epsilon", epsilon)
    if stop_probability is not None:
        gamma = check_finite("stop_probability", stop_probability)
        if not 0 < gamma <= 1:
            raise ValueError(f"stop_probability must be in (0, 1], got {stop_probability!r}")
    return 3 * epsilon


def _pmf_arrays(pmf) -> tuple[np.ndarray, np.ndarray, float]:
    """(losses, probabilities, infinity mass) of a dp_accounting PLD PMF (dense or sparse)."""
    d = float(pmf._discretization)
    if hasattr(pmf, "_probs"):
        probs = np.asarray(pmf._probs, dtype=np.float64)
        losses = (pmf._lower_loss + np.arange(len(probs))) * d
    else:
        items = sorted(pmf._loss_probs.items())
        losses = np.asarray([k for k, _ in items], dtype=np.float64) * d
        probs = np.asarray([v for _, v in items], dtype=np.float64)
    keep = probs > 0
    return losses[keep], probs[keep], float(pmf._infinity_mass)


def _logsumexp(x: np.ndarray) -> float:
    m = float(np.max(x))
    return m + math.log(float(np.sum(np.exp(x - m))))


def _cut(losses: np.ndarray, probs: np.ndarray, cut: float) -> slice:
    r"""The good set: drop the highest losses while their P-mass stays <= ``cut`` and the
    lowest while their Q-mass (:math:`p e^{-\ell}`) stays <= ``cut``."""
    if cut <= 0:
        return slice(0, len(probs))
    top = np.cumsum(probs[::-1])
    hi = len(probs) - int(np.searchsorted(top, cut, side="right"))
    bottom = np.cumsum(np.exp(np.log(probs) - losses))
    lo = int(np.searchsorted(bottom, cut, side="right"))
    return slice(lo, max(hi, lo + 1))


def _pmf_renyi(pmf, orders: np.ndarray, cut: float = 0.0) -> tuple[np.ndarray, float, float]:
    """Both-direction Rényi divergences of one PMF's good parts, and (β_P, β_Q)."""
    losses, probs, infinity_mass = _pmf_arrays(pmf)
    if len(probs) == 0:
        raise ValueError("the privacy loss distribution has no finite mass")
    q_off_support = max(0.0, 1.0 - float(np.exp(_logsumexp(np.log(probs) - losses))))
    good = _cut(losses, probs, cut)
    beta_p = max(infinity_mass, 0.0) + float(np.sum(probs[good.stop:]))
    beta_q = q_off_support + float(np.sum(np.exp(np.log(probs[:good.start])
                                                  - losses[:good.start])))
    beta_p += float(np.sum(probs[:good.start]))  # P-mass of the cut bottom (tiny)
    beta_q += float(np.sum(np.exp(np.log(probs[good.stop:]) - losses[good.stop:])))
    losses, probs = losses[good], probs[good]
    # the exact distance of P from its finite part also covers mass the PMF dropped
    beta_p = max(beta_p, 1.0 - float(np.sum(probs)))
    log_p = np.log(probs)
    log_mp = math.log(float(np.sum(probs)))
    log_mq = _logsumexp(log_p - losses)
    if log_mq > 1e-3:
        raise ValueError(f"not a privacy loss distribution of a pair of distributions: "
                         f"sum p e^-l = {math.exp(log_mq):.12g} > 1")
    # m_Q > 1 (grid round-off, or a PMF built from an upper-bound profile): Q_f = p e^-l / m_Q
    # is the pair with every loss raised by log m_Q, whose hockey-stick curve is larger
    # (pessimistic); the formulas then hold as is.
    out = np.empty_like(orders)
    for i, lam in enumerate(orders):
        # m_P > 1 (round-off): P is not scaled down in the forward direction (that would
        # lower every loss); each term takes the larger of the two readings.
        fwd = (_logsumexp(log_p + (lam - 1) * losses) - lam * min(log_mp, 0.0)
               + (lam - 1) * log_mq) / (lam - 1)
        rev = (_logsumexp(log_p - lam * losses) - lam * log_mq
               + (lam - 1) * log_mp) / (lam - 1)
        out[i] = max(fwd, rev, 0.0)
    return out, beta_p, beta_q


def pld_renyi(pld, orders: Sequence[float] = DEFAULT_ORDERS, *,
              cut: float = 0.0) -> list[tuple[np.ndarray, float]]:
    r"""Rényi bounds of one accounting unit's dp_accounting ``PrivacyLossDistribution``, one
    ``(rdp, tail_mass)`` per *world* (module docstring): the remove PMF's pair, then (for an
    asymmetric PLD) the add PMF's pair reversed. Each world's pair alone dominates the ordered
    pair of the unit's outputs, so each gives a valid bound, used on its own (never mixed
    order by order): ``rdp`` is the larger of its two Rényi divergences at each order, and
    ``tail_mass`` its :math:`\beta_P + \beta_Q`. ``cut`` > 0 also moves the highest losses
    (P-mass up to ``cut``) and the lowest (Q-mass up to ``cut``) out of the finite parts, into
    the tail masses. Orders must be > 1."""
    orders = np.asarray(orders, dtype=np.float64)
    if np.any(orders <= 1):
        raise ValueError("orders must be > 1")
    pmfs = [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]
    worlds = []
    for pmf in pmfs:
        rdp, beta_p, beta_q = _pmf_renyi(pmf, orders, cut)
        worlds.append((rdp, beta_p + beta_q))
    return worlds


def epsilon_with_tail(orders: Sequence[float], rdp: Sequence[float], delta: float, *,
                      tail_mass: float, mean_trials: float, share: float = 1e-3) -> float:
    r"""ε at δ of a procedure whose finite part has RDP ``rdp`` and whose trials each leave
    the finite part with probability at most ``tail_mass`` (:math:`\beta_P + \beta_Q`):
    the RDP conversion at :math:`\delta' = (1-\text{share})\delta`, checked to leave
    :math:`\mathbb E[K]\,e^{\varepsilon}\beta \le \delta - \delta'` (module docstring).
    Raises ``ValueError`` when the tail mass is too large for this δ."""
    delta = check_open_unit("delta", delta)
    tail_mass = check_nonnegative("tail_mass", tail_mass)
    if tail_mass == 0:
        return rdp_epsilon(orders, rdp, delta)
    reserve = share * delta
    eps = rdp_epsilon(orders, rdp, delta - reserve)
    charged = mean_trials * math.exp(min(eps, 700.0)) * tail_mass
    if not charged <= reserve:
        raise ValueError(
            f"the privacy loss distributions' truncated tail mass ({tail_mass:.3g} per trial, "
            f"{charged:.3g} over the trials at epsilon={eps:.3g}) exceeds {share:g} x delta="
            f"{reserve:.3g}; use a larger delta or a finer discretization")
    return eps
