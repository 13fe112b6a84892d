"""Baselines for the privacy–utility report: seasonal naive (no training, so no privacy cost
from training) and the same model trained without DP (ε = ∞, via
:func:`~opacus_structured.forecasting.training.train_forecaster` with ``epsilon=None``).

Seasonal naive forecasts ``ŷ_{t+h} = y_{t+h−m·k}`` with the smallest ``k`` such that the value
is in the past (``m`` = season length, 12 for monthly data); it is a point forecast, so all
its quantiles coincide (as in the paper's tables). Note that, like any forecast, it reads the
test series' own history at prediction time (inference is not covered by training DP).
"""

from __future__ import annotations

from .._validation import check_int
from .seasonality import season_length as default_season_length

__all__ = ["seasonal_naive_predictor"]


def seasonal_naive_predictor(prediction_length: int, freq: str, season_length: int | None = None):
    """gluonts ``SeasonalNaivePredictor`` (season from ``freq`` unless given: see
    :func:`~opacus_structured.forecasting.seasonality.season_length`)."""
    from gluonts.model.seasonal_naive import SeasonalNaivePredictor

    h = check_int("prediction_length", prediction_length, minimum=1)
    if season_length is None:
        season_length = default_season_length(freq)
    season_length = check_int("season_length", season_length, minimum=1)
    return SeasonalNaivePredictor(prediction_length=h, season_length=season_length)
