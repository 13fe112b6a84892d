"""Frequencies and timestamps of a user's panel (split out of
:mod:`opacus_structured.forecasting.user_data`, which loads panels with them): pandas period
frequencies (inferred or given), timestamps parsed in the common forms (:data:`TIMESTAMP_FORMS`:
ISO dates and date-times, ``1998 Q1`` / ``1998Q1`` quarters, ISO weeks) and the first break in
a series' regular grid."""

from __future__ import annotations

import warnings
from typing import Optional

import numpy as np

_MONTHS = ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")
#: Calendar units tried (finest first) when ``pandas.infer_freq`` finds no fixed offset.
_CALENDAR_UNITS = ("D", "W", "M", "Q", "Y")
#: How many offending values an error message lists.
_MAX_LISTED = 5


# ---- frequencies ---------------------------------------------------------------------------
def _period_freq(freq: str) -> str:
    """The pandas Period alias of an offset alias (``"MS"``/``"ME"`` -> ``"M"``, ...).

    Weekly, quarterly and yearly offsets of any anchor map to ``"W"``, ``"Q"``, ``"Y"``: each
    timestamp of a regular series at such an offset lies in its own period, consecutively.
    """
    import pandas as pd
    from pandas.tseries.frequencies import to_offset

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            offset = to_offset(freq)
        except ValueError as exc:
            raise ValueError(f"freq {freq!r} is not a pandas frequency: {exc}") from None
        name, n = type(offset).__name__, int(offset.n)
        base = {"MonthBegin": "M", "MonthEnd": "M", "QuarterBegin": "Q", "QuarterEnd": "Q",
                "YearBegin": "Y", "YearEnd": "Y", "Week": "W"}.get(name)
        alias = (base if n == 1 else f"{n}{base}") if base else str(freq)
        for candidate in (alias, alias.replace("Y", "A")):
            try:
                period = pd.Period("2000-01-01", freq=candidate)
            except (ValueError, TypeError):
                continue
            return candidate if base else period.freqstr
    raise ValueError(f"freq {freq!r} has no pandas Period equivalent (supported: e.g. "
                     "'h', 'D', 'B', 'W', 'M', 'Q', 'Y', and multiples like '15min')")


def _infer_period_freq(stamps) -> Optional[str]:
    """Period alias of sorted, distinct timestamps (a ``DatetimeIndex``), ``None`` if none."""
    import pandas as pd

    if isinstance(stamps, pd.PeriodIndex):
        return _period_freq(stamps.freqstr)
    if len(stamps) < 3:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            inferred = pd.infer_freq(stamps)
        except (ValueError, TypeError):
            inferred = None
    if inferred is not None:
        try:
            return _period_freq(inferred)
        except ValueError:
            pass
    for unit in _CALENDAR_UNITS:  # same calendar unit at varying offsets (the 15th, ...)
        if _first_break(_to_periods(stamps, unit), unit) is None:
            return unit
    return None


def _t(stamp) -> str:
    """A timestamp for a message: the date alone when there is no time of day."""
    import pandas as pd

    if isinstance(stamp, pd.Timestamp) and stamp == stamp.normalize():
        return stamp.strftime("%Y-%m-%d")
    return str(stamp)


def _to_periods(stamps, freq: str):
    import pandas as pd

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if isinstance(stamps, pd.PeriodIndex):
            if stamps.freqstr == pd.Period("2000-01-01", freq=freq).freqstr:
                return stamps
            return pd.PeriodIndex(stamps.start_time, freq=freq)
        return pd.PeriodIndex(stamps, freq=freq)


def _first_break(periods, freq: str) -> Optional[int]:
    """Position of the first period that is not the previous one plus one step (or None)."""
    import pandas as pd

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = pd.period_range(start=periods[0], periods=len(periods), freq=freq)
    bad = np.flatnonzero(np.asarray(periods != expected))
    return int(bad[0]) if bad.size else None


def _parse_times(values, where, what: str):
    """``DatetimeIndex`` / ``PeriodIndex`` of ``values``; raises naming unparseable rows."""
    import pandas as pd

    if isinstance(values, pd.PeriodIndex):
        return values
    series = pd.Series(values)
    if isinstance(series.dtype, pd.PeriodDtype):
        return pd.PeriodIndex(series)
    if pd.api.types.is_datetime64_any_dtype(series.dtype):
        parsed = pd.to_datetime(series)
    else:
        text = series.where(series.isna(), series.astype(str).map(_normalise_time_text))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Could not infer format")
            warnings.simplefilter("ignore", FutureWarning)
            try:
                parsed = pd.to_datetime(text, errors="coerce")
            except (ValueError, TypeError):
                parsed = pd.to_datetime(text, errors="coerce", format="mixed")
    bad = np.flatnonzero((parsed.isna() & series.notna()).to_numpy())
    if bad.size and not isinstance(values, pd.DatetimeIndex) and not \
            pd.api.types.is_datetime64_any_dtype(series.dtype):
        _raise_if_mixed(text, bad, where, what)
    bad = np.flatnonzero(parsed.isna().to_numpy())
    if bad.size:
        shown = ", ".join(f"{where(int(p))}: {series.iloc[p]!r}" for p in bad[:_MAX_LISTED])
        more = f" and {bad.size - _MAX_LISTED} more" if bad.size > _MAX_LISTED else ""
        raise ValueError(f"unparseable timestamps in {what} ({bad.size} value(s)): {shown}{more}; "
                         f"accepted forms: {TIMESTAMP_FORMS}")
    if getattr(parsed.dt, "tz", None) is not None:
        parsed = parsed.dt.tz_localize(None)
    return pd.DatetimeIndex(parsed)


