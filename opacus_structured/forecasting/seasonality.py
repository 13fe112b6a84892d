r"""Season length (steps per seasonal cycle) of every pandas frequency.

The season length :math:`m` sets the seasonal-naive baseline (:math:`\hat y_{t+h} =
y_{t+h-mk}`), the period of the synthetic public pretraining corpus
(:func:`~opacus_structured.forecasting.public_corpus.synthetic_panel`) and, when given
explicitly, the MASE scale. :func:`season_length` takes the cycle that dominates data at each
step size and divides it by the step's multiple:

=========================================  ======================  ==========================
step (pandas alias)                        cycle                   season length of one step
=========================================  ======================  ==========================
second (``s``), sub-second                 hour                    3600 (``s``)
minute (``min``), e.g. ``15min``           day                     1440 / n (``15min``: 96)
hour (``h``), e.g. ``2h``                  day                     24 / n (``2h``: 12)
business hour (``bh``)                     business day            8
day (``D``)                                week                    7
business day (``B``, ``C``)                business week           5
week (``W``, every anchor)                 year                    52
semi-month (``SM``, ``SMS``)               year                    24
month (``M``, ``MS``, ``ME``, ``BM``, …)   year                    12
quarter (``Q``, ``QS``, ``QE``, …)         year                    4
year (``Y``, ``YS``, ``A``, …)             none                    1
=========================================  ======================  ==========================

A multiple ``n`` of the step (``2h``, ``2W``, ``2M``) gives ``cycle / n`` when ``n`` divides
the cycle, else 1 (no whole number of steps per cycle: no seasonal lag). Every Period alias of
the panel (``"M"``, ``"Q-DEC"``, ``"Y-DEC"``, ``"W-SUN"``) and every offset alias (``"MS"``,
``"ME"``, ``"QS"``) is accepted. Pass ``season_length=`` / ``--season-length`` to override.
"""

from __future__ import annotations

import warnings

__all__ = ["season_length", "SEASON_CYCLES"]

#: Steps of one unit step per seasonal cycle, by pandas offset class name (module docstring).
SEASON_CYCLES = {
    "Nano": 3_600_000_000_000, "Micro": 3_600_000_000, "Milli": 3_600_000, "Second": 3600,
    "Minute": 1440, "Hour": 24, "BusinessHour": 8, "CustomBusinessHour": 8,
    "Day": 7, "BusinessDay": 5, "CustomBusinessDay": 5,
    "Week": 52, "SemiMonthBegin": 24, "SemiMonthEnd": 24,
    "MonthBegin": 12, "MonthEnd": 12, "BusinessMonthBegin": 12, "BusinessMonthEnd": 12,
    "CustomBusinessMonthBegin": 12, "CustomBusinessMonthEnd": 12,
    "QuarterBegin": 4, "QuarterEnd": 4, "BQuarterBegin": 4, "BQuarterEnd": 4,
    "FY5253Quarter": 4,
    "YearBegin": 1, "YearEnd": 1, "BYearBegin": 1, "BYearEnd": 1, "FY5253": 1, "Easter": 1,
}


def _offset(freq: str):
    """The pandas offset of a Period alias (``"M"``, ``"Q-DEC"``) or an offset alias
    (``"MS"``, ``"15min"``), without pandas' alias-deprecation warnings."""
    import pandas as pd
    from pandas.tseries.frequencies import to_offset

    with warnings.catch_warnings():
        # Period aliases ('M', 'Q', 'Y') are deprecated as *offset* aliases in pandas >= 2.2;
        # read through a Period first (where they are current), as an offset only otherwise
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message=r".*is deprecated and will be removed")
        try:
            return pd.Period("2000-01-01", freq=freq).freq
        except (ValueError, TypeError, AttributeError):
            pass
        try:
            return to_offset(freq)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"freq {freq!r} is not a pandas frequency ({exc}); pass "
                             "season_length= / --season-length with the steps per seasonal "
                             "cycle") from None


def season_length(freq: str) -> int:
    """Steps per seasonal cycle of ``freq`` (table in the module docstring); >= 1.

    Raises:
        ValueError: ``freq`` is not a pandas frequency (the message names the override).
    """
    if not isinstance(freq, str) or not freq:
        raise ValueError(f"freq must be a pandas frequency string, got {freq!r}")
    offset = _offset(freq)
    cycle = SEASON_CYCLES.get(type(offset).__name__)
    if cycle is None:  # an offset outside the table (e.g. a custom one): no seasonal lag
        return 1
    n = abs(int(getattr(offset, "n", 1) or 1))
    return cycle // n if cycle % n == 0 else 1
