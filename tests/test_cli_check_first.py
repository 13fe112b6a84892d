"""Issue 41, check first, import later: every input error of ``opacus-structured forecast``
names the flag as typed and exits with status 2 before torch, gluonts, Lightning, opacus or
matplotlib is imported; ``forecast --help`` and ``schemes`` start without them too. (The
wall-clock targets are measured by ``benchmarks/cli_startup.py``, not asserted here.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pd = pytest.importorskip("pandas")

from opacus_structured import cli, console  # noqa: E402
from opacus_structured.commands._forecast_check import (  # noqa: E402
    check_arguments,
    load_checked_data,
)

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "gluonts", "lightning", "matplotlib", "opacus", "dp_accounting")


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OPACUS_STRUCTURED_PROGRESS": "0"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=180, cwd=ROOT, env=env)


def _long_csv(path, stamps_by_series: dict) -> str:
    rows = [(item, t, float(k)) for item, stamps in stamps_by_series.items()
            for k, t in enumerate(stamps)]
    pd.DataFrame(rows, columns=["item_id", "timestamp", "target"]).to_csv(path, index=False)
    return str(path)


def _monthly(n: int, start: str = "2000-01-01") -> list[str]:
    return [str(d.date()) for d in pd.date_range(start, periods=n, freq="MS")]


@pytest.fixture
def panel_csv(tmp_path):
    """Three monthly series of 40 steps."""
    return _long_csv(tmp_path / "panel.csv", {s: _monthly(40) for s in ("a", "b", "c")})


@pytest.fixture(autouse=True)
def _no_training(monkeypatch):
    """An input that passes the checks by mistake fails the test instead of training."""
    def refuse(args):
        raise AssertionError("the checks passed: the forecast would run")
    monkeypatch.setattr(console, "_run_checked_forecast", refuse)


def _error(capsys, *argv) -> str:
    """Run ``forecast argv`` through the console entry point; assert exit status 2 and one
    ``opacus-structured: error:`` line on stderr; return that line."""
    assert console.main(["forecast", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("opacus-structured: error: ") and "\n" not in err, err
    return err


# ---- every flag with a range check: the message names the flag --------------------------------
FLAG_ERRORS = [
    (["--epsilon", "0"], "--epsilon must be > 0 (or inf for non-private), got 0.0"),
    (["--epsilon", "nan"], "--epsilon must be > 0"),
    (["--epsilons", "1,0"], "--epsilons: every budget must be > 0"),
    (["--epsilons", "1,x"], "--epsilons: 'x' is not a number"),
    (["--epsilons", "1,2", "--noise-multiplier", "1"], "cannot be combined with "
                                                       "--noise-multiplier"),
    (["--noise-multiplier", "0"], "--noise-multiplier must be in [0.5, 1e+06], got 0.0"),
    (["--delta", "1"], "--delta must be in [1e-10, 1), got 1.0"),
    (["--discretization", "0"], "--discretization must be in [1e-06, 0.1], got 0.0"),
    # issue 47: out of range values that failed (or hung) minutes later, in the accounting or
    # the network, without naming their flag
    (["--epsilon", "1e9"], "--epsilon must be in [0.01, 100] (or inf for non-private), got "
                           "1000000000.0"),
    (["--epsilon", "1e-9"], "--epsilon must be in [0.01, 100]"),
    (["--epsilons", "1,1e9"], "--epsilons must be in [0.01, 100] for every finite budget"),
    (["--noise-multiplier", "1e-6"], "--noise-multiplier must be in [0.5, 1e+06]"),
    (["--delta", "1e-300"], "--delta must be in [1e-10, 1), got 1e-300"),
    (["--discretization", "0.5"], "--discretization must be in [1e-06, 0.1], got 0.5"),
    (["--discretization", "1e-12"], "--discretization must be in [1e-06, 0.1]"),
    (["--max-grad-norm", "1e300"], "--max-grad-norm must be in (0, 1e+06]"),
    (["--lr", "1e300"], "--lr must be in (0, 10]"),
    (["--max-steps", "100000000"], "--max-steps must be <= 1000000, got 100000000"),
    (["--num-samples", "100000000"], "--num-samples must be <= 10000, got 100000000"),
    (["--tune", "--tune-trials", "1e9"], "--tune-trials must be in [1, 100] (the mean number "
                                         "of trials), got 1000000000.0"),
    (["--inference-epsilon", "1e9", "--inference-sensitivity", "1"],
     "--inference-epsilon must be in [0.01, 100]"),
    (["--verdict-runs", "0"], "--verdict-runs must be >= 1, got 0"),
    (["--verdict-runs", "50"], "--verdict-runs must be <= 20, got 50"),
    (["--max-steps", "0"], "--max-steps must be >= 1, got 0"),
    (["--epochs", "0"], "--epochs must be > 0, got 0.0"),
    (["--epochs", "inf"], "--epochs must be finite, got inf"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--prediction-length", "-3"], "--prediction-length must be >= 1, got -3"),
    (["--context-length", "0"], "--context-length must be >= 1, got 0"),
    (["--season-length", "0"], "--season-length must be >= 1, got 0"),
    (["--num-series", "0"], "--num-series must be >= 1, got 0"),
    (["--min-length", "0"], "--min-length must be >= 1, got 0"),
    (["--num-samples", "0"], "--num-samples must be >= 1, got 0"),
    (["--dataset-size", "0"], "--dataset-size must be >= 1, got 0"),
    (["--num-workers", "-1"], "--num-workers must be >= 0, got -1"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--init-seed", "-2"], "--init-seed must be >= 0, got -2"),
    (["--max-grad-norm", "0"], "--max-grad-norm must be in (0, 1e+06], got 0.0"),
    (["--lr", "-1"], "--lr must be in (0, 10], got -1.0"),
    (["--lr", "inf"], "--lr must be in (0, 10], got inf"),
    (["--tail-average", "1.5"], "--tail-average must be in [0, 1]"),
    (["--zero-shot-weight", "1"], "--zero-shot-weight must be in [0, 1)"),
    (["--zero-shot-weight", "0.3", "--init-from", "none"], "--zero-shot-weight mixes in the "
                                                           "public zero-shot model"),
    (["--init-public"], "--init-public declares the weights of --init-from PATH"),
    (["--init-from", "/no/such/weights.pt"], "--init-from '/no/such/weights.pt': no such file"),
    (["--inference-epsilon", "0"], "--inference-epsilon must be in [0.01, 100], got 0.0"),
    (["--inference-epsilon", "1"], "--inference-epsilon needs --inference-sensitivity"),
    (["--inference-epsilon", "1", "--inference-sensitivity", "0"],
     "--inference-sensitivity must be > 0, got 0.0"),
    (["--inference-epsilon", "1", "--inference-sensitivity", "1", "--inference-rate", "0"],
     "--inference-rate must be in (0, 1], got 0.0"),
    (["--inference-sensitivity", "1"], "--inference-sensitivity applies to --inference-epsilon"),
    (["--freq", "W"], "--freq applies to --data PATH (your own CSV) only"),
    (["--model", "deepar", "--grad-sample-mode", "ghost", "--lstm-impl", "opacus"],
     "--grad-sample-mode ghost needs --lstm-impl fast"),
    (["--data", "/no/such/panel.csv"], "--data '/no/such/panel.csv': no such file"),
]


@pytest.mark.parametrize("argv, message", FLAG_ERRORS,
                         ids=[" ".join(a) for a, _ in FLAG_ERRORS])
def test_each_flag_error_names_the_flag_and_exits_2(capsys, tmp_path, argv, message):
    err = _error(capsys, *argv, "--output", str(tmp_path / "out"), "--no-progress")
    assert message in err
    assert "prediction_length" not in err and "batch_size" not in err  # parameter names


def test_the_check_names_the_flag_when_called_without_the_console(capsys, tmp_path):
    # cli.main (the full parser) runs the same checks inside run_forecast
    assert cli.main(["forecast", "--prediction-length", "-3", "--output",
                     str(tmp_path / "out")]) == 2
    assert "--prediction-length must be >= 1, got -3" in capsys.readouterr().err


def test_device_cuda_without_cuda_names_the_flag(capsys, tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is available")
    assert cli.main(["forecast", "--device", "cuda", "--num-series", "3", "--output",
                     str(tmp_path / "out")]) == 2  # torch knows: checked first in the run
    assert "--device cuda: no CUDA device is available" in capsys.readouterr().err


def test_a_value_argparse_cannot_read_is_a_usage_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as stop:
        console.main(["forecast", "--prediction-length", "abc"])
    assert stop.value.code == 2
    assert "--prediction-length: invalid int value: 'abc'" in capsys.readouterr().err


def test_bad_freq_with_data_names_the_flag(capsys, panel_csv):
    err = _error(capsys, "--data", panel_csv, "--freq", "XYZ", "--no-progress")
    assert "--freq 'XYZ'" in err and "not a pandas frequency" in err


# ---- the --data file: read and checked before the training code -------------------------------
def test_empty_csv(capsys, tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("")
    assert f"the CSV file {str(path)!r} is empty" in _error(capsys, "--data", str(path))


def test_header_only_csv(capsys, tmp_path):
    path = tmp_path / "header.csv"
    path.write_text("item_id,timestamp,target\n")
    assert "has no rows" in _error(capsys, "--data", str(path))


def test_duplicate_timestamp_names_series_and_lines(capsys, tmp_path):
    path = _long_csv(tmp_path / "dup.csv", {"a": _monthly(30) + ["2000-03-01"]})
    err = _error(capsys, "--data", path)
    assert "duplicate timestamp 2000-03-01 in series 'a' (line 4 and line 32)" in err


def test_unparseable_timestamp_names_line_and_value(capsys, tmp_path):
    stamps = _monthly(30)
    stamps[5] = "not a date"
    err = _error(capsys, "--data", _long_csv(tmp_path / "bad.csv", {"a": stamps}))
    assert "unparseable timestamps in column 'timestamp' (1 value(s)): line 7: 'not a date'" in err


def test_too_short_series_name_min_length_and_prediction_length(capsys, tmp_path):
    path = _long_csv(tmp_path / "short.csv", {"a": _monthly(10), "b": _monthly(11)})
    err = _error(capsys, "--data", path, "--prediction-length", "6")
    assert "no series left" in err
    assert "max(--min-length 1, 2 × --prediction-length 6) = 12 steps" in err


@pytest.mark.parametrize("argv, message", [
    (["--num-series", "4"], "--num-series must be in [1, 3], got 4"),
    (["--batch-size", "4"], "3 training series (after exclusions) but --batch-size 4"),
    (["--dataset-size", "5"], "--dataset-size 5 declares more series than the panel holds (3"),
    (["--dataset-size", "2", "--top-level", "shuffle"], "only --top-level wor"),
    (["--dataset-size", "2", "--batch-size", "3"], "--batch-size 3 exceeds --dataset-size 2"),
    # issue 47: a context or season longer than every training series (28 steps after the
    # default monthly horizon 12), and an epoch count beyond the step limit
    (["--context-length", "100000"], "--context-length 100000 exceeds the longest training "
                                     "series (28 steps"),
    (["--season-length", "29"], "--season-length 29 exceeds the longest training series"),
    (["--epochs", "1e12"], "--epochs 1e+12 runs more than 1000000 steps"),
])
def test_data_dependent_flag_errors_name_the_flag(capsys, panel_csv, argv, message):
    assert message in _error(capsys, "--data", panel_csv, *argv)


def test_checked_data_fits_the_batch_to_the_panel(panel_csv):
    args = console.forecast_parser().parse_args(["--data", panel_csv, "--prediction-length",
                                                 "6"])
    checked = load_checked_data(args, check_arguments(args))
    assert (len(checked.train), checked.train.min_length, checked.batch_size) == (3, 34, 3)
    assert checked.batch_size_source == "default min(64, N = 3)"


# ---- the horizon's default per frequency (issue 47) ------------------------------------------
@pytest.mark.parametrize("freq, days, horizon", [
    ("YS", None, 6), ("QS", None, 8), ("MS", None, 12), ("W-MON", None, 13), ("D", None, 14),
    ("h", None, 24)])
def test_a_left_out_horizon_is_the_frequencys_default(tmp_path, freq, days, horizon):
    stamps = [str(d) for d in pd.date_range("2000-01-03", periods=80, freq=freq)]
    path = _long_csv(tmp_path / "p.csv", {"a": stamps, "b": stamps[:11]})
    args = console.forecast_parser().parse_args(["--data", path])
    checked = load_checked_data(args, check_arguments(args))
    assert args.prediction_length == horizon == checked.test_steps
    record = checked.dataset_record()
    assert record["prediction_length_source"].startswith("default for freq")
    # the short series is excluded by the default horizon's rule (2 × h steps), named
    assert [e["item_id"] for e in record["excluded"]] == ["b"] and record["num_series"] == 1
    assert record["min_length"] == 2 * horizon
    # the bundled (monthly) panel and a given --freq decide the horizon before reading
    args = console.forecast_parser().parse_args(["--data", path, "--freq", freq])
    load_checked_data(args, check_arguments(args))
    assert args.prediction_length == horizon
    given = console.forecast_parser().parse_args(["--data", path, "--prediction-length", "3"])
    assert load_checked_data(given, check_arguments(given)).prediction_length_source == "given"


# ---- mixed timestamp formats ----------------------------------------------------------------
def test_mixed_timestamp_formats_are_named_as_a_mix(capsys, tmp_path):
    stamps = _monthly(30)
    stamps[3] = "04/01/2000"  # parses on its own (month first), not in the column's ISO format
    path = _long_csv(tmp_path / "mixed.csv", {"a": stamps})
    err = _error(capsys, "--data", path)
    assert "mixed timestamp formats in column 'timestamp': 2 formats" in err
    assert "%Y-%m-%d (29 value(s), e.g. line 2: '2000-01-01')" in err
    assert "%m/%d/%Y (1 value(s), e.g. line 5: '04/01/2000')" in err
    assert "day and month cannot be told apart" in err and "unparseable" not in err


# ---- frequency-neutral report keys ---------------------------------------------------------
def test_dataset_record_counts_test_steps_of_any_frequency(tmp_path):
    weeks = [str(d.date()) for d in pd.date_range("2020-01-06", periods=40, freq="W-MON")]
    path = _long_csv(tmp_path / "weekly.csv", {"a": weeks, "b": weeks})
    args = console.forecast_parser().parse_args(["--data", path, "--prediction-length", "8"])
    record = load_checked_data(args, check_arguments(args)).dataset_record()
    assert record["freq"] == "W" and record["test_steps"] == 8
    assert record["min_train_length"] == 32 and record["num_series"] == 2
    assert not any("month" in key for key in record)


# ---- nothing heavy before the checks pass ---------------------------------------------------
def test_forecast_help_and_input_errors_import_no_heavy_package(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    dup = _long_csv(tmp_path / "dup.csv", {"a": _monthly(30) + ["2000-03-01"]})
    runs = {"help": ["forecast", "--help"], "flag": ["forecast", "--prediction-length", "-3"],
            "missing": ["forecast", "--data", str(tmp_path / "missing.csv")],
            "empty": ["forecast", "--data", str(empty)], "dup": ["forecast", "--data", dup],
            "schemes": ["schemes"]}
    done = _python(
        "import sys, json\nfrom opacus_structured import console\n"
        f"argv = json.loads({json.dumps(json.dumps(runs))})\n"
        "for name, args in argv.items():\n"
        "    try:\n        code = console.main(args)\n"
        "    except SystemExit as stop:\n        code = stop.code\n"
        f"    print('RESULT', name, code, sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    assert done.returncode == 0, done.stderr
    results = [line.split(" ", 3)[1:] for line in done.stdout.splitlines()
               if line.startswith("RESULT")]
    assert results == [["help", "0", "[]"], ["flag", "2", "[]"], ["missing", "2", "[]"],
                       ["empty", "2", "[]"], ["dup", "2", "[]"], ["schemes", "0", "[]"]]


def test_fast_forecast_help_is_the_full_parsers(capsys):
    with pytest.raises(SystemExit):
        console.main(["forecast", "--help"])
    fast = capsys.readouterr().out
    cli._load_plugins(["forecast"])
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["forecast", "--help"])
    assert fast == capsys.readouterr().out and "--prediction-length" in fast


# ---- schemes from the shipped index ---------------------------------------------------------
def test_the_shipped_schemes_index_is_current():
    """Fails after a scheme is edited: regenerate with
    ``python -c "from opacus_structured import cli; cli.write_schemes_index()"``."""
    index = json.loads(console.SCHEMES_INDEX.read_text(encoding="utf-8"))
    assert index["digest"] == console.schemes_sources_digest(), (
        "data/schemes_index.json is stale: run python -c \"from opacus_structured import cli; "
        "cli.write_schemes_index()\"")
    assert console.read_schemes_index() == cli.scheme_rows()


def test_schemes_prints_the_same_from_the_index_and_from_the_schemes(capsys):
    for as_json in (False, True):
        extra = ["--json"] if as_json else []
        assert console.main(["schemes", *extra]) == 0
        fast = capsys.readouterr().out
        assert cli.main(["schemes", *extra]) == 0  # the full parser computes the rows
        assert fast == capsys.readouterr().out
    poisson = [r for r in json.loads(fast) if r["scheme"] == "poisson"]
    assert poisson == [{"scheme": "poisson", "flags": ["--sample-rate"], "summary":
                        "Poisson-subsampled Gaussian (plain DP-SGD), add/remove relation"}]


def test_a_stale_index_is_not_used(monkeypatch, tmp_path):
    stale = tmp_path / "schemes_index.json"
    stale.write_text(json.dumps({"digest": "0" * 64, "rows": [{"scheme": "made-up"}]}))
    monkeypatch.setattr(console, "SCHEMES_INDEX", stale)  # what the console's schemes reads
    assert console.read_schemes_index(console.SCHEMES_INDEX) is None


# A subprocess for the command list of ``python -m opacus_structured.cli --help``.
@pytest.mark.slow  # 2 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_python_m_cli_lists_every_command():
    done = subprocess.run([sys.executable, "-m", "opacus_structured.cli", "--help"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    for name, _ in (*console.BUILTIN_COMMANDS, *console.plugin_commands()):
        assert name in done.stdout
    assert "forecast" in done.stdout and "pretrain" in done.stdout
