r"""Conditional-composition accountant for matrix mechanisms under random allocation.

Schuchardt & Kalinin, "Sampling-Free Privacy Accounting for Matrix Mechanisms under Random Allocation",
Section 4, Algorithm 4, Appendices D–F. Pure
numpy/scipy + dp_accounting (through :mod:`.pld`).

**Conditional composition** (Lemma 4.1; Theorem 3.1 of Choquette-Choo et al. 2024). For the
``N``-dimensional Lemma 2.8 pair ``(P, Q)`` pick, for every step ``n``, a univariate pair
``(P^{(n)}, Q^{(n)})`` that dominates the step-``n`` conditionals outside a bad event ``E``:

.. math::

    H_\gamma(P\|Q) \le H_\gamma\big(\times_n P^{(n)} \,\|\, \times_n Q^{(n)}\big) + P(E).

**Per-step pair** (Eq. 7–8, Corollary 4.4). With the step-``n`` means sorted,
``0 ≤ m_{π(1),n} ≤ … ≤ m_{π(b),n}``, and upper bounds ``λ̄_i`` on the posterior reverse hazards
``P(z = i | z ≤ i, y_{1:n-1})``,

.. math::

    P^{(n)} = \sum_i p_i\, \mathcal N(m_{\pi(i), n}, \sigma^2), \quad
    p_i = \bar\lambda_i \prod_{j>i} (1-\bar\lambda_j), \qquad Q^{(n)} = \mathcal N(0, \sigma^2).

**Reverse hazards** (Lemma 4.5): :math:`\lambda_i = s(-\log(i-1) - L_i(y))` with
:math:`L_i = \log \frac{\frac{1}{i-1}\sum_{j<i} \mathcal N(y|\mu_j)}{\mathcal N(y|\mu_i)}` on the
length-``(n-1)`` prefixes :math:`\mu_j`. A high-probability lower bound :math:`L_i \ge \tau_i`
gives :math:`\bar\lambda_i = s(-\log(i-1) - \tau_i)`.

**Variational tail bounds** (Lemma 4.7, Theorem 4.8, Lemma D.2, Theorem D.3). For any categorical
ψ, :math:`\log\sum_{j\in R} e^{L_{ij}} \ge E_\psi[L_{ij}] + H(\psi)` and :math:`E_\psi L_{ij}(x)` is
affine in ``x``, hence Gaussian under each component of the prefix law: under REMOVE the prefix
follows the full mixture :math:`\frac1b\sum_k \mathcal N(\mu_k, \sigma^2 I)` (Theorem D.3;
Algorithm 4's partial sum over ``k ≥ i`` is not used: it does not follow from D.3), under ADD
:math:`\mathcal N(0, \sigma^2 I)` (Theorem 4.8, closed form). The family is Option 1 (uniform)
and Option 3 (:math:`\psi_j \propto e^{-\|\mu_i-\mu_j\|^2/t}`, ``t ∈ {10^{-1}, …, 10}``), the
largest ``τ`` wins (Appendix F).

Two always-valid refinements (Remark D.5 and Lemma 4.2, made exact here):

* Components ``j`` with :math:`\mu_j = \mu_i` exactly have :math:`L_{ij} \equiv 0` (Remark D.5);
  they are kept out of ψ and enter exactly: :math:`L_i \ge \log(|E| + e^{\tau_R}) - \log(i-1)`.
* Components in the lowest tie group of step-``n`` means need no bound (``λ̄ = 1`` leaves the
  mixture unchanged and the dominance of Lemma 4.2 holds trivially), so the step's failure budget
  is split over the remaining components only (for DP-SGD: one component).

**Failure budget** (Appendix E): a union bound, ``δ_E/N`` per step (split evenly over the
components that need a bound). The paper's "max"/"hybrid" allocations are not implemented: their
validity is not argued in the paper. ``δ_E = δ/2`` (App. B.2).

**Composition**: the ``N`` univariate pairs are discretised pessimistically (connect-the-dots,
:func:`.pld.pld_from_profile`) with the remove pair from the REMOVE weights and the add pair from
the ADD weights, composed with dp_accounting, and ``ε = ε_PLD(δ − δ_E)``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

import numpy as np
from scipy import special

from .._validation import check_open_unit, check_positive
from . import pld as pld_lib
from .mixture import MixturePair
from .profiles import PairProfile

__all__ = [
    "DEFAULT_TEMPERATURES",
    "StepPair",
    "reverse_hazard_bounds",
    "step_pairs",
    "conditional_composition_pld",
    "conditional_composition_epsilon",
    "conditional_composition_delta",
    "remove_lower_bound_epsilon",
    "remove_lower_bound_delta",
    "conditional_composition_epsilon_lower_bound",
    "conditional_composition_delta_lower_bound",
]

#: Option-3 temperatures of Appendix F (t = ∞, the uniform Option 1, is always included).
DEFAULT_TEMPERATURES = (10 ** -1, 10 ** -0.5, 1.0, 10 ** 0.5, 10.0)
_BISECTION_STEPS = 60


def _check_means(means) -> np.ndarray:
    means = np.asarray(means, dtype=np.float64)
    if means.ndim != 2 or means.shape[0] == 0 or means.shape[1] == 0:
        raise ValueError(f"means must be a non-empty (b, N) array, got shape {means.shape}")
    if np.any(~np.isfinite(means)) or np.any(means < 0):
        raise ValueError("means must be finite and non-negative (Lemma 2.8 needs C >= 0)")
    return means


def _tail_lower(nu: np.ndarray, xi: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """Largest τ with ``mean_k Φ((τ−ν_k)/ξ) ≤ β`` (row-wise; ``nu``: (..., K), ``xi``: (...))."""
    z = special.ndtri(beta)
    K = nu.shape[-1]
    deg = xi <= 1e-300
    xs = np.where(deg, 1.0, xi)
    lo = nu.min(-1) + xs * z
    hi = nu.max(-1) + xs * z
    if K > 1:
        for _ in range(_BISECTION_STEPS):
            mid = 0.5 * (lo + hi)
            F = special.ndtr((mid[..., None] - nu) / xs[..., None]).mean(-1)
            ok = F <= beta
            lo = np.where(ok, mid, lo)
            hi = np.where(ok, hi, mid)
    # ξ = 0: L is the point mass mixture on ν; the largest τ with #{ν_k < τ}/K ≤ β
    if np.any(deg):
        srt = np.sort(nu, axis=-1)
        j = np.minimum(np.floor(beta * K).astype(int), K - 1)
        q = np.take_along_axis(srt, np.broadcast_to(j, srt.shape[:-1])[..., None], -1)[..., 0]
        lo = np.where(deg, q, lo)
    return lo


def reverse_hazard_bounds(means, step: int, noise_multiplier: float, significance: float,
                          relation: str, *, temperatures: Sequence[float] = DEFAULT_TEMPERATURES
                          ) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 4 for one step: ``(order, λ̄)`` with ``order`` the ascending sort of step means.

    Args:
        means: ``b × N`` mixture means (:func:`random_allocation_mf.mixture_means`).
        step: 1-indexed step ``n``.
        noise_multiplier: σ.
        significance: failure probability ``β`` of this step (all bounds of the step together).
        relation: ``"remove"`` (tail under P) or ``"add"`` (tail under Q).

    With probability ≥ 1 − β (under P for remove, Q for add) the posterior reverse hazards are
    ≤ ``λ̄`` (Theorem 4.6).
    """
    means = _check_means(means)
    sigma = check_positive("noise_multiplier", noise_multiplier)
    beta = check_open_unit("significance", significance)
    if relation not in ("remove", "add"):
        raise ValueError(f"relation must be 'remove' or 'add', got {relation!r}")
    b, N = means.shape
    if not (isinstance(step, (int, np.integer)) and 1 <= step <= N):
        raise ValueError(f"step must be an integer in [1, {N}], got {step!r}")
    v = means[:, step - 1]
    order = np.argsort(v, kind="stable")
    v = v[order]
    mu = means[order, : step - 1]
    lam = np.ones(b)
    low = int(np.searchsorted(v, v[0], side="right"))  # size of the lowest tie group
    need = np.arange(low, b)                             # 0-indexed sorted components to bound
    if len(need) == 0:
        return order, lam
    beta_i = beta / len(need)
    s2 = sigma ** 2
    if step == 1:
        # empty prefix: L_i ≡ 0, τ = 0, λ̄_i = 1/i (1-indexed)
        lam[need] = 1.0 / (need + 1.0)
        return order, lam
    Gp = mu @ mu.T
    sq = np.diag(Gp).copy()
    _, group = np.unique(mu, axis=0, return_inverse=True)
    group = group.ravel()
    d = np.maximum(sq[:, None] + sq[None, :] - 2 * Gp, 0.0)
    I = len(need)
    idx = np.arange(b)
    before = idx[None, :] < need[:, None]                          # (I, b): j < i
    same = group[None, :] == group[need][:, None]
    n_equal = np.sum(before & same, axis=1).astype(float)          # |E|
    in_R = before & ~same                                          # (I, b)
    has_R = in_R.any(axis=1)
    temps = [math.inf] + [float(check_positive("temperature", t)) for t in temperatures]
    dist = d[need]                                                 # (I, b)
    psi = np.empty((I, len(temps), b))
    for ti, t in enumerate(temps):
        logits = np.zeros((I, b)) if math.isinf(t) else -dist / t
        logits = np.where(in_R, logits, -np.inf)
        logits = np.where(has_R[:, None], logits, 0.0)
        psi[:, ti] = special.softmax(logits, axis=1)
    psi = np.where(in_R[:, None, :], psi, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.sum(np.where(psi > 0, psi * np.log(psi), 0.0), axis=-1)     # H(ψ): (I, T)
    psiG = psi @ Gp                                                # (I, T, b): ψ·⟨μ_j, μ_k⟩
    gi = Gp[need]                                                  # (I, b): ⟨μ_i, μ_k⟩
    gii = sq[need]
    e_sq = psi @ sq                                                # (I, T): E_ψ‖μ_j‖²
    cross = np.take_along_axis(psiG, need[:, None, None].repeat(len(temps), 1), -1)[..., 0]
    quad = np.sum(psiG * psi, -1)                                  # ‖E_ψ μ‖²
    xi = np.sqrt(np.maximum(gii[:, None] - 2 * cross + quad, 0.0)) / sigma
    const = (gii[:, None] - e_sq) / (2 * s2) + ent
    if relation == "remove":
        nu = (psiG - gi[:, None, :]) / s2 + const[..., None]      # (I, T, b) over k
    else:
        nu = const[..., None]                                      # ρ = 0
    tau_R = _tail_lower(nu, xi, np.full(xi.shape, beta_i))         # (I, T)
    tau_R = np.max(tau_R, axis=1)
    with np.errstate(divide="ignore"):
        log_sum = np.where(has_R, np.logaddexp(np.log(n_equal), tau_R), np.log(n_equal))
    tau = log_sum - np.log(need.astype(float))                     # i - 1 = need (0-indexed)
    lam[need] = special.expit(-np.log(need.astype(float)) - tau)
    return order, lam


def _weights(lam: np.ndarray) -> np.ndarray:
    """Corollary 4.4: ``p_i = λ̄_i Π_{j>i}(1 − λ̄_j)`` (λ̄_1 = 1 ⇒ Σp = 1)."""
    lam = lam.copy()
    lam[0] = 1.0
    tail = np.concatenate([np.cumprod((1 - lam)[::-1])[::-1][1:], [1.0]])
    return lam * tail


@dataclasses.dataclass(frozen=True)
class StepPair:
    """Univariate per-step pair: ``Σ_j weights_j N(means_j, σ²)`` versus ``N(0, σ²)``."""

    means: tuple
    weights: tuple

    def pair(self, sigma: float) -> MixturePair:
        return MixturePair.from_components(list(self.means), list(self.weights), [0.0], [1.0],
                                           sigma)


def _step_pair(v_sorted: np.ndarray, lam: np.ndarray) -> StepPair:
    p = _weights(lam)
    keep = p > 0
    vals, inv = np.unique(v_sorted[keep], return_inverse=True)
    w = np.bincount(inv.ravel(), weights=p[keep])
    w = w / w.sum()
    return StepPair(tuple(float(x) for x in vals), tuple(float(x) for x in w))


#: ``progress(stage, done, total)``: optional callback of the long computations below.
ProgressCallback = Callable[[str, int, int], None]


def _step_pair_at(means: np.ndarray, n: int, sigma: float, beta: float, relation: str,
                  temperatures: Sequence[float], cache: Optional[dict]) -> StepPair:
    """The step-``n`` pair (1-indexed) at per-step budget ``beta``, memoised in ``cache``."""
    key = (relation, float(beta), float(sigma), tuple(float(t) for t in temperatures), int(n))
    if cache is not None and key in cache:
        return cache[key]
    order, lam = reverse_hazard_bounds(means, n, sigma, beta, relation,
                                       temperatures=temperatures)
    pair = _step_pair(means[order, n - 1], lam)
    if cache is not None:
        cache[key] = pair
    return pair


def step_pairs(means, noise_multiplier: float, bad_event_mass: float, relation: str, *,
               temperatures: Sequence[float] = DEFAULT_TEMPERATURES,
               cache: Optional[dict] = None,
               progress: Optional[ProgressCallback] = None) -> list[StepPair]:
    """The ``N`` per-step pairs of one direction with the union-bound budget ``δ_E/N`` per step.

    ``cache``: a dict shared by calls on the **same** ``means`` (keys: relation, per-step
    budget, σ, temperatures, step); ``progress(stage, done, total)`` is called after each step.
    """
    means = _check_means(means)
    sigma = check_positive("noise_multiplier", noise_multiplier)
    N = means.shape[1]
    beta = check_open_unit("bad_event_mass", bad_event_mass) / N
    out = []
    for n in range(1, N + 1):
        out.append(_step_pair_at(means, n, sigma, beta, relation, temperatures, cache))
        if progress is not None:
            progress(f"step pairs ({relation})", n, N)
    return out


def conditional_composition_pld(means, noise_multiplier: float, bad_event_mass: float, *,
                                discretization: float = pld_lib.DEFAULT_DISCRETIZATION,
                                temperatures: Sequence[float] = DEFAULT_TEMPERATURES,
                                cache: Optional[dict] = None,
                                progress: Optional[ProgressCallback] = None):
    """PLD of ``×_n P^{(n)}`` vs ``×_n Q^{(n)}`` (both directions). The privacy profile of the
    mechanism is bounded by ``δ_PLD(ε) + bad_event_mass`` (Lemma 4.1).

    ``cache`` and ``progress``: see :func:`step_pairs` (progress stages: the two step-pair
    passes, then ``"PLD composition"`` over the distinct step pairs)."""
    sigma = check_positive("noise_multiplier", noise_multiplier)
    rem = step_pairs(means, sigma, bad_event_mass, "remove", temperatures=temperatures,
                     cache=cache, progress=progress)
    add = step_pairs(means, sigma, bad_event_mass, "add", temperatures=temperatures,
                     cache=cache, progress=progress)
    counts: dict[tuple, int] = {}
    for r, a in zip(rem, add, strict=True):
        counts[(r, a)] = counts.get((r, a), 0) + 1
    total = len(counts)

    def parts():
        for i, ((r, a), c) in enumerate(counts.items()):
            step_pld = pld_lib.pld_from_profile(PairProfile(r.pair(sigma)),
                                                PairProfile(a.pair(sigma).reversed()),
                                                discretization=discretization)
            yield step_pld, c
            if progress is not None:
                progress("PLD composition", i + 1, total)
    return pld_lib.compose(parts())


# ----------------------------------------------------------------------------------------------
# Certified lower bounds on what conditional composition returns (to skip it in "best" mode)
# ----------------------------------------------------------------------------------------------
def _gaussian_delta(mu: np.ndarray, eps: np.ndarray) -> np.ndarray:
    """Hockey-stick ``δ(ε)`` of ``N(μ, 1)`` vs ``N(0, 1)`` (μ > 0), vectorised."""
    with np.errstate(over="ignore", under="ignore"):
        return special.ndtr(-eps / mu + mu / 2) - np.exp(eps + special.log_ndtr(-eps / mu
                                                                                 - mu / 2))


# Floating-point margin of the comparisons below (δ values are ≥ 1e-300 relative, ≥ 1e-14 abs).
_REL = 1e-9
_ABS = 1e-14


def _prefix_terms(terms: list[tuple[float, float]], sigma: float
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Sort per-step ``(log w, v²)`` by a gain score; cumulative ``(log W_K, μ_K)``."""
    arr = np.asarray(terms, dtype=np.float64).reshape(-1, 2)
    score = arr[:, 1] / (2 * sigma ** 2) + arr[:, 0]
    arr = arr[np.argsort(-score, kind="stable")]
    log_w = np.cumsum(arr[:, 0])
    mu = np.sqrt(np.cumsum(arr[:, 1])) / sigma
    return log_w, mu


def _eps_lower_from_terms(terms: list[tuple[float, float]], sigma: float, delta: float
                          ) -> float:
    r"""Largest certified ``ε`` with :math:`\delta_{\mathrm{true}}(ε) > δ` from the sub-products.

    For any set ``S`` of steps and one component ``(w_n, v_n)`` of each remove mixture,
    :math:`P^{(n)} \ge w_n \mathcal N(v_n, σ^2)` as measures, so with :math:`W = \prod_S w_n`,
    :math:`μ = \|v_S\|/σ` and post-processing (dropping the other steps),
    :math:`δ_{\mathrm{true}}(ε) \ge W\,δ_μ(ε + \log(1/W))` (Gaussian hockey stick :math:`δ_μ`).
    """
    if not terms:
        return 0.0
    log_w, mu = _prefix_terms(terms, sigma)
    W = np.exp(log_w)
    ok = (W * (1 - _REL) > delta + _ABS) & (mu > 0)
    if not np.any(ok):
        return 0.0
    log_w, mu, W = log_w[ok], mu[ok], W[ok]
    target = (delta + _ABS) / (W * (1 - _REL))      # need δ_μ(x) > target (with margin)
    # bracket: δ_μ(lo) > target (checked), δ_μ(hi) <= target (Φ(-hi/μ + μ/2) <= target)
    lo = np.zeros_like(mu)
    good = _gaussian_delta(mu, lo) > target
    hi = mu ** 2 / 2 - mu * special.ndtri(np.minimum(target, 0.5)) + 1.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        above = _gaussian_delta(mu, mid) > target
        lo = np.where(above, mid, lo)
        hi = np.where(above, hi, mid)
    eps = np.where(good, lo + log_w, 0.0)          # x - log(1/W)
    return max(0.0, float(np.max(eps)))


def _delta_lower_from_terms(terms: list[tuple[float, float]], sigma: float, epsilon: float
                            ) -> float:
    """Certified lower bound on the remove-direction ``δ_true(ε)`` (see above)."""
    if not terms:
        return 0.0
    log_w, mu = _prefix_terms(terms, sigma)
    keep = mu > 0
    if not np.any(keep):
        return 0.0
    vals = np.exp(log_w[keep]) * _gaussian_delta(mu[keep], float(epsilon) - log_w[keep])
    return max(0.0, float(np.max(vals)) * (1 - _REL) - _ABS)


def _best_component(pair: StepPair, sigma: float) -> Optional[tuple[float, float]]:
    best = None
    for v, w in zip(pair.means, pair.weights, strict=True):
        if v > 0 and w > 0:
            cand = (math.log(w), v * v)
            if best is None or cand[1] / (2 * sigma ** 2) + cand[0] > \
                    best[1] / (2 * sigma ** 2) + best[0]:
                best = cand
    return best


def _remove_terms(means: np.ndarray, sigma: float, bad_event_mass: float,
                  temperatures: Sequence[float], cache: Optional[dict],
                  stop: Callable[[list], bool], progress: Optional[ProgressCallback],
                  check_every: int = 4) -> list:
    """Remove pairs from the last step backwards (later steps know more of the prefix, so
    their hazard bounds are larger) until ``stop(terms)``; returns the collected terms."""
    N = means.shape[1]
    beta = check_open_unit("bad_event_mass", bad_event_mass) / N
    terms: list[tuple[float, float]] = []
    for i, n in enumerate(range(N, 0, -1)):
        t = _best_component(_step_pair_at(means, n, sigma, beta, "remove", temperatures,
                                          cache), sigma)
        if t is not None:
            terms.append(t)
        if progress is not None:
            progress("lower bound", i + 1, N)
        if (i + 1) % check_every == 0 and stop(terms):
            break
    return terms


def remove_lower_bound_epsilon(means, noise_multiplier: float, bad_event_mass: float,
                               delta: float, *, target: Optional[float] = None,
                               temperatures: Sequence[float] = DEFAULT_TEMPERATURES,
                               cache: Optional[dict] = None,
                               progress: Optional[ProgressCallback] = None) -> float:
    r"""A certified **lower** bound on ε(``delta``) of the remove product ``×_n P^{(n)}`` vs
    ``×_n Q^{(n)}`` (no discretisation): see :func:`_eps_lower_from_terms`. With ``target``
    it stops as soon as the bound reaches ``target`` (the value is then still a lower bound)."""
    means = _check_means(means)
    sigma = check_positive("noise_multiplier", noise_multiplier)
    delta = check_open_unit("delta", delta)

    def stop(terms):
        return target is not None and _eps_lower_from_terms(terms, sigma, delta) >= target
    terms = _remove_terms(means, sigma, bad_event_mass, temperatures, cache, stop, progress)
    return _eps_lower_from_terms(terms, sigma, delta)


def remove_lower_bound_delta(means, noise_multiplier: float, bad_event_mass: float,
                             epsilon: float, *, target: Optional[float] = None,
                             temperatures: Sequence[float] = DEFAULT_TEMPERATURES,
                             cache: Optional[dict] = None,
                             progress: Optional[ProgressCallback] = None) -> float:
    """A certified **lower** bound on δ(``epsilon``) of the remove product (as above)."""
    means = _check_means(means)
    sigma = check_positive("noise_multiplier", noise_multiplier)

    def stop(terms):
        return target is not None and _delta_lower_from_terms(terms, sigma, epsilon) >= target
    terms = _remove_terms(means, sigma, bad_event_mass, temperatures, cache, stop, progress)
    return _delta_lower_from_terms(terms, sigma, epsilon)


def conditional_composition_epsilon_lower_bound(
        means, noise_multiplier: float, delta: float, *, bad_event_fraction: float = 0.5,
        target: Optional[float] = None, temperatures: Sequence[float] = DEFAULT_TEMPERATURES,
        cache: Optional[dict] = None, progress: Optional[ProgressCallback] = None) -> float:
    r"""A certified lower bound on what :func:`conditional_composition_epsilon` returns with the
    same arguments (any ``discretization``).

    That function returns :math:`ε_{\mathrm{PLD}}((1-f)δ)` of a *pessimistic* PLD whose remove
    direction dominates the product of the per-step remove pairs, so it is at least the true
    ε of that product at :math:`(1-f)δ`, which is bounded below by
    :func:`remove_lower_bound_epsilon` (exact closed forms, no discretisation). Used by
    ``method="best"`` to skip conditional composition when it cannot beat the Rényi bound: the
    reported minimum is then unchanged.
    """
    delta = check_open_unit("delta", delta)
    frac = check_open_unit("bad_event_fraction", bad_event_fraction)
    return remove_lower_bound_epsilon(means, noise_multiplier, frac * delta, (1 - frac) * delta,
                                      target=target, temperatures=temperatures, cache=cache,
                                      progress=progress)


def conditional_composition_delta_lower_bound(
        means, noise_multiplier: float, epsilon: float, *, bad_event_mass: float,
        target: Optional[float] = None, temperatures: Sequence[float] = DEFAULT_TEMPERATURES,
        cache: Optional[dict] = None, progress: Optional[ProgressCallback] = None) -> float:
    """A certified lower bound on what :func:`conditional_composition_delta` returns with the same
    arguments: ``min(1, δ_true(ε) + δ_E)`` with ``δ_true`` bounded below as above."""
    lb = remove_lower_bound_delta(means, noise_multiplier, bad_event_mass, epsilon,
                                  target=None if target is None else target - bad_event_mass,
                                  temperatures=temperatures, cache=cache, progress=progress)
    return min(1.0, lb + bad_event_mass)


def conditional_composition_epsilon(means, noise_multiplier: float, delta: float, *,
                                    bad_event_fraction: float = 0.5,
                                    discretization: float = pld_lib.DEFAULT_DISCRETIZATION,
                                    temperatures: Sequence[float] = DEFAULT_TEMPERATURES,
                                    cache: Optional[dict] = None,
                                    progress: Optional[ProgressCallback] = None) -> float:
    """ε at ``delta`` with ``δ_E = bad_event_fraction·δ`` (App. B.2 uses 1/2)."""
    delta = check_open_unit("delta", delta)
    frac = check_open_unit("bad_event_fraction", bad_event_fraction)
    pld = conditional_composition_pld(means, noise_multiplier, frac * delta,
                                      discretization=discretization, temperatures=temperatures,
                                      cache=cache, progress=progress)
    return pld_lib.epsilon_for_delta(pld, (1 - frac) * delta)


def conditional_composition_delta(means, noise_multiplier: float, epsilon: float, *,
                                  bad_event_mass: float,
                                  discretization: float = pld_lib.DEFAULT_DISCRETIZATION,
                                  temperatures: Sequence[float] = DEFAULT_TEMPERATURES,
                                  cache: Optional[dict] = None,
                                  progress: Optional[ProgressCallback] = None) -> float:
    """``δ_PLD(ε) + δ_E`` for a fixed bad-event mass ``δ_E``."""
    pld = conditional_composition_pld(means, noise_multiplier, bad_event_mass,
                                      discretization=discretization, temperatures=temperatures,
                                      cache=cache, progress=progress)
    return min(1.0, float(pld_lib.delta_for_epsilon(pld, float(epsilon))) + bad_event_mass)
