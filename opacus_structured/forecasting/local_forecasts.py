r"""Local statistical forecasts fitted inside each model window, vectorised in torch.

A per-series ETS model (statsmodels, :mod:`.ets`) beats a DP global model on most panels
(issue 47), and it needs no more than a window: on the project's own measurements an
``ETS(A,Ad,A)`` fitted on the last 36 monthly points is as good as one fitted on the whole
history. This module fits classical local methods on **one window's own context** (the
``past_target`` a network reads), for a whole batch of windows at once, so that a global
network can combine or correct them (FFORMA, Montero-Manso et al. 2020; the ES-hybrid, Smyl
2020; :mod:`.baseline_skip` uses them as the inputs of its skip).

**Privacy.** Every output row is a deterministic function of that row's context and observed
mask only (no parameter, no other window, no batch statistic): the fits run row by row in
parallel, and a window's forecasts do not change when the other rows of the batch change
(``tests/test_local_forecasts.py``). They are therefore part of the model's input transform,
and per-window clipping bounds one window's influence exactly as before: the structured
accountant's analysis (one window's gradient depends on that window only) is unchanged.

Methods, for a context ``y_1..y_T`` (in the scaler's units) with observed mask ``o_t`` and
season length ``m`` (the first observed index is ``k``; steps before it are padding):

* ``seasonal_naive`` — ``y_{T-m+1+((h-1) mod m)}``; naive where ``m = 1`` or ``m > T``.
* ``naive`` — ``y_T``.
* ``drift`` — ``y_T + h (y_T - y_k) / (T - k)`` (naive when one value is observed).
* ``ets`` — ``ETS(A,Ad,A)`` (additive error, damped additive trend, additive season), or
  ``ETS(A,Ad,N)`` where no two full seasons are observed (or ``m = 1``). The smoothing
  parameters ``(α, β, γ, φ)`` are chosen per window from the grid :data:`ETS_GRID` by the
  smallest sum of squared one-step errors over the observed steps (maximum likelihood of the
  Gaussian model restricted to the grid). Initial states by the heuristic of Hyndman et al.
  (2008, sec. 2.6.1) on the first two observed seasons: trend = difference of their means over
  ``m``, season = their deviations from the line through the two means (averaged, centred),
  level = the first season's mean moved back to just before the first observed step; without
  a season, level = the first observed value and trend = its mean step over the next five.
  Steps before ``k`` leave the state unchanged; unobserved steps after it propagate the state
  without a correction. Forecast ``ℓ_T + (φ + … + φ^h) b_T + s_{T+h-m⌈h/m⌉}``, standard
  deviation ``σ·sqrt(1 + Σ_{j<h} c_j²)`` (:func:`ets_forecast`).
* ``theta`` — the Theta method (Assimakopoulos & Nikolopoulos 2000, as in Hyndman & Billah
  2003): simple exponential smoothing (``α`` from :data:`THETA_ALPHAS` by the smallest SSE)
  of the seasonally adjusted context plus half the slope ``b`` of its least-squares line,
  ``ℓ_T + (b/2)(h - 1 + 1/α - (1-α)^n/α)``, re-seasonalised. The additive seasonal indices are
  the per-phase means of the context minus its least-squares line (when two full seasons are
  observed).

:func:`local_forecasts` returns a ``(B, H, K)`` tensor in the order of its ``methods``
argument (:data:`METHODS`) and, on request, ETS's ``(B, H)`` forecast standard deviation.
Runtime: one Python loop over the ``T`` context steps, each a few element-wise operations on
``B × |grid|`` states (about 5 ms for 64 windows of 36 steps on one idle CPU thread).
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch

__all__ = ["METHODS", "ETS_GRID", "THETA_ALPHAS", "local_forecasts", "ets_forecast",
           "theta_forecast", "drift_forecast", "seasonal_naive_forecast", "check_methods",
           "local_forecasts_with_history", "trim_leading_padding", "check_pair"]

#: The local methods, in the order :func:`local_forecasts` stacks them by default.
METHODS = ("seasonal_naive", "naive", "drift", "ets", "theta")

_ALPHAS = (0.05, 0.15, 0.3, 0.5, 0.75, 0.99)
_BETA_SHARES = (0.0, 0.1, 0.3)   # β = share · α (β <= α, as ETS requires)
_GAMMAS = (0.0, 0.1, 0.3)        # γ <= 1 - α is enforced by clipping
_PHIS = (0.8, 0.9, 0.98)
#: The ETS parameter grid ``(α, β, γ, φ)``: 162 combinations.
ETS_GRID = tuple((a, s * a, min(g, 1.0 - a), p)
                 for a, s, g, p in itertools.product(_ALPHAS, _BETA_SHARES, _GAMMAS, _PHIS))
#: The SES smoothing parameters of the Theta method.
THETA_ALPHAS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)


def check_methods(methods: Sequence[str], allowed: Sequence[str] = METHODS) -> tuple:
    """``methods`` as a tuple of distinct names from ``allowed`` (default :data:`METHODS`; a
    ValueError names them otherwise)."""
    methods = tuple(methods)
    allowed = tuple(allowed)
    bad = [m for m in methods if m not in allowed]
    if bad or not methods or len(set(methods)) != len(methods):
        raise ValueError(f"local forecast methods must be distinct names from {allowed}, got "
                         f"{methods!r}")
    return methods


def check_pair(y: torch.Tensor, observed: torch.Tensor, axis: str = "time") -> None:
    """A ValueError unless ``y`` and ``observed`` are both ``(batch, axis)`` tensors."""
    if y.dim() != 2 or observed.shape != y.shape:
        raise ValueError(f"y and observed must both be (batch, {axis}) tensors, got "
                         f"{tuple(y.shape)} and {tuple(observed.shape)}")


def _first_observed(observed: torch.Tensor) -> torch.Tensor:
    """Index of the first observed step of each row (``T`` for a row with none)."""
    T = observed.shape[1]
    pos = torch.arange(T, device=observed.device).expand_as(observed)
    return torch.where(observed > 0, pos, torch.full_like(pos, T)).min(dim=1).values


def _last_value(y: torch.Tensor) -> torch.Tensor:
    return y[:, -1]


def seasonal_naive_forecast(y: torch.Tensor, m: int, horizon: int) -> torch.Tensor:
    """``(B, H)`` seasonal naive forecasts of contexts ``y`` ``(B, T)`` (naive when ``m = 1``
    or ``m > T``)."""
    T = y.shape[1]
    if 1 < m <= T:
        index = [T - m + (h % m) for h in range(horizon)]
    else:
        index = [T - 1] * horizon
    return y[:, index]


def drift_forecast(y: torch.Tensor, observed: torch.Tensor, horizon: int) -> torch.Tensor:
    """``(B, H)`` drift forecasts: the line through the first observed and the last value."""
    T = y.shape[1]
    k = _first_observed(observed).clamp(max=T - 1)
    first = y.gather(1, k[:, None]).squeeze(1)
    span = (T - 1 - k).clamp(min=1).to(y.dtype)
    slope = torch.where(k < T - 1, (_last_value(y) - first) / span, torch.zeros_like(first))
    h = torch.arange(1, horizon + 1, device=y.device, dtype=y.dtype)
    return _last_value(y)[:, None] + slope[:, None] * h


def _season_ok(n_obs: torch.Tensor, m: int) -> torch.Tensor:
    """Rows whose observed context holds two full seasons (a seasonal model is fitted)."""
    if m <= 1:
        return torch.zeros_like(n_obs, dtype=torch.bool)
    return n_obs >= 2 * m


def _window_summary(y, observed, m):
    """``(obs, k, n_obs, m_eff, season)`` of each row: the observed mask as ``y``'s dtype, the
    first observed index, the number of observed steps, the season length in use (1 where
    ``m = 1`` or ``m`` exceeds the context) and whether two full seasons are observed."""
    T = y.shape[1]
    obs = (observed > 0).to(y.dtype)
    n_obs = obs.sum(1)
    m_eff = m if 1 < m <= T else 1
    return obs, _first_observed(observed), n_obs, m_eff, _season_ok(n_obs, m_eff)


def _initial_states(y, k, n_obs, m, season):
    """Heuristic initial level, trend and seasonal state (by phase ``t mod m``) per row."""
    B, T = y.shape
    dtype = y.dtype
    if m > 1:
        first = (k[:, None] + torch.arange(m, device=y.device)).clamp(max=T - 1)   # (B, m)
        second = (first + m).clamp(max=T - 1)
        s1, s2 = y.gather(1, first), y.gather(1, second)
        mean1, mean2 = s1.mean(1), s2.mean(1)
        trend_s = (mean2 - mean1) / m
        # deviations from the line through the two seasons' means, averaged over both
        ramp = (torch.arange(m, device=y.device, dtype=dtype) - (m - 1) / 2)[None, :]
        dev = 0.5 * ((s1 - mean1[:, None]) + (s2 - mean2[:, None])) - trend_s[:, None] * ramp
        dev = dev - dev.mean(1, keepdim=True)
        # the level just before step k (the first season's mean is the level at its centre)
        level_s = mean1 - trend_s * (m + 1) / 2
        # the deviation of step k + i belongs to phase (k + i) mod m
        phase_of = (first % m)
        seasonal = torch.zeros(B, m, dtype=dtype, device=y.device).scatter(1, phase_of, dev)
        seasonal = seasonal * season[:, None].to(dtype)
    else:
        seasonal = torch.zeros(B, 1, dtype=dtype, device=y.device)
        level_s = trend_s = None
    # without a season: level = first value, trend = mean step over the first observed steps
    span = torch.clamp(n_obs - 1, min=0).clamp(max=5).long()
    i0 = k.clamp(max=T - 1)
    i1 = (k + span).clamp(max=T - 1)
    y0, y1 = y.gather(1, i0[:, None]).squeeze(1), y.gather(1, i1[:, None]).squeeze(1)
    level_n = y0
    trend_n = torch.where(span > 0, (y1 - y0) / span.clamp(min=1).to(dtype), torch.zeros_like(y0))
    if level_s is not None:
        level = torch.where(season, level_s, level_n)
        trend = torch.where(season, trend_s, trend_n)
    else:
        level, trend = level_n, trend_n
    return level, trend, seasonal


def ets_forecast(y: torch.Tensor, observed: torch.Tensor, m: int, horizon: int,
                 grid: Sequence[tuple] = ETS_GRID, *, recent: Optional[int] = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(forecasts (B, H), std (B, H))``: ETS(A,Ad,A) (ETS(A,Ad,N) where no two seasons are
    observed) fitted per row on a grid (module docstring). ``std`` is the model's ``h``-step
    forecast standard deviation ``σ·sqrt(1 + Σ_{j<h} c_j²)`` with
    ``c_j = α + β(φ + … + φ^j) + γ·[j mod m = 0]`` (Hyndman et al. 2008, Table 6.1, class 1)
    and ``σ`` the root mean squared one-step error of the chosen fit: over every observed
    step, or with ``recent`` over the observed steps among the last ``recent`` only (the
    fit's recent error, for a long history whose volatility changed; all observed steps where
    none of the last ``recent`` is)."""
    with torch.no_grad():
        B, T = y.shape
        dtype = y.dtype
        obs, k, n_obs, m_eff, season = _window_summary(y, observed, m)
        level0, trend0, seas0 = _initial_states(y, k, n_obs, m_eff, season)
        params = torch.tensor(grid, dtype=dtype, device=y.device)              # (G, 4)
        alpha, beta, gamma, phi = (params[:, i][None, :] for i in range(4))    # (1, G)
        gamma = gamma * season[:, None].to(dtype)                               # (B, G)
        G = params.shape[0]
        level = level0[:, None].expand(B, G).clone()
        trend = trend0[:, None].expand(B, G).clone()
        # one (B, G) state per seasonal phase: no strided writes into a (B, G, m) tensor
        seas = [seas0[:, i:i + 1].expand(B, G).clone() for i in range(seas0.shape[1])]
        sse = torch.zeros(B, G, dtype=dtype, device=y.device)
        tail = T if recent is None else max(0, T - int(recent))
        sse_tail = None
        # a step before the first observed one leaves the state as it is (its error is 0
        # too: the step is unobserved)
        started = (torch.arange(T, device=y.device)[None, :] >= k[:, None]).to(dtype)
        for t in range(T):
            if t == tail:
                sse_tail = sse.clone()
            p = t % m_eff
            a = started[:, t:t + 1]                                             # (B, 1)
            s_t = seas[p]
            damped = phi * trend
            err = (y[:, t:t + 1] - level - damped - s_t) * obs[:, t:t + 1]
            sse.addcmul_(err, err)
            level = level + a * damped + alpha * err
            trend = trend + a * (damped - trend) + beta * err
            seas[p] = s_t + gamma * err
        seas = torch.stack(seas, dim=-1)                                        # (B, G, m)
        best = sse.argmin(dim=1)                                                # (B,)
        pick = best[:, None]
        lv = level.gather(1, pick).squeeze(1)
        tr = trend.gather(1, pick).squeeze(1)
        ph = phi.expand(B, G).gather(1, pick).squeeze(1)
        al = alpha.expand(B, G).gather(1, pick).squeeze(1)
        be = beta.expand(B, G).gather(1, pick).squeeze(1)
        ga = gamma.expand(B, G).gather(1, pick).squeeze(1)
        ss = seas[torch.arange(B, device=y.device), best]                      # (B, m)
        h = torch.arange(1, horizon + 1, device=y.device, dtype=dtype)
        # φ + φ² + … + φ^h
        damp_sum = torch.cumsum(ph[:, None] ** h[None, :], dim=1)
        phases = [(T + i) % m_eff for i in range(horizon)]
        fc = lv[:, None] + damp_sum * tr[:, None] + ss[:, phases]
        sse_best = sse.gather(1, pick).squeeze(1)
        sigma = torch.sqrt(sse_best / n_obs.clamp(min=1))
        if sse_tail is not None:  # the chosen fit's error over the last `recent` steps
            n_recent = obs[:, tail:].sum(1)
            recent_sse = sse_best - sse_tail.gather(1, pick).squeeze(1)
            sigma = torch.where(n_recent > 0,
                                torch.sqrt(recent_sse.clamp(min=0) / n_recent.clamp(min=1)),
                                sigma)
        # c_j for j = 1 .. H-1, then the cumulated variance factor of step h = 1 .. H
        j = h[:-1]
        seasonal_hit = ((j.long() % m_eff) == 0).to(dtype) if m_eff > 1 else torch.zeros_like(j)
        c = (al[:, None] + be[:, None] * damp_sum[:, :-1]
             + ga[:, None] * seasonal_hit[None, :])
        factor = torch.cat([torch.ones(B, 1, dtype=dtype, device=y.device),
                            1 + torch.cumsum(c * c, dim=1)], dim=1)
        return fc, sigma[:, None] * torch.sqrt(factor)


