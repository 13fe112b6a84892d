"""Local forecasts fitted inside each window (forecasting/local_forecasts.py): the ETS smoother
against statsmodels at the same parameters and initial states, the grid fit against
statsmodels' maximum likelihood, the closed forms of naive / seasonal naive / drift / Theta,
and the per-window property the privacy analysis rests on (a window's forecasts depend on its
own context only), also through the skip's per-window gradients."""

import warnings

import numpy as np
import pandas as pd
import pytest
import torch

from opacus_structured.forecasting.local_forecasts import (
    ETS_GRID,
    METHODS,
    _initial_states,
    check_methods,
    drift_forecast,
    ets_forecast,
    local_forecasts,
    seasonal_naive_forecast,
    theta_forecast,
)


def _series(n, m=12, seed=0, trend=0.01, amp=0.2, noise=0.03):
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    return (1.0 + trend * t + amp * np.sin(2 * np.pi * t / m + seed)
            + noise * rng.standard_normal(n))


def _ones(y):
    return torch.ones_like(y)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ets_smoother_equals_statsmodels_at_fixed_parameters(seed):
    """One grid point and the heuristic initial states: the forecasts are statsmodels'
    ETS(A,Ad,A) smoothed with those parameters and states (``initialization_method='known'``)."""
    sm = pytest.importorskip("statsmodels.tsa.exponential_smoothing.ets")
    m, H, T = 12, 12, 36
    y = _series(T, m, seed)
    yt = torch.tensor(y[None])
    params = (0.3, 0.03, 0.1, 0.9)
    fc, std = ets_forecast(yt, _ones(yt), m, H, grid=[params])
    k = torch.zeros(1, dtype=torch.long)
    level, trend, seas = _initial_states(yt, k, torch.tensor([float(T)]), m,
                                         torch.tensor([True]))
    # statsmodels' initial seasonal states are s_{1-m}, ..., s_0 in time order, and step t
    # reads s_{t-m}: the state of phase p (step t = p reads it) is the p-th entry
    initial_seasonal = seas[0].numpy()
    model = sm.ETSModel(pd.Series(y), error="add", trend="add", damped_trend=True,
                        seasonal="add", seasonal_periods=m, initialization_method="known",
                        initial_level=float(level[0]), initial_trend=float(trend[0]),
                        initial_seasonal=initial_seasonal)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = model.smooth(list(params))
    np.testing.assert_allclose(fc[0].numpy(), res.forecast(H), rtol=1e-9, atol=1e-9)
    # the h-step standard deviation: statsmodels' exact forecast variance at the same σ²
    sigma2 = float(std[0, 0]) ** 2
    pred = res.get_prediction(start=T, end=T + H - 1)
    assert pred.method == "exact"
    factor = np.asarray(pred.forecast_variance) / float(res.mse)
    np.testing.assert_allclose(std[0].numpy() ** 2 / sigma2, factor, rtol=1e-9)


def test_ets_grid_fit_is_close_to_statsmodels_maximum_likelihood():
    """On seasonal series with a trend the grid fit is about as good as statsmodels' maximum
    likelihood ETS(A,Ad,A) on the same 36 steps: its one-step RMSE within 1.3 times
    statsmodels', and its forecasts within a tenth of the level (the seasonal amplitude is 0.2;
    the fits differ in the grid and in statsmodels' moving-average initial states)."""
    sm = pytest.importorskip("statsmodels.tsa.exponential_smoothing.ets")
    m, H, T = 12, 12, 36
    ys = np.stack([_series(T, m, seed, trend=0.005 * seed) for seed in range(4)])
    fc, sigma = ets_forecast(torch.tensor(ys), torch.ones(4, T, dtype=torch.float64), m, H)
    for i, y in enumerate(ys):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = sm.ETSModel(y, error="add", trend="add", damped_trend=True, seasonal="add",
                              seasonal_periods=m, initialization_method="heuristic"
                              ).fit(disp=False)
        rmse = float(np.sqrt(np.mean(np.asarray(ref.resid) ** 2)))
        assert float(sigma[i, 0]) < 1.3 * rmse, (i, float(sigma[i, 0]), rmse)
        assert np.max(np.abs(fc[i].numpy() - ref.forecast(H))) < 0.1, i


