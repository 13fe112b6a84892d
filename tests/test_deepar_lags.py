"""DeepAR's lags follow the season (estimators.deepar_lags): a season that divides 12
(monthly, quarterly, yearly) keeps [1, 2, 3, 12, 13] and its weights, other seasons look one
season back, the weights key names the lags, and the command, the zero-shot row and
pretraining agree on them."""

import json

import pytest

pytest.importorskip("gluonts")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

from opacus_structured.cli import main  # noqa: E402
from opacus_structured.forecasting import pretraining  # noqa: E402
from opacus_structured.forecasting.estimators import (build_estimator, deepar_lags,  # noqa: E402
                                                      prepare_estimator)

TINY = pretraining.PretrainRecipe(num_series=8, min_length=80, max_length=100, steps=2,
                                  batch_size=4)


MONTHLY = [1, 2, 3, 12, 13]


@pytest.mark.parametrize("season,lags", [(12, MONTHLY), (6, MONTHLY), (4, MONTHLY),
                                         (3, MONTHLY), (2, MONTHLY), (1, MONTHLY),
                                         (24, [1, 2, 3, 24, 25]), (7, [1, 2, 3, 7, 8]),
                                         (5, [1, 2, 3, 5, 6]), (52, [1, 2, 3, 52, 53]),
                                         (8, [1, 2, 3, 8, 9])])
def test_lags_are_the_last_three_steps_and_one_season_back(season, lags):
    assert deepar_lags(season) == lags


def test_bad_season_is_refused():
    with pytest.raises(ValueError, match="season_length"):
        deepar_lags(0)


@pytest.mark.parametrize("freq,season,lags", [("M", None, [1, 2, 3, 12, 13]),
                                              ("h", None, [1, 2, 3, 24, 25]),
                                              ("Q", None, MONTHLY),
                                              ("W", None, [1, 2, 3, 52, 53]),
                                              ("D", 14, [1, 2, 3, 14, 15])])
def test_estimator_and_model_window_follow_the_season(freq, season, lags):
    kw = {} if season is None else {"season_length": season}
    est = build_estimator("deepar", freq=freq, prediction_length=4, **kw)
    assert list(est.lags_seq) == [k - 1 for k in lags] or list(est.lags_seq) == lags
    prepared = prepare_estimator("deepar", freq=freq, prediction_length=4, **kw)
    # gluonts: past_length = context (2·L_F) + largest lag - 1
    assert prepared.past_length == 8 + max(lags) - 1


def test_weights_key_names_lags_other_than_monthly():
    assert pretraining.weights_key("deepar", freq="M", prediction_length=12) == \
        "deepar-M-h12-c24-aaba26b5c3"  # the shipped file: unchanged
    assert pretraining.shipped_weights_path("deepar-M-h12-c24-aaba26b5c3") is not None
    assert "-l1_2_3_24_25-" in pretraining.weights_key("deepar", freq="h", prediction_length=24)
    assert "-s14-l1_2_3_14_15-" in pretraining.weights_key("deepar", freq="D",
                                                           prediction_length=7,
                                                           season_length=14)
    assert "-l" not in pretraining.weights_key("dlinear", freq="h", prediction_length=24)
    for freq in ("Q", "Y"):  # seasons that divide 12: the lags and keys of before
        assert "-l" not in pretraining.weights_key("deepar", freq=freq, prediction_length=4)


def test_pretrained_weights_carry_their_lags_and_fit_the_zero_shot_model(monkeypatch,
                                                                        tmp_path):
    monkeypatch.setenv("OPACUS_STRUCTURED_CACHE", str(tmp_path))
    monkeypatch.setitem(pretraining.PRETRAIN_RECIPE, "deepar", TINY)
    state, meta = pretraining.pretrained_weights("deepar", freq="B", prediction_length=4)
    assert meta["lags_seq"] == [1, 2, 3, 5, 6] and "-l1_2_3_5_6-" in meta["key"]
    assert pretraining.zero_shot_predictor("deepar", state, freq="B", prediction_length=4)
    _, quarterly = pretraining.pretrained_weights("deepar", freq="Q", prediction_length=4)
    assert quarterly["lags_seq"] == MONTHLY and "-l" not in quarterly["key"]
    state14, meta14 = pretraining.pretrained_weights("deepar", freq="D", prediction_length=4,
                                                     season_length=14)
    assert meta14["lags_seq"] == [1, 2, 3, 14, 15]
    assert pretraining.zero_shot_predictor("deepar", state14, freq="D", prediction_length=4,
                                           season_length=14)


@pytest.mark.slow
def test_forecast_command_runs_deepar_with_seasonal_lags(monkeypatch, tmp_path, capsys):
    import numpy as np
    import pandas as pd

    monkeypatch.setenv("OPACUS_STRUCTURED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(pretraining.PRETRAIN_RECIPE, "deepar", TINY)
    rng = np.random.default_rng(0)
    idx = pd.date_range("2020-01-01", periods=120, freq="D")
    frame = pd.DataFrame({f"s{i}": 10 + np.sin(np.arange(120) * 2 * np.pi / 7)
                          + rng.normal(0, 0.1, 120) for i in range(6)}, index=idx)
    frame.index.name = "timestamp"
    frame.to_csv(tmp_path / "d.csv")
    assert main(["forecast", "--model", "deepar", "--data", str(tmp_path / "d.csv"),
                 "--prediction-length", "7", "--max-steps", "2", "--dataset-size", "6",
                 "--seed", "0", "--no-ets", "--no-plot", "--json", "--no-progress",
                 "--output", str(tmp_path / "out")]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert "-l1_2_3_7_8-" in rep["pretrained"]["key"]
    assert rep["baselines"]["zero_shot"]["crps"] > 0
