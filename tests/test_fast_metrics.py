"""``fast_metrics.score_forecasts`` against gluonts' ``Evaluator`` (issue 41).

The reference is gluonts' own ``Evaluator(quantiles, seasonality, num_workers=0)`` run on the
same forecast and series objects; each of the four aggregate numbers must agree to a relative
difference of 1e-9 (NaN with NaN, ``inf`` with ``inf``). Panels: mixed lengths, horizons,
sample counts, dtypes and frequencies (monthly and weekly, seasonality 12 and 52, short series
that fall back to lag 1); constant series; NaN and inf in the past and in the target; forecast
starts inside the series; a PeriodIndex with a gap (gluonts' label extraction); the package's
seasonal-naive predictor and the shipped DLinear weights (zero-shot) through
``make_evaluation_predictions``; ETS ``QuantileForecast`` s and torch ``DistributionForecast`` s.
One small case is also checked by hand.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("gluonts")

from gluonts.evaluation import Evaluator, make_evaluation_predictions  # noqa: E402
from gluonts.model.forecast import QuantileForecast, SampleForecast  # noqa: E402

from opacus_structured.forecasting.fast_metrics import score_forecasts  # noqa: E402
from opacus_structured.forecasting.metrics import QUANTILES  # noqa: E402
from opacus_structured.forecasting.warning_filters import (  # noqa: E402
    known_harmless_warnings_filtered,
)

KEYS = ("mean_wQuantileLoss", "MASE", "MSE", "ND")


def reference(forecasts, series, quantiles=QUANTILES, season_length=None) -> dict:
    """gluonts' Evaluator aggregate (the independent reference; its masked-array and
    division warnings silenced)."""
    with known_harmless_warnings_filtered(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.filterwarnings("ignore", "Warning: converting a masked element to nan",
                                UserWarning)
        evaluator = Evaluator(quantiles=list(quantiles), num_workers=0,
                              seasonality=season_length)
        agg, _ = evaluator(iter(series), iter(forecasts), num_series=len(series))
    return {key: float(agg[key]) for key in KEYS}


def assert_parity(forecasts, series, quantiles=QUANTILES, season_length=None) -> dict:
    ref = reference(forecasts, series, quantiles, season_length)
    got = score_forecasts(forecasts, series, quantiles, season_length)
    assert set(got) == set(KEYS)
    for key in KEYS:
        assert isinstance(got[key], float)
        assert got[key] == pytest.approx(ref[key], rel=1e-9, abs=0.0, nan_ok=True), \
            (key, got[key], ref[key])
    return ref


def frame(values, start: str, freq: str) -> pd.DataFrame:
    """A series as ``make_evaluation_predictions`` yields it: a one-column DataFrame on a
    PeriodIndex."""
    index = pd.period_range(pd.Period(start, freq), periods=len(values), freq=freq)
    return pd.DataFrame(np.asarray(values), index=index)


def sample_forecast(rng, truth, h, num_samples, *, offset=0, dtype=np.float32, scale=0.1):
    """Samples around the truth's last ``h`` steps (``offset`` steps before the end)."""
    end = len(truth) - offset
    base = truth.to_numpy()[end - h:end, 0].astype(np.float64)
    spread = scale * (np.abs(base).mean() + 1e-3)
    samples = base * (1 + 0.1 * rng.normal()) + spread * rng.standard_normal((num_samples, h))
    return SampleForecast(samples.astype(dtype), start_date=truth.index[end - h])


def seasonal(rng, length, period, dtype=np.float32):
    """Level 10^U(-1, 4), a seasonal swing and heavy-tailed noise: float32 sums of such
    values round, so the parity checks see the dtypes of every operation."""
    t = np.arange(length)
    level = 10 ** rng.uniform(-1, 4)
    return (level * (5 + np.sin(2 * np.pi * t / period) + 0.3 * rng.standard_t(3, length))
            ).astype(dtype)


