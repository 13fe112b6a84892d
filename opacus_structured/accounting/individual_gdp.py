r"""Individual (per-example) privacy accounting with Gaussian differential privacy.

Koskela, Tobaben & Honkela, *Individual Privacy Accounting with Gaussian Differential Privacy*
(arXiv:2209.15596, ICLR 2023). Pure numpy/scipy: no torch (the torch state lives in
:mod:`opacus_structured.accountants.individual_gdp` and :mod:`lightning_callbacks`).

Exact results (certified):

* **Per-step individual GDP parameter** (eq. (4.2), App. C.2). In DP-GD the released quantity is
  :math:`\sum_{x \in S_j} \mathrm{clip}_C(g_x) + \mathcal N(0, \sigma^2 C^2 I)`; removing example
  :math:`i` changes the sum by at most :math:`\min(\lVert g_i\rVert_2, C)` (the global L2 norm over
  all parameters of the gradient actually summed), so step :math:`j` is
  :math:`\mu_j^{(i)}`-GDP with respect to the removal of :math:`x_i`, where

  .. math:: \mu_j^{(i)} = \frac{\min(\lVert g_{ij}\rVert_2, C)}{\sigma\,C}.

* **Fully adaptive composition** (Theorem 2 of the paper, §3.3): if
  :math:`\sum_{m=1}^{k} \mu_m^2 \le B^2` almost surely, with :math:`k` fixed in advance and each
  :math:`\mu_m` predictable (a function of the released history), the composition is
  :math:`B`-GDP. Applied per example this is **Theorem 1** (the individual GDP filter,
  Algorithm 1): an example stays active at step :math:`j` only while
  :math:`\sum_{m<j} (\mu_m^{(i)})^2 + (\mu_j^{(i)})^2 \le B^2`; then the output is :math:`B`-GDP
  for every :math:`i` under the remove relation, i.e. :math:`(\varepsilon, \delta(\varepsilon))`-DP
  with :math:`\delta(\varepsilon) = \Phi(-\varepsilon/B + B/2) - e^{\varepsilon}\Phi(-\varepsilon/B - B/2)`
  (Corollary C.2).
* **Individual ε** of example :math:`i` after :math:`n` steps: the GDP conversion at
  :math:`\mu^{(i)} = (\sum_j (\mu_j^{(i)})^2)^{1/2}` (an ex-post value: the filter with budget
  :math:`\mu^{(i)}` would have certified it; odometer, App. C.5).

Approximate results (NOT certified bounds; the names say so):

* :class:`ApproximateIndividualPLDAccountant`: the App. D accountant for Poisson-subsampled
  DP-SGD (σ-grid bucketing, Thm D.2; FFT composition; a μ-GDP curve fitted on an ε-grid, then the
  RDP conversion, Lemma C.4). The μ is fitted on a finite ε-grid and not verified to dominate
  the individual PLD for every ε (§5 of the paper approximates it numerically, relying on the
  central limit theorem), so its ε values are estimates.

The μ-GDP conversions themselves are the foundation's :func:`~.gaussian.gdp_delta`,
:func:`~.gaussian.gdp_epsilon` and :func:`~.gaussian.gdp_mu`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np
from scipy import special

from .._validation import (
    check_int,
    check_nonnegative,
    check_open_unit,
    check_positive,
    check_probability,
)
from .gaussian import gdp_epsilon, gdp_mu

__all__ = [
    "individual_mu",
    "sum_mu_squared",
    "individual_epsilons",
    "budget_from_epsilon",
    "budget_from_steps",
    "worst_case_mu",
    "filter_epsilon",
    "IndividualGDPFilterState",
    "rdp_to_dp_epsilon",
    "gdp_rdp_epsilon",
    "max_steps_gdp",
    "max_steps_rdp",
    "ApproximateIndividualPLDAccountant",
    "ApproximateIndividualEpsilons",
    "DEFAULT_RDP_ORDERS",
]

#: Integer Rényi orders 2..32, as in the paper's RDP baselines (App. C.4, Figs. 3-5).
DEFAULT_RDP_ORDERS = tuple(range(2, 33))


# ---------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------
def _as_norms(name: str, norms) -> np.ndarray:
    arr = np.asarray(norms, dtype=np.float64)
    if arr.size and (not np.all(np.isfinite(arr)) or np.any(arr < 0)):
        raise ValueError(f"{name} must be finite and >= 0 (per-sample gradient norms)")
    return arr


def _as_mu(name: str, mu) -> np.ndarray:
    arr = np.asarray(mu, dtype=np.float64)
    if arr.size and (not np.all(np.isfinite(arr)) or np.any(arr < 0)):
        raise ValueError(f"{name} must be finite and >= 0 (GDP parameters)")
    return arr


# ---------------------------------------------------------------------------------------------
# Exact individual GDP (Theorems 1 and 2)
# ---------------------------------------------------------------------------------------------
def individual_mu(norms, noise_multiplier: float, max_grad_norm: float) -> np.ndarray:
    r"""Per-step individual GDP parameters :math:`\mu_j^{(i)} = \min(\lVert g\rVert, C)/(\sigma C)`.

    Eq. (4.2) and App. C.2 of Koskela et al. (2023) with Opacus' convention that the noise std
    is ``noise_multiplier * max_grad_norm``. ``norms`` are the global L2 norms (over all
    parameters) of the per-sample gradients actually summed; any array shape.
    """
    sigma = check_positive("noise_multiplier", noise_multiplier)
    clip = check_positive("max_grad_norm", max_grad_norm)
    n = _as_norms("norms", norms)
    return np.minimum(n, clip) / (sigma * clip)


def sum_mu_squared(norms, noise_multiplier: float, max_grad_norm: float) -> np.ndarray:
    r""":math:`\sum_j (\mu_j^{(i)})^2` over the steps axis (axis 0) of recorded norms ``[steps, n]``.

    ``noise_multiplier`` may also be an array of shape ``[steps]`` (a noise schedule).
    """
    n = _as_norms("norms", norms)
    if n.ndim != 2:
        raise ValueError(f"norms must have shape [steps, n], got shape {n.shape}")
    clip = check_positive("max_grad_norm", max_grad_norm)
    sig = np.asarray(noise_multiplier, dtype=np.float64)
    if sig.ndim == 0:
        sig = np.full(n.shape[0], check_positive("noise_multiplier", float(sig)))
    if sig.shape != (n.shape[0],) or not np.all(np.isfinite(sig)) or np.any(sig <= 0):
        raise ValueError("noise_multiplier must be > 0 (a scalar or one value per step)")
    mu = np.minimum(n, clip) / (sig[:, None] * clip)
    return np.sum(mu * mu, axis=0)


def _gdp_delta_vec(eps: np.ndarray, mu: np.ndarray) -> np.ndarray:
    # Same closed form as gaussian.gdp_delta (Dong et al. Cor. 2.13), broadcast over an *array*
    # of mu > 0 (gdp_delta takes a scalar mu). Tested against gdp_delta.
    a = -eps / mu + mu / 2.0
    b = -eps / mu - mu / 2.0
    log_first = special.log_ndtr(a)
    diff = np.minimum(eps + special.log_ndtr(b) - log_first, 0.0)
    return np.clip(np.exp(log_first) * -np.expm1(diff), 0.0, 1.0)


def individual_epsilons(mu_total, delta: float, *, iterations: int = 200) -> np.ndarray:
    r"""Vectorised :math:`\varepsilon_i(\delta)` of :math:`\mu_i`-GDP (Corollary C.2), rounded up.

    For each entry of ``mu_total`` (:math:`\mu^{(i)} = \sqrt{\sum_j (\mu_j^{(i)})^2}`) returns the
    smallest ε ≥ 0 (to bisection precision, always on the safe side) with
    :math:`\delta(\varepsilon;\mu) \le` ``delta``. Agrees with the scalar
    :func:`~.gaussian.gdp_epsilon`; starts from the feasible point
    :math:`\mu^2/2 + \mu\,\Phi^{-1}(1-\delta)` and bisects keeping the upper end feasible, so the
    result never under-reports.
    """
    delta = check_open_unit("delta", delta)
    check_int("iterations", iterations, minimum=1)
    mu = _as_mu("mu_total", mu_total)
    shape = mu.shape
    mu = mu.reshape(-1)
    out = np.zeros_like(mu)
    pos = mu > 0
    if np.any(pos):
        m = mu[pos]
        hi = m * m / 2.0 + m * special.ndtri(1.0 - delta)
        hi = np.maximum(hi, 0.0)
        lo = np.zeros_like(m)
        zero_ok = _gdp_delta_vec(np.zeros_like(m), m) <= delta
        for _ in range(iterations):
            mid = 0.5 * (lo + hi)
            ok = _gdp_delta_vec(mid, m) <= delta
            hi = np.where(ok, mid, hi)
            lo = np.where(ok, lo, mid)
            if np.all(hi - lo <= 1e-13 * np.maximum(1.0, hi)):
                break
        out[pos] = np.where(zero_ok, 0.0, hi)
    return out.reshape(shape)


def budget_from_epsilon(epsilon: float, delta: float) -> float:
    r"""GDP budget :math:`B` such that :math:`B`-GDP implies :math:`(\varepsilon, \delta)`-DP.

    Corollary C.2 solved for μ (rounded down; e.g. (2.75, 1e-5) gives B = 0.665942).
    """
    return gdp_mu(check_positive("epsilon", epsilon), delta)


def budget_from_steps(steps: int, noise_multiplier: float) -> float:
    r"""Budget :math:`B = \sqrt{T_0}/\sigma`: every example can take ``steps`` worst-case
    (clipped-norm) DP-GD steps before it is filtered (the paper's MIMIC setting, §6)."""
    steps = check_int("steps", steps, minimum=0)
    return math.sqrt(steps) / check_positive("noise_multiplier", noise_multiplier)


def worst_case_mu(steps: int, noise_multiplier: float) -> float:
    r"""Worst-case (dataset-level) GDP parameter of ``steps`` full-batch DP-GD steps,
    :math:`\mu = \sqrt{T}/\sigma` (Dong et al. Cor. 3.3)."""
    return budget_from_steps(steps, noise_multiplier)


def filter_epsilon(budget: float, delta: float) -> float:
    r"""ε(δ) certified by the individual GDP filter with budget :math:`B` (Theorem 1, Cor. C.2).

    Valid for the output of Algorithm 1 (and Algorithm 2) run for a number of steps fixed in
    advance, with predictable :math:`\mu_j^{(i)}` and a fixed public normaliser, for every
    example under the add/remove relation.
    """
    return gdp_epsilon(delta, check_nonnegative("budget", budget))


class IndividualGDPFilterState:
    r"""Reference (numpy) implementation of Algorithm 1, the individual GDP filter.

    Keeps :math:`s_i = \sum_m (\mu_m^{(i)})^2 \cdot 1\{x_i \in S_m\}` and at each step admits
    :math:`x_i` iff :math:`s_i + (\mu_j^{(i)})^2 \le B^2` (the test *includes* the current
    step). Inactive examples spend nothing. With ``permanent_drop=True`` (the released code's
    conservative policy) an example once refused never returns; the literal Algorithm 1 lets it
    return if a later, smaller :math:`\mu` fits into its remainder. Both satisfy Theorem 1.

    Args:
        num_examples: N, the dataset size.
        budget: B (a μ value), e.g. :func:`budget_from_epsilon` or :func:`budget_from_steps`.
        tolerance: slack added to :math:`B^2` to absorb floating-point round-off at equality
            (default 1e-12 relative); it is reported by :attr:`effective_budget`.
    """

    def __init__(self, num_examples: int, budget: float, *, permanent_drop: bool = False,
                 tolerance: float = 1e-12):
        self.num_examples = check_int("num_examples", num_examples, minimum=1)
        self.budget = check_positive("budget", budget)
        self.tolerance = check_nonnegative("tolerance", tolerance)
        self.permanent_drop = bool(permanent_drop)
        self.spent = np.zeros(self.num_examples)
        self.dropped = np.zeros(self.num_examples, dtype=bool)
        self.steps = 0

    @property
    def effective_budget(self) -> float:
        """:math:`\\sqrt{B^2(1+\\text{tolerance})}`: the budget actually certified."""
        return math.sqrt(self.budget ** 2 * (1.0 + self.tolerance))

    def step(self, mu) -> np.ndarray:
        """Apply one step with per-example ``mu`` (shape [N]); returns the active mask."""
        mu = _as_mu("mu", mu)
        if mu.shape != (self.num_examples,):
            raise ValueError(f"mu must have shape ({self.num_examples},), got {mu.shape}")
        active = self.spent + mu * mu <= self.budget ** 2 * (1.0 + self.tolerance)
        if self.permanent_drop:
            active &= ~self.dropped
            self.dropped |= ~active
        self.spent += np.where(active, mu * mu, 0.0)
        self.steps += 1
        return active

    def epsilons(self, delta: float) -> np.ndarray:
        """Individual ε(δ) spent so far (each ≤ :func:`filter_epsilon` of the budget)."""
        return individual_epsilons(np.sqrt(self.spent), delta)


# ---------------------------------------------------------------------------------------------
# RDP baseline (App. A, C.4) and the σ = 100 DP-GD step counts (§4.1, Figs. 3-5)
# ---------------------------------------------------------------------------------------------
def rdp_to_dp_epsilon(orders: Sequence[float], rdp: Sequence[float], delta: float) -> float:
    r"""RDP → (ε, δ) by Lemma C.4 (Canonne, Kamath & Steinke 2020), minimised over orders:

    .. math:: \varepsilon = \min_\alpha\ \rho(\alpha) + \frac{\log(1/\delta) - \log\alpha}{\alpha-1}
              + \log\frac{\alpha-1}{\alpha}.
    """
    delta = check_open_unit("delta", delta)
    a = np.asarray(orders, dtype=np.float64)
    r = np.asarray(rdp, dtype=np.float64)
    if a.ndim != 1 or a.shape != r.shape or a.size == 0 or np.any(a <= 1):
        raise ValueError("orders must be a non-empty 1-d array of values > 1 matching rdp")
    if np.any(~np.isfinite(r)) or np.any(r < 0):
        raise ValueError("rdp must be finite and >= 0")
    eps = r + (np.log(1.0 / delta) - np.log(a)) / (a - 1.0) + np.log((a - 1.0) / a)
    return float(max(np.min(eps), 0.0))


def gdp_rdp_epsilon(mu: float, delta: float,
                    orders: Sequence[float] = DEFAULT_RDP_ORDERS) -> float:
    r"""ε(δ) of a μ-GDP mechanism via its RDP curve :math:`\rho(\alpha)=\alpha\mu^2/2` and
    Lemma C.4 (the paper's "RDP" baseline; looser than :func:`~.gaussian.gdp_epsilon`)."""
    mu = check_nonnegative("mu", mu)
    a = np.asarray(orders, dtype=np.float64)
    return rdp_to_dp_epsilon(a, a * mu * mu / 2.0, delta)


def _max_steps(eps_of_steps, epsilon: float, guess: int) -> int:
    k = max(int(guess), 0)
    while k > 0 and eps_of_steps(k) > epsilon:
        k -= 1
    while eps_of_steps(k + 1) <= epsilon:
        k += 1
    return k


def max_steps_gdp(epsilon: float, delta: float, noise_multiplier: float) -> int:
    r"""Largest number of full-batch DP-GD steps with GDP ε(δ) ≤ ``epsilon``.

    :math:`k_{\max} = \lfloor (\sigma\,\mu^*(\varepsilon,\delta))^2 \rfloor` (Fig. 5 of the
    paper), confirmed by evaluating ε at :math:`k_{\max}` and :math:`k_{\max}+1`.
    """
    epsilon = check_positive("epsilon", epsilon)
    sigma = check_positive("noise_multiplier", noise_multiplier)
    guess = math.floor((sigma * gdp_mu(epsilon, delta)) ** 2)
    return _max_steps(lambda k: gdp_epsilon(delta, math.sqrt(k) / sigma), epsilon, guess)


def max_steps_rdp(epsilon: float, delta: float, noise_multiplier: float,
                  orders: Sequence[float] = DEFAULT_RDP_ORDERS) -> int:
    """Largest number of DP-GD steps with RDP-converted ε(δ) ≤ ``epsilon`` (Fig. 5 baseline)."""
    epsilon = check_positive("epsilon", epsilon)
    sigma = check_positive("noise_multiplier", noise_multiplier)
    f = lambda k: gdp_rdp_epsilon(math.sqrt(k) / sigma, delta, orders)  # noqa: E731
    return _max_steps(f, epsilon, math.floor((sigma * gdp_mu(epsilon, delta)) ** 2))


# ---------------------------------------------------------------------------------------------
# App. D: APPROXIMATE individual PLD accountant for Poisson-subsampled DP-SGD
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ApproximateIndividualEpsilons:
    """Output of :meth:`ApproximateIndividualPLDAccountant.approximate_epsilons`.

    APPROXIMATE: ``mu_fit`` is fitted on a finite ε-grid and is not certified to dominate the
    individual PLD for all ε; ``epsilon_rdp`` and ``epsilon_gdp`` are estimates, not bounds.

    Fields: ``mu_fit`` (fitted μ per example: max over the ε-grid of the μ matching δ̃(ε)),
    ``epsilon_rdp`` (ε(δ) from the RDP curve αμ²/2 and Lemma C.4, the paper's pipeline),
    ``epsilon_gdp`` (ε(δ) of μ_fit-GDP directly, Cor. C.2), ``delta_pld`` (δ̃ of the discretised
    individual PLD at the ε-grid, shape [m, len(grid)]), ``is_certified`` (always False).
    """

    mu_fit: np.ndarray
    epsilon_rdp: np.ndarray
    epsilon_gdp: np.ndarray
    delta_pld: np.ndarray
    is_certified: bool = False


class ApproximateIndividualPLDAccountant:
    r"""APPROXIMATE individual PLD accountant for Poisson-subsampled DP-SGD (App. D).

    **Not a certified bound**: the μ-GDP curve is fitted on a finite ε-grid and not verified to
    dominate the individual PLD for every ε (§5 of the paper: "it is then easy to numerically
    approximate μ" by the central limit theorem), and the FFT's circular wrap-around is not
    bounded (see the discretisation below). Use it to *report* individual ε (Fig. 1 of the
    paper), never to guarantee privacy.

    Per step, example :math:`x` with clipped norm :math:`c = \min(\lVert g_x\rVert, C)` sees the
    effective noise :math:`\tilde\sigma = \sigma C / c \ge \sigma`; the remove-direction pair is
    :math:`P = q\,\mathcal N(1,\tilde\sigma^2) + (1-q)\,\mathcal N(0,\tilde\sigma^2)`,
    :math:`Q = \mathcal N(0,\tilde\sigma^2)` (App. D.3). :math:`\tilde\sigma` is rounded **down**
    to a grid :math:`\sigma_b = \sigma + b\,(\sigma_{\max}-\sigma)/(n_\sigma-1)` (less noise,
    an upper bound by data processing; Theorem D.2), so an example is summarised by integer
    counts :math:`k_b`. The composed PLD is :math:`\mathrm{IFFT}(\prod_b A_b^{k_b})`, evaluated
    for many examples at once as ``exp(K @ log A)`` (integer powers: any branch of the log).

    Discretisation: the loss grid is :math:`v_j = j\Delta`, :math:`j\in[-n/2, n/2)`,
    :math:`\Delta = 2L/n`; each cell's probability mass is put at its **upper** end (pessimistic)
    and mass beyond :math:`L` is kept as an infinite-loss atom. Circular wrap-around of the FFT
    is *not* bounded (a second reason this is approximate). μ is then fitted: for each ε₀ of
    ``epsilon_grid``, the μ with :math:`\delta_{GDP}(\varepsilon_0;\mu)=\tilde\delta(\varepsilon_0)`;
    ``mu_fit`` is the maximum over the grid.

    Args:
        noise_multiplier: σ (noise std / C), > 0.
        sample_rate: Poisson rate q in (0, 1].
        sigma_max: top of the σ-grid (effective noise above it is rounded down to it); default
            ``20 σ``.
        num_sigmas: number of σ-grid points (≥ 2).
        loss_range: L, the grid covers [-L, L) (must exceed the composed losses that matter:
            wrap-around beyond it is not accounted for).
        grid_size: n, a power of two. Each step rounds losses up by at most 2L/n, so T steps
            shift ε by at most T·2L/n (pessimistically).
    """

    def __init__(self, noise_multiplier: float, sample_rate: float, *,
                 sigma_max: Optional[float] = None, num_sigmas: int = 16,
                 loss_range: float = 4.0, grid_size: int = 2 ** 18):
        self.noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
        self.sample_rate = check_probability("sample_rate", sample_rate)
        self.sigma_max = (20.0 * self.noise_multiplier if sigma_max is None
                          else check_positive("sigma_max", sigma_max))
        if self.sigma_max <= self.noise_multiplier:
            raise ValueError(f"sigma_max must be > noise_multiplier={self.noise_multiplier}, "
                             f"got {self.sigma_max}")
        self.num_sigmas = check_int("num_sigmas", num_sigmas, minimum=2)
        self.loss_range = check_positive("loss_range", loss_range)
        self.grid_size = check_int("grid_size", grid_size, minimum=16)
        if self.grid_size & (self.grid_size - 1):
            raise ValueError(f"grid_size must be a power of two, got {grid_size}")
        self.sigma_grid = np.linspace(self.noise_multiplier, self.sigma_max, self.num_sigmas)
        self._log_fft = None
        self._inf_mass = None

    # ---- encoding ------------------------------------------------------------------------
    def bucket(self, norms, max_grad_norm: float) -> np.ndarray:
        r"""σ-grid bucket of each norm: :math:`\lfloor(\tilde\sigma-\sigma)/\Delta_\sigma\rfloor`
        clipped to ``[0, num_sigmas-1]`` (rounds the effective noise down; norm 0 → top)."""
        clip = check_positive("max_grad_norm", max_grad_norm)
        ratio = np.minimum(_as_norms("norms", norms), clip) / clip
        step = (self.sigma_max - self.noise_multiplier) / (self.num_sigmas - 1)
        with np.errstate(divide="ignore"):
            sig_eff = np.where(ratio > 0, self.noise_multiplier / np.maximum(ratio, 1e-300),
                               np.inf)
        b = np.floor((np.minimum(sig_eff, self.sigma_max) - self.noise_multiplier) / step
                     * (1 + 1e-12))
        return np.clip(b, 0, self.num_sigmas - 1).astype(np.int64)

    def counts(self, norms, max_grad_norm: float) -> np.ndarray:
        """Bucket counts ``K[x, b]`` from recorded norms of shape ``[steps, m]``: every step,
        sampled or not (the accountant needs each example's gradient norm at every step; the
        paper tracks "the gradient norms for all elements of the training dataset", App. E.2)."""
        n = _as_norms("norms", norms)
        if n.ndim != 2:
            raise ValueError(f"norms must have shape [steps, m], got {n.shape}")
        b = self.bucket(n, max_grad_norm)
        k = np.zeros((n.shape[1], self.num_sigmas), dtype=np.int64)
        cols = np.broadcast_to(np.arange(n.shape[1]), b.shape)
        np.add.at(k, (cols.reshape(-1), b.reshape(-1)), 1)
        return k

    # ---- discretised PLDs ----------------------------------------------------------------
    def _step_pmf(self, s: float) -> tuple[np.ndarray, float]:
        q, n = self.sample_rate, self.grid_size
        delta_x = 2.0 * self.loss_range / n
        idx = np.arange(-n // 2, n // 2)
        v = idx * delta_x

        def cdf_p_of_loss(y):
            # P-probability that L(t) <= y, L(t) = log(1 - q + q exp((2t - 1)/(2 s^2))).
            y = np.asarray(y, dtype=np.float64)
            out = np.zeros_like(y)
            ok = np.expm1(y) + q > 0  # e^y > 1 - q
            if q == 1.0:
                t = s * s * y[ok] + 0.5
            else:
                t = s * s * np.log((np.expm1(y[ok]) + q) / q) + 0.5
            out[ok] = q * special.ndtr((t - 1.0) / s) + (1 - q) * special.ndtr(t / s)
            return out

        upper = cdf_p_of_loss(v)
        lower = cdf_p_of_loss(v - delta_x)
        lower[0] = 0.0  # everything below the grid is pushed up to its first point
        mass = np.maximum(upper - lower, 0.0)
        inf_mass = max(1.0 - upper[-1], 0.0)
        pmf = np.zeros(n)
        pmf[idx % n] = mass
        return pmf, inf_mass

    def _prepare(self):
        if self._log_fft is None:
            logs, infs = [], []
            for s in self.sigma_grid:
                pmf, inf_mass = self._step_pmf(float(s))
                f = np.fft.fft(pmf).astype(np.complex128)
                # log|A| floored at -745 (exp underflows to 0 there): 0 * log(0) must stay 0.
                logs.append(np.maximum(np.log(np.maximum(np.abs(f), 1e-320)), -745.0)
                            + 1j * np.angle(f))
                infs.append(inf_mass)
            self._log_fft = np.stack(logs)
            self._inf_mass = np.asarray(infs)
        return self._log_fft, self._inf_mass

    def approximate_deltas(self, counts, epsilons) -> np.ndarray:
        """APPROXIMATE δ̃(ε) of each example's composed individual PLD, shape [m, len(ε)]."""
        k = np.asarray(counts)
        if k.ndim != 2 or k.shape[1] != self.num_sigmas or np.any(k < 0):
            raise ValueError(f"counts must be non-negative with shape [m, {self.num_sigmas}]")
        eps = np.atleast_1d(np.asarray(epsilons, dtype=np.float64))
        log_a, inf_mass = self._prepare()
        n = self.grid_size
        v = np.where(np.arange(n) < n // 2, np.arange(n), np.arange(n) - n) * (
            2.0 * self.loss_range / n)
        weights = np.maximum(-np.expm1(eps[:, None] - v[None, :]), 0.0)  # (1 - e^{ε - v})_+
        out = np.empty((k.shape[0], eps.size))
        chunk = 16
        for start in range(0, k.shape[0], chunk):
            kb = k[start:start + chunk].astype(np.float64)
            pmf = np.fft.ifft(np.exp(kb @ log_a), axis=1).real
            pmf = np.maximum(pmf, 0.0)
            finite_mass = np.exp(kb @ np.log1p(-np.minimum(inf_mass, 1 - 1e-300)))
            out[start:start + chunk] = (1.0 - finite_mass)[:, None] + pmf @ weights.T
        return np.clip(out, 0.0, 1.0)

    def approximate_epsilons(self, counts, delta: float, *,
                             epsilon_grid: Optional[Sequence[float]] = None,
                             orders: Optional[Sequence[float]] = None
                             ) -> ApproximateIndividualEpsilons:
        """APPROXIMATE individual ε(δ) (paper App. D pipeline); NOT a certified bound.

        ``epsilon_grid`` defaults to 40 points in [0.01, ε_wc], ε_wc being the (unamplified)
        worst-case GDP ε of the same number of steps, so the fit covers the region where δ is
        near the target (a fit only on small ε, e.g. [0.01, 0.3], may miss where the individual
        curve lies above the fitted GDP curve at the target δ). Grid points
        where an example's δ̃ is below max(δ/10, 1e-12) are ignored (numerical noise).
        """
        delta = check_open_unit("delta", delta)
        k = np.asarray(counts)
        steps = int(k.sum(axis=1).max()) if k.size else 0
        if epsilon_grid is None:
            top = max(gdp_epsilon(delta, math.sqrt(max(steps, 1)) / self.noise_multiplier), 0.02)
            epsilon_grid = np.linspace(0.01, top, 40)
        grid = np.asarray(epsilon_grid, dtype=np.float64)
        if grid.ndim != 1 or grid.size == 0 or np.any(grid < 0):
            raise ValueError("epsilon_grid must be a non-empty 1-d array of values >= 0")
        deltas = self.approximate_deltas(k, grid)
        mu = np.zeros(k.shape[0])
        # Fit only where delta~ is meaningful (>= delta/10, above the FFT noise floor); the
        # first grid point always counts. Tail points with delta~ at round-off level would
        # otherwise dominate the max with noise.
        floor = max(delta / 10.0, 1e-12)
        for j, e0 in enumerate(grid):
            fit = _mu_matching_delta(e0, deltas[:, j])
            use = (deltas[:, j] >= floor) | (j == 0)
            mu = np.where(use, np.maximum(mu, fit), mu)
        orders = np.asarray(DEFAULT_RDP_ORDERS if orders is None else orders, dtype=np.float64)
        eps_rdp = np.array([gdp_rdp_epsilon(m, delta, orders) for m in mu])
        return ApproximateIndividualEpsilons(mu_fit=mu, epsilon_rdp=eps_rdp,
                                             epsilon_gdp=individual_epsilons(mu, delta),
                                             delta_pld=deltas)


def _mu_matching_delta(eps0: float, deltas: np.ndarray, iterations: int = 200) -> np.ndarray:
    # Smallest mu with delta_GDP(eps0; mu) >= deltas (delta_GDP is increasing in mu).
    d = np.asarray(deltas, dtype=np.float64)
    lo = np.zeros_like(d)
    hi = np.ones_like(d)
    for _ in range(60):
        need = _gdp_delta_vec(np.full_like(hi, eps0), hi) < d
        if not np.any(need):
            break
        hi = np.where(need, 2 * hi, hi)
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        ok = _gdp_delta_vec(np.full_like(mid, eps0), np.maximum(mid, 1e-300)) >= d
        hi = np.where(ok, mid, hi)
        lo = np.where(ok, lo, mid)
        if np.all(hi - lo <= 1e-13 * np.maximum(hi, 1e-12)):
            break
    return np.where(d <= 0, 0.0, hi)
