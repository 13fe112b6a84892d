"""The structured-subsampling scheme of a forecaster's training run and its step budget (split
out of :mod:`opacus_structured.forecasting.training`, which re-exports these names).

:func:`make_scheme` builds the scheme the accountant prices from the panel and the model's input
window; :func:`check_window_matches_scheme` refuses a scheme whose window differs from the
model's; :func:`max_steps_within_budget` and :func:`_epochs_to_steps` turn a budget into steps.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

from .._validation import check_int, check_positive
from ..schemes.structured import StructuredScheme
from .data import Panel
from .estimators import PreparedModel

__all__ = ["make_scheme", "check_window_matches_scheme", "max_steps_within_budget"]


# ---- scheme / window consistency -------------------------------------------------------------
def make_scheme(train: Panel, prepared: PreparedModel, batch_size: int, *,
                num_series: Optional[int] = None, **kwargs):
    """The structured-subsampling scheme of a training run (λ = 1, WOR top unless ``kwargs``
    say otherwise (``top_level``), WR bottom, 1-event).

    ``L`` is the shortest training series, ``L_C`` the model's ``past_length`` (lags
    included), ``L_F`` its prediction length; ``N`` is ``num_series`` (a declared public
    number of series, at most the panel's) or the panel's own.
    """
    batch_size = check_int("batch_size", batch_size, minimum=1)
    n = len(train) if num_series is None else check_int("dataset_size", num_series, minimum=1)
    if batch_size > n:
        raise ValueError(f"batch_size={batch_size} exceeds the number of training series "
                         f"({n}): each step draws batch_size distinct series")
    if train.min_length < prepared.prediction_length:
        raise ValueError(f"the shortest training series ({train.min_length}) is shorter than "
                         f"the prediction length ({prepared.prediction_length})")
    return StructuredScheme(
        num_series=n, series_length=train.min_length,
        context_length=prepared.past_length, forecast_length=prepared.prediction_length,
        batch_size=batch_size, **kwargs)


def check_window_matches_scheme(scheme, prepared: PreparedModel, train: Panel) -> None:
    """Raise ValueError unless the model input window is the one the accountant prices.

    The model reads ``past_length`` context steps (DeepAR: ``context_length`` plus the
    largest lag) and ``prediction_length`` forecast steps; the scheme must have the same
    ``L_C``/``L_F``, ``N`` = number of training series and ``L`` <= every series length.
    """
    if int(scheme.context_length) != prepared.past_length:
        raise ValueError(
            f"the model reads {prepared.past_length} past steps (context_length plus lags) but "
            f"the scheme's context_length is {scheme.context_length}: build the scheme with "
            f"context_length={prepared.past_length}")
    if int(scheme.forecast_length) != prepared.prediction_length:
        raise ValueError(f"the model forecasts {prepared.prediction_length} steps but the "
                         f"scheme's forecast_length is {scheme.forecast_length}")
    if int(scheme.num_series) != len(train):
        raise ValueError(f"the scheme has num_series={scheme.num_series} but the training "
                         f"panel has {len(train)} series")
    if int(scheme.series_length) > train.min_length:
        raise ValueError(f"the scheme's series_length={scheme.series_length} exceeds the "
                         f"shortest training series ({train.min_length}): the accountant "
                         f"must use the shortest length")


def max_steps_within_budget(epsilon_of_steps: Callable[[int], float], target_epsilon: float,
                            max_steps: int) -> int:
    """Largest ``n <= max_steps`` with ``epsilon_of_steps(n) <= target_epsilon`` (ε is
    non-decreasing in the number of steps); bisection, ~log2(max_steps) evaluations."""
    target_epsilon = check_positive("target_epsilon", target_epsilon)
    max_steps = check_int("max_steps", max_steps, minimum=0)
    if max_steps == 0 or epsilon_of_steps(max_steps) <= target_epsilon:
        return max_steps
    lo, hi = 0, max_steps  # eps(lo) <= target < eps(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if epsilon_of_steps(mid) <= target_epsilon:
            lo = mid
        else:
            hi = mid
    return lo


def _epochs_to_steps(epochs: float, steps_per_epoch: int) -> int:
    """``ceil(epochs × steps_per_epoch)``, products within a relative 1e-9 of an integer snapped
    to it (float round-off). The same rule as :func:`opacus_structured.cli.epochs_to_steps`
    (the CLI is a higher layer than this module; a test checks that the two agree)."""
    x = float(epochs) * int(steps_per_epoch)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"epochs × steps per epoch must be finite and >= 0, got {epochs} × "
                         f"{steps_per_epoch}")
    nearest = round(x)
    return int(nearest) if abs(x - nearest) <= 1e-9 * max(1.0, x) else int(math.ceil(x))
