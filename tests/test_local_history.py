"""Local forecasts from a series' whole history at prediction time (issue 47): the methods of
``history_methods`` read the predictor's longer input, the others (and DLinear) the last
``context_length`` steps; training windows keep their own context. Checked against
statsmodels' ETS on the whole series, through gluonts' predictor serialization, the zero-shot
mixture and the inference-privacy path."""

import warnings

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("gluonts")
warnings.filterwarnings("ignore", category=FutureWarning)

from opacus_structured.forecasting import baseline_skip  # noqa: E402
from opacus_structured.forecasting.baseline_skip import LOCAL_FEATURES, BaselineSkipDLinearModel  # noqa: E402
from opacus_structured.forecasting.estimators import build_estimator, prepare_estimator  # noqa: E402,E501
from opacus_structured.forecasting.local_forecasts import (  # noqa: E402
    ets_forecast,
    local_forecasts,
    local_forecasts_with_history,
    trim_leading_padding,
)
from opacus_structured.forecasting.model_defaults import model_defaults  # noqa: E402

H, CTX, M = 5, 12, 4


def _series(n, m=12, seed=0, trend=0.01, amp=0.2, noise=0.03):
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    return (1.0 + trend * t + amp * np.sin(2 * np.pi * t / m + seed)
            + noise * rng.standard_normal(n))


def test_history_methods_read_the_whole_input_and_the_others_its_window():
    T, window, m, h = 120, 36, 12, 12
    y = torch.tensor(np.stack([_series(T, m, s) for s in range(3)]))
    obs = torch.ones_like(y)
    methods = ("seasonal_naive", "drift", "ets", "theta")
    out, std = local_forecasts_with_history(y, obs, window, m, h, methods, ("ets",),
                                            with_ets_std=True, recent_std=True)
    short = local_forecasts(y[:, -window:], obs[:, -window:], m, h, methods)
    whole_ets, whole_std = ets_forecast(y, obs, m, h, recent=None)
    for k, name in enumerate(methods):
        expected = whole_ets if name == "ets" else short[..., k]
        torch.testing.assert_close(out[..., k], expected, rtol=0, atol=0)
    # the spread: the whole-history fit's one-step error over the last `window` steps
    torch.testing.assert_close(std, ets_forecast(y, obs, m, h, recent=window)[1], rtol=0,
                               atol=0)
    assert not torch.allclose(std, whole_std)
    flat = local_forecasts_with_history(y, obs, window, m, h, methods, ("ets",),
                                        with_ets_std=True)[1]
    torch.testing.assert_close(flat, whole_std, rtol=0, atol=0)
    # an input of `window` steps (every training window) is the window's fit, whatever
    # history_methods say
    inside = local_forecasts_with_history(y[:, -window:], obs[:, -window:], window, m, h,
                                          methods, ("ets", "theta"))
    torch.testing.assert_close(inside, short, rtol=0, atol=0)
    with pytest.raises(ValueError, match="window must be in"):
        local_forecasts_with_history(y, obs, T + 1, m, h, methods, ("ets",))


