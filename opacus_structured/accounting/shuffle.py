r"""Shuffled fixed-size batches (DP-SGD with ``DataLoader(shuffle=True)``): a sound upper bound
and a labelled lower bound.

**Mechanism.** Each epoch draws a uniformly random permutation of the :math:`n` examples (a
fresh one per epoch) and cuts it into :math:`K` consecutive batches of :math:`B` (the last one
partial, or dropped with ``drop_last``); every step adds :math:`\mathcal N(0, \sigma^2C^2I)` to
the sum of the clipped gradients of its batch. Chua et al. call its linear-query core
:math:`\mathrm{ABLQ}_S` ("How Private are DP-SGD Implementations?", ICML 2024).

**Neighbouring relations.** The dataset size :math:`n` is public (it fixes :math:`K`, which the
released run reveals: removing an example outright can change the number of steps, which no
finite ε covers). The relations priced are therefore of fixed size:

* ``"zero-out"`` — one example is replaced by a ghost whose clipped gradient is 0 (Kairouz et
  al. 2021; the relation of Chua et al. 2024): add/remove with the example's slot kept.
  Sensitivity :math:`\Delta = 1` (in units of :math:`C`).
* ``"replace-one"`` — one example is replaced by another (substitution): :math:`\Delta = 2`.

**Upper bound (a guarantee, no amplification).** Condition on the permutations: the two
neighbouring datasets then differ in exactly one batch per epoch, by a vector of norm
:math:`\le \Delta`, and every other batch is identical. One epoch is the adaptive composition
of :math:`K` Gaussian mechanisms of which one has sensitivity :math:`\le\Delta` and the others
0, i.e. :math:`(\Delta/\sigma)`-GDP (Dong, Roth & Su 2022, Cor. 3.3); :math:`E` epochs are
:math:`\mu`-GDP with

.. math:: \mu = \Delta\sqrt{E}/\sigma

and, since the permutations are drawn the same way under both datasets, mixing over them keeps
the bound (joint convexity of the hockey-stick divergence). The exact profile of μ-GDP is
:func:`~opacus_structured.accounting.gaussian.gdp_delta`. A *partial* epoch (a loop that breaks
mid-epoch) is priced as a full one: its examples may have been in any of its batches. Epochs at
different noise multipliers compose to :math:`\mu^2 = \Delta^2\sum_e \sigma_e^{-2}`, each epoch
at the smallest σ used in it (:func:`shuffle_mu`).

**Lower bound (NOT a guarantee, labelled ``BoundKind.LOWER``).** Chua et al. (ICML 2024,
§4; NeurIPS 2024, "Scalable DP-SGD: Shuffling vs. Poisson Subsampling", §3) take the 1-d
gradients :math:`-1` for every other example and :math:`+1` for the differing one. After
shifting by the public batch sums, one epoch's output is, under the two neighbours,

.. math::

    P = \mathrm{MoG}(m_P),\quad Q = \mathrm{MoG}(m_Q),\qquad
    \mathrm{MoG}(m) = \frac1K\sum_{t=1}^K \mathcal N(m\,e_t, \sigma^2 I_K),

with :math:`(m_P, m_Q) = (2, 1)` for zero-out (the ghost contributes 0) and :math:`(2, 0)` for
replace-one (the replacement has gradient :math:`-1`). The statistic :math:`s = \max_t y_t`
(a post-processing) has the closed-form CDF

.. math:: F_m(c) = \Pr_{\mathrm{MoG}(m)}[s \le c] = \Phi\!\Big(\frac{c-m}{\sigma}\Big)\,
          \Phi\!\Big(\frac{c}{\sigma}\Big)^{K-1}.

Any event :math:`S` gives :math:`\delta(\varepsilon) \ge P(S) - e^\varepsilon Q(S)` for the
true mechanism (a distinguishing test): :func:`single_epoch_delta_lower_bound` maximises it over
the "cube" events :math:`\{s > c\}` (and :math:`\{s \le c\}` for the other direction). For
:math:`E` epochs (fresh permutations: the epochs' outputs are independent) the NeurIPS paper
composes the PLD of :math:`s` binned on a grid: :func:`lower_bound_pmf` bins :math:`s`
(binning is post-processing), rounds each bin's privacy loss :math:`\log P(b)/Q(b)` *down* to
the grid (a smaller loss can only lower δ), keeps every bin (the two tails are bins: no mass is
dropped), and :func:`multi_epoch_delta_lower_bound` composes it by FFT convolution, dropping
only mass below ``1e-30`` per entry (dropping mass can only lower δ). Both directions are
computed and the larger δ kept. The lower bound is what shuffling costs *at least*; compared
with Poisson subsampling at :math:`q = 1/K` it shows when reporting Poisson's ε for a shuffled
loader under-reports.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from dp_accounting.pld import pld_pmf
from scipy import signal, special

from .._validation import check_int, check_open_unit, check_positive
from .gaussian import gdp_delta, gdp_epsilon

__all__ = [
    "RELATIONS",
    "SENSITIVITY",
    "LOWER_BOUND_MEANS",
    "shuffle_mu",
    "shuffle_epsilon",
    "shuffle_delta",
    "mog_max_log_cdf",
    "single_epoch_delta_lower_bound",
    "lower_bound_pmf",
    "multi_epoch_delta_lower_bound",
    "epsilon_lower_bound",
]

RELATIONS = ("zero-out", "replace-one")
#: Sensitivity Δ of one epoch's release (in units of the clip norm C) per relation.
SENSITIVITY = {"zero-out": 1.0, "replace-one": 2.0}
#: Means (m_P, m_Q) of the Chua et al. lower-bound pair per relation.
LOWER_BOUND_MEANS = {"zero-out": (2.0, 1.0), "replace-one": (2.0, 0.0)}

_DROP = 1e-30  # composed-PMF entries below this are dropped (lowers δ: still a lower bound)
_MAX_ENTRIES = 20_000_000


def _check_relation(relation: str) -> str:
    if relation not in RELATIONS:
        raise ValueError(f"relation must be one of {RELATIONS}, got {relation!r}")
    return relation


# ---- upper bound --------------------------------------------------------------------------
def shuffle_mu(noise_multipliers: Sequence[float], relation: str = "zero-out") -> float:
    r""":math:`\mu = \Delta\sqrt{\sum_e \sigma_e^{-2}}` of epochs priced at noise multipliers
    ``noise_multipliers`` (one entry per epoch, each the smallest σ used in that epoch)."""
    delta_sens = SENSITIVITY[_check_relation(relation)]
    total = 0.0
    for i, s in enumerate(noise_multipliers):
        total += check_positive(f"noise_multipliers[{i}]", s) ** -2
    return delta_sens * math.sqrt(total)


def shuffle_epsilon(noise_multiplier: float, epochs: int, delta: float,
                    relation: str = "zero-out") -> float:
    r"""Exact ε(δ) of :math:`E` shuffled epochs: μ-GDP with :math:`\mu = \Delta\sqrt E/\sigma`
    (module docstring). ``epochs`` counts every epoch begun (a partial epoch is a full one)."""
    sigma = check_positive("noise_multiplier", noise_multiplier)
    epochs = check_int("epochs", epochs, minimum=0)
    delta = check_open_unit("delta", delta)
    return gdp_epsilon(delta, SENSITIVITY[_check_relation(relation)] * math.sqrt(epochs) / sigma)


def shuffle_delta(noise_multiplier: float, epochs: int, epsilon: float,
                  relation: str = "zero-out") -> float:
    r"""Exact δ(ε) of :math:`E` shuffled epochs (μ-GDP, :math:`\mu = \Delta\sqrt E/\sigma`)."""
    sigma = check_positive("noise_multiplier", noise_multiplier)
    epochs = check_int("epochs", epochs, minimum=0)
    return gdp_delta(epsilon, SENSITIVITY[_check_relation(relation)] * math.sqrt(epochs) / sigma)


# ---- lower bound (Chua et al. 2024) ---------------------------------------------------------
def mog_max_log_cdf(c, mean: float, noise_multiplier: float, steps_per_epoch: int):
    r""":math:`\log F_m(c) = \log\Phi((c-m)/\sigma) + (K-1)\log\Phi(c/\sigma)`: log-probability
    that :math:`\max_t y_t \le c` under :math:`\mathrm{MoG}(m)` (exact, log space)."""
    c = np.asarray(c, dtype=np.float64)
    return (special.log_ndtr((c - mean) / noise_multiplier)
            + (steps_per_epoch - 1) * special.log_ndtr(c / noise_multiplier))


def _log_sf(log_cdf):
    """log(1 - F) from log F, stable for F near 0 and near 1."""
    log_cdf = np.minimum(np.asarray(log_cdf, dtype=np.float64), 0.0)
    with np.errstate(divide="ignore"):
        return np.where(log_cdf > -math.log(2), np.log(-np.expm1(log_cdf)),
                        np.log1p(-np.exp(log_cdf)))


def _checked(noise_multiplier, steps_per_epoch, relation):
    return (check_positive("noise_multiplier", noise_multiplier),
            check_int("steps_per_epoch", steps_per_epoch, minimum=1),
            LOWER_BOUND_MEANS[_check_relation(relation)])


def single_epoch_delta_lower_bound(noise_multiplier: float, steps_per_epoch: int, epsilon,
                                   relation: str = "zero-out", *, caps=None) -> np.ndarray:
    r"""LOWER BOUND on δ(ε) of one shuffled epoch (Chua et al., ICML 2024): the largest
    :math:`P(S) - e^\varepsilon Q(S)` over the events :math:`S = \{\max_t y_t > c\}` and the
    reverse direction :math:`Q(S') - e^\varepsilon P(S')`, :math:`S' = \{\max_t y_t \le c\}`,
    for :math:`c` on ``caps`` (default a grid of step σ/200 over the bulk of both laws).

    Each term is exact (closed-form CDFs), so the result is a certain lower bound on the
    mechanism's δ(ε) at each ε (never a guarantee). Returns an array shaped like ``epsilon``.
    """
    sigma, k, (m_p, m_q) = _checked(noise_multiplier, steps_per_epoch, relation)
    eps = np.atleast_1d(np.asarray(epsilon, dtype=np.float64))
    if caps is None:
        lo = min(m_q, 0.0) - 10.0 * sigma
        hi = m_p + sigma * (10.0 + math.sqrt(2.0 * math.log(k + 1.0)))
        caps = np.arange(lo, hi, sigma / 200.0)
    caps = np.asarray(caps, dtype=np.float64)
    log_fp = mog_max_log_cdf(caps, m_p, sigma, k)
    log_fq = mog_max_log_cdf(caps, m_q, sigma, k)
    sf_p, sf_q = np.exp(_log_sf(log_fp)), np.exp(_log_sf(log_fq))
    cdf_p, cdf_q = np.exp(log_fp), np.exp(log_fq)
    out = np.empty_like(eps)
    for i, e in enumerate(eps):
        w = math.exp(e)
        out[i] = max(0.0, float(np.max(sf_p - w * sf_q)), float(np.max(cdf_q - w * cdf_p)))
    return out if np.ndim(epsilon) else out[:1].reshape(())


def lower_bound_pmf(noise_multiplier: float, steps_per_epoch: int, relation: str = "zero-out",
                    *, discretization: float = 1e-3, reverse: bool = False):
    r"""Optimistic PLD of the binned statistic :math:`s = \max_t y_t` of one epoch.

    Returns ``(lower_loss_index, probs)``: ``probs[j]`` is the mass, under the upper
    distribution (:math:`P`; :math:`Q` with ``reverse``), of privacy loss
    ``(lower_loss_index + j) * discretization``. Bins of width :math:`d\sigma^2/|m_P-m_Q|`
    (the loss changes by about ``d`` per bin) cover :math:`[c_{lo}, c_{hi}]`; the two tails
    :math:`s \le c_{lo}`, :math:`s > c_{hi}` are one bin each, so every outcome is kept. Each
    bin's loss :math:`\log P(b)/Q(b)` (exact, log space) is rounded *down*: a lower bound.
    """
    sigma, k, (m_p, m_q) = _checked(noise_multiplier, steps_per_epoch, relation)
    d = check_positive("discretization", discretization)
    if reverse:
        m_p, m_q = m_q, m_p
    lo = min(m_p, m_q, 0.0) - sigma * 9.0
    hi = max(m_p, m_q) + sigma * (9.0 + math.sqrt(2.0 * math.log(k + 1.0)))
    gap = d * sigma * sigma / abs(m_p - m_q)
    count = int(math.ceil((hi - lo) / gap))
    if count > _MAX_ENTRIES:
        raise ValueError(f"the lower bound needs {count} bins at discretization={d:g}; use a "
                         f"coarser discretization")
    edges = lo + gap * np.arange(count + 1)
    lp = mog_max_log_cdf(edges, m_p, sigma, k)
    lq = mog_max_log_cdf(edges, m_q, sigma, k)

    def log_bins(log_cdf):
        a, b = log_cdf[:-1], log_cdf[1:]          # log F(left), log F(right), b >= a
        with np.errstate(divide="ignore"):
            inner = a + np.log(np.maximum(np.expm1(np.maximum(b - a, 0.0)), 0.0))
        low_tail = log_cdf[0]
        high_tail = _log_sf(log_cdf[-1])
        return np.concatenate([[low_tail], inner, [high_tail]])

    log_p, log_q = log_bins(lp), log_bins(lq)
    keep = np.isfinite(log_p)                      # bins of zero P-mass carry nothing
    if np.any(keep & ~np.isfinite(log_q)):         # Q underflowed where P did not: drop them
        keep &= np.isfinite(log_q)                 # (dropping P-mass lowers δ: still a bound)
    losses = np.floor((log_p[keep] - log_q[keep]) / d).astype(np.int64)
    mass = np.exp(log_p[keep])
    low = int(losses.min())
    probs = np.bincount(losses - low, weights=mass)
    return low, probs


def _compose(low: int, probs: np.ndarray, times: int) -> tuple[int, np.ndarray]:
    """``times``-fold convolution by repeated squaring (FFT), dropping entries below _DROP."""

    def trim(lo, p):
        p = np.where(p < _DROP, 0.0, p)
        nz = np.nonzero(p)[0]
        if len(nz) == 0:
            return lo, np.zeros(1)
        return lo + int(nz[0]), p[nz[0]:nz[-1] + 1]

    def conv(a, b):
        (la, pa), (lb, pb) = a, b
        if len(pa) + len(pb) > _MAX_ENTRIES:
            raise ValueError("the composed lower-bound PLD is too large; use a coarser "
                             "discretization")
        return trim(la + lb, np.maximum(signal.fftconvolve(pa, pb), 0.0))

    result = None
    base = trim(low, probs)
    while times:
        if times & 1:
            result = base if result is None else conv(result, base)
        times >>= 1
        if times:
            base = conv(base, base)
    return result


def _composed_pmfs(noise_multiplier, steps_per_epoch, epochs, relation, discretization):
    """The two directions' composed optimistic PMFs (dp_accounting ``DensePLDPmf``)."""
    out = []
    for reverse in (False, True):
        low, probs = _compose(*lower_bound_pmf(noise_multiplier, steps_per_epoch, relation,
                                               discretization=discretization,
                                               reverse=reverse), epochs)
        out.append(pld_pmf.DensePLDPmf(discretization, low, probs, 0.0, False))
    return out