def _weighted_line(y, obs):
    """Least-squares line of ``y`` on the step index over the observed steps:
    ``(intercept at t = 0, slope)`` per row (slope 0 with fewer than two observations)."""
    T = y.shape[1]
    t = torch.arange(T, device=y.device, dtype=y.dtype)[None, :]
    n = obs.sum(1).clamp(min=1)
    tm = (obs * t).sum(1) / n
    ym = (obs * y).sum(1) / n
    dt = (t - tm[:, None]) * obs
    var = (dt * dt).sum(1)
    slope = torch.where(var > 0, (dt * (y - ym[:, None])).sum(1) / var.clamp(min=1e-12),
                        torch.zeros_like(ym))
    return ym - slope * tm, slope


def theta_forecast(y: torch.Tensor, observed: torch.Tensor, m: int, horizon: int,
                   alphas: Sequence[float] = THETA_ALPHAS) -> torch.Tensor:
    """``(B, H)`` Theta-method forecasts per row (module docstring)."""
    with torch.no_grad():
        B, T = y.shape
        dtype = y.dtype
        obs, k, n_obs, m_eff, season = _window_summary(y, observed, m)
        intercept, slope = _weighted_line(y, obs)
        t = torch.arange(T, device=y.device)
        if m_eff > 1:
            resid = (y - (intercept[:, None] + slope[:, None] * t.to(dtype))) * obs
            onehot = torch.nn.functional.one_hot(t % m_eff, m_eff).to(dtype)      # (T, m)
            counts = obs @ onehot                                                # (B, m)
            index = (resid @ onehot) / counts.clamp(min=1)
            index = (index - index.mean(1, keepdim=True)) * season[:, None].to(dtype)
            adjusted = y - index[:, t % m_eff]
        else:
            index = torch.zeros(B, 1, dtype=dtype, device=y.device)
            adjusted = y
        # the adjusted line's slope (the season is removed)
        _, b = _weighted_line(adjusted, obs)
        a = torch.tensor(alphas, dtype=dtype, device=y.device)[None, :]          # (1, A)
        first = adjusted.gather(1, k.clamp(max=T - 1)[:, None])                  # (B, 1)
        level = first.expand(B, a.shape[1]).clone()
        sse = torch.zeros_like(level)
        for step in range(T):
            active = (step > k)[:, None]
            err = (adjusted[:, step:step + 1] - level) * obs[:, step:step + 1]
            sse = sse + torch.where(active, err * err, torch.zeros_like(err))
            level = torch.where(active, level + a * err, level)
        best = sse.argmin(dim=1, keepdim=True)
        lv = level.gather(1, best).squeeze(1)
        al = a.expand(B, -1).gather(1, best).squeeze(1)
        h = torch.arange(1, horizon + 1, device=y.device, dtype=dtype)[None, :]
        n = n_obs.clamp(min=1)[:, None]
        drift = 0.5 * b[:, None] * (h - 1 + 1 / al[:, None]
                                    - (1 - al[:, None]) ** n / al[:, None])
        phases = [(T + i) % m_eff for i in range(horizon)]
        return lv[:, None] + drift + index[:, phases]


