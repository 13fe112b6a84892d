r"""Inference-time privacy: Poisson subsampling in the time domain plus Gaussian input noise.

Training with DP-SGD protects the *training* series through the model's parameters. A forecast
:math:`f_\theta(x_n)` of a sensitive series :math:`x_n` also reads :math:`x_n` itself, and the
training guarantee says nothing about that read. Schuchardt et al., "Privacy Amplification by
Structured Subsampling for Deep Differentially Private Time Series Forecasting" (ICML 2025,
arXiv:2502.02410), Appendix H, protect it with the time-domain mechanism of Koga, Meehan &
Chaudhuri, "Privacy Amplification by Subsampling in Time Domain" (AISTATS 2022,
arXiv:2201.04762), Theorem 3.2 (privacy amplification for time-series release via Poisson
subsampling), and then forecast from the released series. This module is the math of that
mechanism; the torch glue that runs it is
:mod:`opacus_structured.forecasting.private_inference`. Pure numpy/scipy: no torch.

Mechanism
---------
For an input series :math:`x \in \mathbb{R}^{T}` (the forecast's context):

1. keep every time step independently with probability :math:`r` (Poisson subsampling in the
   time domain, Koga et al. §3);
2. add :math:`\mathcal{N}(0, \sigma^2)` to every kept value, :math:`\sigma = z\,v` (``z`` is the
   noise multiplier, :math:`v` the sensitivity below);
3. impute the dropped steps with the average of the kept noisy values (Schuchardt et al.,
   Appendix H) and apply the forecaster to the reconstructed series.

Steps 3 and the forecast are post-processing of what steps 1–2 release (the mask and the noisy
kept values), so they cannot increase ε.

Neighbouring relation (what is protected)
-----------------------------------------
The :math:`(w, v)`-event-level relation of Schuchardt et al. (§3.4, "(w, v)-event and
(w, v)-user-level privacy"; bounded change as in Koga et al.): two input series are neighbours
if they differ in at most :math:`w` time steps (``changed_steps``), each by at most :math:`v`
in absolute value (``sensitivity``). The default :math:`w = 1` is one time step of one series —
the setting of Appendix H (Tables 11–13: :math:`v = 0.1, 10, 1`, :math:`\delta = 10^{-4}`). The
assumption that must hold is :math:`|x_t - x'_t| \le v` at every changed step: either the domain
guarantees it (an individual moves a count by at most 1) or the input is clipped to a range of
width :math:`\le v` (:mod:`~opacus_structured.forecasting.private_inference` does that with
``value_range``). No property of the forecaster is needed — no Lipschitz constant, no output
clipping — because the noise is on the input.

Releasing :math:`n` forecasts (``releases``) whose inputs all contain the changed steps, each
with fresh coins, is :math:`m = n\,w` independent uses of a changed step.

Privacy profile
---------------
With :math:`\mu = v/\sigma = 1/z`, :math:`J \sim \mathrm{Binomial}(m, r)` the number of those uses
that survive the subsampling, and the Gaussian profile
:math:`\delta_{\mathcal{N}}(\varepsilon; \mu) = \Phi(-\varepsilon/\mu + \mu/2)
- e^{\varepsilon}\Phi(-\varepsilon/\mu - \mu/2)` (Balle & Wang 2018, Theorem 8), the mechanism
is :math:`(\varepsilon, \delta(\varepsilon))`-DP for every :math:`\varepsilon \ge 0` with

.. math::

    \delta(\varepsilon) = \sum_{j=0}^{m} \binom{m}{j} r^{j} (1-r)^{m-j}\,
        \delta_{\mathcal{N}}\!\left(\varepsilon; \sqrt{j}\,\mu\right),
    \qquad \delta_{\mathcal{N}}(\varepsilon; 0) = 0.

For :math:`m = 1` (one step, one forecast) this is :math:`\delta(\varepsilon) =
r\,\delta_{\mathcal{N}}(\varepsilon; v/\sigma)`, the calibration Schuchardt et al. use for
Appendix H.

*Why.* Koga et al.'s analysis of Poisson subsampling in time (Theorem 3.2) rests on this
decomposition: the number of an individual's contributions that reach the Gaussian mechanism is
binomial, and given that number :math:`j` the mechanism's :math:`\ell_2` sensitivity on the
sample is :math:`\sqrt{j}\,v`. Here the resulting mixture is evaluated exactly rather than
bounded. Condition on the masks: they are drawn independently of the data, and we may take them
to be released along with the kept noisy values (the imputed series and the forecast are
functions of both), so the two output distributions are mixtures over the same, observable mask
events, and the hockey-stick divergence of such a mixture is the mixture of the conditional
divergences. Given masks with :math:`J = j`, the outputs are Gaussians whose means differ by a
vector of :math:`\ell_2` norm at most :math:`\sqrt{j}\,v` (equality when every change is
exactly :math:`v`), whose divergence is :math:`\delta_{\mathcal{N}}(\varepsilon; \sqrt{j}\mu)`.

*Kind of bound.* For the release of the subsampled noisy series with its mask, the formula is
the exact hockey-stick divergence of a worst-case neighbouring pair: **tight**
(:data:`RELEASE_BOUND`). For a forecast computed from it, it is an **upper bound**
(:data:`FORECAST_BOUND`): post-processing by the imputation and the model may leak less.
The profile is symmetric in the two neighbours, so it covers both directions.

*Composition with training.* This ε protects the *input* of the forecast and is separate from
the model's training ε. A value that is both in the training data and in a released forecast's
input is covered by the composition of the two mechanisms (e.g. basic composition:
:math:`(\varepsilon_{\text{train}} + \varepsilon_{\text{inf}},
\delta_{\text{train}} + \delta_{\text{inf}})` for the same neighbouring relation).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize, special, stats

from .._validation import check_int, check_open_unit, check_positive, check_probability
from .bounds import BoundKind

__all__ = [
    "FORECAST_BOUND",
    "MAX_USES",
    "RELEASE_BOUND",
    "calibrate_time_domain_noise",
    "noiseless_delta",
    "time_domain_delta",
    "time_domain_epsilon",
]

RELEASE_BOUND = BoundKind.TIGHT
"""Kind of :func:`time_domain_epsilon` for the released subsample (mask and noisy kept values)."""

FORECAST_BOUND = BoundKind.UPPER
"""Kind of :func:`time_domain_epsilon` for a forecast computed from the released subsample."""

MAX_USES = 10**6
"""Largest ``releases * changed_steps`` accepted (the profile sums ``m + 1`` binomial terms)."""

MAX_EPSILON = 1e9
MIN_NOISE_MULTIPLIER = 1e-12
MAX_NOISE_MULTIPLIER = 1e12


def _uses(releases, changed_steps) -> int:
    releases = check_int("releases", releases, minimum=1)
    changed_steps = check_int("changed_steps", changed_steps, minimum=1)
    m = releases * changed_steps
    if m > MAX_USES:
        raise ValueError(
            f"releases * changed_steps must be <= {MAX_USES}, got {releases} * {changed_steps} "
            f"= {m}")
    return m


def _binomial_weights(m: int, rate: float) -> tuple[np.ndarray, np.ndarray]:
    """``(j, P[J = j])`` for ``j = 1..m`` (``j = 0`` contributes nothing)."""
    j = np.arange(1, m + 1, dtype=np.float64)
    return j, stats.binom.pmf(np.arange(1, m + 1), m, rate)


def _profile(eps: np.ndarray, noise_multiplier: float, rate: float, m: int) -> np.ndarray:
    """δ(ε) of the mechanism for an array of ε ≥ 0 (validated arguments)."""
    j, weights = _binomial_weights(m, rate)
    keep = weights > 0
    mu = np.sqrt(j[keep]) / noise_multiplier          # (K,)
    w = weights[keep]
    e = eps.reshape(-1, 1)                            # (E, 1)
    a = -e / mu + mu / 2.0
    b = -e / mu - mu / 2.0
    log_first = special.log_ndtr(a)
    log_second = e + special.log_ndtr(b)
    # Φ(a) − e^ε Φ(b) = Φ(a) · (1 − exp(log e^ε Φ(b) − log Φ(a))), stable in log space.
    diff = np.minimum(log_second - log_first, 0.0)
    gauss = np.clip(np.exp(log_first) * -np.expm1(diff), 0.0, 1.0)
    out = np.clip(gauss @ w, 0.0, 1.0)
    return out.reshape(eps.shape)


def _check_common(noise_multiplier, subsampling_rate):
    noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
    subsampling_rate = check_probability("subsampling_rate", subsampling_rate)
    return noise_multiplier, subsampling_rate


def noiseless_delta(subsampling_rate: float, *, releases: int = 1,
                    changed_steps: int = 1) -> float:
    r"""Probability that a changed step is used at all, :math:`1 - (1 - r)^{m}`.

    This is the limit of :math:`\delta(\varepsilon)` as the noise vanishes: a target δ at or
    above it is met with *no* noise (the change is simply omitted often enough), which is why
    :func:`calibrate_time_domain_noise` refuses such targets.
    """
    subsampling_rate = check_probability("subsampling_rate", subsampling_rate)
    m = _uses(releases, changed_steps)
    return float(-np.expm1(m * np.log1p(-subsampling_rate))) if subsampling_rate < 1 else 1.0


def time_domain_delta(epsilon, *, noise_multiplier: float, subsampling_rate: float,
                      releases: int = 1, changed_steps: int = 1):
    r"""Exact :math:`\delta(\varepsilon)` of time-domain Poisson subsampling with Gaussian noise.

    The profile of the module docstring (Koga et al. 2022, Theorem 3.2, as applied by
    Schuchardt et al. 2025, Appendix H): a tight bound for the released subsample, an upper
    bound for forecasts computed from it.

    Args:
        epsilon: ε ≥ 0, a number or an array of them.
        noise_multiplier: :math:`z = \sigma / v` > 0 (noise standard deviation per kept step in
            units of the sensitivity).
        subsampling_rate: :math:`r \in (0, 1]`, the probability that a time step is kept.
        releases: number of released forecasts whose inputs contain the protected steps
            (≥ 1), each with fresh coins.
        changed_steps: :math:`w \ge 1`, the number of time steps two neighbouring series may
            differ in (each by at most the sensitivity :math:`v`).

    Returns:
        A float, or an array with the shape of ``epsilon``.
    """
    noise_multiplier, subsampling_rate = _check_common(noise_multiplier, subsampling_rate)
    m = _uses(releases, changed_steps)
    try:
        eps = np.asarray(epsilon, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"epsilon must be a real number >= 0, got {epsilon!r}") from None
    if isinstance(epsilon, bool) or not np.all(np.isfinite(eps)) or np.any(eps < 0):
        raise ValueError(f"epsilon must be finite and >= 0, got {epsilon!r}")
    out = _profile(eps, noise_multiplier, subsampling_rate, m)
    return float(out) if out.ndim == 0 else out


def time_domain_epsilon(delta: float, *, noise_multiplier: float, subsampling_rate: float,
                        releases: int = 1, changed_steps: int = 1) -> float:
    r"""Smallest :math:`\varepsilon \ge 0` with :math:`\delta(\varepsilon) \le` ``delta``.

    Brent's method on the decreasing profile of :func:`time_domain_delta`; the root is rounded
    up until the profile at the returned ε is at most ``delta`` (never under-reports). Arguments
    as in :func:`time_domain_delta`; ``delta`` must be in (0, 1).

    Raises:
        ValueError: for bad arguments, or if ε would exceed 1e9 (noise far too small).
    """
    delta = check_open_unit("delta", delta)
    noise_multiplier, subsampling_rate = _check_common(noise_multiplier, subsampling_rate)
    m = _uses(releases, changed_steps)

    def prof(e: float) -> float:
        return float(_profile(np.asarray(e, dtype=np.float64), noise_multiplier,
                              subsampling_rate, m))

    if prof(0.0) <= delta:
        return 0.0
    hi = 1.0
    while prof(hi) > delta:
        hi *= 2.0
        if hi > MAX_EPSILON:
            raise ValueError(
                f"epsilon exceeds {MAX_EPSILON:g} at noise_multiplier={noise_multiplier}: "
                "raise noise_multiplier")
    log_delta = math.log(delta)

    def f(e: float) -> float:
        return math.log(max(prof(e), 1e-300)) - log_delta

    eps = optimize.brentq(f, 0.0, hi, xtol=1e-12, rtol=1e-12, maxiter=500)
    for _ in range(200):
        if prof(eps) <= delta:
            return float(eps)
        eps = eps + 1e-12 * max(1.0, eps)
    return float(hi)  # prof(hi) <= delta by construction


def calibrate_time_domain_noise(epsilon: float, delta: float, *, subsampling_rate: float,
                                releases: int = 1, changed_steps: int = 1,
                                rtol: float = 1e-9) -> float:
    r"""Smallest noise multiplier :math:`z = \sigma/v` meeting a target (ε, δ).

    :math:`\varepsilon(\delta) \le \varepsilon_{\text{target}}` holds exactly when
    :math:`\delta(\varepsilon_{\text{target}}) \le \delta`, and :math:`\delta(\varepsilon)`
    decreases in :math:`z`, so this bisects on :math:`\log z` over the closed-form profile and
    returns the *upper* end of the final bracket (relative width ``rtol``): the result always
    meets the target.

    Args:
        epsilon: target ε > 0.
        delta: target δ in (0, 1), below :func:`noiseless_delta` (at or above it no noise is
            needed and there is no smallest noise).
        subsampling_rate, releases, changed_steps: as in :func:`time_domain_delta`.
        rtol: relative width of the final bracket on :math:`z`, in (0, 1).

    Raises:
        ValueError: naming the argument, for bad input or an unattainable target.
    """
    epsilon = check_positive("epsilon", epsilon)
    delta = check_open_unit("delta", delta)
    subsampling_rate = check_probability("subsampling_rate", subsampling_rate)
    m = _uses(releases, changed_steps)
    rtol = check_open_unit("rtol", rtol)
    limit = noiseless_delta(subsampling_rate, releases=releases, changed_steps=changed_steps)
    if delta >= limit:
        raise ValueError(
            f"delta must be < 1 - (1 - subsampling_rate)^(releases * changed_steps) = {limit:.6g} "
            f"(the probability that a changed step is used at all), got {delta!r}: that delta "
            "is met without noise; choose a smaller delta")

    e = np.asarray(epsilon, dtype=np.float64)

    def ok(z: float) -> bool:
        return float(_profile(e, z, subsampling_rate, m)) <= delta

    hi = 1.0
    if ok(hi):
        lo = hi / 2.0
        while ok(lo):
            hi = lo
            if hi <= MIN_NOISE_MULTIPLIER:
                return float(hi)  # meets the target; any smaller z is numerically irrelevant
            lo = hi / 2.0
    else:
        lo = hi
        hi = 2.0
        while not ok(hi):
            lo = hi
            hi *= 2.0
            if hi > MAX_NOISE_MULTIPLIER:
                raise ValueError(
                    f"epsilon={epsilon} at delta={delta} needs noise_multiplier > "
                    f"{MAX_NOISE_MULTIPLIER:g}; raise epsilon or delta")
    while hi / lo > 1.0 + rtol:
        mid = math.sqrt(lo * hi)
        if mid <= lo or mid >= hi:
            break
        if ok(mid):
            hi = mid
        else:
            lo = mid
    # ε(δ) at the result must not exceed the target after its own root-finding and rounding.
    for _ in range(100):
        if time_domain_epsilon(delta, noise_multiplier=hi, subsampling_rate=subsampling_rate,
                               releases=releases, changed_steps=changed_steps) <= epsilon:
            return float(hi)
        hi *= 1.0 + max(rtol, 1e-12)
    raise ValueError(  # pragma: no cover - numerical safety net
        f"could not certify noise_multiplier={hi} for epsilon={epsilon}, delta={delta}")