def multi_epoch_delta_lower_bound(noise_multiplier: float, steps_per_epoch: int, epochs: int,
                                  epsilon, relation: str = "zero-out", *,
                                  discretization: float = 1e-3):
    r"""LOWER BOUND on δ(ε) after ``epochs`` shuffled epochs (Chua et al., NeurIPS 2024): the
    larger direction of the ``epochs``-fold composition of :func:`lower_bound_pmf`, and for one
    epoch also :func:`single_epoch_delta_lower_bound`. Never a guarantee."""
    epochs = check_int("epochs", epochs, minimum=0)
    eps = np.atleast_1d(np.asarray(epsilon, dtype=np.float64))
    if np.any(np.isnan(eps)):
        raise ValueError("epsilon must not be NaN")
    out = np.zeros_like(eps)
    if epochs > 0:
        for pmf in _composed_pmfs(noise_multiplier, steps_per_epoch, epochs, relation,
                                  check_positive("discretization", discretization)):
            out = np.maximum(out, np.asarray(pmf.get_delta_for_epsilon(eps), dtype=np.float64))
        if epochs == 1:
            out = np.maximum(out, single_epoch_delta_lower_bound(
                noise_multiplier, steps_per_epoch, eps, relation))
    return out if np.ndim(epsilon) else float(out[0])


