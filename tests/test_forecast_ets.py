"""The non-private statsmodels ETS reference row (issue 30, item 3).

Independent checks: a pure seasonal series whose pattern ETS must recover; the Gaussian
quantiles against statsmodels' own prediction intervals (``summary_frame``, another code path);
the CRPS (mean weighted quantile loss) and MASE against a hand computation in numpy; the
fallbacks against their closed forms; the command's row, its label and its absence without
statsmodels (one notice, no traceback).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

pytest.importorskip("gluonts")

from conftest import TEST_DISCRETIZATION  # noqa: E402

from opacus_structured.cli import main  # noqa: E402
from opacus_structured.forecasting.data import Panel, train_test_split  # noqa: E402
from opacus_structured.forecasting.ets import (  # noqa: E402
    ETS_LABEL,
    ets_series_forecast,
    ets_specs_for,
)
from opacus_structured.forecasting.metrics import QUANTILES  # noqa: E402

PATTERN = np.array([5.0, 7, 9, 12, 15, 14, 11, 8, 6, 4, 3, 4])


def test_specs_follow_the_documented_rule():
    assert [s[0] for s in ets_specs_for(120, 12)] == ["ETS(A,Ad,A) m=12", "ETS(A,Ad,N)",
                                                      "ETS(A,N,N)"]
    assert [s[0] for s in ets_specs_for(23, 12)] == ["ETS(A,Ad,N)", "ETS(A,N,N)"]  # < 2m
    assert [s[0] for s in ets_specs_for(13, 4)] == ["ETS(A,Ad,N)", "ETS(A,N,N)"]  # < m + 10
    assert [s[0] for s in ets_specs_for(500, 52)][0] == "ETS(A,Ad,N)"  # m > 24: no season
    assert [s[0] for s in ets_specs_for(500, 1)][0] == "ETS(A,Ad,N)"
    assert [s[0] for s in ets_specs_for(5, 4)] == ["ETS(A,N,N)"]
    assert ets_specs_for(3, 4) == []
    with pytest.raises(ValueError, match="season_length"):
        ets_specs_for(10, 0)


def test_pure_seasonal_series_is_recovered():
    pytest.importorskip("statsmodels")
    y = np.tile(PATTERN, 10)
    mean, std, spec = ets_series_forecast(y, 12, 12)
    assert spec == "ETS(A,Ad,A) m=12"
    np.testing.assert_allclose(mean, PATTERN, atol=1e-3)
    assert np.all(std < 1e-3)
    # a noisy copy: the pattern within the noise, the spread of the order of the noise (0.1)
    rng = np.random.default_rng(0)
    mean, std, _ = ets_series_forecast(y + 0.1 * rng.standard_normal(y.size), 12, 12)
    np.testing.assert_allclose(mean, PATTERN, atol=0.3)
    assert np.all((0.05 < std) & (std < 0.3))


def test_gaussian_quantiles_match_statsmodels_intervals():
    """The 10 % and 90 % quantiles are statsmodels' own 80 % prediction interval, read through
    ``summary_frame`` (scaled data, as the module fits)."""
    pytest.importorskip("statsmodels")
    import pandas as pd
    from statsmodels.tsa.exponential_smoothing.ets import ETSModel

    rng = np.random.default_rng(1)
    y = 50 + np.tile(PATTERN, 8) + np.cumsum(rng.normal(0, 0.5, 96))
    mean, std, spec = ets_series_forecast(y, 6, 12)
    assert spec == "ETS(A,Ad,A) m=12"
    scale = np.mean(np.abs(y))
    res = ETSModel(pd.Series(y / scale), error="add", trend="add", damped_trend=True,
                   seasonal="add", seasonal_periods=12,
                   initialization_method="heuristic").fit(disp=False)
    frame = res.get_prediction(start=96, end=101).summary_frame(alpha=0.2)
    z = 1.2815515655446004  # Φ^{-1}(0.9)
    np.testing.assert_allclose(mean - z * std, frame["pi_lower"].to_numpy() * scale, rtol=1e-6)
    np.testing.assert_allclose(mean + z * std, frame["pi_upper"].to_numpy() * scale, rtol=1e-6)


def test_fallbacks_have_their_closed_forms():
    mean, std, spec = ets_series_forecast([3.0, 3.0, 3.0, 3.0, 3.0], 4, 12)
    assert spec == "constant" and np.all(mean == 3.0) and np.all(std == 0.0)
    y = np.array([1.0, 4.0, 2.0])  # too short for any ETS spec: naive, random-walk spread
    mean, std, spec = ets_series_forecast(y, 3, 12)
    assert spec == "naive (fallback: only 3 training steps)"
    sigma = np.sqrt(((3 - 0.5) ** 2 + (-2 - 0.5) ** 2) / 1)  # std of diffs [3, -2], ddof=1
    np.testing.assert_allclose(mean, [2.0, 2.0, 2.0])
    np.testing.assert_allclose(std, sigma * np.sqrt([1, 2, 3]))
    with pytest.raises(ValueError, match="finite"):
        ets_series_forecast([1.0, np.nan, 2.0], 2, 1)
    with pytest.raises(ValueError, match="prediction_length"):
        ets_series_forecast([1.0, 2.0], 0, 1)


def _hand_metrics(train_targets, test_targets, h, m, means, stds):
    """mean wQL over QUANTILES (pooled over series and horizons) and MASE (mean over series of
    MAE(median) / mean |y_t - y_{t-m}| over the training part), in numpy."""
    from scipy.stats import norm

    losses = []
    total = sum(np.abs(t[-h:]).sum() for t in test_targets)
    for q in QUANTILES:
        num = 0.0
        for truth, mu, sd in zip(test_targets, means, stds, strict=True):
            pred = mu + norm.ppf(q) * sd
            y = truth[-h:]
            num += np.sum(np.abs((pred - y) * ((y <= pred).astype(float) - q)))
        losses.append(2 * num / total)
    mase = []
    for past, truth, mu in zip(train_targets, test_targets, means, strict=True):
        scale = np.mean(np.abs(past[m:] - past[:-m]))
        mase.append(np.mean(np.abs(truth[-h:] - mu)) / scale)
    return float(np.mean(losses)), float(np.mean(mase))


def _tiny_panel():
    rng = np.random.default_rng(2)
    import pandas as pd

    targets = (np.tile(PATTERN, 6) * 10 + rng.normal(0, 2, 72),
               np.tile(PATTERN[::-1], 5)[:56] + 30 + np.arange(56) * 0.2,
               np.abs(np.cumsum(rng.normal(0, 1, 28))) + 5)  # 22 training steps < 2m
    starts = tuple(pd.Period("2000-01", freq="M") + k for k in (0, 16, 32))
    return Panel(tuple(t.astype(np.float32) for t in targets), starts, ("a", "b", "c"), "M")


def test_ets_reference_metrics_match_a_hand_computation():
    pytest.importorskip("statsmodels")
    from gluonts.evaluation import make_evaluation_predictions  # noqa: F401

    from opacus_structured.forecasting.ets import ets_reference

    h, m = 6, 12
    train, test = train_test_split(_tiny_panel(), h)
    truth = [_series(test, i) for i in range(len(test))]
    ref = ets_reference(train, truth, h, m)
    fits = [ets_series_forecast(t, h, m) for t in train.targets]
    assert [f[2] for f in fits] == ["ETS(A,Ad,A) m=12", "ETS(A,Ad,A) m=12", "ETS(A,Ad,N)"]
    assert ref["models"] == {"ETS(A,Ad,A) m=12": 2, "ETS(A,Ad,N)": 1}
    assert ref["fallbacks"] == [] and ref["private"] is False
    crps, mase = _hand_metrics([np.asarray(t, np.float64) for t in train.targets],
                               [np.asarray(t, np.float64) for t in test.targets], h, m,
                               [f[0] for f in fits], [f[1] for f in fits])
    # float32 forecast arrays inside gluonts: agreement to ~1e-6 relative
    assert ref["crps"] == pytest.approx(crps, rel=1e-5)
    assert ref["mase"] == pytest.approx(mase, rel=1e-5)


def _series(panel, i):
    import pandas as pd

    y = np.asarray(panel.targets[i], dtype=np.float32)
    index = pd.period_range(panel.starts[i], periods=len(y), freq=panel.freq)
    return pd.DataFrame(y, index=index)


def _tiny_csv(tmp_path):
    import pandas as pd

    panel = _tiny_panel()
    frames = [pd.DataFrame({"item_id": item, "timestamp": pd.period_range(
        start, periods=len(y), freq="M").to_timestamp().strftime("%Y-%m-%d"), "target": y})
        for y, start, item in zip(panel.targets, panel.starts, panel.item_ids, strict=True)]
    path = tmp_path / "tiny.csv"
    pd.concat(frames).to_csv(path, index=False)
    return path


def _argv(tmp_path, csv, *extra):
    return ["forecast", "--data", str(csv), "--prediction-length", "6", "--max-steps", "2",
            "--context-length", "8", "--init-from", "none", "--num-samples", "10",
            "--epsilon", "4", "--delta", "1e-5", "--dataset-size", "3", "--discretization", str(TEST_DISCRETIZATION),
            "--output", str(tmp_path / "out"), "--no-plot", "--no-progress", *extra]


@pytest.mark.slow
def test_forecast_command_adds_the_not_private_ets_row(tmp_path, capsys):
    pytest.importorskip("statsmodels")
    from opacus_structured.forecasting.ets import ets_reference

    csv = _tiny_csv(tmp_path)
    assert main(_argv(tmp_path, csv, "--json")) == 0
    rep = json.loads(capsys.readouterr().out)
    ets = rep["baselines"]["ets"]
    assert ets["private"] is False and "WITHOUT any privacy" in ets["note"]
    row = [r for r in rep["rows"] if r["method"] == ETS_LABEL]
    assert len(row) == 1 and "NOT PRIVATE" in row[0]["method"] and row[0]["private"] is False
    train, test = train_test_split(_tiny_panel(), 6)
    direct = ets_reference(train, [_series(test, i) for i in range(3)], 6, 12)
    assert ets["crps"] == pytest.approx(direct["crps"], rel=1e-9)
    assert ets["mase"] == pytest.approx(direct["mase"], rel=1e-9)
    # the table labels the row not private; --no-ets drops it
    assert main(_argv(tmp_path, csv)) == 0
    table = capsys.readouterr().out
    assert f"{ETS_LABEL}" in table and "not private" in table
    assert "WITHOUT any privacy protection" in table
    assert main(_argv(tmp_path, csv, "--json", "--no-ets")) == 0
    rep = json.loads(capsys.readouterr().out)
    assert "ets" not in rep["baselines"]
    assert all(r["method"] != ETS_LABEL for r in rep["rows"])


# A forecast run for the notice printed without an optional dependency (no privacy bound).
@pytest.mark.slow  # 2 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_without_statsmodels_the_row_is_omitted_with_one_notice(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "statsmodels.tsa.exponential_smoothing.ets", None)
    csv = _tiny_csv(tmp_path)
    assert main(_argv(tmp_path, csv, "--json")) == 0
    captured = capsys.readouterr()
    rep = json.loads(captured.out)
    assert "Traceback" not in captured.err
    assert captured.err.count("statsmodels is not installed") == 1
    assert "notice:" in captured.err and "pip install" in captured.err
    assert "statsmodels is not installed" in rep["baselines"]["ets"]["omitted"]
    assert all(r["method"] != ETS_LABEL for r in rep["rows"])
    assert main(_argv(tmp_path, csv)) == 0  # the table form too
    captured = capsys.readouterr()
    assert captured.err.count("statsmodels is not installed") == 1
    assert ETS_LABEL not in captured.out


def test_forked_workers_give_the_same_forecasts_as_one_process():
    """Issue 41, item 6: the series are fitted in forked worker processes where there are CPUs
    for them; each runs the same code, so the forecasts agree with one process (exactly; the
    tolerance only guards the comparison). No wall time is asserted."""
    pytest.importorskip("statsmodels")
    import multiprocessing

    import pandas as pd

    from opacus_structured.forecasting.ets import (
        MAX_WORKERS,
        MIN_SERIES_PER_WORKER,
        ets_forecasts,
        ets_workers,
    )

    if "fork" not in multiprocessing.get_all_start_methods():
        assert ets_workers(100, 4) == 1
        pytest.skip("no fork start method on this platform: one process only")
    rng = np.random.default_rng(3)
    targets = tuple((np.tile(PATTERN, 4) * (1 + k) + rng.normal(0, 1, 48)).astype(np.float32)
                    for k in range(6))
    starts = tuple(pd.Period("2001-01", freq="M") for _ in targets)
    train, _ = train_test_split(Panel(targets, starts, tuple("abcdef"), "M"), 6)
    one, s1 = ets_forecasts(train, 6, 12, workers=1)
    two, s2 = ets_forecasts(train, 6, 12, workers=2)
    assert (s1["workers"], s2["workers"]) == (1, 2) and s1["models"] == s2["models"]
    for a, b in zip(one, two, strict=True):
        np.testing.assert_allclose(a.forecast_array, b.forecast_array, rtol=1e-12, atol=0)
        assert a.start_date == b.start_date and a.item_id == b.item_id
    # the default count: CPUs, at most MAX_WORKERS, at least MIN_SERIES_PER_WORKER series each
    assert ets_workers(MIN_SERIES_PER_WORKER - 1) == 1
    assert 1 <= ets_workers(1000) <= MAX_WORKERS
    assert ets_workers(3, 8) == 3
    with pytest.raises(ValueError, match="workers"):
        ets_workers(10, 0)


def test_without_threadpoolctl_the_reason_names_it(monkeypatch):
    pytest.importorskip("statsmodels")
    from opacus_structured.forecasting.ets import ets_unavailable_reason

    assert ets_unavailable_reason() is None
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)
    reason = ets_unavailable_reason()
    assert reason.startswith("threadpoolctl is not installed") and "threadpoolctl>=3" in reason