def _format_of(text: str) -> str:
    """A timestamp's format for a message: pandas' guess (``%Y-%m-%d``, ``%m/%d/%Y``, ...),
    else its shape with every digit written ``9`` (``99.99.9999``)."""
    from pandas.tseries.api import guess_datetime_format

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guessed = guess_datetime_format(text)
    return guessed or "".join("9" if c.isdigit() else c for c in text)


def _parses_alone(text: str) -> bool:
    import pandas as pd

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return not pd.isna(pd.to_datetime(text))
        except (ValueError, TypeError, OverflowError):
            return False


def _raise_if_mixed(text, bad, where, what: str) -> None:
    """Raise naming the mix if timestamps that failed to parse with the column's format
    (pandas infers one format per column, from its first value) parse on their own: the column
    mixes formats. Lists each format with its count and first row (of the first 200 failed
    values); a value that parses in no format is listed too."""
    examined = [int(p) for p in bad[:200]]
    alone = [p for p in examined if _parses_alone(str(text.iloc[p]))]
    if not alone:
        return
    good = np.flatnonzero(text.notna().to_numpy())
    good = good[~np.isin(good, bad)]
    groups: dict[str, list[int]] = {}
    if good.size:  # read in the column's format
        groups[_format_of(str(text.iloc[good[0]]))] = [int(p) for p in good]
    for p in alone:
        groups.setdefault(_format_of(str(text.iloc[p])), []).append(p)
    listed = "; ".join(f"{fmt} ({len(rows)} value(s), e.g. {where(rows[0])}: "
                       f"{str(text.iloc[rows[0]])!r})"
                       for fmt, rows in list(groups.items())[:_MAX_LISTED])
    never = [p for p in examined if p not in alone]
    tail = ("" if not never else "; in no format: " + ", ".join(
        f"{where(p)}: {str(text.iloc[p])!r}" for p in never[:_MAX_LISTED]))
    more = (f"; {len(bad) - len(examined)} more value(s) not in the column's format"
            if len(bad) > len(examined) else "")
    ambiguous = any(f"{a}/{b}" in fmt for fmt in groups for a, b in (("%m", "%d"), ("%d", "%m")))
    raise ValueError(
        f"mixed timestamp formats in {what}: {len(groups)} formats ({listed}){tail}{more}. "
        "The values of each format parse on their own, but a column is read in one format "
        "(its first value's)"
        + (", and day and month cannot be told apart in a mix (01/02/2020 is 2 January or "
           "1 February)" if ambiguous else "")
        + "; write every timestamp in one format, e.g. ISO 2020-01-31")


#: The timestamp forms :func:`load_panel` reads (named in its error for an unparseable one).
TIMESTAMP_FORMS = ("ISO dates 2020-01-31, months 2020-01 or 2020-1, years 2020, date-times "
                   "2020-01-31 12:30 / 2020-01-31T12:30:00 (a UTC offset is dropped), "
                   "quarters 1998Q1, 1998 Q1, 1998-Q1 or Q1 1998, weeks 2020-W05")

_QUARTER = (r"^\s*(?:(?P<y1>\d{4})\s*[-/ ]?\s*[Qq](?P<q1>[1-4])"
            r"|[Qq](?P<q2>[1-4])\s*[-/ ]?\s*(?P<y2>\d{4}))\s*$")
_ISO_WEEK = r"^\s*(?P<y>\d{4})-?W(?P<w>\d{2})\s*$"


def _normalise_time_text(text: str) -> str:
    """Rewrite the forms pandas does not read itself into ISO dates: quarters (``1998 Q1``,
    ``1998-Q1``, ``Q1 1998`` -> ``1998-01-01``) and ISO weeks (``2020-W05`` -> its Monday);
    anything else is returned unchanged for ``pandas.to_datetime``."""
    import datetime
    import re

    m = re.match(_QUARTER, text)
    if m:
        year = int(m.group("y1") or m.group("y2"))
        quarter = int(m.group("q1") or m.group("q2"))
        return f"{year:04d}-{3 * quarter - 2:02d}-01"
    m = re.match(_ISO_WEEK, text)
    if m:
        try:
            return datetime.date.fromisocalendar(int(m.group("y")), int(m.group("w")),
                                                 1).isoformat()
        except ValueError:
            return text
    return text