def epsilon_lower_bound(noise_multiplier: float, steps_per_epoch: int, epochs: int,
                        delta: float, relation: str = "zero-out", *,
                        discretization: float = 1e-3) -> float:
    r"""LOWER BOUND on ε(δ) after ``epochs`` shuffled epochs (NOT a guarantee).

    The larger of: each direction's composed optimistic PLD's ε(δ) (dp_accounting's
    ``get_epsilon_for_delta`` on :func:`lower_bound_pmf` composed ``epochs`` times), and for
    one epoch the largest ε with :func:`single_epoch_delta_lower_bound` ``> delta`` (bisection
    to relative 1e-9, rounded down). Every valid ε of this mechanism at ``delta`` is at least
    this large; 0 when no test beats ``delta``.
    """
    delta = check_open_unit("delta", delta)
    epochs = check_int("epochs", epochs, minimum=0)
    if epochs == 0:
        return 0.0
    best = 0.0
    for pmf in _composed_pmfs(noise_multiplier, steps_per_epoch, epochs, relation,
                              check_positive("discretization", discretization)):
        best = max(best, float(pmf.get_epsilon_for_delta(delta)))
    if epochs == 1:
        def f(e):
            return float(single_epoch_delta_lower_bound(noise_multiplier, steps_per_epoch, e,
                                                        relation))
        if f(0.0) > delta:
            lo, hi = 0.0, 1.0
            while f(hi) > delta and hi < 1e4:
                lo, hi = hi, hi * 2.0
            while hi - lo > 1e-9 * hi:
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if f(mid) > delta else (lo, mid)
            best = max(best, lo)
    return best
