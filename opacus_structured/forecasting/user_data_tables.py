"""Tables for :func:`~opacus_structured.forecasting.user_data.load_panel`: a CSV file or a
pandas DataFrame in the *long* or *wide* layout turned into per-series values and timestamps,
then sorted and checked for duplicate timestamps and a regular frequency (given or inferred).

``pick_layout`` chooses and checks the layout and columns, ``long_series`` /
``wide_series`` read the values (numbers only, every bad cell named with its row), and
``regularise`` returns the ``(item_id, start period, values)`` triples that
``user_data`` trims, fills and reports. Split out of ``user_data.py`` when it passed 600 lines;
the module docstring there describes the layouts, timestamps and frequencies.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Optional

import numpy as np

from .timestamps import (
    _MAX_LISTED,
    _first_break,
    _infer_period_freq,
    _parse_times,
    _t,
    _to_periods,
)

__all__ = ["pick_layout", "long_series", "wide_series", "regularise"]


def _has_index_time(frame) -> bool:
    import pandas as pd

    return isinstance(frame.index, (pd.DatetimeIndex, pd.PeriodIndex))


def pick_layout(frame, layout, item_col, ts_col, target_col, description) -> str:
    """The layout (``"long"`` or ``"wide"``; ``"auto"`` decides), its columns checked."""
    cols = [str(c) for c in frame.columns]
    has_time = ts_col in frame.columns or _has_index_time(frame)
    flags = ("set layout= / --layout {long,wide} and the column names with item_id_column= / "
             "--item-id-column, timestamp_column= / --timestamp-column, target_column= / "
             "--target-column")
    if layout == "auto":
        if item_col in frame.columns and target_col in frame.columns:
            layout = "long"
        elif item_col in frame.columns:
            raise ValueError(
                f"{description} has the item-id column {item_col!r} but no target column "
                f"{target_col!r} (a long table needs both); columns found {cols}; {flags}")
        elif has_time:
            layout = "wide"
        else:
            raise ValueError(
                f"cannot tell the layout of {description}: columns found {cols}; expected a "
                f"long table with columns {item_col!r}, {ts_col!r}, {target_col!r} or a wide "
                f"table with a {ts_col!r} column and one column per series; {flags}")
    missing = ([c for c in (item_col, ts_col, target_col) if c not in frame.columns]
               if layout == "long" else ([] if has_time else [ts_col]))
    if layout == "long" and ts_col in missing and _has_index_time(frame):
        missing.remove(ts_col)
    if missing:
        raise ValueError(f"{description} ({layout} layout) is missing the column(s) "
                         f"{missing}; columns found {cols}; {flags}")
    return layout


def _numeric(values, item_ids, stamps, where, hint: str = "") -> np.ndarray:
    """float64 values (row ``p`` of series ``item_ids[p]`` at ``stamps[p]``); raises naming the
    series, timestamp, row and value of every non-numeric or infinite cell (up to a few)."""
    import pandas as pd

    raw = pd.Series(values).reset_index(drop=True)
    if pd.api.types.is_bool_dtype(raw.dtype):
        raise ValueError(f"series {item_ids[0]!r} has boolean targets; targets must be numbers")
    num = pd.to_numeric(raw, errors="coerce")
    out = num.to_numpy(dtype=np.float64)
    for problem, bad in (("non-numeric", (num.isna() & raw.notna()).to_numpy()),
                         ("infinite", np.isinf(out))):
        bad = np.flatnonzero(bad)
        if bad.size:
            series = list(dict.fromkeys(str(item_ids[p]) for p in bad))
            shown = ", ".join(f"{raw.iloc[p]!r} in series {item_ids[p]!r} at {_t(stamps[p])} "
                              f"({where(int(p))})" for p in bad[:_MAX_LISTED])
            more = f" and {bad.size - _MAX_LISTED} more" if bad.size > _MAX_LISTED else ""
            raise ValueError(f"{problem} targets ({bad.size} value(s) in series "
                             f"{', '.join(map(repr, series[:_MAX_LISTED]))}): {shown}{more}"
                             f"{hint}")
    return out


@dataclasses.dataclass
class _Series:
    """One series before regularisation: timestamps (unsorted), values, source positions."""

    item_id: str
    stamps: Any
    values: np.ndarray
    positions: np.ndarray
    where: Any


def long_series(frame, item_col, ts_col, target_col, description, where):
    """The series of a long table (one row per observation) and the ignored columns."""
    import pandas as pd

    ignored = tuple(str(c) for c in frame.columns if c not in (item_col, ts_col, target_col))
    ids = frame[item_col]
    no_id = np.flatnonzero(ids.isna().to_numpy())
    if no_id.size:
        raise ValueError(f"{description}: rows without an item id in column {item_col!r}: "
                         + ", ".join(where(int(p)) for p in no_id[:_MAX_LISTED]))
    times = frame[ts_col] if ts_col in frame.columns else frame.index
    stamps = _parse_times(times, where, f"column {ts_col!r}" if ts_col in frame.columns
                          else "the index")
    id_text = ids.astype(str).to_numpy()
    pairs = pd.DataFrame({"text": id_text, "raw": ids.to_numpy()}).drop_duplicates()
    clash = pairs[pairs["text"].duplicated(keep=False)]
    if len(clash):
        raise ValueError(f"item ids {list(clash['raw'])[:_MAX_LISTED]} read as the same "
                         f"string {clash['text'].iloc[0]!r}")
    values = _numeric(frame[target_col], id_text, stamps, where)
    groups = pd.Series(np.arange(len(id_text))).groupby(id_text, sort=False).indices
    out = []
    for item in pd.unique(id_text):
        pos = np.asarray(groups[item])
        out.append(_Series(str(item), stamps[pos], values[pos], pos, where))
    return out, ignored


def wide_series(frame, ts_col, description, where):
    """The series of a wide table (one column per series, shared timestamps)."""
    from_column = ts_col in frame.columns
    stamps = _parse_times(frame[ts_col] if from_column else frame.index, where,
                          f"column {ts_col!r}" if from_column else "the index")
    columns = [c for c in frame.columns if not (from_column and c == ts_col)]
    if not columns:
        raise ValueError(f"{description} (wide layout) has no series columns besides "
                         f"{ts_col!r}")
    ids = [str(c) for c in columns]
    dup = [i for i, k in Counter(ids).items() if k > 1]
    if dup:
        raise ValueError(f"{description}: duplicate series columns {dup}")
    pos = np.arange(frame.shape[0])
    hint = (f" (in the wide layout every column besides {ts_col!r} is a series; for a long "
            "table set layout= / --layout long and the column names)")
    return [_Series(str(c), stamps, _numeric(frame[c], [str(c)] * len(pos), stamps, where, hint),
                    pos, where) for c in columns]


def regularise(series: list, period_freq, layout, ts_name):
    """Sort each series, check duplicates and spacing, return ``(id, start, values)`` triples."""
    # duplicates and order (on the parsed timestamps themselves)
    for s in series:
        order = np.argsort(np.asarray(s.stamps), kind="stable")
        s.stamps, s.values, s.positions = s.stamps[order], s.values[order], s.positions[order]
        dup = np.flatnonzero(np.asarray(s.stamps[1:] == s.stamps[:-1]))
        if dup.size:
            p = int(dup[0]) + 1
            what = (f"series {s.item_id!r}" if layout == "long" else ts_name)
            raise ValueError(f"duplicate timestamp {_t(s.stamps[p])} in {what} "
                             f"({s.where(int(s.positions[p - 1]))} and "
                             f"{s.where(int(s.positions[p]))}); one value per series and "
                             "timestamp")
    # in the wide layout every series shares the timestamps: check them once
    checks = series if layout == "long" else series[:1]
    label = (lambda s: f"series {s.item_id!r}") if layout == "long" else (lambda s: ts_name)
    freq_source = "given"
    if period_freq is None:
        freq_source = "inferred"
        inferred = {s.item_id: _infer_period_freq(s.stamps) for s in checks}
        found = Counter(f for f in inferred.values() if f is not None)
        consensus = found.most_common(1)[0][0] if found else None
        for s in checks:
            if inferred[s.item_id] is None and len(s.stamps) >= 3:
                _raise_irregular(s, consensus, label(s), freq_given=False)
        if len(found) > 1:
            listed = ", ".join(f"{i!r}: {f}" for i, f in list(inferred.items()) if f is not None)
            raise ValueError(f"the series disagree on the frequency ({listed}); pass freq= / "
                             "--freq, or load the frequencies separately")
        if consensus is None:
            raise ValueError("cannot infer the frequency: every series has fewer than 3 "
                             "timestamps; pass freq= / --freq")
        period_freq = consensus
    raws, shared = [], None
    for s in series:
        if layout == "wide" and shared is not None:  # same timestamps as the first column
            raws.append((s.item_id, shared, s.values))
            continue
        periods = _to_periods(s.stamps, period_freq)
        dup = np.flatnonzero(np.asarray(periods[1:] == periods[:-1]))
        if dup.size:
            p = int(dup[0]) + 1
            raise ValueError(
                f"{label(s)} has two timestamps in one period of frequency {period_freq}: "
                f"{_t(s.stamps[p - 1])} and {_t(s.stamps[p])} ({s.where(int(s.positions[p]))}); "
                + ("is the given freq= / --freq right?" if freq_source == "given" else
                   "the inferred frequency does not fit: pass freq= / --freq"))
        if _first_break(periods, period_freq) is not None:
            _raise_irregular(s, period_freq, label(s), freq_given=freq_source == "given")
        shared = periods[0]
        raws.append((s.item_id, shared, s.values))
    return raws, period_freq, freq_source


def _raise_irregular(s: _Series, freq: Optional[str], label: str, *, freq_given: bool):
    """Raise for an irregular series, naming the first timestamp that breaks ``freq``
    (``freq_given``: the user passed it, so the hint does not suggest passing it)."""
    candidates = [freq] if freq else []
    triples = Counter(_infer_period_freq(s.stamps[i:i + 3]) for i in range(len(s.stamps) - 2))
    triples.pop(None, None)
    candidates += [f for f, _ in triples.most_common()]
    hint = ("a missing timestamp is a gap: add the row with an empty target and choose fill= / "
            "--fill" + (f", or check the given freq={freq!r} / --freq {freq}" if freq_given
                        else ", or pass freq= / --freq"))
    for cand in candidates:
        periods = _to_periods(s.stamps, cand)
        brk = _first_break(periods, cand)
        if brk is None:
            continue
        expected = periods[brk - 1] + 1
        raise ValueError(
            f"{label} is not regular at frequency {cand}: the first irregular timestamp is "
            f"{_t(s.stamps[brk])} ({s.where(int(s.positions[brk]))}), expected {expected} "
            f"after {_t(s.stamps[brk - 1])}; {hint}")
    shown = ", ".join(_t(t) for t in s.stamps[:4])
    raise ValueError(f"{label} has no regular frequency (timestamps {shown}, ...); {hint}")