def test_closed_form_methods():
    y = torch.tensor([[0.0, 0.0, 1.0, 2.0, 3.0, 5.0, 6.0, 7.0]], dtype=torch.float64)
    obs = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]], dtype=torch.float64)
    # seasonal naive with m = 3: the last season repeated
    np.testing.assert_array_equal(seasonal_naive_forecast(y, 3, 4)[0].numpy(), [5, 6, 7, 5])
    # m > context: naive
    np.testing.assert_array_equal(seasonal_naive_forecast(y, 12, 2)[0].numpy(), [7, 7])
    # drift from the first observed value (step 2: 1.0) to the last (7.0) over 5 steps
    np.testing.assert_allclose(drift_forecast(y, obs, 3)[0].numpy(), [8.2, 9.4, 10.6])
    out = local_forecasts(y, obs, 3, 4)
    assert out.shape == (1, 4, len(METHODS))
    np.testing.assert_array_equal(out[0, :, METHODS.index("naive")].numpy(), [7, 7, 7, 7])


def test_theta_on_a_line_continues_half_the_slope():
    """Theta on an exact line: SES follows the line (α = 0.9 wins), the forecast adds half the
    slope per step on top of the smoothed level (its known bias on trends)."""
    y = torch.arange(20, dtype=torch.float64)[None] * 0.5 + 1.0
    fc = theta_forecast(y, _ones(y), 1, 3)[0].numpy()
    assert np.all(np.diff(fc) == pytest.approx(0.25))
    assert 9.5 < fc[0] < 11.0


def test_padding_and_short_windows_are_finite():
    """Windows with a padded (unobserved) start, a single observation or none give finite
    forecasts; seasonality is fitted only where two full seasons are observed."""
    T, m, H = 36, 12, 12
    y = torch.tensor(np.stack([_series(T, m, s) for s in range(4)]))
    obs = torch.ones_like(y)
    obs[1, :20] = 0
    obs[2, :35] = 0
    obs[3, :] = 0
    y = y * obs
    out = local_forecasts(y, obs, m, H)
    assert torch.isfinite(out).all()
    # one observation: every method is the last value
    torch.testing.assert_close(out[2, :, METHODS.index("ets")],
                               y[2, -1].expand(H), rtol=0, atol=1e-12)


def test_each_window_depends_on_its_own_context_only():
    """The per-window property the privacy analysis needs: changing, adding or removing other
    rows of the batch leaves a row's forecasts unchanged (the fits run row by row)."""
    T, m, H = 36, 12, 12
    gen = torch.Generator().manual_seed(0)
    y = 1 + torch.rand(6, T, generator=gen, dtype=torch.float64)
    obs = torch.ones_like(y)
    obs[4, :10] = 0
    full = local_forecasts(y, obs, m, H)
    for i in range(6):
        alone = local_forecasts(y[i:i + 1], obs[i:i + 1], m, H)
        torch.testing.assert_close(alone[0], full[i], rtol=0, atol=1e-12)
    other = y.clone()
    other[1:] = 100 * torch.rand(5, T, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(local_forecasts(other, obs, m, H)[0], full[0], rtol=0,
                               atol=1e-12)


def test_check_methods():
    assert check_methods(["ets", "naive"]) == ("ets", "naive")
    for bad in ([], ["ets", "ets"], ["arima"]):
        with pytest.raises(ValueError, match="local forecast methods"):
            check_methods(bad)
    assert len(ETS_GRID) == 162 and all(0 <= b <= a for a, b, _, _ in ETS_GRID)