def test_leading_padding_does_not_change_a_row():
    """A series shorter than the predictor's input is padded in front (unobserved): its
    forecasts are those of its own observed steps, alone or in a batch with longer series,
    and columns that are padding in every row are dropped before the smoother runs."""
    m, h, window = 12, 12, 36
    long = _series(200, m, 0)
    short = _series(80, m, 1)
    y = torch.zeros(2, 200, dtype=torch.float64)
    obs = torch.zeros_like(y)
    y[0], obs[0] = torch.tensor(long), 1.0
    y[1, -80:], obs[1, -80:] = torch.tensor(short), 1.0
    batch = local_forecasts_with_history(y, obs, window, m, h, LOCAL_FEATURES, ("ets",))
    alone = local_forecasts_with_history(y[1:, -80:], obs[1:, -80:], window, m, h,
                                         LOCAL_FEATURES, ("ets",))
    torch.testing.assert_close(batch[1], alone[0], rtol=1e-12, atol=1e-12)
    # padded in front of every row: trimmed to the first observed column
    ty, to = trim_leading_padding(y[1:], obs[1:], window)
    assert ty.shape[1] == 80 and to.shape[1] == 80
    ty, _ = trim_leading_padding(y[1:, -40:] * 0, obs[1:, -40:] * 0, window)
    assert ty.shape[1] == window  # never shorter than the window


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_whole_history_ets_is_close_to_statsmodels_on_the_whole_series(seed):
    """Fitted on a long history (240 monthly steps) the grid ETS(A,Ad,A) forecasts as
    statsmodels' maximum-likelihood ETS fitted on the same whole series: the forecasts within
    0.03 (15 % of the seasonal amplitude 0.2; 0.007-0.011 measured), the one-step error within 1.15 times
    statsmodels' (the grid is coarse, the initial states differ)."""
    sm = pytest.importorskip("statsmodels.tsa.exponential_smoothing.ets")
    m, h, T, window = 12, 12, 240, 36
    y = _series(T, m, seed, trend=0.004 * (seed + 1))
    out, std = local_forecasts_with_history(
        torch.tensor(y[None]), torch.ones(1, T, dtype=torch.float64), window, m, h,
        LOCAL_FEATURES, ("ets",), with_ets_std=True, recent_std=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = sm.ETSModel(pd.Series(y), error="add", trend="add", damped_trend=True,
                          seasonal="add", seasonal_periods=m,
                          initialization_method="heuristic").fit(disp=False)
    ets = out[0, :, LOCAL_FEATURES.index("ets")].numpy()
    assert np.max(np.abs(ets - ref.forecast(h))) < 0.03, np.abs(ets - ref.forecast(h))
    rmse = float(np.sqrt(np.mean(np.asarray(ref.resid) ** 2)))
    assert float(std[0, 0]) < 1.15 * rmse, (float(std[0, 0]), rmse)
    # fitted on the 36-step window only it is further from the whole-series fit
    inside = local_forecasts(torch.tensor(y[None, -window:]),
                             torch.ones(1, window, dtype=torch.float64), m, h, ("ets",))
    assert (np.abs(inside[0, :, 0].numpy() - ref.forecast(h)).mean()
            > np.abs(ets - ref.forecast(h)).mean())


def test_recent_sigma_is_the_fits_one_step_error_over_the_last_steps():
    """``recent``: σ is the root mean squared one-step error of the chosen fit over the
    last ``recent`` steps; at one grid point it equals statsmodels' residuals there."""
    sm = pytest.importorskip("statsmodels.tsa.exponential_smoothing.ets")
    from opacus_structured.forecasting.local_forecasts import _initial_states

    m, h, T, recent = 12, 6, 120, 36
    y = _series(T, m, 3)
    yt = torch.tensor(y[None])
    params = (0.3, 0.03, 0.1, 0.9)
    _, std = ets_forecast(yt, torch.ones_like(yt), m, h, grid=[params], recent=recent)
    level, trend, seas = _initial_states(yt, torch.zeros(1, dtype=torch.long),
                                         torch.tensor([float(T)]), m, torch.tensor([True]))
    model = sm.ETSModel(pd.Series(y), error="add", trend="add", damped_trend=True,
                        seasonal="add", seasonal_periods=m, initialization_method="known",
                        initial_level=float(level[0]), initial_trend=float(trend[0]),
                        initial_seasonal=seas[0].numpy())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resid = np.asarray(model.smooth(list(params)).resid)
    assert float(std[0, 0]) == pytest.approx(float(np.sqrt(np.mean(resid[-recent:] ** 2))),
                                             rel=1e-9)


def _model(history_methods=("ets",)):
    torch.manual_seed(0)
    return BaselineSkipDLinearModel(prediction_length=H, context_length=CTX,
                                    hidden_dimension=6, kernel_size=3, season_length=M,
                                    skip_gain=10.0, skip_features=LOCAL_FEATURES,
                                    skip_init=(0.25, 0.0, 0.0, 0.25, 0.25), skip_scale=1.0,
                                    history_methods=history_methods)


def _long_inputs(batch=3, length=40):
    gen = torch.Generator().manual_seed(1)
    t = torch.arange(length, dtype=torch.float32)
    past = (5.0 + 0.05 * t + torch.sin(2 * np.pi * t / M)
            + 0.3 * torch.rand(batch, length, generator=gen))
    return past, torch.ones_like(past)


def test_the_network_reads_its_context_and_a_training_window_is_unchanged():
    """A training window (``context_length`` steps) forecasts as without a history; on a
    longer input DLinear reads the last ``context_length`` steps, and only the history
    methods read further back."""
    past, obs = _long_inputs()
    with_history, without = _model(("ets",)), _model(())
    window = past[:, -CTX:], obs[:, -CTX:]
    for a, b in zip(with_history(*window)[0], without(*window)[0], strict=True):
        assert torch.equal(a, b)
    # without history methods the steps before the window are never read
    changed = past.clone()
    changed[:, :-CTX] += 100.0
    for a, b in zip(without(past, obs)[0], without(changed, obs)[0], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(without(past, obs)[0], without(*window)[0], strict=True):
        assert torch.equal(a, b)
    # with them, the location moves with the history; the network's own args do not
    args, loc, scale = with_history(past, obs)
    args2, loc2, scale2 = with_history(changed, obs)
    assert torch.equal(loc, loc2) and torch.equal(scale, scale2)
    assert torch.equal(args[0], args2[0])  # Student-t degrees of freedom: the network's
    assert not torch.allclose(args[1], args2[1])
    with pytest.raises(ValueError, match="fewer than the model's context_length"):
        with_history(past[:, -CTX + 1:], obs[:, -CTX + 1:])


def test_training_geometry_is_unchanged_and_the_predictor_reads_the_history(tmp_path):
    """The training splitter (the accountant's L_C) keeps ``context_length``; the predictor's
    splitter passes ``local_history_length`` steps; gluonts' serialization keeps both the
    longer input and the history methods, and gives the same forecasts."""
    from gluonts.dataset.common import ListDataset
    from gluonts.model.predictor import Predictor

    prepared = prepare_estimator("dlinear", freq="M", prediction_length=H, context_length=CTX,
                                 skip_features=LOCAL_FEATURES, skip_init=(0.2,) * 5,
                                 skip_scale=1.0, local_history_length=30,
                                 history_methods=("ets",))
    assert prepared.past_length == CTX
    predictor = prepared.create_predictor()
    assert predictor.input_transform.transformations[-1].past_length == 30
    data = ListDataset([{"start": "2000-01", "target": _series(n, M, n).tolist()}
                        for n in (9, 25, 80)], freq="M")
    torch.manual_seed(0)
    first = [f.mean for f in predictor.predict(data)]
    predictor.serialize(tmp_path)
    rebuilt = Predictor.deserialize(tmp_path)
    assert rebuilt.input_transform.transformations[-1].past_length == 30
    assert rebuilt.prediction_net.model.history_methods == ("ets",)
    torch.manual_seed(0)
    again = [f.mean for f in rebuilt.predict(data)]
    for a, b in zip(first, again, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # the forecast of the 80-step series is the network on its last 30 steps
    net = prepared.module.model
    past = torch.tensor(_series(80, M, 80)[-30:], dtype=torch.float32)[None]
    with torch.no_grad():
        args, loc, scale = net(past, torch.ones_like(past))
        mean = net.distr_output.distribution(args, loc=loc, scale=scale).mean
    np.testing.assert_allclose(first[2], mean[0].numpy(), rtol=1e-5, atol=1e-5)


def test_the_recipe_reads_the_history_and_its_public_weights_still_fit():
    from opacus_structured.forecasting import gluonts_parity

    recipe = model_defaults("dlinear")
    est = build_estimator("dlinear", freq="M", prediction_length=12)
    assert est.history_methods == tuple(recipe["history_methods"])
    assert est.local_history_length == max(recipe["local_history_multiple"] * 12,
                                           est.context_length)
    plain = build_estimator("dlinear", freq="M", prediction_length=12, local_history_length=None,
                            history_methods=())
    assert gluonts_parity.public_architecture_mismatch(plain, est) == {}
    with pytest.raises(ValueError, match="local_history_length"):
        build_estimator("dlinear", freq="M", prediction_length=12, baseline_skip=False,
                        local_history_length=60)
    with pytest.raises(ValueError, match="local forecast methods"):
        BaselineSkipDLinearModel(prediction_length=H, context_length=CTX, hidden_dimension=4,
                                 history_methods=("arima",))


def test_a_zero_shot_mixture_fits_the_local_forecasts_once(monkeypatch):
    """The public network of the mixture forecasts the same inputs as the fine-tuned one: the
    local forecasts are fitted once per batch, and the forecasts are those of two fits."""
    from gluonts.dataset.common import ListDataset

    from opacus_structured.forecasting.zero_shot_mixture import zero_shot_mixture_predictor

    prepared = prepare_estimator("dlinear", freq="M", prediction_length=H, context_length=CTX,
                                 skip_features=LOCAL_FEATURES, skip_init=(0.2,) * 5,
                                 skip_scale=1.0, local_history_length=30,
                                 history_methods=("ets",))
    public = {k: v.clone() for k, v in prepared.module.model.state_dict().items()}
    with torch.no_grad():
        prepared.module.model.baseline_skip.weight.mul_(1.5)
    mixture = zero_shot_mixture_predictor(prepared.create_predictor(), public, 0.5)
    data = ListDataset([{"start": "2000-01", "target": _series(n, M, n).tolist()}
                        for n in (20, 50)], freq="M")
    calls = []
    fit = baseline_skip.local_forecasts_with_history
    monkeypatch.setattr(baseline_skip, "local_forecasts_with_history",
                        lambda *a, **k: calls.append(1) or fit(*a, **k))
    torch.manual_seed(0)
    memo = [f.samples for f in mixture.predict(data)]
    assert len(calls) == 1
    monkeypatch.setattr(baseline_skip, "_LAST_PREDICTION", _NoMemo())
    torch.manual_seed(0)
    fresh = [f.samples for f in mixture.predict(data)]
    assert len(calls) == 3
    for a, b in zip(memo, fresh, strict=True):
        np.testing.assert_array_equal(a, b)


class _NoMemo(dict):
    """A memo that never keeps an entry."""

    def update(self, *args, **kwargs):
        return None


def test_private_inputs_compose_with_the_history():
    """Inference privacy (private_inference.py) protects every step of the input series it
    releases; the predictor reads up to ``local_history_length`` of those released steps
    (post-processing), so privatize_panel's whole-history release feeds it as it is."""
    from opacus_structured.forecasting.data import Panel
    from opacus_structured.forecasting.private_inference import privatize_panel

    prepared = prepare_estimator("dlinear", freq="M", prediction_length=H, context_length=CTX,
                                 skip_features=LOCAL_FEATURES, skip_init=(0.2,) * 5,
                                 skip_scale=1.0, local_history_length=30,
                                 history_methods=("ets",))
    panel = Panel(tuple(np.asarray(_series(n, M, n), np.float32) for n in (40, 60)),
                  (pd.Period("2000-01", "M"),) * 2, ("a", "b"), "M")
    released, reports = privatize_panel(panel, H, subsampling_rate=0.5, sensitivity=0.1,
                                        delta=1e-6, epsilon=2.0, seed=0)
    assert all(r.series_length >= 30 for r in reports)  # every step the model reads
    forecasts = list(prepared.create_predictor().predict(released.to_gluonts()))
    assert all(np.isfinite(f.mean).all() for f in forecasts)