def mixed_panel(seed=0):
    """20 series: monthly and weekly, lengths 5..300, horizons 6 and 12, 1/50/100 samples,
    float32 and float64, some forecasts ending before the series does."""
    rng = np.random.default_rng(seed)
    forecasts, series = [], []
    for i in range(20):
        monthly = i % 2 == 0
        freq, period = ("M", 12) if monthly else ("W", 52)
        # short series trigger gluonts' lag -> 1 (past length <= seasonality)
        length = [5 + 12, 20, 40, 60, 120, 300][i % 6] + (0 if monthly else 30 * (i % 3))
        h = 12 if i % 3 else 6
        dtype = np.float64 if i % 7 == 3 else np.float32
        truth = frame(seasonal(rng, length, period, dtype), "2001-03-04", freq)
        offset = 3 if i % 5 == 4 else 0
        num_samples = (100, 50, 1)[i % 3]
        forecasts.append(sample_forecast(rng, truth, h, num_samples, offset=offset,
                                         dtype=dtype, scale=0.3))
        series.append(truth)
    return forecasts, series


@pytest.mark.parametrize("season_length", [None, 12, 52, 1])
def test_mixed_panel_matches_gluonts(season_length):
    forecasts, series = mixed_panel()
    ref = assert_parity(forecasts, series, season_length=season_length)
    assert all(math.isfinite(v) and v > 0 for v in ref.values())


def test_other_quantile_sets_match_gluonts():
    forecasts, series = mixed_panel(seed=1)
    assert_parity(forecasts, series, quantiles=(0.05, 0.5, 0.95), season_length=12)
    assert_parity(forecasts, series, quantiles=("p10", "0.9"), season_length=12)
    assert_parity(forecasts, series, quantiles=(0.25,), season_length=12)  # no median level


def test_single_series_and_many_samples():
    rng = np.random.default_rng(2)
    truth = frame(seasonal(rng, 80, 12), "2010-01", "M")
    assert_parity([sample_forecast(rng, truth, 12, 1000)], [truth], season_length=12)


# Metric parity with gluonts at the main job's shape (no privacy bound; smaller panels stay).
@pytest.mark.slow  # 2 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_bundled_panel_shape_matches_gluonts():
    """The main job's shape: 148 monthly series, 100 samples, horizon 12."""
    rng = np.random.default_rng(3)
    forecasts, series = [], []
    for _ in range(148):
        truth = frame(seasonal(rng, int(rng.integers(225, 600)), 12), "1939-01", "M")
        forecasts.append(sample_forecast(rng, truth, 12, 100))
        series.append(truth)
    ref = assert_parity(forecasts, series, season_length=12)
    assert 0 < ref["ND"] < 1


def test_constant_series_gives_inf_mase_like_gluonts():
    """A constant past has seasonal error 0: that series' MASE is inf (mean |error| / 0), so
    the aggregate MASE is inf in gluonts and here; ND, MSE and the quantile loss stay finite."""
    rng = np.random.default_rng(4)
    forecasts, series = mixed_panel(seed=4)
    const = frame(np.full(40, 7.0, dtype=np.float32), "2005-01", "M")
    forecasts.append(sample_forecast(rng, const, 12, 100))
    series.append(const)
    ref = assert_parity(forecasts, series, season_length=12)
    assert ref["MASE"] == math.inf
    assert all(math.isfinite(ref[k]) for k in ("mean_wQuantileLoss", "MSE", "ND"))


def test_constant_series_forecast_exactly_is_left_out_of_mase():
    """Constant past and an exact forecast: MASE 0/0 = NaN for that series, which the
    aggregate mean skips (gluonts' aggregate_no_nan)."""
    rng = np.random.default_rng(5)
    forecasts, series = mixed_panel(seed=5)
    const = frame(np.full(40, 7.0, dtype=np.float32), "2005-01", "M")
    forecasts.append(SampleForecast(np.full((100, 12), 7.0, dtype=np.float32),
                                    start_date=const.index[-12]))
    series.append(const)
    ref = assert_parity(forecasts, series, season_length=12)
    without = reference(forecasts[:-1], series[:-1], season_length=12)
    assert math.isfinite(ref["MASE"]) and ref["MASE"] == pytest.approx(without["MASE"])
    only = assert_parity(forecasts[-1:], series[-1:], season_length=12)
    assert math.isnan(only["MASE"]) and only["ND"] == 0.0 and only["MSE"] == 0.0
    del rng


