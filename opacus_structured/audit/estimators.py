r"""Empirical ε lower bounds from membership-attack scores (numpy / scipy and the accounting
core; no torch).

An audit runs the mechanism ``R`` times **with** a canary and ``R`` times **without** it and
records one attack score per run (higher = "the canary is present"). A threshold ``t`` turns the
scores into a test of :math:`H_0` "without" against :math:`H_1` "with" with

.. math::

    \mathrm{FPR}(t) = \Pr_{\text{without}}[s \ge t], \qquad
    \mathrm{FNR}(t) = \Pr_{\text{with}}[s < t].

If the mechanism is :math:`(\varepsilon, \delta)`-DP, every test obeys both
:math:`1 - \mathrm{FNR} \le e^{\varepsilon}\,\mathrm{FPR} + \delta` and
:math:`1 - \mathrm{FPR} \le e^{\varepsilon}\,\mathrm{FNR} + \delta` (Kairouz, Oh & Viswanath,
"The composition theorem for differential privacy", ICML 2015, Theorem 2.1), hence

.. math::

    \varepsilon \;\ge\; \max\Bigl(\ln\frac{1-\delta-\mathrm{FNR}}{\mathrm{FPR}},\;
                                   \ln\frac{1-\delta-\mathrm{FPR}}{\mathrm{FNR}}\Bigr).

Both right-hand sides decrease in FPR and FNR, so replacing the rates by **upper** confidence
bounds gives an ε that is a lower bound with the bounds' confidence (Jagielski, Ullman & Oprea,
"Auditing differentially private machine learning: how private is private SGD?", NeurIPS 2020;
Nasr, Song, Thakurta, Papernot & Carlini, "Adversary instantiation: lower bounds for
differentially private machine learning", IEEE S&P 2021). Everything returned here is an
:class:`EpsilonLowerBound`: it can expose a pipeline that leaks more than its accountant says,
it can never certify that a pipeline is private.

**Choosing the threshold from the same data** (the default, ``threshold_selection="bonferroni"``)
is valid because the Clopper–Pearson bands are simultaneous over all thresholds. For the false
positives, fix a count ``k`` and let :math:`t^*` be the largest threshold with
:math:`\mathrm{FPR}(t^*) > U_k`, where :math:`U_k` is the one-sided Clopper–Pearson upper bound
at level :math:`\alpha_k` for ``k`` of ``n`` (Clopper & Pearson, Biometrika 1934). Any threshold
``t`` with at most ``k`` "without" scores at or above it and :math:`\mathrm{FPR}(t) > U_k` has
:math:`t \le t^*`, so the count at :math:`t^*` is at most ``k``; that count is binomial with rate
above :math:`U_k`, an event of probability at most :math:`\alpha_k`. Hence
:math:`\Pr[\exists t:\ \mathrm{count}(t) \le k,\ \mathrm{FPR}(t) > U_k] \le \alpha_k` for any score
distribution (ties included). We fix before seeing the data a grid ``G`` of counts (every count
below 10, then counts growing by 10 %, :func:`count_grid`), bound the FPR at a threshold with
count ``k`` by :math:`U_{k'}` for the smallest :math:`k' \in G` with :math:`k' \ge k` (``1`` past
the grid), and take :math:`\alpha_k = \alpha / (2|G|)`: by the union bound the FPR band holds at
every threshold at once with probability :math:`\ge 1 - \alpha/2`; the FNR band likewise. The
grid keeps :math:`|G|` near :math:`10 + \ln(n/10) / \ln 1.1` (76 for n = 5000) instead of ``n``.
``threshold_selection="split"`` instead picks the threshold on a random part of the runs and
bounds the rates on the rest at level :math:`\alpha/2` each (the threshold is independent of the
evaluation part, so no multiplicity correction). A ``threshold=`` given in advance is evaluated
on all runs at :math:`\alpha/2` per rate.

jax_privacy's ``CanaryScoreAuditor.epsilon_clopper_pearson`` (2.0.0) is the peer; its
``Bonferroni()`` strategy divides the significance by the number of thresholds left on the
convex hull of the empirical ROC, a count chosen after seeing the data (usually smaller than our
:math:`|G|`, and without the rounding to the grid), so our Bonferroni bound is a little smaller
(more conservative); its ``Explicit`` and ``Split`` strategies equal ours exactly
(``tests/test_audit_estimators.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from scipy import optimize, special, stats

from .._validation import check_finite, check_int, check_open_unit
from ..accounting.gaussian import gdp_epsilon

__all__ = [
    "AuditScores",
    "EpsilonLowerBound",
    "epsilon_lower_bound",
    "one_run_epsilon_lower_bound",
    "roc_curve",
    "clopper_pearson_upper",
    "count_grid",
    "METHODS",
    "THRESHOLD_SELECTIONS",
]

#: Estimators of :func:`epsilon_lower_bound`.
METHODS = ("clopper-pearson", "gdp")
#: How :func:`epsilon_lower_bound` may choose its threshold from the data.
THRESHOLD_SELECTIONS = ("bonferroni", "split")


def _scores(name: str, value) -> np.ndarray:
    arr = np.asarray(value, dtype=float)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of scores (one per run), got shape "
                         f"{arr.shape}")
    if arr.size < 2:
        raise ValueError(f"{name} must hold >= 2 scores (one per run), got {arr.size}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite, got {int(np.sum(~np.isfinite(arr)))} "
                         f"non-finite scores")
    return arr


def _confidence(value) -> float:
    value = check_finite("confidence", value)
    if not 0.5 <= value < 1:
        raise ValueError(f"confidence must be in [0.5, 1), got {value!r}")
    return value


@dataclass(frozen=True)
class AuditScores:
    """The scores of a multi-run audit: one attack score per independent run.

    ``scores_with[i]`` is the score of run ``i`` trained **with** the canary,
    ``scores_without[j]`` of run ``j`` trained **without** it; higher means "the canary is
    present". ``reported_epsilon`` is what the accountant reports for the pipeline at ``delta``
    (``math.inf`` allowed); ``meta`` records the settings (scheme, σ, steps, canary design, ...).
    """

    scores_with: np.ndarray
    scores_without: np.ndarray
    reported_epsilon: float
    delta: float
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "scores_with", _scores("scores_with", self.scores_with))
        object.__setattr__(self, "scores_without",
                           _scores("scores_without", self.scores_without))
        eps = float(self.reported_epsilon)
        if math.isnan(eps) or eps < 0:
            raise ValueError(f"reported_epsilon must be >= 0 (inf allowed), got "
                             f"{self.reported_epsilon!r}")
        object.__setattr__(self, "reported_epsilon", eps)
        object.__setattr__(self, "delta", check_open_unit("delta", self.delta))
        if not isinstance(self.meta, dict):
            raise ValueError(f"meta must be a dict, got {type(self.meta).__name__}")

    @property
    def runs(self) -> int:
        """Total number of runs (with and without the canary)."""
        return int(self.scores_with.size + self.scores_without.size)

    def lower_bound(self, *, confidence: float = 0.95, method: str = "clopper-pearson",
                    **kwargs) -> "EpsilonLowerBound":
        """:func:`epsilon_lower_bound` of these scores at their ``delta``."""
        return epsilon_lower_bound(self.scores_with, self.scores_without, delta=self.delta,
                                   confidence=confidence, method=method, **kwargs)


@dataclass(frozen=True)
class EpsilonLowerBound:
    """An **empirical lower bound** on ε at ``delta``: with probability at least
    ``confidence`` over the audit's runs, the mechanism is not (ε', δ)-DP for any
    ε' < ``epsilon`` (under ``assumption`` when it is set). Never a privacy guarantee.

    ``threshold`` is the score threshold that attains the bound (``None`` for the one-run
    estimator), ``runs`` the number of runs used (with + without), ``kind`` always
    ``"empirical lower bound"``. Deliberately not a number (no ``__float__``): read
    ``.epsilon`` knowing it is a lower bound, so it cannot slip in where a guarantee is asked.
    """

    epsilon: float
    threshold: Optional[float]
    method: str
    confidence: float
    delta: float
    runs: int
    assumption: Optional[str] = None
    kind: str = field(default="empirical lower bound", init=False)

    def to_dict(self) -> dict:
        return {"epsilon_lower_bound": self.epsilon, "threshold": self.threshold,
                "method": self.method, "confidence": self.confidence, "delta": self.delta,
                "runs": self.runs, "assumption": self.assumption, "kind": self.kind}

    def __str__(self) -> str:
        text = (f"epsilon >= {self.epsilon:.4g} at delta = {self.delta:g} (EMPIRICAL LOWER BOUND "
                f"with {self.confidence:.0%} confidence, {self.method}, {self.runs} runs; "
                f"not a privacy guarantee)")
        return text if self.assumption is None else f"{text}; assumes {self.assumption}"


def clopper_pearson_upper(k, n: int, alpha: float) -> np.ndarray:
    r"""One-sided Clopper–Pearson upper confidence bound on a binomial rate.

    With ``k`` successes in ``n`` trials, :math:`U = \mathrm{Beta}^{-1}(1-\alpha;\, k+1,\, n-k)`
    for ``k < n`` and ``1`` for ``k = n`` satisfies :math:`\Pr[p > U] \le \alpha` for every true
    rate ``p`` (Clopper & Pearson, "The use of confidence or fiducial limits illustrated in the
    case of the binomial", Biometrika 26, 1934).
    """
    k = np.asarray(k)
    with np.errstate(invalid="ignore"):
        upper = stats.beta.ppf(1 - alpha, k + 1, np.maximum(n - k, 1))
    return np.where(k < n, upper, 1.0)


def count_grid(n: int) -> np.ndarray:
    """The counts at which the simultaneous bands of :func:`epsilon_lower_bound` are set, fixed
    before the data: every count below ``min(n, 10)``, then ``ceil(10 · 1.1^j)`` below ``n``."""
    n = check_int("n", n, minimum=1)
    grid = set(range(min(n, 10)))
    x = 10.0
    while x < n:
        grid.add(int(math.ceil(x)))
        x *= 1.1
    return np.array(sorted(k for k in grid if k < n), dtype=np.int64)


def _band_upper(counts, n: int, alpha: float) -> np.ndarray:
    """Simultaneous (over every threshold) upper bounds on a rate with ``counts`` of ``n`` at
    total level ``alpha``: the count rounded up to :func:`count_grid` at ``alpha / |grid|``."""
    grid = count_grid(n)
    idx = np.searchsorted(grid, counts, side="left")
    rounded = np.where(idx < grid.size, grid[np.minimum(idx, grid.size - 1)], n)
    # at most |grid| + 1 distinct counts: the Beta quantile once per count, not per threshold
    # (a 10^6-run audit spent ~14 s in scipy's beta.ppf over repeated values)
    values, inverse = np.unique(rounded, return_inverse=True)
    return clopper_pearson_upper(values, n, alpha / grid.size)[inverse.reshape(rounded.shape)]


def _rates_counts(scores_with: np.ndarray, scores_without: np.ndarray,
                  thresholds: Optional[np.ndarray] = None):
    """Thresholds (every score and +inf unless given) with their false-positive and
    false-negative counts: ``fp = #{without >= t}``, ``fn = #{with < t}``."""
    if thresholds is None:
        thresholds = np.concatenate([np.union1d(scores_with, scores_without), [np.inf]])
    fp = scores_without.size - np.searchsorted(np.sort(scores_without), thresholds, side="left")
    fn = np.searchsorted(np.sort(scores_with), thresholds, side="left")
    return thresholds, fp, fn


def roc_curve(scores_with, scores_without) -> tuple[np.ndarray, np.ndarray]:
    """Empirical ROC of the threshold attack "present iff score >= t": arrays ``(fpr, tpr)``
    over every threshold, increasing, from ``(0, 0)`` to ``(1, 1)``."""
    w = _scores("scores_with", scores_with)
    wo = _scores("scores_without", scores_without)
    thresholds, fp, fn = _rates_counts(w, wo)
    fpr = fp[::-1] / wo.size
    tpr = (w.size - fn[::-1]) / w.size
    return np.concatenate([[0.0], fpr]), np.concatenate([[0.0], tpr])


def _cp_epsilons(fpr_u: np.ndarray, fnr_u: np.ndarray, delta: float) -> np.ndarray:
    """ε lower bound at each threshold from upper bounds on FPR and FNR."""
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(1 - delta - fnr_u > 0, np.log(np.maximum(1 - delta - fnr_u, 1e-300))
                     - np.log(fpr_u), -np.inf)
        b = np.where(1 - delta - fpr_u > 0, np.log(np.maximum(1 - delta - fpr_u, 1e-300))
                     - np.log(fnr_u), -np.inf)
    return np.maximum(a, b)


def _gdp_mus(fpr_u: np.ndarray, fnr_u: np.ndarray) -> np.ndarray:
    r""":math:`\mu \ge \Phi^{-1}(1-\mathrm{FPR}_u) - \Phi^{-1}(\mathrm{FNR}_u)` at each threshold:
    a μ-GDP mechanism has :math:`\mathrm{FNR} \ge \Phi(\Phi^{-1}(1-\mathrm{FPR}) - \mu)` (Dong,
    Roth & Su 2022, Eq. 6), decreasing in both rates, so upper bounds give a lower bound."""
    return stats.norm.isf(fpr_u) - stats.norm.ppf(fnr_u)


_GDP_ASSUMPTION = ("the mechanism's trade-off curve is Gaussian (mu-GDP for some mu): the bound "
                   "is on mu and converted to epsilon(delta) of mu-GDP")


def _split(scores: np.ndarray, rng: np.random.Generator, fraction: float):
    perm = rng.permutation(scores.size)
    cut = int(scores.size * fraction)
    return scores[perm[:cut]], scores[perm[cut:]]


def epsilon_lower_bound(scores_with, scores_without, *, delta: float, confidence: float = 0.95,
                        method: str = "clopper-pearson", threshold: Optional[float] = None,
                        threshold_selection: str = "bonferroni", split_fraction: float = 0.5,
                        seed: int = 0) -> EpsilonLowerBound:
    r"""Empirical lower bound on ε(δ) from a multi-run audit's scores.

    ``method="clopper-pearson"`` (no assumption on the mechanism): for each threshold ``t``,
    one-sided Clopper–Pearson upper bounds :math:`\mathrm{FPR}_u, \mathrm{FNR}_u` at level
    :math:`\alpha/2` each (Bonferroni over the two rates, :math:`\alpha = 1 - \text{confidence}`)
    and

    .. math::

        \varepsilon_{lb} = \max\Bigl(0,\ \max_t \max\bigl(
            \ln\tfrac{1-\delta-\mathrm{FNR}_u(t)}{\mathrm{FPR}_u(t)},\
            \ln\tfrac{1-\delta-\mathrm{FPR}_u(t)}{\mathrm{FNR}_u(t)}\bigr)\Bigr).

    ``method="gdp"`` (Nasr, Hayes, Steinke, Balle, Tramèr, Jagielski, Carlini & Terzis, "Tight
    auditing of differentially private machine learning", USENIX Security 2023, §4): the same
    bounds give :math:`\mu_{lb} = \max(0, \max_t \Phi^{-1}(1-\mathrm{FPR}_u) -
    \Phi^{-1}(\mathrm{FNR}_u))`, reported as ε(δ) of :math:`\mu_{lb}`-GDP
    (:func:`opacus_structured.accounting.gaussian.gdp_epsilon`). Tighter with few runs,
    but a lower bound on ε **only if** the mechanism's trade-off curve is Gaussian (a single
    Gaussian release of a Dirac canary is; a subsampled or composed one need not be); the result
    carries that ``assumption``. jax_privacy 2.0.0's ``epsilon_from_gdp`` takes
    :math:`|\mu|` instead, which reads a test worse than random (:math:`\mathrm{FPR}_u +
    \mathrm{FNR}_u > 1`) as evidence of leakage; we do not.

    Threshold choice (module docstring): ``threshold`` fixed in advance, else
    ``threshold_selection="bonferroni"`` (bands simultaneous over every threshold:
    :math:`\alpha/(2|G|)` per count of the grid ``G``) or ``"split"`` (pick ``t`` on a
    ``split_fraction`` of the runs drawn with ``seed``, bound the rest).

    Args:
        scores_with, scores_without: one score per run, >= 2 each, finite; higher = present.
        delta: δ in (0, 1).
        confidence: in [0.5, 1); the bound holds with at least this probability.
    """
    w = _scores("scores_with", scores_with)
    wo = _scores("scores_without", scores_without)
    delta = check_open_unit("delta", delta)
    confidence = _confidence(confidence)
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if threshold_selection not in THRESHOLD_SELECTIONS:
        raise ValueError(f"threshold_selection must be one of {', '.join(THRESHOLD_SELECTIONS)}, "
                         f"got {threshold_selection!r}")
    alpha = 1.0 - confidence
    runs = int(w.size + wo.size)

    def best(sw, swo, thresholds, simultaneous=False):
        t, fp, fn = _rates_counts(sw, swo, thresholds)
        upper = _band_upper if simultaneous else clopper_pearson_upper
        fpr_u, fnr_u = upper(fp, swo.size, alpha / 2), upper(fn, sw.size, alpha / 2)
        values = _gdp_mus(fpr_u, fnr_u) if method == "gdp" else _cp_epsilons(fpr_u, fnr_u, delta)
        i = int(np.argmax(values))
        return max(0.0, float(values[i])), float(t[i])

    if threshold is not None:
        threshold = check_finite("threshold", threshold)
        value, t = best(w, wo, np.array([threshold]))
    elif threshold_selection == "split":
        split_fraction = check_open_unit("split_fraction", split_fraction)
        rng = np.random.default_rng(check_int("seed", seed))
        w1, w2 = _split(w, rng, split_fraction)
        wo1, wo2 = _split(wo, rng, split_fraction)
        if min(w1.size, w2.size, wo1.size, wo2.size) < 1:
            raise ValueError(f"split_fraction = {split_fraction} leaves an empty part of "
                             f"{w.size} / {wo.size} runs; pick it in (1/runs, 1 - 1/runs)")
        _, t = best(w1, wo1, None)
        value, t = best(w2, wo2, np.array([t]))
    else:
        value, t = best(w, wo, None, simultaneous=True)
    if method == "gdp":
        return EpsilonLowerBound(gdp_epsilon(delta, value), t, method, confidence, delta, runs,
                                 assumption=_GDP_ASSUMPTION)
    return EpsilonLowerBound(value, t, method, confidence, delta, runs)


def _one_run_p_value(m: int, guesses: int, correct: int, eps: float, delta: float) -> float:
    r"""Probability bound of ``correct`` or more right guesses out of ``guesses`` under (ε, δ)-DP
    (Steinke, Nasr & Jagielski 2023, Theorem 3): with :math:`q = e^\varepsilon/(1+e^\varepsilon)`
    and :math:`\beta = \Pr[\mathrm{Bin}(r, q) \ge v]`,

    .. math::

        p = \beta + 2m\delta\,\max_{1 \le i \le v}
            \frac{\Pr[\mathrm{Bin}(r, q) \ge v - i] - \beta}{i}.
    """
    q = special.expit(eps)
    beta = stats.binom.sf(correct - 1, guesses, q)
    if delta == 0 or correct == 0:
        return float(beta)
    i = np.arange(1, correct + 1)
    alpha = np.max((stats.binom.sf(correct - i - 1, guesses, q) - beta) / i, initial=0.0)
    return float(min(beta + alpha * delta * 2 * m, 1.0))


def one_run_epsilon_lower_bound(guesses_correct: int, guesses_made: int, num_canaries: int, *,
                                delta: float, confidence: float = 0.95) -> EpsilonLowerBound:
    r"""Empirical ε lower bound from **one** training run (Steinke, Nasr & Jagielski, "Privacy
    auditing with one (1) training run", NeurIPS 2023, Theorem 3).

    ``num_canaries`` = m canaries are each included independently with probability 1/2; the
    attacker guesses inclusion or exclusion for ``guesses_made`` = r of them and is right
    ``guesses_correct`` = v times. Under (ε, δ)-DP the number of right guesses is stochastically
    dominated as in :func:`_one_run_p_value`, so every ε whose p-value is at most
    :math:`\alpha = 1 - \text{confidence}` is rejected; the bound is the largest such ε (found
    by bisection; 0 when even ε = 0 is not rejected).
    """
    m = check_int("num_canaries", num_canaries, minimum=1)
    r = check_int("guesses_made", guesses_made, minimum=0, maximum=m)
    v = check_int("guesses_correct", guesses_correct, minimum=0, maximum=r)
    delta = check_open_unit("delta", delta)
    confidence = _confidence(confidence)
    alpha = 1.0 - confidence

    def rejects(eps):
        return _one_run_p_value(m, r, v, eps, delta) <= alpha

    if r == 0 or not rejects(0.0):
        return EpsilonLowerBound(0.0, None, "one-run", confidence, delta, 1)
    hi = 1.0
    while rejects(hi):  # terminates: the p-value tends to 1 as eps grows
        hi *= 2
    eps = optimize.brentq(lambda e: alpha - _one_run_p_value(m, r, v, e, delta),
                          hi / 2 if hi > 1 else 0.0, hi, xtol=1e-9)
    return EpsilonLowerBound(float(eps), None, "one-run", confidence, delta, 1)
