r"""Rényi accountant for matrix mechanisms under random allocation (balls-in-bins).

Schuchardt & Kalinin, "Sampling-Free Privacy Accounting for Matrix Mechanisms under Random
Allocation". Pure numpy/scipy.

Sampling (Definition 2.7). ``k`` epochs of ``b`` batches, ``N = k·b`` steps. Every example draws
one bin ``i ∈ {0..b-1}`` uniformly and independently of all others, **once**, and takes part in
steps ``i, b+i, …, (k-1)b+i`` (the same partition is reused in every epoch; batch sizes are
``Binomial(n, 1/b)``). For ``k = 1`` this is Feldman & Shenfeld's random allocation.

Dominating pair (Lemma 2.8 = Lemma 3.2 of Choquette-Choo et al. 2025, directions as corrected in
App. G). For a lower-triangular, entrywise non-negative strategy matrix ``C`` and clip norm 1,

.. math::

    P = \frac1b \sum_{i=1}^b \mathcal N(m_i, \sigma^2 I_N), \qquad Q = \mathcal N(0, \sigma^2 I_N),
    \qquad m_i = \sum_{j=0}^{k-1} |C|_{:,\, i + jb},

with ``(P, Q)`` dominating "remove" and ``(Q, P)`` dominating "add". Everything the Rényi
accountant needs is the Gram matrix :math:`G_{ij} = \langle m_i, m_j\rangle`.

Remove direction (Lemma 3.2, Eq. 5 with the sign typo fixed): for integer :math:`\alpha\ge2`,

.. math::

    R_\alpha(P\|Q) = \frac{1}{\alpha-1}\Big[\log \sum_{(r_1..r_\alpha)\in[b]^\alpha}
    \exp\Big(\sum_{j_1\ne j_2} \frac{G_{r_{j_1} r_{j_2}}}{2\sigma^2}\Big) - \alpha\log b\Big].

Lemma 3.3 evaluates the sum by a dynamic program over count vectors when ``G`` is
``p``-cyclically banded (:math:`G_{ij}=0` whenever :math:`\min(|i-j|, b-|i-j|)\ge p`) in time
exponential in ``p``. For a matrix that is not ``p``-banded, :math:`\tau = \max_{D_{ij}\ge p}
G_{ij}` and :math:`G^{(p)} = \max(G-\tau, 0)` inside the band give the upper bound
:math:`R_\alpha \le R_\alpha[G^{(p)}] + \alpha\tau/(2\sigma^2)` (Section 3, "non-banded").

Add direction (Lemma 3.4): :math:`R_\alpha(Q\|P) \le \sum_j G_{jj}/(2b\sigma^2) +
(\alpha-1)\sum_{ij} G_{ij}/(2b^2\sigma^2)` (AM–GM; valid for real :math:`\alpha > 1`).

Real orders (footnote 4; Wang, Balle & Kasiviswanathan 2019, Corollary 10): the cumulant
:math:`K(\alpha) = (\alpha-1) R_\alpha` is convex with :math:`K(1) = 0`, so linear interpolation of
``K`` between consecutive integers is an upper bound at fractional orders.

Conversion (Theorem 3.1 = Canonne, Kamath & Steinke 2020, Proposition 12):
:math:`H_{e^\varepsilon}(P\|Q) \le \frac{e^{(\alpha-1)(\rho-\varepsilon)}}{\alpha-1}
(1-1/\alpha)^\alpha` when :math:`R_\alpha(P\|Q)\le\rho`; equivalently
:math:`\varepsilon(\alpha) = \rho + \log(1-1/\alpha) - (\log\delta + \log\alpha)/(\alpha-1)`.

The Monte Carlo estimate of Choquette-Choo et al. 2025 (:func:`monte_carlo_epsilon_estimate`) is a
point **estimate** (not a guarantee) and is only used as a test oracle.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
from scipy import special

from .._validation import check_int, check_lower_triangular_matrix, check_open_unit, check_positive
from .random_allocation_dp import log_rest_sums as _log_rest_sums

__all__ = [
    "mixture_means",
    "gram_matrix",
    "cyclic_bandwidth",
    "dominating_pair_logpdf_ratio",
    "RenyiBound",
    "renyi_remove",
    "renyi_remove_bruteforce",
    "renyi_remove_order2_exact",
    "renyi_add",
    "renyi_accountant",
    "rdp_to_epsilon",
    "rdp_to_delta",
    "dp_cost",
    "DEFAULT_MAX_DP_COST",
    "monte_carlo_epsilon_estimate",
]

#: Default ceiling on the estimated element operations of the dynamic program (~10–60 s).
DEFAULT_MAX_DP_COST = 2e9
_MAX_ORDER = 256


# ----------------------------------------------------------------------------------------------
# Dominating pair (Lemma 2.8)
# ----------------------------------------------------------------------------------------------
def _check_strategy(C) -> np.ndarray:
    C = check_lower_triangular_matrix("C", C, why=" (Lemma 2.8)")
    if np.any(C < 0):
        raise ValueError("C must be entrywise non-negative (Lemma 2.8 needs C >= 0; the "
                         "dominating pair of a C with negative entries is not covered)")
    return C


def mixture_means(C, epochs: int, batches_per_epoch: int) -> np.ndarray:
    r"""The ``b × N`` matrix of mixture means :math:`m_i = \sum_{j<k} C_{:, i+jb}` (Lemma 2.8).

    Args:
        C: ``N × N`` lower-triangular, non-negative strategy matrix (``N = k·b``).
        epochs: ``k`` ≥ 1.
        batches_per_epoch: ``b`` ≥ 1.
    """
    k = check_int("epochs", epochs, minimum=1)
    b = check_int("batches_per_epoch", batches_per_epoch, minimum=1)
    C = _check_strategy(C)
    if C.shape[0] != k * b:
        raise ValueError(f"C must be (epochs*batches_per_epoch) square = {k * b}, got "
                         f"{C.shape[0]}")
    # column i + j*b for j = 0..k-1 -> reshape columns as (k, b)
    return C.T.reshape(k, b, k * b).sum(axis=0)


def gram_matrix(means: np.ndarray) -> np.ndarray:
    """``G = m mᵀ`` (``b × b``), symmetrised exactly."""
    means = np.asarray(means, dtype=np.float64)
    G = means @ means.T
    return 0.5 * (G + G.T)


def _cyclic_distance(b: int) -> np.ndarray:
    idx = np.arange(b)
    d = np.abs(idx[:, None] - idx[None, :])
    return np.minimum(d, b - d)


def cyclic_bandwidth(G: np.ndarray, *, atol: float = 0.0) -> int:
    """Smallest ``p`` with ``G_ij <= atol`` whenever the cyclic distance is ``>= p``."""
    G = np.asarray(G, dtype=np.float64)
    D = _cyclic_distance(G.shape[0])
    nz = np.abs(G) > atol
    return int(D[nz].max()) + 1 if nz.any() else 1


def dominating_pair_logpdf_ratio(x: np.ndarray, means: np.ndarray, sigma: float) -> np.ndarray:
    r"""Privacy loss :math:`\log\frac{dP}{dQ}(x) = \log\frac1b\sum_i
    \exp\big((\langle x, m_i\rangle - \|m_i\|^2/2)/\sigma^2\big)` for rows ``x`` (Lemma 2.8)."""
    means = np.asarray(means, dtype=np.float64)
    sq = np.sum(means ** 2, axis=1)
    z = (np.asarray(x) @ means.T - 0.5 * sq[None, :]) / sigma ** 2
    return special.logsumexp(z, axis=1) - math.log(means.shape[0])


# ----------------------------------------------------------------------------------------------
# Remove direction: brute force, alpha = 2 closed form, dynamic program (Lemmas 3.2, 3.3)
# ----------------------------------------------------------------------------------------------
def _check_sigma(sigma) -> float:
    return check_positive("noise_multiplier", sigma)


def renyi_remove_bruteforce(G, noise_multiplier: float, order: int) -> float:
    r"""``R_α(P‖Q)`` by direct summation over all ``b^α`` index tuples (Eq. 5; tests only).

    Exact for any ``G``; cost ``b^α`` (refuses more than 5e6 tuples).
    """
    G = np.asarray(G, dtype=np.float64)
    sigma = _check_sigma(noise_multiplier)
    alpha = check_int("order", order, minimum=2)
    b = G.shape[0]
    if b ** alpha > 5_000_000:
        raise ValueError(f"brute force needs b**order = {b ** alpha} tuples (> 5e6)")
    tuples = np.array(list(itertools.product(range(b), repeat=alpha)), dtype=np.int64)
    expo = np.zeros(len(tuples))
    for j1 in range(alpha):
        for j2 in range(alpha):
            if j1 != j2:
                expo += G[tuples[:, j1], tuples[:, j2]]
    log_sum = special.logsumexp(expo / (2 * sigma ** 2))
    return float((log_sum - alpha * math.log(b)) / (alpha - 1))


def renyi_remove_order2_exact(G, noise_multiplier: float) -> float:
    r"""Exact ``R_2(P‖Q) = \log \frac{1}{b^2}\sum_{ij} e^{G_{ij}/\sigma^2}`` for any ``G``."""
    G = np.asarray(G, dtype=np.float64)
    sigma = _check_sigma(noise_multiplier)
    return float(special.logsumexp(G / sigma ** 2) - 2 * math.log(G.shape[0]))


def _renyi_remove_order3_exact(G, sigma: float) -> float:
    # sum over (r1, r2, r3) of exp((G12 + G13 + G23)/sigma^2) = sum_{r1,r2} e^{G12} sum_r3 e^{G13+G23}
    A = G / sigma ** 2
    b = G.shape[0]
    out = -np.inf
    for r1 in range(b):
        # log sum_{r2, r3} exp(A[r1, r2] + A[r1, r3] + A[r2, r3])
        M = A[r1][:, None] + A[r1][None, :] + A
        out = np.logaddexp(out, special.logsumexp(M))
    return float((out - 3 * math.log(b)) / 2)


def _truncate(G: np.ndarray, bands: int) -> tuple[np.ndarray, float]:
    """``(G^{(p)}, τ)`` of the non-banded bound (Section 3): ``G <= G^{(p)} + τ 11ᵀ``."""
    D = _cyclic_distance(G.shape[0])
    outside = D >= bands
    tau = max(0.0, float(G[outside].max())) if outside.any() else 0.0
    Gp = np.where(outside, 0.0, np.maximum(G - tau, 0.0))
    return Gp, tau


def _dp_plan(b: int, bands: int, Gp: np.ndarray) -> tuple[int, bool]:
    """Window ``w`` of the forward pass and whether wrap-around pairs need prefix enumeration."""
    w = min(bands, b)
    if w >= b:
        return b, False
    iu = np.triu_indices(b, k=w)  # pairs with linear distance >= w
    wrap = bool(np.any(Gp[iu] != 0))
    if wrap and b < 2 * w - 1:
        # prefix and suffix windows would overlap: one linear pass over a full window
        return b, False
    return w, wrap


def dp_cost(b: int, bands: int, max_order: int, *, wrap: bool = True) -> float:
    """Cost of the dynamic program on the full cube (Lemma 3.3: ``O(b p α^{2p})``): the rule
    that picks the effective bandwidth and the largest order against ``max_cost``.

    ``#prefixes × (positions) × (α+1)^{w+1}`` with ``#prefixes = C(α+w-1, w-1)`` when wrap-around
    pairs exist (k ≥ 2 or non-banded ``C``) and 1 otherwise: the element operations of
    :func:`~opacus_structured.accounting.random_allocation_dp.log_rest_sums_dense`. The program
    actually run (:func:`~opacus_structured.accounting.random_allocation_dp.log_rest_sums`) visits
    only the reachable part of that cube (issue 41: 38,760 of 6.1 million cells a bin, ~150×
    less time), but the rule is kept so that the bandwidth, the orders and hence every ε stay
    what they were.
    """
    w = min(bands, b)
    a1 = max_order + 1
    n_prefix = math.comb(max_order + w - 1, w - 1) if (wrap and w > 1) else 1
    return float(n_prefix) * max(b - (w - 1 if wrap else 0), 1) * float(a1) ** (w + 1)


@dataclasses.dataclass(frozen=True)
class RenyiBound:
    """Rényi divergences of the Lemma 2.8 pair at ``orders`` (an upper bound, or exact).

    ``remove[i]`` bounds ``R_{orders[i]}(P‖Q)``, ``add[i]`` bounds ``R_{orders[i]}(Q‖P)``.
    ``exact_remove`` says whether ``remove`` is exact (banded ``C``, integer orders).
    """

    orders: np.ndarray
    remove: np.ndarray
    add: np.ndarray
    bands: int
    tau: float
    exact_remove: bool

    @property
    def rdp(self) -> np.ndarray:
        """``max(remove, add)``: Rényi divergence bound of the worse direction per order."""
        return np.maximum(self.remove, self.add)

    def epsilon(self, delta: float) -> float:
        return rdp_to_epsilon(self.orders, self.rdp, delta)[0]

    def delta(self, epsilon: float) -> float:
        return rdp_to_delta(self.orders, self.rdp, epsilon)[0]


def _check_orders(orders) -> np.ndarray:
    arr = np.atleast_1d(np.asarray(orders, dtype=np.float64))
    if arr.size == 0 or np.any(~np.isfinite(arr)) or np.any(arr <= 1) or np.any(arr > _MAX_ORDER):
        raise ValueError(f"orders must be finite numbers in (1, {_MAX_ORDER}], got {orders!r}")
    return arr


def _interpolate_cgf(int_values: dict[int, float], orders: np.ndarray) -> np.ndarray:
    """ρ at real orders from ρ at integers via convexity of K(α) = (α−1)ρ(α), K(1) = 0."""
    K = {1: 0.0, **{a: (a - 1) * v for a, v in int_values.items()}}
    out = np.empty(len(orders))
    for n, a in enumerate(orders):
        lo = math.floor(a)
        if lo == a:
            out[n] = int_values[int(a)]
            continue
        th = a - lo
        out[n] = ((1 - th) * K[lo] + th * K[lo + 1]) / (a - 1)
    return out


def renyi_remove(G, noise_multiplier: float, orders, *, bands: int | None = None,
                 max_cost: float = DEFAULT_MAX_DP_COST) -> tuple[np.ndarray, float, bool]:
    r"""Upper bound on ``R_α(P‖Q)`` (remove) at each order (Lemmas 3.2–3.3, Algorithm 1).

    Args:
        G: ``b × b`` Gram matrix of the mixture means.
        noise_multiplier: σ > 0.
        orders: orders α > 1 (integers exact; reals by CGF interpolation).
        bands: effective cyclic bandwidth ``p`` of the dynamic program. ``None`` uses the exact
            bandwidth of ``G`` (:func:`cyclic_bandwidth`). A smaller ``p`` than the true one
            gives the τ upper bound.
        max_cost: ceiling on :func:`dp_cost`; a larger estimate raises ``ValueError``.

    Returns:
        ``(rho, tau, exact)``. At α = 2 (and α = 3 for b ≤ 200) the exact tuple sum is used when
        it is smaller than the banded bound.
    """
    G = np.asarray(G, dtype=np.float64)
    if G.ndim != 2 or G.shape[0] != G.shape[1] or np.any(~np.isfinite(G)):
        raise ValueError("G must be a finite square matrix")
    sigma = _check_sigma(noise_multiplier)
    orders = _check_orders(orders)
    b = G.shape[0]
    true_bw = cyclic_bandwidth(G)
    p = true_bw if bands is None else check_int("bands", bands, minimum=1)
    p = min(p, true_bw)
    Gp, tau = _truncate(G, p)
    w, wrap = _dp_plan(b, p, Gp)
    int_needed = sorted(({int(math.floor(a)) for a in orders}
                         | {int(math.ceil(a)) for a in orders}) - {1})
    A = max(int_needed)
    cost = dp_cost(b, w, A, wrap=wrap)
    if cost > max_cost:
        raise ValueError(
            f"the Rényi dynamic program with bands={p} (window {w}, "
            f"{'with' if wrap else 'without'} wrap-around) and max order {A} needs about "
            f"{cost:.3g} operations (> max_cost={max_cost:.3g}); runtime is exponential in the "
            f"bandwidth (Lemma 3.3). Pass a smaller `bands` (upper bound with the τ penalty), "
            f"smaller orders, or raise max_cost")
    log_s = _log_rest_sums(Gp, sigma, w, wrap, A)
    vals: dict[int, float] = {}
    for a in int_needed:
        rho = (log_s[a] + special.gammaln(a + 1.0) - a * math.log(b)) / (a - 1) \
            + tau * a / (2 * sigma ** 2)
        if tau > 0 and a == 2:
            rho = min(rho, renyi_remove_order2_exact(G, sigma))
        if tau > 0 and a == 3 and b <= 200:
            rho = min(rho, _renyi_remove_order3_exact(G, sigma))
        vals[a] = float(rho)
    exact = tau == 0.0
    return _interpolate_cgf(vals, orders), tau, exact


def renyi_add(G, noise_multiplier: float, orders) -> np.ndarray:
    r"""Lemma 3.4 bound ``R_α(Q‖P) ≤ ΣG_jj/(2bσ²) + (α−1)ΣG_ij/(2b²σ²)`` (real α > 1)."""
    G = np.asarray(G, dtype=np.float64)
    sigma = _check_sigma(noise_multiplier)
    orders = _check_orders(orders)
    b = G.shape[0]
    return (np.trace(G) / (2 * b * sigma ** 2)
            + (orders - 1) * np.sum(G) / (2 * b ** 2 * sigma ** 2))


def default_orders(bands: int, b: int, *, wrap: bool, max_cost: float = DEFAULT_MAX_DP_COST,
                   cap: int = 64) -> np.ndarray:
    """Orders 1.25, 1.5, 1.75, 2, 3, …, A with A ≤ ``cap`` the largest affordable one."""
    A = cap
    while A > 2 and dp_cost(b, bands, A, wrap=wrap) > max_cost:
        A -= 1
    return np.concatenate([[1.25, 1.5, 1.75], np.arange(2, A + 1, dtype=np.float64)])


def renyi_accountant(C=None, epochs: int = 1, batches_per_epoch: int = 1,
                     noise_multiplier: float = 1.0, orders=None, *, means=None,
                     bands: int | None = None, max_cost: float = DEFAULT_MAX_DP_COST
                     ) -> RenyiBound:
    """Algorithm 3: Rényi bounds of both directions of the Lemma 2.8 pair at ``orders``.

    Pass ``C`` (with ``epochs``, ``batches_per_epoch``) or precomputed ``means`` (``b × N``).
    ``orders=None`` picks :func:`default_orders` for the bandwidth in use.
    """
    if means is None:
        if C is None:
            raise ValueError("pass C (strategy matrix) or means")
        means = mixture_means(C, epochs, batches_per_epoch)
    means = np.asarray(means, dtype=np.float64)
    if means.ndim != 2 or np.any(means < 0) or np.any(~np.isfinite(means)):
        raise ValueError("means must be a finite non-negative (b, N) array")
    G = gram_matrix(means)
    sigma = _check_sigma(noise_multiplier)
    b = G.shape[0]
    if orders is None:
        p = cyclic_bandwidth(G) if bands is None else min(check_int("bands", bands, minimum=1),
                                                           cyclic_bandwidth(G))
        Gp, _ = _truncate(G, p)
        w, wrap = _dp_plan(b, p, Gp)
        orders = default_orders(w, b, wrap=wrap, max_cost=max_cost)
        if orders[-1] < 3:
            raise ValueError(
                f"bands={p} is too wide for the Rényi dynamic program: even order 3 needs "
                f"about {dp_cost(b, w, 3, wrap=wrap):.3g} operations (> max_cost="
                f"{max_cost:.3g}); pass a smaller `bands` (τ upper bound)")
    orders = _check_orders(orders)
    rem, tau, exact = renyi_remove(G, sigma, orders, bands=bands, max_cost=max_cost)
    add = renyi_add(G, sigma, orders)
    p_used = cyclic_bandwidth(G) if bands is None else min(int(bands), cyclic_bandwidth(G))
    return RenyiBound(orders=orders, remove=rem, add=add, bands=p_used, tau=tau,
                      exact_remove=exact and bool(np.all(orders == np.floor(orders))))


# ----------------------------------------------------------------------------------------------
# RDP -> (eps, delta): Canonne, Kamath & Steinke 2020, Proposition 12 (Theorem 3.1)
# ----------------------------------------------------------------------------------------------
def rdp_to_epsilon(orders, rdp, delta: float) -> tuple[float, float]:
    """``(ε, α*)``: ``min_α ρ(α) + log(1−1/α) − (log δ + log α)/(α−1)``, clipped at 0."""
    delta = check_open_unit("delta", delta)
    orders = _check_orders(orders)
    rdp = np.asarray(rdp, dtype=np.float64)
    if rdp.shape != orders.shape or np.any(np.isnan(rdp)):
        raise ValueError("rdp must be an array of the same shape as orders, without NaN")
    eps = rdp + np.log1p(-1.0 / orders) - (math.log(delta) + np.log(orders)) / (orders - 1)
    i = int(np.argmin(eps))
    return max(float(eps[i]), 0.0), float(orders[i])


def rdp_to_delta(orders, rdp, epsilon: float) -> tuple[float, float]:
    """``(δ, α*)``: ``min_α exp((α−1)(ρ−ε)) (1−1/α)^α/(α−1)``, capped at 1."""
    if not isinstance(epsilon, (int, float, np.floating, np.integer)) or math.isnan(epsilon):
        raise ValueError(f"epsilon must be a real number, got {epsilon!r}")
    orders = _check_orders(orders)
    rdp = np.asarray(rdp, dtype=np.float64)
    logd = (orders - 1) * (rdp - float(epsilon)) + orders * np.log1p(-1.0 / orders) \
        - np.log(orders - 1)
    i = int(np.argmin(logd))
    return float(min(1.0, math.exp(min(logd[i], 0.0)))), float(orders[i])


# ----------------------------------------------------------------------------------------------
# Monte Carlo oracle (an ESTIMATE, never a guarantee): tests and plots only
# ----------------------------------------------------------------------------------------------
def monte_carlo_epsilon_estimate(means, noise_multiplier: float, delta: float, *,
                                 samples: int = 200_000, seed: int = 0,
                                 chunk: int = 50_000) -> dict:
    r"""Monte Carlo **estimate** of ε(δ) of the Lemma 2.8 pair (Choquette-Choo et al. 2025).

    Samples the privacy loss ``L = log dP/dQ`` under ``P`` (remove) and under ``Q`` (add, loss
    ``−L``) and estimates ``δ(ε) = E[max(1 − e^{ε−L}, 0)]`` for each direction. Returns a dict
    with ``epsilon`` (point estimate of the larger direction), ``epsilon_low`` and
    ``epsilon_high`` (ε at δ ± 3 standard errors of the estimator) — an estimate with an error
    bar, **not** a privacy guarantee.
    """
    means = np.asarray(means, dtype=np.float64)
    sigma = _check_sigma(noise_multiplier)
    delta = check_open_unit("delta", delta)
    samples = check_int("samples", samples, minimum=1000)
    rng = np.random.default_rng(seed)
    b, N = means.shape
    losses = {"remove": [], "add": []}
    done = 0
    while done < samples:
        n = min(chunk, samples - done)
        z = rng.standard_normal((n, N)) * sigma
        comp = rng.integers(0, b, size=n)
        losses["remove"].append(dominating_pair_logpdf_ratio(z + means[comp], means, sigma))
        losses["add"].append(-dominating_pair_logpdf_ratio(z, means, sigma))
        done += n

    def eps_at(L: np.ndarray, target: float) -> float:
        def dlt(e):
            v = -np.expm1(e - L)
            return float(np.mean(np.maximum(v, 0.0)))
        lo, hi = 0.0, max(float(L.max()), 1e-9)
        if dlt(0.0) <= target:
            return 0.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if dlt(mid) > target:
                lo = mid
            else:
                hi = mid
        return hi

    out = {"epsilon": 0.0, "epsilon_low": 0.0, "epsilon_high": 0.0, "kind": "estimate"}
    for key in ("remove", "add"):
        L = np.concatenate(losses[key])
        # standard error of the delta estimator at the point estimate
        e0 = eps_at(L, delta)
        v = np.maximum(-np.expm1(e0 - L), 0.0)
        se = float(np.std(v) / math.sqrt(len(L)))
        lo_d = max(delta - 3 * se, delta * 1e-3)
        hi_d = min(delta + 3 * se, 1 - 1e-12)
        out[key] = e0
        out["epsilon"] = max(out["epsilon"], e0)
        out["epsilon_high"] = max(out["epsilon_high"], eps_at(L, lo_d))
        out["epsilon_low"] = max(out["epsilon_low"], eps_at(L, hi_d))
    return out