def test_nan_and_inf_in_past_and_target_match_gluonts():
    rng = np.random.default_rng(6)
    forecasts, series = mixed_panel(seed=6)
    for j, truth in enumerate(series[:8]):
        values = truth.to_numpy()[:, 0].copy()
        n = len(values)
        h = forecasts[j].prediction_length
        if j % 4 == 0:
            values[rng.choice(n - h, size=3, replace=False)] = np.nan  # past
        elif j % 4 == 1:
            values[n - h + 1] = np.nan  # target
            values[0] = np.inf
        elif j % 4 == 2:
            values[: n - h] = np.nan  # whole past: seasonal error NaN, MASE NaN
        else:
            values[n - h - 3:] = np.nan  # whole target of a forecast at the end
        series[j] = pd.DataFrame(values, index=truth.index)
    assert_parity(forecasts, series, season_length=12)
    assert_parity(forecasts, series, season_length=None)


def test_all_targets_nan_gives_nan_like_gluonts():
    truth = frame(np.r_[np.arange(30.0), np.full(12, np.nan)].astype(np.float32), "2000-01",
                  "M")
    fc = SampleForecast(np.ones((10, 12), dtype=np.float32), start_date=truth.index[-12])
    ref = assert_parity([fc], [truth], season_length=12)
    assert all(math.isnan(ref[k]) for k in KEYS)


def test_series_objects_and_index_gaps():
    """A pandas Series (not a frame), and a PeriodIndex with a missing month (read by labels,
    as gluonts does)."""
    rng = np.random.default_rng(7)
    forecasts, series = mixed_panel(seed=7)
    series = [s.iloc[:, 0] if j % 2 else s for j, s in enumerate(series)]
    gap = series[0].drop(series[0].index[3])
    series[0] = gap
    assert_parity(forecasts, series, season_length=12)
    assert_parity(forecasts, series, season_length=None)
    del rng


def test_hand_computed_values():
    """One series, one sample path (all quantiles equal the path): the formulas by hand."""
    y = np.array([1.0, 2.0, 4.0, 3.0, 5.0, 6.0], dtype=np.float32)  # past 1,2,4,3; target 5,6
    truth = frame(y, "2000-01", "M")
    path = np.array([[4.0, 8.0]], dtype=np.float32)
    fc = SampleForecast(path, start_date=truth.index[4])
    got = score_forecasts([fc], [truth], quantiles=(0.1, 0.5, 0.9), season_length=2)
    # seasonal error, lag 2 < 4: |1-4|, |2-3| -> 2; |5-4| + |6-8| = 3
    assert got["MASE"] == pytest.approx((3 / 2) / 2.0, rel=1e-12)
    assert got["MSE"] == pytest.approx((1 + 4) / 2, rel=1e-12)
    assert got["ND"] == pytest.approx(3 / 11, rel=1e-12)
    # QL_q = 2 (|(4-5)(0-q)| + |(8-6)(1-q)|) = 2 (q + 2 (1 - q)) = 2 (2 - q)
    wql = [2 * (2 - q) / 11 for q in (0.1, 0.5, 0.9)]
    assert got["mean_wQuantileLoss"] == pytest.approx(np.mean(wql), rel=1e-7)
    # a lag not below the past's length falls back to 1: mean(1, 2, 1) = 4/3
    got = score_forecasts([fc], [truth], quantiles=(0.5,), season_length=4)
    assert got["MASE"] == pytest.approx(1.5 / (4 / 3), rel=1e-7)
    assert_parity([fc], [truth], quantiles=(0.1, 0.5, 0.9), season_length=2)
    assert_parity([fc], [truth], quantiles=(0.5,), season_length=4)


def test_seasonal_naive_predictor_through_make_evaluation_predictions():
    from opacus_structured.forecasting.baselines import seasonal_naive_predictor
    from opacus_structured.forecasting.data import Panel

    rng = np.random.default_rng(8)
    lengths = [40, 60, 90, 30, 120, 75]
    panel = Panel(tuple(seasonal(rng, n, 12) for n in lengths),
                  tuple(pd.Period("2001-01", "M") + i for i in range(len(lengths))),
                  tuple(f"s{i}" for i in range(len(lengths))), "M")
    with known_harmless_warnings_filtered():
        predictor = seasonal_naive_predictor(12, "M")
        f_it, ts_it = make_evaluation_predictions(panel.to_gluonts(), predictor,
                                                  num_samples=100)
        forecasts, series = list(f_it), list(ts_it)
    assert isinstance(forecasts[0], SampleForecast)
    ref = assert_parity(forecasts, series, season_length=12)
    assert_parity(forecasts, series, season_length=None)
    assert math.isfinite(ref["MASE"]) and ref["MASE"] > 0


