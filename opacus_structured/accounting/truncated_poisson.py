r"""Truncated Poisson sampling: Theorems 3.1, 3.3 and 3.4 of Ganesh (2025).

Mechanism (Algorithm 1 of A. Ganesh, "Tighter Privacy Analysis for Truncated Poisson Sampling",
Google Research 2025; cited by dp_accounting as arXiv:2508.15089): every one of the ``n``
examples joins the batch independently with probability :math:`p`; if more than :math:`B` joined,
a **uniformly random** size-:math:`B` subset is kept; :math:`\mathcal{N}(0, \sigma^2 I)` is added
to the sum of the clipped (norm :math:`\le 1`) contributions.

Dominating pairs. With the public selector :math:`r` (whether at least :math:`B` of the *other*
:math:`n-1` examples were Poisson-sampled),

.. math::

    w_2 = \Pr[r = 2] = \Pr[\mathrm{Bin}(n-1, p) \ge B], \qquad w_1 = 1 - w_2,

    q = p \sum_{s=B}^{n-1} \frac{\Pr[\mathrm{Bin}(n-1,p)=s]}{\Pr[\mathrm{Bin}(n-1,p)\ge B]}
        \frac{B}{s+1}
      = \frac{B}{n}\,\frac{\Pr[\mathrm{Bin}(n,p)\ge B+1]}{\Pr[\mathrm{Bin}(n-1,p)\ge B]}
      \quad\text{(Section 3.4)},

the output of the dominating pair is :math:`(r, x + z)`, :math:`z\sim\mathcal{N}(0,\sigma^2)`, and
conditioned on :math:`r` the pair is a univariate Gaussian mixture pair:

============  ======  ===========================================  ============================
relation      branch  P                                            Q
============  ======  ===========================================  ============================
add/remove    r=1     :math:`(1-p)N(0) + pN(1)`                    :math:`N(0)`  (Thm 3.1)
add/remove    r=2     :math:`(1-q)N(0) + qN(2)`                    :math:`N(0)`
zero-out      r=1     :math:`(1-p)N(0) + pN(1)`                    :math:`N(0)`  (Thm 3.3)
zero-out      r=2     :math:`(1-q)N(0) + qN(2)`                    :math:`(1-q)N(0) + qN(-1)`
replace-one   r=1     :math:`(1-p)N(0) + pN(1)`                    :math:`(1-p)N(0) + pN(-1)` (Thm 3.4)
replace-one   r=2     :math:`(1-q)N(0) + qN(2)`                    :math:`(1-q)N(0) + qN(-2)`
============  ======  ===========================================  ============================

The other direction is dominated by :math:`(Q, P)` (Zhu, Dong & Wang 2022). Because :math:`r` is
public and has the same law under both datasets, the privacy-loss distribution of the pair is the
:math:`(w_1, w_2)` **mixture of the two conditional PLDs** (Section 3.4). This module builds each
branch with dp_accounting's pessimistic connect-the-dots ``from_gaussian_mechanism`` (built by
:func:`.gaussian_branch.gaussian_pld`, the same PMF with the per-point inverse vectorised; the zero-out
:math:`r=2` pair, which dp_accounting has no primitive for, with our own exact
:class:`~opacus_structured.accounting.mixture.MixturePair` and
:func:`~opacus_structured.accounting.pld.pld_from_profile`) and mixes them with
``PrivacyLossDistribution.compute_mixture(other, self_weight)`` (``self_weight`` is the weight of
the PLD the method is called on). A mixture of pessimistic PMFs is pessimistic: the hockey-stick
divergence is linear in the PMF and equals :math:`w_1 H^{(1)} + w_2 H^{(2)}` for the exact pair.

Add/remove is the *restricted* relation :math:`\sim^{AR,n}` (:math:`|D| = n`): the guarantee depends on
the public dataset size n; do not compose it with mechanisms that reveal or change n.

dp_accounting 0.6's ``TruncatedSubsampledGaussianDpEvent`` prices the :math:`r=2` branch with the
replace-one :math:`\pm 2` pair under every relation: valid, but up to ~8% looser than Theorem 3.1.

Baseline (Chua et al. 2024, "Scalable DP-SGD: Shuffling vs. Poisson subsampling"): if untruncated
Poisson sampling is :math:`(\varepsilon, \delta)`-DP then truncated Poisson sampling is
:math:`(\varepsilon, \delta + e^\varepsilon\eta)`-DP, with :math:`\eta` the probability that any of
the :math:`T` batches is truncated, :math:`\eta = 1 - (1 - \Pr[\mathrm{Bin}(n,p) > B])^T`.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np
from dp_accounting import NeighboringRelation
from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution
from scipy import stats

from .._validation import check_int, check_open_unit, check_positive, check_probability
from . import pld as pld_lib
from .calibration import smallest_passing_int
from .gaussian_branch import gaussian_pld
from .mixture import MixturePair
from .profiles import PairProfile, WeightedProfile

__all__ = [
    "RELATIONS",
    "check_parameters",
    "truncation_weight",
    "conditional_sampling_probability",
    "batch_truncation_probability",
    "inclusion_probability",
    "expected_batch_size",
    "branch_pairs",
    "truncated_poisson_pld",
    "truncated_poisson_profiles",
    "poisson_pld",
    "truncation_eta",
    "baseline_epsilon",
    "baseline_delta",
    "truncated_poisson_epsilon",
    "poisson_epsilon",
    "smallest_max_batch_size",
    "max_batch_size_search",
    "largest_sample_rate",
]

#: Neighbouring relations of Definition 2.1 (restricted to datasets of size n).
RELATIONS = ("add-remove", "zero-out", "replace-one")


# ---- parameters and binomial tail terms --------------------------------------------------------
def check_relation(relation: str) -> str:
    if relation not in RELATIONS:
        raise ValueError(f"relation must be one of {RELATIONS}, got {relation!r}")
    return relation


def check_parameters(dataset_size, sample_rate, max_batch_size) -> tuple[int, float, int]:
    """Validate ``(n, p, B)``: n >= 1, p in (0, 1], B integer in [1, n]."""
    n = check_int("dataset_size", dataset_size, minimum=1)
    p = check_probability("sample_rate", sample_rate)
    b = check_int("max_batch_size", max_batch_size, minimum=1)
    if b > n:
        raise ValueError(f"max_batch_size B must be in [1, dataset_size={n}], got {b} (a batch "
                         f"can never exceed n; B = n means no truncation)")
    return n, p, b


def truncation_weight(dataset_size, sample_rate, max_batch_size) -> float:
    r""":math:`w_2 = \Pr[\mathrm{Bin}(n-1, p) \ge B]`: weight of the truncation branch r = 2."""
    n, p, b = check_parameters(dataset_size, sample_rate, max_batch_size)
    return float(stats.binom.sf(b - 1, n - 1, p))


def conditional_sampling_probability(dataset_size, sample_rate, max_batch_size) -> float:
    r""":math:`q = (B/n)\Pr[\mathrm{Bin}(n,p) \ge B+1] / \Pr[\mathrm{Bin}(n-1,p) \ge B]`.

    The probability that the target example is sampled *and* survives truncation given that at
    least B others were sampled (Theorem 3.1; closed form of Section 3.4). Returns ``p`` when
    :math:`w_2 = 0` (the branch then has no weight).
    """
    n, p, b = check_parameters(dataset_size, sample_rate, max_batch_size)
    w2 = stats.binom.sf(b - 1, n - 1, p)
    if w2 == 0.0:
        return p
    q = float(stats.binom.sf(b, n, p) * b / (n * w2))
    return min(max(q, 0.0), p)  # q <= p always; guard rounding


def batch_truncation_probability(dataset_size, sample_rate, max_batch_size) -> float:
    r""":math:`\Pr[\mathrm{Bin}(n, p) > B]`: probability that one step truncates its batch."""
    n, p, b = check_parameters(dataset_size, sample_rate, max_batch_size)
    return float(stats.binom.sf(b, n, p))


def expected_batch_size(dataset_size, sample_rate, max_batch_size) -> float:
    r""":math:`E[\min(\mathrm{Bin}(n,p), B)]`, the mean number of real (unpadded) examples."""
    n, p, b = check_parameters(dataset_size, sample_rate, max_batch_size)
    k = np.arange(0, b)
    # E[min(S, B)] = sum_{k=0}^{B-1} Pr[S > k]
    return float(np.sum(stats.binom.sf(k, n, p)))


def inclusion_probability(dataset_size, sample_rate, max_batch_size) -> float:
    r"""Probability that a given example is in a batch: :math:`p\,w_1 + q\,w_2 = E[\min(S,B)]/n`."""
    n, p, b = check_parameters(dataset_size, sample_rate, max_batch_size)
    w2 = truncation_weight(n, p, b)
    return p * (1.0 - w2) + w2 * conditional_sampling_probability(n, p, b)


# ---- dominating pairs -----------------------------------------------------------------------
def branch_pairs(dataset_size, sample_rate, max_batch_size, noise_multiplier,
                 relation: str = "add-remove") -> list[tuple[float, MixturePair]]:
    r"""The dominating pair of Theorem 3.1 / 3.3 / 3.4 as ``[(w_1, pair_1), (w_2, pair_2)]``.

    Each ``pair_r`` is the pair :math:`(P|r, Q|r)` (remove direction, ``pair.delta(eps)`` =
    :math:`H_{e^\varepsilon}(P|r \,\|\, Q|r)`); the joint pair's divergence is
    :math:`\sum_r w_r H_{e^\varepsilon}(P|r\|Q|r)` and the add direction uses ``pair.reversed()``.
    Branches with zero weight are omitted.
    """
    n, p, b = check_parameters(dataset_size, sample_rate, max_batch_size)
    sigma = check_positive("noise_multiplier", noise_multiplier)
    relation = check_relation(relation)
    w2 = truncation_weight(n, p, b)
    q = conditional_sampling_probability(n, p, b)
    if not q > 0.0:  # numerator underflow with w2 > 0: rate p dominates any q <= p (pessimistic)
        q = p
    if relation == "replace-one":
        pair1 = MixturePair.from_components([0.0, 1.0], [1 - p, p], [0.0, -1.0], [1 - p, p], sigma)
        pair2 = MixturePair.from_components([0.0, 2.0], [1 - q, q], [0.0, -2.0], [1 - q, q], sigma)
    else:
        pair1 = MixturePair.from_components([0.0, 1.0], [1 - p, p], [0.0], [1.0], sigma)
        if relation == "add-remove":
            pair2 = MixturePair.from_components([0.0, 2.0], [1 - q, q], [0.0], [1.0], sigma)
        else:  # zero-out
            pair2 = MixturePair.from_components([0.0, 2.0], [1 - q, q], [0.0, -1.0], [1 - q, q],
                                                sigma)
    return [(w, pair) for w, pair in ((1.0 - w2, pair1), (w2, pair2)) if w > 0]


def truncated_poisson_profiles(dataset_size, sample_rate, max_batch_size, noise_multiplier,
                               relation: str = "add-remove"):
    """Exact ``(remove, add)`` privacy profiles of the theorem's pair (WeightedProfile of pairs).

    An independent route to the same guarantee as :func:`truncated_poisson_pld` (our own exact
    hockey-stick divergences discretised once, instead of dp_accounting branch PLDs mixed).
    """
    branches = branch_pairs(dataset_size, sample_rate, max_batch_size, noise_multiplier, relation)
    weights = [w for w, _ in branches]
    total = sum(weights)
    weights = [w / total for w in weights]
    remove = WeightedProfile(weights, [PairProfile(pair) for _, pair in branches])
    add = WeightedProfile(weights, [PairProfile(pair.reversed()) for _, pair in branches])
    return remove, add


def _gaussian_branch(sigma: float, sensitivity: float, rate: float, relation: str,
                     discretization: float) -> PrivacyLossDistribution:
    """dp_accounting's ``from_gaussian_mechanism(..., use_connect_dots=True)`` PLD, built by
    :func:`.gaussian_branch.gaussian_pld` (the same PMF, vectorised)."""
    neighboring = (NeighboringRelation.REPLACE_ONE if relation == "replace-one"
                   else NeighboringRelation.ADD_OR_REMOVE_ONE)
    return gaussian_pld(sigma, sensitivity, sampling_prob=rate,
                        value_discretization_interval=discretization,
                        neighboring_relation=neighboring)


def poisson_pld(sample_rate, noise_multiplier, relation: str = "add-remove", *,
                discretization: float = pld_lib.DEFAULT_DISCRETIZATION
                ) -> PrivacyLossDistribution:
    """Pessimistic PLD of one step of *untruncated* Poisson sampling (branch r = 1) under
    ``relation`` (zero-out uses the add/remove pair, as in Theorem 3.3)."""
    p = check_probability("sample_rate", sample_rate)
    sigma = check_positive("noise_multiplier", noise_multiplier)
    relation = check_relation(relation)
    discretization = check_positive("discretization", discretization)
    return _gaussian_branch(sigma, 1.0, p, relation, discretization)


def truncated_poisson_pld(dataset_size, sample_rate, max_batch_size, noise_multiplier,
                          relation: str = "add-remove", *,
                          discretization: float = pld_lib.DEFAULT_DISCRETIZATION
                          ) -> PrivacyLossDistribution:
    r"""Pessimistic PLD of one step (Theorem 3.1, 3.3 or 3.4; mixture of Section 3.4).

    ``PLD = w_2 PLD_2 + w_1 PLD_1`` per direction, where ``PLD_1`` is the Poisson-subsampled
    Gaussian (rate p, sensitivity 1) and ``PLD_2`` the rate-q, sensitivity-2 branch of the table
    in the module docstring. With :math:`w_2 = 0` (e.g. B = n) this is exactly the Poisson PLD;
    with p = 1 and B < n (:math:`w_2 = 1`) it is the sensitivity-2 Poisson-subsampled Gaussian at
    rate B/n (tight for add/remove).
    """
    n, p, b = check_parameters(dataset_size, sample_rate, max_batch_size)
    sigma = check_positive("noise_multiplier", noise_multiplier)
    relation = check_relation(relation)
    discretization = check_positive("discretization", discretization)
    pld_1 = _gaussian_branch(sigma, 1.0, p, relation, discretization)
    return _with_truncation_branch(pld_1, n, p, b, sigma, relation, discretization)


def _with_truncation_branch(pld_1: PrivacyLossDistribution, n: int, p: float, b: int,
                            sigma: float, relation: str,
                            discretization: float) -> PrivacyLossDistribution:
    """The step PLD of :func:`truncated_poisson_pld` from its (checked) arguments and the
    branch r = 1, ``pld_1`` (= :func:`poisson_pld`; it does not depend on B, so a search over
    B builds it once)."""
    w2 = truncation_weight(n, p, b)
    if w2 == 0.0:
        return pld_1
    q = conditional_sampling_probability(n, p, b)
    if not q > 0.0:  # numerator underflow with w2 > 0: rate p dominates any q <= p (pessimistic)
        q = p
    if relation == "zero-out":
        # (1-q)N(0)+qN(2) vs (1-q)N(0)+qN(-1): no dp_accounting primitive; exact MixturePair.
        _, pair2 = branch_pairs(n, p, b, sigma, relation)[-1]
        pld_2 = pld_lib.pld_from_profile(PairProfile(pair2), PairProfile(pair2.reversed()),
                                         discretization=discretization)
        if pld_1._symmetric:  # pragma: no cover - AR PLDs are asymmetric in dp_accounting 0.6
            raise AssertionError("expected an asymmetric add/remove PLD for branch r = 1")
    else:
        # Sensitivity 2 at sigma: AR -> (1-q)N(0)+qN(2) vs N(0) (Thm 3.1); RO -> the +-2 pair.
        pld_2 = _gaussian_branch(sigma, 2.0, q, relation, discretization)
    if w2 >= 1.0:
        return pld_2
    return pld_2.compute_mixture(pld_1, self_weight=w2)


# ---- baseline (eps, delta + e^eps eta) -----------------------------------------------------------
def truncation_eta(dataset_size, sample_rate, max_batch_size, steps) -> float:
    r""":math:`\eta = 1 - (1 - \Pr[\mathrm{Bin}(n,p) > B])^T`, probability that any of T
    independent batches is truncated (at most the union bound :math:`T\Pr[\mathrm{Bin}(n,p)>B]`)."""
    s = batch_truncation_probability(dataset_size, sample_rate, max_batch_size)
    steps = check_int("steps", steps, minimum=0)
    if s >= 1.0:
        return 1.0 if steps else 0.0
    return float(min(1.0, -math.expm1(steps * math.log1p(-s))))


def baseline_epsilon(poisson: Optional[PrivacyLossDistribution], eta: float, delta: float,
                     *, max_iterations: int = 200) -> float:
    r"""Smallest ε with :math:`\varepsilon \ge \varepsilon_{\rm Poisson}(\delta - e^\varepsilon\eta)`.

    ``poisson`` is the composed untruncated-Poisson PLD (``None`` = no step). Fixed-point
    iteration from below; the value returned is verified feasible
    (:math:`f(\varepsilon) \le \varepsilon`), so it is never below the baseline's ε.
    Returns ``inf`` when :math:`\delta - e^\varepsilon\eta \le 0` (infeasible).
    """
    delta = check_open_unit("delta", delta)
    eta = float(eta)
    if not 0.0 <= eta <= 1.0:
        raise ValueError(f"eta must be in [0, 1], got {eta!r}")

    def f(eps: float) -> float:
        rest = delta - math.exp(eps) * eta
        if rest <= 0.0:
            return math.inf
        return pld_lib.epsilon_for_delta(poisson, min(rest, 1.0 - 1e-16))

    eps = f(0.0)
    for _ in range(max_iterations):
        if math.isinf(eps):
            return math.inf
        nxt = f(eps)
        if nxt <= eps:  # feasible: Poisson is (eps, delta - e^eps eta)-DP
            return eps
        # Jump slightly above the fixed point to end the (monotone) iteration quickly; an
        # infeasible candidate stays below the smallest fixed point, so we only move up.
        eps = nxt if nxt - eps > 1e-9 else nxt + 1e-9
    raise RuntimeError("baseline epsilon iteration did not converge")  # pragma: no cover


def baseline_delta(poisson: Optional[PrivacyLossDistribution], eta: float, epsilon: float) -> float:
    r""":math:`\min(1, \delta_{\rm Poisson}(\varepsilon) + e^\varepsilon\eta)`."""
    if math.isnan(epsilon):
        raise ValueError("epsilon must not be NaN")
    d = float(pld_lib.delta_for_epsilon(poisson, float(epsilon)))
    return min(1.0, d + math.exp(epsilon) * float(eta))


# ---- epsilon helpers and the overhead search --------------------------------------------------
def truncated_poisson_epsilon(dataset_size, sample_rate, max_batch_size, noise_multiplier, steps,
                              delta, relation: str = "add-remove", *, analysis: str = "tight",
                              discretization: float = pld_lib.DEFAULT_DISCRETIZATION) -> float:
    """ε(δ) after ``steps`` steps (``analysis`` = "tight" (Theorems 3.1/3.3/3.4) or "baseline")."""
    steps = check_int("steps", steps, minimum=0)
    delta = check_open_unit("delta", delta)
    if analysis == "tight":
        step = truncated_poisson_pld(dataset_size, sample_rate, max_batch_size, noise_multiplier,
                                     relation, discretization=discretization)
        return pld_lib.epsilon_for_delta(pld_lib.self_compose(step, steps), delta)
    if analysis == "baseline":
        eta = truncation_eta(dataset_size, sample_rate, max_batch_size, steps)
        step = poisson_pld(sample_rate, noise_multiplier, relation, discretization=discretization)
        return baseline_epsilon(pld_lib.self_compose(step, steps), eta, delta)
    raise ValueError(f"analysis must be 'tight' or 'baseline', got {analysis!r}")


def poisson_epsilon(sample_rate, noise_multiplier, steps, delta, relation: str = "add-remove", *,
                    discretization: float = pld_lib.DEFAULT_DISCRETIZATION) -> float:
    """ε(δ) of untruncated Poisson sampling after ``steps`` steps (the reference)."""
    steps = check_int("steps", steps, minimum=0)
    step = poisson_pld(sample_rate, noise_multiplier, relation, discretization=discretization)
    return pld_lib.epsilon_for_delta(pld_lib.self_compose(step, steps), delta)


def _overhead_ok(eps: float, eps_poisson: float, max_overhead: float) -> bool:
    return eps <= (1.0 + max_overhead) * eps_poisson


#: Discretization of the bracketing pass of :func:`smallest_max_batch_size` (when finer is
#: asked): ten times fewer grid points, so each probe is ~10x cheaper.
SEARCH_DISCRETIZATION = 1e-3


def smallest_max_batch_size(dataset_size, sample_rate, noise_multiplier, steps, delta,
                            max_overhead: float, relation: str = "add-remove", *,
                            discretization: float = pld_lib.DEFAULT_DISCRETIZATION,
                            progress: Optional[Callable[[int, float], None]] = None) -> int:
    r"""Smallest B with :math:`\varepsilon_{\rm trunc}(B) \le (1 + \text{max\_overhead})\,
    \varepsilon_{\rm Poisson}` (tight analysis, fixed n, p, σ, T, δ; both ε at
    ``discretization``).

    The search is over :math:`B \ge \lceil np \rceil` (B = n always qualifies: it *is*
    Poisson). Below the expected batch size ε is not monotone in B (truncating to a handful of
    examples is a different, more private mechanism: B = 1 can beat Poisson), so such B are not
    considered. Galloping from :math:`np` in steps of the binomial standard deviation, then
    bisection; ε is non-increasing in B above np in every case we computed
    (docs/guides/truncated_poisson.md) but this is not proven. The returned B was evaluated
    and meets the target (or is n).

    When ``discretization`` is finer than :data:`SEARCH_DISCRETIZATION`, the search runs first
    on that coarser grid; its answer B' is then settled on the asked grid by walking from it
    (B' meets the target there and B' - 1 does not, else step down or gallop up): the same B
    as a search on the asked grid alone, with two or three evaluations on it instead of ~10.
    ``progress(B, ε)`` sees only evaluations on the asked grid.
    """
    return max_batch_size_search(dataset_size, sample_rate, noise_multiplier, steps, delta,
                                 max_overhead, relation, discretization=discretization,
                                 progress=progress)[0]


def max_batch_size_search(dataset_size, sample_rate, noise_multiplier, steps, delta,
                          max_overhead: float, relation: str = "add-remove", *,
                          discretization: float = pld_lib.DEFAULT_DISCRETIZATION,
                          progress: Optional[Callable[[int, float], None]] = None
                          ) -> tuple[int, float, float]:
    """``(B, ε_trunc(B), ε_Poisson)`` of :func:`smallest_max_batch_size`, both ε as evaluated
    at ``discretization`` (``ε_trunc(n)`` is ``ε_Poisson``)."""
    n = check_int("dataset_size", dataset_size, minimum=1)
    p = check_probability("sample_rate", sample_rate)
    max_overhead = float(max_overhead)
    if not (max_overhead >= 0 and math.isfinite(max_overhead)):
        raise ValueError(f"max_overhead must be a finite number >= 0, got {max_overhead!r}")
    sigma = check_positive("noise_multiplier", noise_multiplier)
    relation = check_relation(relation)
    steps = check_int("steps", steps, minimum=0)
    delta = check_open_unit("delta", delta)
    discretization = check_positive("discretization", discretization)
    start = min(n, max(1, math.ceil(n * p - 1e-9)))
    seen: dict[int, Callable[[], float]] = {}  # B -> its ε on the asked grid (computed lazily)

    def record(b: int, eps: Callable[[], float]) -> None:
        seen[b] = eps
        if progress is not None:
            progress(b, eps())

    ok, ref = _overhead_test(n, p, sigma, steps, delta, max_overhead, relation,
                             discretization, record)
    if discretization >= SEARCH_DISCRETIZATION:
        b = _gallop_and_bisect(ok, n, p, start)
    else:
        b = _settle(ok, _gallop_and_bisect(
            _overhead_test(n, p, sigma, steps, delta, max_overhead, relation,
                           SEARCH_DISCRETIZATION, None)[0], n, p, start), start, n)
    if b not in seen:  # B = n, never evaluated: it is Poisson itself
        ok(b)
    return b, seen[b](), ref


def _settle(ok: Callable[[int], bool], guess: int, start: int, n: int) -> int:
    """Smallest passing B in [start, n] near ``guess`` (the coarse grid's answer)."""
    if ok(guess):
        while guess > start and ok(guess - 1):
            guess -= 1
        return guess
    lo, width = guess, 1  # ok(lo) is false; gallop up to a passing B (n always passes)
    hi = min(n, lo + width)
    while hi < n and not ok(hi):
        lo, width = hi, 2 * width
        hi = min(n, lo + width)
    return smallest_passing_int(ok, lo, hi)


def _overhead_test(n, p, sigma, steps, delta, max_overhead, relation, discretization,
                   record) -> tuple[Callable[[int], bool], float]:
    """``(ok, ε_Poisson)``: ``ok(B)`` tells whether truncating at B costs at most
    ``max_overhead`` over Poisson at ``discretization`` (the Poisson branch, shared by every B,
    is built once). ``record(B, eps)``, if given, receives a function returning ε_trunc(B).

    ``ok(B)`` is ``ε_trunc(B) <= (1 + max_overhead) ε_Poisson`` decided by
    :func:`.pld.epsilon_at_most`: the same decision, and the same ε when ``eps()`` is called,
    without the round-off FFTs where the decision is clear without them (issue 41)."""
    pld_1 = _gaussian_branch(sigma, 1.0, p, relation, discretization)
    ref = pld_lib.epsilon_for_delta(pld_lib.self_compose(pld_1, steps), delta)
    threshold = (1.0 + max_overhead) * ref  # _overhead_ok's right-hand side

    def ok(b: int) -> bool:
        step = _with_truncation_branch(pld_1, n, p, b, sigma, relation, discretization)
        passed, eps = pld_lib.epsilon_at_most(step, steps, delta, threshold)
        if record is not None:
            record(b, eps)
        return passed

    return ok, ref


def _gallop_and_bisect(ok: Callable[[int], bool], n: int, p: float, start: int) -> int:
    """Smallest B in [start, n] with ``ok`` (monotone above np; B = n passes)."""
    if ok(start):
        return start
    lo, hi = start, n  # invariant: B = hi qualifies (B = n is Poisson itself); B = lo does not
    # Gallop from E[batch] = np upwards in multiples of the binomial standard deviation.
    step = max(1.0, math.sqrt(n * p * (1 - p)))
    guess, k = min(n, math.ceil(n * p + step)), 1
    while lo < guess < hi:
        if ok(guess):
            hi = guess
            break
        lo = guess
        guess = min(n - 1, math.ceil(n * p + step * 2 ** k))
        k += 1
    return smallest_passing_int(ok, lo, hi)


def largest_sample_rate(dataset_size, max_batch_size, noise_multiplier, steps, delta,
                        max_overhead: float, relation: str = "add-remove", *,
                        rtol: float = 1e-3,
                        discretization: float = pld_lib.DEFAULT_DISCRETIZATION,
                        progress: Optional[Callable[[float, float], None]] = None) -> float:
    r"""Largest p in :math:`(0, B/n]` (to relative tolerance ``rtol``) with
    :math:`\varepsilon_{\rm trunc}(p) \le (1 + \text{max\_overhead})\,
    \varepsilon_{\rm Poisson}(p)` at fixed n, B, σ, T, δ.

    The search is restricted to :math:`np \le B` (expected Poisson batch not above B): beyond
    it the *ratio* to Poisson falls again (at p = 1 truncation is fixed-size sampling, far better
    than Poisson at p = 1), so the overhead is not monotone on (0, 1]. The returned p was
    evaluated and meets the target (bisection on log p; the overhead grows with p on
    :math:`(0, B/n]` in every case we computed, which is not proven).
    """
    n = check_int("dataset_size", dataset_size, minimum=1)
    b = check_int("max_batch_size", max_batch_size, minimum=1)
    check_parameters(n, 1.0, b)
    rtol = check_positive("rtol", rtol)
    max_overhead = float(max_overhead)
    if not (max_overhead >= 0 and math.isfinite(max_overhead)):
        raise ValueError(f"max_overhead must be a finite number >= 0, got {max_overhead!r}")

    def ok(p: float) -> bool:
        eps = truncated_poisson_epsilon(n, p, b, noise_multiplier, steps, delta, relation,
                                        discretization=discretization)
        ref = poisson_epsilon(p, noise_multiplier, steps, delta, relation,
                              discretization=discretization)
        if progress is not None:
            progress(p, eps)
        return _overhead_ok(eps, ref, max_overhead)

    hi = min(1.0, b / n)
    if ok(hi):
        return hi
    lo = hi / 2
    while not ok(lo):
        hi, lo = lo, lo / 2
        if lo < 1e-12:
            raise ValueError("no sample rate in (0, B/n] meets the overhead target")
    while hi / lo > 1.0 + rtol:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo
