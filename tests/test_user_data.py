"""Your own data: ``forecasting.user_data.load_panel`` and ``opacus-structured forecast --data``."""

from __future__ import annotations

import dataclasses
import json
import warnings

import numpy as np
import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("gluonts")

from conftest import TEST_DISCRETIZATION  # noqa: E402

from opacus_structured.forecasting.data import Panel, train_test_split  # noqa: E402
from opacus_structured.forecasting.user_data import DataReport, load_panel  # noqa: E402


def _series(lengths, freq="MS", start="2019-01-01", seed=0):
    """``{item_id: (timestamps, values)}`` with distinct, non-round values."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, n in enumerate(lengths):
        stamps = pd.date_range(start, periods=n, freq=freq)
        out[f"s{k}"] = (stamps, np.round(100 + 10 * rng.standard_normal(n), 3))
    return out


def _long(series, fmt="%Y-%m-%d"):
    rows = [(i, t.strftime(fmt), v) for i, (ts, vs) in series.items()
            for t, v in zip(ts, vs, strict=True)]
    return pd.DataFrame(rows, columns=["item_id", "timestamp", "target"])


def _wide(series, fmt="%Y-%m-%d"):
    frame = pd.DataFrame({i: pd.Series(vs, index=ts.strftime(fmt)) for i, (ts, vs)
                          in series.items()})
    return frame.rename_axis("timestamp").reset_index()


def _assert_panel_is(panel, series, freq="M"):
    assert isinstance(panel, Panel) and panel.freq == freq
    assert panel.item_ids == tuple(series)
    for target, start, (stamps, values) in zip(panel.targets, panel.starts, series.values(),
                                               strict=True):
        assert target.dtype == np.float32 and target.ndim == 1
        np.testing.assert_allclose(target, values.astype(np.float32))
        assert start == pd.Period(stamps[0], freq=freq) and start.freqstr == panel.starts[0].freqstr


def _error(match, *args, **kwargs):
    with pytest.raises(ValueError, match=match) as info:
        load_panel(*args, **kwargs)
    return str(info.value)


# ---- layouts and sources -------------------------------------------------------------------
def test_long_csv_round_trip(tmp_path):
    series = _series([14, 11, 9])
    path = tmp_path / "long.csv"
    _long(series).to_csv(path, index=False)
    panel, report = load_panel(path)
    _assert_panel_is(panel, series)
    assert isinstance(report, DataReport)
    assert report.layout == "long" and report.source == str(path)
    assert (report.freq, report.freq_source) == ("M", "inferred")
    assert report.num_series == report.num_input_series == 3
    assert (report.min_series_length, report.max_series_length) == (9, 14)
    assert report.excluded == report.filled == report.trimmed == ()
    # the same file with other column names and an extra column
    other = _long(series).rename(columns={"item_id": "store", "timestamp": "month",
                                          "target": "sales"}).assign(note="x")
    other.to_csv(path, index=False)
    panel2, report2 = load_panel(str(path), item_id_column="store", timestamp_column="month",
                                 target_column="sales")
    _assert_panel_is(panel2, series)
    assert report2.ignored_columns == ("note",)


def test_wide_csv_round_trip_trims_ragged_ends(tmp_path):
    series = _series([12, 10, 7])
    path = tmp_path / "wide.csv"
    _wide(series, fmt="%Y-%m").to_csv(path, index=False)  # shorter series: empty trailing cells
    panel, report = load_panel(path)
    _assert_panel_is(panel, series)
    assert report.layout == "wide" and report.freq == "M"
    assert report.trimmed == (("s1", 0, 2), ("s2", 0, 5))
    assert report.to_dict()["trimmed"][0] == {"item_id": "s1", "leading": 0, "trailing": 2}
    # a late start is a leading trim, the start moves
    late = _wide(series)
    late.loc[:2, "s0"] = np.nan
    panel, report = load_panel(late, layout="wide")
    assert panel.starts[0] == pd.Period("2019-04", freq="M") and len(panel.targets[0]) == 9
    assert ("s0", 3, 0) in report.trimmed


def test_dataframe_input_long_and_wide_with_datetime_index():
    series = _series([10, 8], freq="D")
    panel, report = load_panel(_long(series))
    _assert_panel_is(panel, series, freq="D")
    assert report.source.startswith("DataFrame (18 rows")
    wide = _wide(series).set_index("timestamp")
    wide.index = pd.DatetimeIndex(wide.index)
    panel, report = load_panel(wide)  # the index stands in for the timestamp column
    _assert_panel_is(panel, series, freq="D")
    assert report.layout == "wide"


def test_gluonts_list_dataset_and_pandas_dataset():
    from gluonts.dataset.common import ListDataset
    from gluonts.dataset.pandas import PandasDataset

    series = _series([10, 8])
    entries = [{"start": str(ts[0])[:7], "target": vs, "item_id": i}
               for i, (ts, vs) in series.items()]
    with warnings.catch_warnings():  # pandas' 'M' -> 'ME' alias deprecation inside gluonts
        warnings.simplefilter("ignore", FutureWarning)
        dataset = ListDataset(entries, freq="M")
    panel, report = load_panel(dataset)
    _assert_panel_is(panel, series)
    assert (report.layout, report.freq_source) == ("gluonts", "dataset")

    frame = _long(series).assign(timestamp=lambda f: pd.to_datetime(f.timestamp))
    pandas_ds = PandasDataset.from_long_dataframe(frame, target="target", item_id="item_id",
                                                  timestamp="timestamp", freq="D")
    _error("reading the dataset", pandas_ds)  # gluonts' own check: monthly stamps at freq D
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        pandas_ds = PandasDataset.from_long_dataframe(frame, target="target",
                                                      item_id="item_id",
                                                      timestamp="timestamp", freq="M")
        panel, report = load_panel(pandas_ds)
    _assert_panel_is(panel, series)
    # a panel passes through (only min_length applies)
    again, rep = load_panel(panel, min_length=9)
    assert again.item_ids == ("s0",) and rep.excluded == (("s1", "8 steps < min_length 9"),)


def test_gluonts_entries_are_checked():
    month = pd.Period("2020-01", freq="M")
    _error("univariate", [{"start": month, "target": np.ones((2, 6))}])
    _error("needs 'start' and 'target'", [{"begin": month, "target": [1.0]}])
    msg = _error("disagree on the frequency", [
        {"start": month, "target": np.ones(6), "item_id": "m"},
        {"start": pd.Period("2020-01-01", freq="D"), "target": np.ones(6), "item_id": "d"}])
    assert "'m': M" in msg and "'d': D" in msg
    _error("source must be", 42)


# ---- frequency -----------------------------------------------------------------------------
@pytest.mark.parametrize("freq, fmt, expected", [
    ("MS", "%Y-%m-%d", "M"), ("ME", "%Y-%m-%d", "M"), ("MS", "%Y-%m", "M"),
    ("D", "%Y-%m-%d", "D"), ("W-MON", "%Y-%m-%d", "W"), ("QS", "%Y-%m-%d", "Q"),
    ("h", "%Y-%m-%d %H:%M", "h")])
def test_frequency_is_inferred(freq, fmt, expected):
    series = _series([9, 7], freq=freq)
    panel, report = load_panel(_long(series, fmt=fmt))
    assert (panel.freq, report.freq, report.freq_source) == (expected, expected, "inferred")
    _assert_panel_is(panel, series, freq=expected)


def test_given_frequency_and_mid_month_stamps():
    series = _series([9, 7])
    panel, report = load_panel(_long(series), freq="MS")
    assert (panel.freq, report.freq_source) == ("M", "given")
    mid = pd.DataFrame({"timestamp": [f"2020-{m:02d}-15" for m in range(1, 10)],
                        "x": np.arange(9.0)})
    panel, _ = load_panel(mid)  # no fixed offset, but one value per month and no gap
    assert panel.freq == "M" and panel.starts[0] == pd.Period("2020-01", freq="M")
    msg = _error("two timestamps in one period", _long(series), freq="Y")
    assert "series 's0'" in msg and "2019-01-01" in msg
    _error("not a pandas frequency", _long(series), freq="fortnightly")


def test_irregular_frequency_names_series_and_first_irregular_timestamp(tmp_path):
    frame = _long(_series([12, 10]))
    gap = frame.drop(index=frame.index[(frame.item_id == "s1")
                                       & (frame.timestamp == "2019-06-01")])
    path = tmp_path / "gap.csv"
    gap.to_csv(path, index=False)
    msg = _error("not regular", path)
    assert "series 's1'" in msg and "first irregular timestamp is 2019-07-01" in msg
    assert "expected 2019-06" in msg and "line " in msg
    # with the frequency given, the same gap
    msg = _error("not regular", gap, freq="M")
    assert "series 's1'" in msg and "2019-07-01" in msg
    # disagreeing series
    daily = _long(_series([8], freq="D")).assign(item_id="d")
    msg = _error("disagree on the frequency", pd.concat([frame, daily]))
    assert "'d': D" in msg and "'s0': M" in msg


# ---- bad input -----------------------------------------------------------------------------
def test_missing_columns_are_named_with_the_flags():
    frame = _long(_series([8]))
    msg = _error("cannot tell the layout", frame.rename(columns={"timestamp": "date",
                                                                 "item_id": "id"}))
    assert "'date'" in msg and "--timestamp-column" in msg and "--layout" in msg
    msg = _error("no target column", frame.rename(columns={"target": "value"}))
    assert "'value'" in msg and "--target-column" in msg
    msg = _error("missing the column", frame.drop(columns="timestamp"), layout="long")
    assert "'timestamp'" in msg and "columns found" in msg
    _error("no series columns", frame[["timestamp"]], layout="wide")


def test_unparseable_timestamps_name_line_and_value(tmp_path):
    frame = _long(_series([8, 8]))
    frame.loc[10, "timestamp"] = "2019-13-45"
    path = tmp_path / "bad_time.csv"
    frame.to_csv(path, index=False)
    msg = _error("unparseable timestamps", path)
    assert "line 12" in msg and "'2019-13-45'" in msg and "column 'timestamp'" in msg


def test_a_mix_with_a_value_in_no_format_lists_both():
    frame = pd.DataFrame({"item_id": "a", "timestamp": ["2020-01-01", "01/02/2020", "garbage",
                                                       "2020-04-01"], "target": 1.0})
    with pytest.raises(ValueError) as err:
        load_panel(frame)
    msg = str(err.value)
    assert "mixed timestamp formats" in msg and "in no format: row 2: 'garbage'" in msg


def test_one_format_per_column_still_loads():
    frame = pd.DataFrame({"item_id": "a", "target": 1.0,
                          "timestamp": ["01/02/2020", "02/02/2020", "03/02/2020"]})
    panel, report = load_panel(frame)  # one (month-first) format: no mix
    assert report.freq == "M" and str(panel.starts[0]) == "2020-01"


def test_duplicate_timestamp_names_series_and_timestamp():
    frame = _long(_series([8, 8]))
    frame = pd.concat([frame, frame.iloc[[11]]], ignore_index=True)
    msg = _error("duplicate timestamp", frame)
    assert "2019-04-01" in msg and "series 's1'" in msg and "row 11" in msg


def test_non_numeric_and_infinite_targets_are_named():
    frame = _long(_series([8, 8])).astype({"target": object})
    frame.loc[12, "target"] = "12,5"
    msg = _error("non-numeric targets", frame)
    assert "'12,5'" in msg and "series 's1'" in msg and "2019-05-01" in msg and "row 12" in msg
    frame.loc[12, "target"] = np.inf
    msg = _error("infinite targets", frame)
    assert "series 's1'" in msg and "2019-05-01" in msg
    wide = _wide(_series([8])).assign(label="x")
    msg = _error("non-numeric targets", wide, layout="wide")
    assert "series 'label'" in msg and "wide layout" in msg


def test_interior_nan_is_an_error_naming_series_and_timestamp():
    frame = _long(_series([10, 10]))
    frame.loc[[13, 14], "target"] = np.nan  # s1 at 2019-04 and 2019-05
    frame.loc[0, "target"] = np.nan  # leading: trimmed, not an error
    msg = _error("missing values", frame)
    assert "series 's1'" in msg and "2 interior missing value(s), the first at 2019-04" in msg
    assert "'s0'" not in msg and "--fill" in msg


# ---- fill policies, exclusions, report -----------------------------------------------------
def _with_holes():
    series = _series([10, 10, 10])
    frame = _long(series)
    frame.loc[[3, 4], "target"] = np.nan  # s0: two interior values
    frame.loc[[19], "target"] = np.nan  # s1: trailing value
    return series, frame


def test_fill_ffill_and_interpolate():
    series, frame = _with_holes()
    v = series["s0"][1]
    panel, report = load_panel(frame, fill="ffill")
    np.testing.assert_allclose(panel.targets[0], np.r_[v[:3], v[2], v[2], v[5:]]
                               .astype(np.float32))
    assert report.filled == (("s0", 2, "ffill"),) and report.trimmed == (("s1", 0, 1),)
    assert len(panel.targets[1]) == 9 and report.excluded == ()
    panel, report = load_panel(frame, fill="interpolate")
    step = (v[5] - v[2]) / 3
    np.testing.assert_allclose(panel.targets[0][2:6], [v[2], v[2] + step, v[2] + 2 * step, v[5]],
                               rtol=1e-6)
    assert report.filled == (("s0", 2, "interpolate"),) and report.fill == "interpolate"
    assert not np.isnan(np.concatenate(panel.targets)).any()


def test_fill_drop_series_and_short_series_are_excluded_and_reported():
    _, frame = _with_holes()
    short = _long(_series([4], start="2019-03-01")).assign(item_id="short")
    empty = _long(_series([5])).assign(item_id="empty", target=np.nan)
    panel, report = load_panel(pd.concat([frame, short, empty]), fill="drop-series",
                               min_length=5)
    assert panel.item_ids == ("s1", "s2")
    reasons = dict(report.excluded)
    assert set(reasons) == {"s0", "short", "empty"}
    assert "2 interior missing value(s), the first at 2019-04" in reasons["s0"]
    assert "drop-series" in reasons["s0"]
    assert reasons["short"] == "4 steps < min_length 5"
    assert reasons["empty"] == "no observed value"
    assert (report.num_input_series, report.num_series, report.min_length) == (5, 2, 5)
    out = report.to_dict()
    json.dumps(out)
    assert {"item_id": "short", "reason": "4 steps < min_length 5"} in out["excluded"]
    assert "excluded 3" in report.summary()
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.num_series = 3  # type: ignore[misc]
    msg = _error("no series left", frame, fill="drop-series", min_length=11)
    assert "s0:" in msg and "s2: 10 steps < min_length 11" in msg


def test_bad_arguments():
    frame = _long(_series([6]))
    _error("fill must be one of", frame, fill="zero")
    _error("layout must be one of", frame, layout="tall")
    _error("min_length", frame, min_length=0)


# ---- the forecast command ------------------------------------------------------------------
H = 3


def _cli_csv(tmp_path):
    """Five monthly series: one too short for --prediction-length 3 (needs 2·3 steps), one
    with an interior gap, ragged lengths; the shortest kept one has 15 steps."""
    series = _series([30, 26, 15, 5, 28], seed=1)
    frame = _long(series)
    frame.loc[(frame.item_id == "s4") & (frame.timestamp == "2019-06-01"), "target"] = np.nan
    path = tmp_path / "panel.csv"
    frame.to_csv(path, index=False)
    return path


def _forecast_args(path, tmp_path, *extra):
    return ["forecast", "--data", str(path), "--no-baselines", "--no-plot", "--max-steps", "2",
            "--batch-size", "2", "--prediction-length", str(H), "--epsilon", "8", "--delta",
            "1e-5", "--discretization", str(TEST_DISCRETIZATION), "--output",
            str(tmp_path / "out"), "--json", "--no-progress", "--num-samples", "10",
            "--init-from", "none", *extra]


@pytest.mark.slow
def test_forecast_command_on_a_csv_reports_the_data(tmp_path, capsys):
    from opacus_structured.cli import main

    path = _cli_csv(tmp_path)
    assert main(_forecast_args(path, tmp_path, "--fill", "interpolate")) == 0
    rep = json.loads(capsys.readouterr().out)
    ds = rep["dataset"]
    assert ds["name"] == str(path) and ds["layout"] == "long" and ds["freq"] == "M"
    assert ds["freq_source"] == "inferred" and ds["fill"] == "interpolate"
    assert ds["excluded"] == [{"item_id": "s3", "reason": "5 steps < min_length 6"}]
    assert ds["filled"] == [{"item_id": "s4", "count": 1, "policy": "interpolate"}]
    assert ds["num_series"] == 4 and ds["num_input_series"] == 5 and ds["min_length"] == 2 * H
    # the accountant's L is the shortest *kept* training series (15 - H), not the excluded one
    assert ds["min_train_length"] == 15 - H
    assert rep["scheme"]["series_length"] == 15 - H and rep["scheme"]["num_series"] == 4
    saved = json.loads((tmp_path / "out" / "diagnostics" / "report.json").read_text())
    assert saved["dataset"] == ds


def test_series_length_is_the_shortest_training_series_after_exclusions(tmp_path):
    from opacus_structured.forecasting.training import train_forecaster

    panel, report = load_panel(_cli_csv(tmp_path), fill="drop-series", min_length=2 * H)
    assert dict(report.excluded).keys() == {"s3", "s4"}
    train, _ = train_test_split(panel, H)
    res = train_forecaster("dlinear", train, prediction_length=H, batch_size=2, max_steps=1,
                           epsilon=8.0, delta=1e-5, discretization=TEST_DISCRETIZATION)
    assert res.scheme.series_length == train.min_length == 15 - H
    assert res.scheme.num_series == len(train) == 3


def test_forecast_command_errors(tmp_path, capsys):
    from opacus_structured.cli import main

    path = _cli_csv(tmp_path)
    assert main(_forecast_args(path, tmp_path, "--batch-size", "8", "--fill", "ffill")) == 2
    err = capsys.readouterr().err
    assert "fewer series than the batch size" in err and "4 training series" in err
    assert "--batch-size 8" in err and "--batch-size 4 or smaller" in err
    assert main(_forecast_args(path, tmp_path, "--fill", "error")) == 2  # s4's gap
    err = capsys.readouterr().err
    assert "series 's4'" in err and "2019-06" in err
    assert main(["forecast", "--freq", "D", "--no-progress", "--output", ""]) == 2
    assert "--freq applies to --data" in capsys.readouterr().err