def test_quantile_forecasts_from_ets():
    pytest.importorskip("statsmodels")
    from opacus_structured.forecasting.data import Panel, train_test_split
    from opacus_structured.forecasting.ets import ets_forecasts

    rng = np.random.default_rng(9)
    panel = Panel(tuple(seasonal(rng, n, 12) for n in (48, 60, 36)),
                  (pd.Period("2001-01", "M"),) * 3, ("a", "b", "c"), "M")
    train, test = train_test_split(panel, 12)
    with known_harmless_warnings_filtered():
        forecasts, _ = ets_forecasts(train, 12, 12)
    assert isinstance(forecasts[0], QuantileForecast)
    series = [frame(t, "2001-01", "M") for t in test.targets]
    assert_parity(forecasts, series, season_length=12)
    # levels between the stored ones: gluonts' interpolation / tail approximation
    assert_parity(forecasts, series, quantiles=(0.05, 0.15, 0.5, 0.95), season_length=12)


def test_quantile_forecast_without_mean_and_distribution_forecasts():
    torch = pytest.importorskip("torch")
    from gluonts.torch.model.forecast import DistributionForecast

    rng = np.random.default_rng(10)
    forecasts, series = [], []
    for i in range(5):
        truth = frame(seasonal(rng, 50 + 5 * i, 12), "2001-01", "M")
        last = torch.tensor(truth.to_numpy()[-12:, 0])
        start = truth.index[-12]
        if i % 2:
            dist = torch.distributions.Normal(last + 1.0, torch.full((12,), 2.0))
            forecasts.append(DistributionForecast(dist, start_date=start))
        else:  # quantiles only: gluonts' mean falls back to the median
            arrays = np.stack([last.numpy() + d for d in (-2.0, 0.0, 2.0)]).astype(np.float32)
            forecasts.append(QuantileForecast(arrays, start_date=start,
                                              forecast_keys=["0.1", "0.5", "0.9"]))
        series.append(truth)
    assert_parity(forecasts, series, season_length=12)


def test_student_t_distribution_forecasts_in_one_scipy_call():
    """DLinear's output (gluonts' StudentT under an affine scale; here one scipy call for all
    series and levels), a bare StudentT, and a negative scale (the icdf flips the levels)."""
    torch = pytest.importorskip("torch")
    from gluonts.torch.distributions import StudentTOutput
    from gluonts.torch.distributions.affine_transformed import AffineTransformed
    from gluonts.torch.distributions.studentT import StudentT
    from gluonts.torch.model.forecast import DistributionForecast

    from opacus_structured.forecasting.fast_metrics import (
        _student_t_chain,
        _student_t_quantiles,
    )

    rng = np.random.default_rng(13)
    forecasts, series = [], []
    for i in range(9):
        truth = frame(seasonal(rng, 40 + 7 * i, 12), "2001-01", "M")
        last = torch.tensor(truth.to_numpy()[-12:, 0])
        scale = last.abs().mean() + 1e-3
        df = torch.full((12,), 2.0 + i)
        sd = torch.full((12,), 0.1 + 0.05 * i)
        if i % 3 == 0:
            distr = StudentTOutput().distribution((df, last / scale, sd),
                                                  scale=scale.expand(12))
        elif i % 3 == 1:
            distr = StudentT(df, last, sd * scale)
        else:
            distr = AffineTransformed(StudentT(df, -last / scale, sd), loc=torch.zeros(12),
                                      scale=-scale.expand(12))
        forecasts.append(DistributionForecast(distr, start_date=truth.index[-12]))
        series.append(truth)
    chains = [_student_t_chain(f) for f in forecasts]
    assert all(c is not None for c in chains)
    tables = _student_t_quantiles(forecasts, range(len(forecasts)), chains, [0.1, 0.5, 0.93])
    for i, fc in enumerate(forecasts):  # bit for bit, every series and level
        assert tables[i].shape == (3, 12)
        for k, q in enumerate((0.1, 0.5, 0.93)):
            np.testing.assert_array_equal(tables[i][k], fc.quantile(q))
    assert_parity(forecasts, series, season_length=12)
    assert_parity(forecasts, series, quantiles=(0.05, 0.5, 0.95), season_length=None)