def local_forecasts(y: torch.Tensor, observed: torch.Tensor, m: int, horizon: int,
                    methods: Sequence[str] = METHODS, *, with_ets_std: bool = False,
                    ets_recent: Optional[int] = None):
    """``(B, H, K)`` forecasts of the ``K`` local ``methods`` (:data:`METHODS`) fitted on each
    row of the contexts ``y`` ``(B, T)`` with observed mask ``observed`` ``(B, T)``; season
    length ``m >= 1``. Computed without autograd (they are inputs, not parameters).
    ``with_ets_std``: also return ETS's ``(B, H)`` forecast standard deviation
    (:func:`ets_forecast`, its ``σ`` over the last ``ets_recent`` steps when given; ETS is
    fitted even when not among ``methods``)."""
    methods = check_methods(methods)
    check_pair(y, observed, "context")
    with torch.no_grad():
        out = []
        ets = ets_forecast(y, observed, m, horizon, recent=ets_recent) if (
            with_ets_std or "ets" in methods) else None
        for name in methods:
            if name == "seasonal_naive":
                out.append(seasonal_naive_forecast(y, m, horizon))
            elif name == "naive":
                out.append(_last_value(y)[:, None].expand(-1, horizon))
            elif name == "drift":
                out.append(drift_forecast(y, observed, horizon))
            elif name == "ets":
                out.append(ets[0])
            else:
                out.append(theta_forecast(y, observed, m, horizon))
        stacked = torch.stack(out, dim=-1)
        return (stacked, ets[1]) if with_ets_std else stacked


