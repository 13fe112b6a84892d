r"""Privacy amplification by structured subsampling (Schuchardt et al., ICML 2025), as profiles.

Every result of "Privacy Amplification by Structured Subsampling for Deep Differentially Private
Time Series Forecasting" (Schuchardt, Dalirrooyfard, Guzelkabaagac, Schneider, Nevmyvaka,
Günnemann, ICML 2025) is one function here, returning a
:class:`~opacus_structured.accounting.profiles.PrivacyProfile` built from
:class:`~opacus_structured.accounting.mixture.MixturePair` objects. Means are in units of the
clipping norm :math:`C`; ``noise_multiplier`` is :math:`\sigma`. Pure numpy/scipy: no torch.

Notation (paper §3–4): :math:`N` series, :math:`L` series length, :math:`L_C` context length
(every input value the model sees, lags included), :math:`L_F` forecast length, :math:`\lambda`
windows per sampled series, :math:`\Lambda` batch size, :math:`T = L - L_F + 1` window starts,
:math:`k` windows that can contain the protected unit (Appendix I,
:func:`windows_per_element`), :math:`r = k / T` (with-replacement bottom level),
:math:`\rho = \lfloor \Lambda/\lambda \rfloor / N` (without-replacement top level).

================  ==========================  ==========  ========  ==================
function          sampling                    kind        unit      pair
================  ==========================  ==========  ========  ==================
:func:`thm_4_2`   deterministic + WR, λ = 1   tight       epoch     switching
:func:`thm_4_4`   WOR + WR, λ = 1             tight       step      switching
:func:`thm_e_8`   deterministic + Poisson     tight       epoch     two-sided
:func:`thm_e_1`   deterministic + WR, any λ   upper       epoch     two-sided
:func:`thm_f_1`   WOR + WR, any λ             upper       step      weighted two-sided
:func:`thm_f_2`   WOR + Poisson               upper       step      weighted two-sided
:func:`thm_g_1`   WOR + WR + augmentation     upper       step      switching
:func:`thm_4_3`   deterministic + WR, any λ   **lower**   epoch     switching
:func:`thm_f_7`   WOR + WR, any λ             **lower**   step      switching
:func:`thm_f_8`   WOR + Poisson               **lower**   step      two-sided
================  ==========================  ==========  ========  ==================

*Lower bounds are optimistic*: they are attained by one worst-case model and dataset, so the
true ε is at least as large. They are baselines for comparisons and are never returned where a
guarantee is asked for (the scheme labels them ``bound="lower"``).

Errata applied (checked against the proofs): Theorem 4.3/F.7 weights are ``Binomial(i − 1 | λ, r)`` for mean
``2(i − 1)``; Theorems F.1/F.2 hold for general λ; for λ > 1 the upper bound uses the two-sided
pair of Theorem E.1 (the authors' code uses the lower-bound mixture there, which is not a proven
bound). Theorem F.8 is implemented with the two-sided mixed pair
``(1−ρ)N(0) + ρ MoG(−μ, p)`` vs ``(1−ρ)N(0) + ρ MoG(μ, p)`` given by the construction of
Lemma E.12 (±1 at the protected element) under top-level subsampling; the displayed formula (mixture
versus ``N(0, σ)``) is a weaker valid lower bound, and both lie below Theorem F.2 by joint
convexity.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
from scipy import special

from .._validation import check_int, check_nonnegative, check_positive, check_probability
from .mixture import MixturePair
from .profiles import (
    PERFECT_PRIVACY,
    PairProfile,
    PrivacyProfile,
    SwitchingProfile,
    WeightedProfile,
)

__all__ = [
    "TOP_LEVELS", "BOTTOM_LEVELS", "RELATIONS", "BOUNDS",
    "start_positions", "windows_per_element", "window_hit_probability",
    "poisson_window_rate", "series_sampling_rate", "worst_case_series_length",
    "tvd_gaussian", "augmented_hit_probability",
    "thm_4_2", "thm_4_4", "thm_e_8", "thm_e_1", "thm_f_1", "thm_f_2",
    "thm_4_3", "thm_f_7", "thm_f_8", "thm_g_1", "thm_4_5",
    "StructuredSetting", "select_theorem", "structured_profile", "padding_summary",
]

TOP_LEVELS = ("wor", "deterministic", "shuffle")
BOTTOM_LEVELS = ("wr", "poisson")
RELATIONS = ("event", "user")
BOUNDS = ("tight", "upper", "lower")


# ---- counting (Appendix I) -----------------------------------------------------------------
def start_positions(series_length: int, forecast_length: int) -> int:
    """:math:`T = L - L_F + 1`, the number of window starts (Algorithm 4); raises if L < L_F."""
    L_F = check_int("forecast_length", forecast_length, minimum=1)
    L = check_int("series_length", series_length, minimum=1)
    if L < L_F:
        raise ValueError(f"series_length={L} is shorter than forecast_length={L_F}: no window "
                         f"fits (need series_length >= forecast_length)")
    return L - L_F + 1


def windows_per_element(context_length: int, forecast_length: int, series_length: int,
                        relation: str = "event", w: int = 1) -> int:
    r"""Number :math:`k` of windows that can contain the protected unit (Appendix I).

    * 1-event (Definition 3.5 with w = 1): :math:`L_C + L_F`;
    * w-event: :math:`\min(L_C + L_F + w - 1,\ T)`;
    * w-user (Definition 3.6): :math:`\min(w (L_C + L_F),\ T)`;

    always clamped to :math:`T = L - L_F + 1` (series shorter than :math:`L_C + 2L_F - 1`,
    Appendix I.1).
    """
    L_C = check_int("context_length", context_length, minimum=0)
    L_F = check_int("forecast_length", forecast_length, minimum=1)
    w = check_int("w", w, minimum=1)
    T = start_positions(series_length, L_F)
    if relation == "event":
        k = L_C + L_F + w - 1
    elif relation == "user":
        k = w * (L_C + L_F)
    else:
        raise ValueError(f"relation must be one of {RELATIONS}, got {relation!r}")
    return max(0, min(k, T))


def window_hit_probability(context_length: int, forecast_length: int, series_length: int,
                           relation: str = "event", w: int = 1) -> float:
    r""":math:`r = k / T`: chance that one uniformly drawn window touches the protected unit."""
    T = start_positions(series_length, forecast_length)
    return windows_per_element(context_length, forecast_length, series_length, relation, w) / T


def poisson_window_rate(instances_per_series: int, series_length: int,
                        forecast_length: int) -> float:
    r""":math:`r = \min(1, \lambda / T)`, the per-start rate of Algorithm 6 (Theorem E.8)."""
    lam = check_int("instances_per_series", instances_per_series, minimum=1)
    return min(1.0, lam / start_positions(series_length, forecast_length))


def series_sampling_rate(num_series: int, batch_size: int, instances_per_series: int = 1) -> float:
    r""":math:`\rho = \lfloor \Lambda / \lambda \rfloor / N` (Algorithm 5, Theorem 4.4)."""
    N = check_int("num_series", num_series, minimum=1)
    lam = check_int("instances_per_series", instances_per_series, minimum=1)
    B = check_int("batch_size", batch_size, minimum=lam)
    n_top = B // lam
    if n_top > N:
        raise ValueError(f"batch_size // instances_per_series = {n_top} series per step exceeds "
                         f"num_series={N}: need batch_size <= num_series * instances_per_series")
    return n_top / N


def worst_case_series_length(lengths: Sequence[int], forecast_length: int) -> int:
    r"""The length to account with for variable-length series (Appendix I.1): the shortest one.

    Every with-replacement bound is non-decreasing in :math:`\min(k, T)/T`, which is
    non-increasing in :math:`L`, so the shortest series is the worst case (tight bounds stay
    tight). Raises if any series is shorter than the forecast length.
    """
    arr = np.asarray(list(lengths))
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("lengths must be a non-empty 1-d sequence of series lengths")
    if not np.all(np.equal(np.mod(arr, 1), 0)):
        raise ValueError(f"lengths must be integers, got {arr[:5]!r}...")
    L_F = check_int("forecast_length", forecast_length, minimum=1)
    shortest = int(arr.min())
    if shortest < L_F:
        bad = int(np.argmin(arr))
        raise ValueError(f"series {bad} has length {shortest} < forecast_length={L_F}: no window "
                         f"fits; drop or pad that series")
    return shortest


def tvd_gaussian(shift: float, sigma: float) -> float:
    r""":math:`\mathrm{TVD}(\mathcal{N}(0, s^2), \mathcal{N}(m, s^2)) = 2\Phi(m / 2s) - 1`; 1 if s = 0."""
    shift = check_nonnegative("shift", shift)
    sigma = check_nonnegative("sigma", sigma)
    if sigma == 0.0:
        return 1.0 if shift > 0 else 0.0
    return float(2.0 * special.ndtr(shift / (2.0 * sigma)) - 1.0)


def augmented_hit_probability(rho: float, r: float, phi: float, context_noise: float,
                              forecast_noise: float, w: int = 1) -> float:
    r""":math:`p_2` of Theorem G.1 (and 4.5): the weight of the mean-2 component under augmentation.

    .. math:: p_2 = \rho r \left[\phi\,\tau_F + (1-\phi)\,\tau_C\right],\quad
              \tau_X = \mathrm{TVD}(\mathcal{N}(0, \sigma_X), \mathcal{N}(\sqrt{w}, \sigma_X))

    with :math:`\phi = L_F / (L_C + L_F)`. For :math:`\sigma_C \ne \sigma_F` only
    :math:`w = 1` is covered (Appendix I.2); with :math:`\sigma_C = \sigma_F` the shift is
    :math:`\sqrt{w}` (Theorem 4.5 generalised).
    """
    rho = check_probability("rho", rho)
    r = check_probability("r", r, allow_zero=True)
    phi = check_probability("phi", phi)
    sc = check_nonnegative("context_noise", context_noise)
    sf = check_nonnegative("forecast_noise", forecast_noise)
    w = check_int("w", w, minimum=1)
    if sc != sf and w != 1:
        raise ValueError(
            f"augmentation with context_noise != forecast_noise is only covered for w = 1 "
            f"(Theorem G.1; Appendix I.2), got w={w}: use equal noises or w=1")
    shift = math.sqrt(w)
    return rho * r * (phi * tvd_gaussian(shift, sf) + (1.0 - phi) * tvd_gaussian(shift, sc))


# ---- pairs -----------------------------------------------------------------------------------
def _binom(n: int, p: float) -> np.ndarray:
    """Binomial(k | n, p) for k = 0..n, computed in log space (robust for subnormal p)."""
    k = np.arange(n + 1, dtype=np.float64)
    out = np.zeros(n + 1)
    if p <= 0.0 or p >= 1.0:
        out[0 if p <= 0.0 else n] = 1.0
        return out
    log_pmf = (special.gammaln(n + 1.0) - special.gammaln(k + 1.0) - special.gammaln(n - k + 1.0)
               + k * math.log(p) + (n - k) * math.log1p(-p))
    out = np.exp(log_pmf)
    out /= out.sum()
    # Negligible (< 1e-250) weights upset log-space mixture arithmetic; move them to the largest
    # mean (a stochastically larger count: pessimistic, Lemma E.14 monotonicity).
    tiny = (out < 1e-250) & (out > 0)
    top = int(np.nonzero(out > 0)[0].max())
    tiny[top] = False
    if tiny.any():
        out[top] += out[tiny].sum()
        out[tiny] = 0.0
    return out


def _one_sided(sigma: float, means, weights) -> MixturePair:
    """``MoG(means, weights)`` versus ``N(0, σ)`` (means >= 0)."""
    return MixturePair.from_components(means, weights, [0.0], [1.0], sigma)


def _two_sided(sigma: float, means, weights) -> MixturePair:
    """``MoG(−means, w)`` versus ``MoG(+means, w)`` (means >= 0)."""
    means = np.asarray(means, dtype=np.float64)
    return MixturePair.from_components(-means, weights, means, weights, sigma)


def _check_common(noise_multiplier, r, lam=1):
    return (check_positive("noise_multiplier", noise_multiplier),
            check_probability("r", r, allow_zero=True),
            check_int("instances_per_series", lam, minimum=1))


def thm_4_2(noise_multiplier: float, r: float) -> SwitchingProfile:
    r"""Theorem 4.2 (Schuchardt et al., ICML 2025): deterministic top level, WR bottom, λ = 1.

    Tight per-**epoch** profile: :math:`H(\alpha) = H_\alpha(P(1) \| \mathcal{N}(0,\sigma))` for
    :math:`\alpha \ge 1` and :math:`H_\alpha(\mathcal{N}(0,\sigma) \| P(1))` for
    :math:`\alpha < 1`, with :math:`P(1) = (1-r)\mathcal{N}(0,\sigma) + r\mathcal{N}(2,\sigma)`,
    :math:`r = k/T`. Compose once per epoch; independent of :math:`N` and :math:`\Lambda`.
    """
    sigma, r, _ = _check_common(noise_multiplier, r)
    return SwitchingProfile(_one_sided(sigma, [0.0, 2.0], [1.0 - r, r]))


def thm_4_4(noise_multiplier: float, rho: float, r: float) -> SwitchingProfile:
    r"""Theorem 4.4 (Schuchardt et al., ICML 2025): WOR top level, WR bottom, λ = 1 (main result).

    Tight per-**step** switching profile of
    :math:`\tilde P(1) = (1-\rho r)\mathcal{N}(0,\sigma) + \rho r\,\mathcal{N}(2,\sigma)` versus
    :math:`\mathcal{N}(0,\sigma)`. Equal to a Poisson-subsampled Gaussian with noise multiplier
    :math:`\sigma/2` and rate :math:`\rho r` (remove pair for ε >= 0, add pair for ε < 0).
    """
    sigma, r, _ = _check_common(noise_multiplier, r)
    rho = check_probability("rho", rho)
    q = rho * r
    return SwitchingProfile(_one_sided(sigma, [0.0, 2.0], [1.0 - q, q]))


def thm_4_3(noise_multiplier: float, instances_per_series: int, r: float) -> SwitchingProfile:
    r"""Theorem 4.3 — OPTIMISTIC LOWER BOUND (not a guarantee): deterministic top, WR, any λ.

    Per epoch, :math:`H(\alpha) \ge H_\alpha(P_\lambda \| \mathcal{N}(0,\sigma))` (α >= 1) and the
    reversed pair for α < 1, with
    :math:`P_\lambda = \sum_{k=0}^{\lambda} \mathrm{Binomial}(k \mid \lambda, r)\,
    \mathcal{N}(2k, \sigma)` (index erratum applied). Equals Theorem 4.2 at λ = 1.
    """
    sigma, r, lam = _check_common(noise_multiplier, r, instances_per_series)
    return SwitchingProfile(_one_sided(sigma, 2.0 * np.arange(lam + 1), _binom(lam, r)))


def thm_f_7(noise_multiplier: float, instances_per_series: int, rho: float,
            r: float) -> SwitchingProfile:
    r"""Theorem F.7 — OPTIMISTIC LOWER BOUND (not a guarantee): WOR top, WR bottom, any λ.

    Per step, switching profile of :math:`(1-\rho)\mathcal{N}(0,\sigma) + \rho P_\lambda` versus
    :math:`\mathcal{N}(0,\sigma)` with :math:`P_\lambda` of Theorem 4.3 and
    :math:`\rho = \lfloor\Lambda/\lambda\rfloor/N`. Equals Theorem 4.4 at λ = 1 (tightness).
    """
    sigma, r, lam = _check_common(noise_multiplier, r, instances_per_series)
    rho = check_probability("rho", rho)
    weights = rho * _binom(lam, r)
    weights[0] += 1.0 - rho
    return SwitchingProfile(_one_sided(sigma, 2.0 * np.arange(lam + 1), weights))


def thm_e_1(noise_multiplier: float, instances_per_series: int, r: float) -> PairProfile:
    r"""Theorem E.1 (Schuchardt et al., ICML 2025): deterministic top, WR bottom, any λ — upper bound.

    Per epoch, :math:`H(\alpha) \le H_\alpha(\bar P(\lambda) \| \bar Q(\lambda))` for all α with
    :math:`\bar P = \mathrm{MoG}(-\mu, p, \sigma)`, :math:`\bar Q = \mathrm{MoG}(\mu, p, \sigma)`,
    :math:`\mu = (0, 2, \dots, 2\lambda)`, :math:`p_i = \mathrm{Binomial}(i-1 \mid \lambda, r)`.
    A two-sided dominating pair (no switching). Loose at λ = 1 (components 4 apart).
    """
    sigma, r, lam = _check_common(noise_multiplier, r, instances_per_series)
    return PairProfile(_two_sided(sigma, 2.0 * np.arange(lam + 1), _binom(lam, r)))


def thm_f_1(noise_multiplier: float, instances_per_series: int, rho: float,
            r: float) -> WeightedProfile:
    r"""Theorem F.1 (Schuchardt et al., ICML 2025): WOR top, WR bottom, any λ — upper bound.

    Per step, :math:`\tilde H(\alpha) \le (1-\rho)\max\{0, 1-\alpha\} + \rho\,
    H_\alpha(\bar P(\lambda) \| \bar Q(\lambda))` with the two-sided pair of Theorem E.1 (not the
    lower-bound mixture the authors' code uses for λ > 1).
    """
    rho = check_probability("rho", rho)
    return WeightedProfile([1.0 - rho, rho],
                           [PERFECT_PRIVACY, thm_e_1(noise_multiplier, instances_per_series, r)])


def _poisson_pair(sigma: float, k: int, rate: float) -> MixturePair:
    return _two_sided(sigma, np.arange(k + 1, dtype=np.float64), _binom(k, rate))


def thm_e_8(noise_multiplier: float, windows: int, rate: float) -> PairProfile:
    r"""Theorem E.8 (Schuchardt et al., ICML 2025): deterministic top, Poisson bottom — tight.

    Per epoch, tight dominating pair :math:`P = \mathrm{MoG}(-\mu, p, \sigma)`,
    :math:`Q = \mathrm{MoG}(\mu, p, \sigma)` with **unit** spacing :math:`\mu_i = i - 1` and
    :math:`p_i = \mathrm{Binomial}(i-1 \mid k, r)`, :math:`k = L_C + L_F` (Appendix I:
    :func:`windows_per_element`) and :math:`r = \min(1, \lambda/T)`.
    """
    sigma = check_positive("noise_multiplier", noise_multiplier)
    k = check_int("windows", windows, minimum=0)
    rate = check_probability("rate", rate, allow_zero=True)
    return PairProfile(_poisson_pair(sigma, k, rate))


def thm_f_2(noise_multiplier: float, windows: int, rho: float, rate: float) -> WeightedProfile:
    r"""Theorem F.2 (Schuchardt et al., ICML 2025): WOR top, Poisson bottom — upper bound.

    Per step, :math:`(1-\rho)\max\{0, 1-\alpha\} + \rho\,H_\alpha(P \| Q)` with the pair of
    Theorem E.8.
    """
    rho = check_probability("rho", rho)
    return WeightedProfile([1.0 - rho, rho],
                           [PERFECT_PRIVACY, thm_e_8(noise_multiplier, windows, rate)])


def thm_f_8(noise_multiplier: float, windows: int, rho: float, rate: float) -> PairProfile:
    r"""Theorem F.8 — OPTIMISTIC LOWER BOUND (not a guarantee): WOR top, Poisson bottom.

    Per step, :math:`H_\alpha((1-\rho)\mathcal{N}(0) + \rho\,\mathrm{MoG}(-\mu, p) \,\|\,
    (1-\rho)\mathcal{N}(0) + \rho\,\mathrm{MoG}(\mu, p))` (σ common, :math:`\mu`, :math:`p` of
    Theorem E.8): the Lemma E.12 construction (±1 at the protected element, gradient ±C for
    windows containing it, 0 otherwise) with the series drawn with probability ρ.
    """
    sigma = check_positive("noise_multiplier", noise_multiplier)
    k = check_int("windows", windows, minimum=0)
    rate = check_probability("rate", rate, allow_zero=True)
    rho = check_probability("rho", rho)
    means = np.arange(k + 1, dtype=np.float64)
    weights = rho * _binom(k, rate)
    weights[0] += 1.0 - rho
    return PairProfile(_two_sided(sigma, means, weights))


def thm_g_1(noise_multiplier: float, rho: float, r: float, phi: float, context_noise: float,
            forecast_noise: float, w: int = 1) -> SwitchingProfile:
    r"""Theorem G.1 (Schuchardt et al., ICML 2025): amplification by data augmentation — upper bound.

    WOR top, WR bottom, λ = 1, :math:`(w, v)`-relations with context/forecast augmentation
    :math:`y_C + \mathcal{N}(0, \sigma_C^2 v^2)`, :math:`y_F + \mathcal{N}(0, \sigma_F^2 v^2)`
    (Eq. 1). Per step, switching profile of
    :math:`\hat P(1) = (1-p_2)\mathcal{N}(0,\sigma) + p_2\mathcal{N}(2,\sigma)` versus
    :math:`\mathcal{N}(0,\sigma)` with :math:`p_2` from :func:`augmented_hit_probability`.
    """
    sigma = check_positive("noise_multiplier", noise_multiplier)
    p2 = augmented_hit_probability(rho, r, phi, context_noise, forecast_noise, w)
    return SwitchingProfile(_one_sided(sigma, [0.0, 2.0], [1.0 - p2, p2]))


def thm_4_5(noise_multiplier: float, rho: float, r: float, augmentation_noise: float,
            w: int = 1) -> SwitchingProfile:
    r"""Theorem 4.5 (Schuchardt et al., ICML 2025): Theorem G.1 with :math:`\sigma_C = \sigma_F`.

    :math:`p_2 = \rho r\,\mathrm{TVD}(\mathcal{N}(0, \sigma_F), \mathcal{N}(\sqrt{w}, \sigma_F))`
    (the :math:`\sqrt{w}` shift is Appendix I.2's generalisation to :math:`(w, v)` relations).
    """
    return thm_g_1(noise_multiplier, rho, r, 0.5, augmentation_noise, augmentation_noise, w)


# ---- selection -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StructuredSetting:
    """All public parameters of structured subsampling that a bound depends on."""

    num_series: int
    series_length: int
    context_length: int
    forecast_length: int
    batch_size: int
    instances_per_series: int = 1
    top_level: str = "wor"
    bottom_level: str = "wr"
    relation: str = "event"
    w: int = 1
    bound: str = "tight"
    context_noise: float = 0.0
    forecast_noise: float = 0.0

    @property
    def augmented(self) -> bool:
        return self.context_noise > 0 or self.forecast_noise > 0

    @property
    def unit(self) -> str:
        return "step" if self.top_level == "wor" else "epoch"

    def rho(self) -> float:
        return series_sampling_rate(self.num_series, self.batch_size, self.instances_per_series)

    def windows(self) -> int:
        return windows_per_element(self.context_length, self.forecast_length,
                                   self.series_length, self.relation, self.w)

    def r(self) -> float:
        """Window hit probability k/T (WR) or the Poisson rate min(1, λ/T) (Poisson)."""
        if self.bottom_level == "poisson":
            return poisson_window_rate(self.instances_per_series, self.series_length,
                                       self.forecast_length)
        return window_hit_probability(self.context_length, self.forecast_length,
                                      self.series_length, self.relation, self.w)

    def phi(self) -> float:
        return self.forecast_length / (self.context_length + self.forecast_length)


def padding_summary(s: StructuredSetting) -> dict:
    r"""What left padding does to the windows of the shortest series, and to the guarantee.

    Algorithm 4 prepends :math:`L_C` zeros, so a window of start :math:`s`
    (:math:`0 \le s \le T-1`, :math:`T = L - L_F + 1`) reads original indices
    :math:`s - L_C, \dots, s + L_F - 1`; the negative ones are zeros. The zeros are public
    constants, identical under both neighbouring datasets: they carry no data and create no
    window. A protected value at index :math:`j` lies in the windows of starts
    :math:`\max(0, j - L_F + 1) \dots \min(T - 1, j + L_C)` — at most
    :math:`k = \min(k_0, T)` of the :math:`T` starts with :math:`k_0 = L_C + L_F + w - 1`
    (w-event) or :math:`w(L_C + L_F)` (w-user) — and :math:`k` is what every theorem prices.
    Padding therefore never weakens the guarantee. What a long window changes is the
    amplification: when :math:`k_0 \ge T` (1-event: :math:`L \le L_C + 2L_F - 2`) every start
    can contain the protected value (:math:`k = T`); with the ``"wr"`` bottom level
    :math:`r = 1` and window sampling amplifies nothing: ε is that of sampling series alone
    (Theorem 4.4 with :math:`r = 1` is the Poisson-subsampled Gaussian of noise multiplier
    :math:`\sigma/2` at rate :math:`\rho`; Theorem 4.2 is the Gaussian mechanism of
    sensitivity :math:`2C` per epoch).

    Returns a JSON-ready dict: ``prepended_zeros`` (:math:`L_C`), ``start_positions``
    (:math:`T`), ``padded_starts`` (:math:`\min(L_C, T)` starts read at least one zero),
    ``window_length`` (:math:`L_C + L_F`), ``window_exceeds_series``
    (:math:`L_C + L_F > L`), ``windows_per_element_unclamped`` (:math:`k_0`),
    ``every_start_covers_element`` (:math:`k_0 \ge T`), ``window_sampling_amplifies``
    (``False`` when the bottom level cannot amplify: ``"wr"`` with :math:`k = T`) and
    ``note`` (one sentence for people, ``None`` unless :math:`k_0 \ge T`).
    """
    T = start_positions(s.series_length, s.forecast_length)
    L_C, L_F, w = s.context_length, s.forecast_length, s.w
    k0 = L_C + L_F + w - 1 if s.relation == "event" else w * (L_C + L_F)
    covers_all = k0 >= T
    amplifies = not (covers_all and s.bottom_level == "wr")
    note = None
    if covers_all:
        unit = "value" if (s.relation == "event" and w == 1) else f"{w}-{s.relation} unit"
        note = (f"series_length={s.series_length} leaves T = {T} window starts "
                f"(series_length - forecast_length + 1), no more than the "
                f"{k0} windows that can contain one protected {unit} "
                f"(context_length={L_C} + forecast_length={L_F}"
                + (" + w - 1" if s.relation == "event" and w > 1 else "")
                + (", times w" if s.relation == "user" and w > 1 else "")
                + f"): every window of a drawn series can contain it. {min(L_C, T)} of the {T} "
                f"starts read zero padding before the series (public constants, the "
                f"same for both neighbours: no effect on the guarantee), and ε is priced "
                f"with k = T = {T} windows per element"
                + (", r = 1: window sampling gives no amplification and ε is that of "
                   "sampling series alone" if not amplifies else "")
                + ". To gain amplification from window sampling use series longer than "
                f"{k0 + L_F - 1} or a shorter context/forecast")
    return {"prepended_zeros": L_C, "start_positions": T, "padded_starts": min(L_C, T),
            "window_length": L_C + L_F, "window_exceeds_series": L_C + L_F > s.series_length,
            "windows_per_element_unclamped": k0, "every_start_covers_element": covers_all,
            "window_sampling_amplifies": amplifies, "note": note}


_ALTERNATIVE = {"tight": "upper", "lower": "upper"}


def select_theorem(s: StructuredSetting) -> str:
    """Name of the theorem pricing ``s`` (e.g. ``"thm_4_4"``); ValueError if none applies.

    ``bound="tight"`` where no tight result exists raises and names the sound alternative
    (``"upper"``); ``bound="upper"`` always selects the general upper-bound theorem of the
    configuration (E.1/F.1 for with-replacement bottom level even at λ = 1, where they are
    looser than the tight 4.2/4.4; E.8 or F.2 for Poisson; G.1 with augmentation).
    """
    if s.top_level not in TOP_LEVELS:
        raise ValueError(f"top_level must be one of {TOP_LEVELS}, got {s.top_level!r}")
    if s.bottom_level not in BOTTOM_LEVELS:
        raise ValueError(f"bottom_level must be one of {BOTTOM_LEVELS}, got {s.bottom_level!r}")
    if s.bound not in BOUNDS:
        raise ValueError(f"bound must be one of {BOUNDS}, got {s.bound!r}")
    wor = s.top_level == "wor"
    lam = s.instances_per_series
    if s.augmented:
        where = []
        if not wor:
            where.append(f"top_level={s.top_level!r} (needs 'wor')")
        if s.bottom_level != "wr":
            where.append(f"bottom_level={s.bottom_level!r} (needs 'wr')")
        if lam != 1:
            where.append(f"instances_per_series={lam} (needs 1)")
        if s.context_noise != s.forecast_noise and s.w != 1:
            where.append(f"w={s.w} with context_noise != forecast_noise (needs w=1 or equal "
                         f"noises)")
        if where:
            raise ValueError("amplification by augmentation (Theorems 4.5/G.1) is only derived "
                             "for WOR top level, WR bottom level, lambda = 1; not covered: "
                             + "; ".join(where) + ". Set context_noise = forecast_noise = 0")
        if s.bound != "upper":
            raise ValueError(
                f"bound={s.bound!r} is not available with augmentation noise: Theorem G.1 is an "
                f"upper bound only; use bound='upper'")
        return "thm_g_1"
    if s.bottom_level == "wr":
        if s.bound == "tight":
            if lam != 1:
                raise ValueError(
                    f"no tight bound is known for bottom_level='wr' with instances_per_series="
                    f"{lam} > 1; use bound='upper' (Theorem {'F.1' if wor else 'E.1'}; sound) or "
                    f"instances_per_series=1")
            return "thm_4_4" if wor else "thm_4_2"
        if s.bound == "upper":
            return "thm_f_1" if wor else "thm_e_1"
        return "thm_f_7" if wor else "thm_4_3"
    # Poisson bottom level
    if not wor:
        return "thm_e_8"  # tight, hence also the upper and the lower bound
    if s.bound == "tight":
        raise ValueError("no tight bound is known for top_level='wor' with bottom_level="
                         "'poisson'; use bound='upper' (Theorem F.2; sound)")
    return "thm_f_2" if s.bound == "upper" else "thm_f_8"


def structured_profile(s: StructuredSetting, noise_multiplier: float) -> PrivacyProfile:
    """The profile of one accounting unit (a step for ``wor``, an epoch otherwise)."""
    name = select_theorem(s)
    sigma = noise_multiplier
    lam = s.instances_per_series
    if name == "thm_4_2":
        return thm_4_2(sigma, s.r())
    if name == "thm_4_4":
        return thm_4_4(sigma, s.rho(), s.r())
    if name == "thm_4_3":
        return thm_4_3(sigma, lam, s.r())
    if name == "thm_f_7":
        return thm_f_7(sigma, lam, s.rho(), s.r())
    if name == "thm_e_1":
        return thm_e_1(sigma, lam, s.r())
    if name == "thm_f_1":
        return thm_f_1(sigma, lam, s.rho(), s.r())
    if name == "thm_e_8":
        return thm_e_8(sigma, s.windows(), s.r())
    if name == "thm_f_2":
        return thm_f_2(sigma, s.windows(), s.rho(), s.r())
    if name == "thm_f_8":
        return thm_f_8(sigma, s.windows(), s.rho(), s.r())
    if name == "thm_g_1":
        return thm_g_1(sigma, s.rho(), s.r(), s.phi(), s.context_noise, s.forecast_noise, s.w)
    raise AssertionError(name)  # pragma: no cover