def test_nan_forecast_raises_like_gluonts():
    forecasts, series = mixed_panel(seed=11)
    samples = forecasts[1].samples.copy()
    assert samples.shape[0] == 50
    samples[3, 1] = np.nan
    forecasts[1] = SampleForecast(samples, start_date=forecasts[1].start_date)
    with pytest.raises(ValueError, match="Forecast contains NaN values"):
        reference(forecasts, series, season_length=12)
    with pytest.raises(ValueError, match="Forecast contains NaN values"):
        score_forecasts(forecasts, series, QUANTILES, 12)


def test_bad_inputs_raise():
    forecasts, series = mixed_panel(seed=12)
    with pytest.raises(ValueError, match="one forecast per series"):
        score_forecasts(forecasts, series[:-1])
    with pytest.raises(ValueError, match="one forecast per series"):
        score_forecasts([], [])
    late = SampleForecast(forecasts[0].samples, start_date=series[0].index[-1])
    with pytest.raises(AssertionError):  # gluonts: forecast index outside the series
        reference([late], series[:1], season_length=12)
    with pytest.raises(ValueError, match="outside"):
        score_forecasts([late], series[:1], season_length=12)
    with pytest.raises(ValueError, match="season_length"):
        score_forecasts(forecasts, series, season_length=-1)


@pytest.mark.slow
def test_shipped_dlinear_zero_shot_predictor():
    """A real predictor: the shipped DLinear weights, zero-shot, on 12 bundled series (its
    forecasts are scaled Student t ``DistributionForecast`` s, the job's zero-shot row)."""
    pytest.importorskip("torch")
    from gluonts.torch.model.forecast import DistributionForecast

    from opacus_structured.forecasting.data import load_us_employment
    from opacus_structured.forecasting.pretraining import pretrained_weights, zero_shot_predictor

    state, meta = pretrained_weights("dlinear", freq="M", prediction_length=12)
    if meta.get("source") != "shipped":  # pragma: no cover - the wheel ships them
        pytest.skip("no shipped DLinear weights for monthly data: would pretrain")
    panel = load_us_employment().subset(range(0, 148, 12))
    with known_harmless_warnings_filtered():
        predictor = zero_shot_predictor("dlinear", state, freq="M", prediction_length=12)
        f_it, ts_it = make_evaluation_predictions(panel.to_gluonts(), predictor,
                                                  num_samples=100)
        forecasts, series = list(f_it), list(ts_it)
    assert isinstance(forecasts[0], DistributionForecast)
    ref = assert_parity(forecasts, series, season_length=12)
    assert 0 < ref["mean_wQuantileLoss"] < 0.1 and 0 < ref["MASE"] < 5


def test_per_series_items_match_gluonts_frame():
    """``return_items=True``: the evaluator's per-series columns, series by series (what the
    job's MASE over series with a nonzero scale is computed from)."""
    rng = np.random.default_rng(14)
    forecasts, series = mixed_panel(seed=14)
    const = frame(np.full(40, 7.0, dtype=np.float32), "2005-01", "M")
    forecasts.append(sample_forecast(rng, const, 12, 100))
    series.append(const)
    values = series[3].to_numpy()[:, 0].copy()
    values[-2] = np.nan
    series[3] = pd.DataFrame(values, index=series[3].index)
    quantiles = (0.1, 0.5, 0.9)
    with known_harmless_warnings_filtered(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agg, frame_ = Evaluator(quantiles=list(quantiles), num_workers=0, seasonality=12)(
            iter(series), iter(forecasts), num_series=len(series))
    got, items = score_forecasts(forecasts, series, quantiles, 12, return_items=True)
    assert got == score_forecasts(forecasts, series, quantiles, 12)
    assert set(items) == {"MASE", "seasonal_error", "MSE", "abs_error", "abs_target_sum",
                          "QuantileLoss[0.1]", "QuantileLoss[0.5]", "QuantileLoss[0.9]"}
    for key, column in items.items():
        assert column.dtype == np.float64 and column.shape == (len(series),)
        np.testing.assert_allclose(column, frame_[key].to_numpy(dtype=float), rtol=1e-9,
                                   atol=0, equal_nan=True, err_msg=key)
    assert items["seasonal_error"][-1] == 0 and items["MASE"][-1] == math.inf
    scaled = items["seasonal_error"] > 0  # the job's MASE: series with a nonzero scale
    expected = frame_["MASE"].to_numpy(dtype=float)[
        frame_["seasonal_error"].to_numpy(dtype=float) > 0].mean()
    assert items["MASE"][scaled].mean() == pytest.approx(expected, rel=1e-9)