def trim_leading_padding(y: torch.Tensor, observed: torch.Tensor, keep: int):
    """``(y, observed)`` without the leading columns that are padding in every row (no row has
    an observed step there), keeping at least the last ``keep`` columns. Every method here
    leaves its state unchanged before a row's first observed step, so each row's forecasts are
    the same with or without those columns: this only saves the smoother's steps."""
    T = y.shape[1]
    first = int(_first_observed(observed).min()) if y.shape[0] else T
    start = max(0, min(first, T - int(keep)))
    return (y, observed) if start == 0 else (y[:, start:], observed[:, start:])


def local_forecasts_with_history(y: torch.Tensor, observed: torch.Tensor, window: int, m: int,
                                 horizon: int, methods: Sequence[str] = METHODS,
                                 history_methods: Sequence[str] = (), *,
                                 with_ets_std: bool = False, recent_std: bool = False):
    """:func:`local_forecasts` where the methods of ``history_methods`` are fitted on the
    whole input ``y`` ``(B, T)`` (a series' longer history, at prediction time) and the other
    ``methods`` on its last ``window`` steps (the model's context, as in training). With
    ``T == window`` (every training window) this is :func:`local_forecasts` itself. ETS's
    standard deviation (``with_ets_std``) comes from the ETS fitted on the history when
    ``"ets"`` is in ``history_methods``, else from the window's; ``recent_std``: the history
    fit's ``σ`` is its one-step error over the last ``window`` steps only (the
    ``recent`` argument of :func:`ets_forecast`). Leading columns that are
    padding in every row are dropped first (:func:`trim_leading_padding`: no row's forecast
    changes)."""
    methods = check_methods(methods)
    history_methods = tuple(history_methods)
    if history_methods:
        check_methods(history_methods)
    check_pair(y, observed)
    T = y.shape[1]
    if not 1 <= int(window) <= T:
        raise ValueError(f"window must be in [1, {T}] (the input's length), got {window!r}")
    long = [k for k in methods if k in history_methods]
    ets_long = with_ets_std and "ets" in history_methods
    wy, wo = y[:, T - window:], observed[:, T - window:]
    if T == window or (not long and not ets_long):
        return local_forecasts(wy, wo, m, horizon, methods, with_ets_std=with_ets_std)
    with torch.no_grad():
        hy, ho = trim_leading_padding(y, observed, window)
        columns, std = _fits(hy, ho, m, horizon, long, ets_long,
                             window if recent_std else None)
        short = [k for k in methods if k not in history_methods]
        more, window_std = _fits(wy, wo, m, horizon, short, with_ets_std and std is None)
        columns.update(more)
        stacked = torch.stack([columns[k] for k in methods], dim=-1)
        return (stacked, std if std is not None else window_std) if with_ets_std else stacked


def _fits(y, observed, m, horizon, methods, with_ets_std, recent=None):
    """``({method: (B, H) forecasts}, ETS's (B, H) std or None)``: :func:`local_forecasts` of
    ``methods`` (none fitted when empty) and, with ``with_ets_std``, ETS's standard deviation
    (``recent`` as in :func:`ets_forecast`)."""
    if not methods:
        return {}, (ets_forecast(y, observed, m, horizon, recent=recent)[1]
                    if with_ets_std else None)
    out = local_forecasts(y, observed, m, horizon, methods, with_ets_std=with_ets_std,
                          ets_recent=recent)
    out, std = out if with_ets_std else (out, None)
    return dict(zip(methods, out.unbind(-1), strict=True)), std
