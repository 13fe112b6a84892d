r"""A public pretraining corpus: synthetic seasonal series generated on the fly.

DP *fine-tuning* starts from weights learnt on data that carries no privacy cost. The corpus
here is synthetic, so it is disjoint from any user's panel by construction and needs no
download or licence: every series is

.. math::

    x_t = \ell \cdot \exp\big(g(t) + s_{t \bmod P} + u_t\big),

a multiplicative composition (as in Chronos' KernelSynth, Ansari et al. 2024, arXiv:2403.07815,
but with parametric components) of

* a **level** :math:`\ell` log-uniform over four decades (models must scale per window);
* a **trend** :math:`g`: a random walk with drift whose slope changes at a few random change
  points (piecewise-linear growth with business-cycle-like turns);
* a **seasonal profile** :math:`s` of period :math:`P` (12 for monthly data): a random sum of
  the first three harmonics, amplitude log-uniform, zero mean over a period;
* **noise** :math:`u`: an AR(1) process with random coefficient and scale.

Series lengths are uniform in ``[min_length, max_length]``. The generator is a pure function of
``seed`` (public randomness), so :func:`synthetic_panel` with the same arguments returns the same
panel on every machine and the pretrained weights can be reproduced.

The privacy guarantee of DP fine-tuning covers the fine-tuning panel only; the pretraining data
is public (here: synthetic), and nothing private is read while pretraining.
"""

from __future__ import annotations

import numpy as np

from .._validation import check_int
from .data import Panel
from .seasonality import season_length as _season_length

__all__ = ["synthetic_panel"]


def synthetic_panel(num_series: int = 2000, *, freq: str = "M", season_length: int | None = None,
                    min_length: int = 120, max_length: int = 480,
                    seasonal_amplitude: tuple[float, float] = (10 ** -2.5, 10 ** -0.8),
                    noise_scale: tuple[float, float] = (1e-3, 10 ** -1.5),
                    seed: int = 0) -> Panel:
    """``num_series`` synthetic series (module docstring) as a :class:`~.data.Panel`.

    Args:
        num_series: number of series.
        freq: pandas frequency of the panel (``"M"``: monthly, season 12; any pandas
            frequency, e.g. ``"30min"``: season 48).
        season_length: period of the seasonal profile (default
            :func:`~opacus_structured.forecasting.seasonality.season_length` of ``freq``).
        min_length, max_length: series lengths are uniform in this range.
        seasonal_amplitude: range of the seasonal profile's peak (log scale), log-uniform.
        noise_scale: range of the AR(1) innovations' std (log scale), log-uniform.
        seed: the generator's seed (public: the corpus is not private data).
    """
    import warnings

    import pandas as pd

    num_series = check_int("num_series", num_series, minimum=1)
    min_length = check_int("min_length", min_length, minimum=2)
    max_length = check_int("max_length", max_length, minimum=min_length)
    period = (_season_length(freq) if season_length is None
              else check_int("season_length", season_length, minimum=1))
    seed = check_int("seed", seed, minimum=0)
    rng = np.random.default_rng(seed)
    targets, starts, ids = [], [], []
    with warnings.catch_warnings():  # business-day Periods: pandas deprecates, still exact
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message="Period with BDay freq is deprecated")
        base = pd.Period("1950-01", freq=freq)
    for i in range(num_series):
        n = int(rng.integers(min_length, max_length + 1))
        t = np.arange(n)
        level = 10 ** rng.uniform(0.5, 4.5)
        # trend: drift with a few slope changes plus a small random walk
        drift = np.full(n, rng.normal(0.002, 0.004))
        for cp in rng.integers(0, n, size=rng.integers(0, 4)):
            drift[cp:] = rng.normal(0.002, 0.006)
        trend = np.cumsum(drift) + np.cumsum(rng.normal(0, rng.uniform(0.0, 0.01), n))
        # seasonal profile: first three harmonics, random amplitude and phase, zero mean
        amp = np.exp(rng.uniform(*np.log(seasonal_amplitude)))
        season = np.zeros(period)
        phase = 2 * np.pi * np.arange(period) / period
        for k in range(1, 4):
            season += rng.normal(0, 1.0 / k) * np.cos(k * phase + rng.uniform(0, 2 * np.pi))
        season = amp * (season - season.mean()) / max(np.abs(season).max(), 1e-12)
        offset = int(rng.integers(0, period))
        seasonal = season[(t + offset) % period]
        # AR(1) noise
        phi, scale = rng.uniform(0.0, 0.9), np.exp(rng.uniform(*np.log(noise_scale)))
        eps = rng.normal(0, scale, n)
        noise = np.empty(n)
        noise[0] = eps[0]
        for j in range(1, n):
            noise[j] = phi * noise[j - 1] + eps[j]
        x = level * np.exp(trend + seasonal + noise)
        targets.append(x.astype(np.float32))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning,
                                    message="Period with BDay freq is deprecated")
            starts.append(base + int(rng.integers(0, 240)))
        ids.append(f"synthetic-{i}")
    return Panel(tuple(targets), tuple(starts), tuple(ids), freq)
