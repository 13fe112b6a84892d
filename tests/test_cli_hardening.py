"""Issue 20, command-line hardening: honest flags, reasons for ε = ∞, no tracebacks, progress,
fast start (lazy loading) with Opacus registration intact."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from opacus_structured import _progress, cli, console
from opacus_structured.schemes import SCHEMES, Scheme

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "OPACUS_STRUCTURED_PROGRESS": "0"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def _json_run(capsys, *argv) -> dict:
    assert cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ---- 1. flags that lie ----------------------------------------------------------------------
def test_poisson_epochs_are_floor_one_over_q_steps(capsys):
    by_epochs = _json_run(capsys, "epsilon", "poisson", "--sample-rate", "0.3",
                          "--noise-multiplier", "2", "--epochs", "2", "--delta", "1e-5")
    by_steps = _json_run(capsys, "epsilon", "poisson", "--sample-rate", "0.3",
                         "--noise-multiplier", "2", "--steps", "6", "--delta", "1e-5")
    assert by_epochs["steps"] == 6  # floor(1/0.3) = 3 steps per epoch, as Opacus counts them
    assert by_epochs["epsilon"] == by_steps["epsilon"]


def test_gdp_epochs_are_one_step_each(capsys):
    rec = _json_run(capsys, "epsilon", "gdp", "--noise-multiplier", "10", "--epochs", "100",
                    "--delta", "1e-5")
    assert rec["steps"] == 100


@pytest.mark.slow
@pytest.mark.long  # 15-45 s: left out of CI's 30-minute budget (-m long)
def test_calibrate_accepts_epochs_for_poisson(capsys):
    rec = _json_run(capsys, "calibrate", "poisson", "--sample-rate", "0.5", "--epochs", "1",
                    "--target-epsilon", "2", "--delta", "1e-5", "--no-progress")
    assert rec["steps"] == 2 and rec["epsilon"] <= 2


def _walk(parser: argparse.ArgumentParser, path=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))
        else:
            yield path, parser, action


def _full_parser() -> argparse.ArgumentParser:
    cli._load_plugins([])  # every plugin command (those whose extra is installed)
    return cli.build_parser()


def test_epochs_offered_exactly_where_the_scheme_has_epochs():
    parser = _full_parser()
    for path, sub, action in _walk(parser):
        if len(path) == 2 and path[0] in ("epsilon", "calibrate") and action.dest == "help":
            cls = SCHEMES[path[1]]
            has = cls.steps_per_epoch is not Scheme.steps_per_epoch
            assert ("--epochs" in sub._option_string_actions) == has, path


def test_every_flag_has_help_text():
    missing = [(" ".join(path), action.option_strings or action.dest)
               for path, _, action in _walk(_full_parser())
               if not isinstance(action, (argparse._HelpAction, argparse._VersionAction))
               and not action.help]
    assert not missing, missing


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
@pytest.mark.slow
def test_examples_parse_arguments_before_working(example):
    done = subprocess.run([sys.executable, str(ROOT / "examples" / example), "--help"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:")
    assert "step/s" not in done.stderr  # no training started


# ---- 2. a reason next to every ε = ∞ ----------------------------------------------------------
_BASELINE = ["epsilon", "truncated-poisson", "--dataset-size", "1000", "--sample-rate", "0.01",
             "--max-batch-size", "15", "--noise-multiplier", "1", "--steps", "1000", "--delta",
             "1e-5", "--analysis", "baseline"]


def test_infinite_epsilon_comes_with_a_reason_in_text_and_json(capsys):
    assert cli.main(_BASELINE) == 0
    out = capsys.readouterr().out
    assert "epsilon = inf" in out and "epsilon is infinite:" in out and "eta = " in out
    rec = _json_run(capsys, *_BASELINE)
    assert math.isinf(rec["epsilon"])
    assert "truncated" in rec["epsilon_infinite_reason"]
    assert "--analysis tight" in rec["epsilon_infinite_reason"]


def test_generic_reason_for_schemes_without_their_own():
    reason = cli._infinite_epsilon_reason(SCHEMES["poisson"](sample_rate=0.1), 1.0, 10, 1e-9)
    assert "infinite privacy loss" in reason and "--delta" in reason


def test_monte_carlo_infinite_epsilon_names_the_samples():
    scheme = SCHEMES["bminsep-mc"](bands=1, dataset_size=100, batch_size=10.0)
    reason = cli._infinite_epsilon_reason(scheme, 1.0, 2, 1e-3)
    assert "--samples" in reason and "Monte Carlo" in reason


# ---- 3. no tracebacks; no hidden curves -----------------------------------------------------
_SMALL_PLOT = ["plot", "structured", "--num-series", "8", "--series-length", "6",
               "--context-length", "1", "--forecast-length", "1", "--batch-size", "2",
               "--noise-multiplier", "1", "--steps", "1", "--points", "4",
               "--curve", "top_level=deterministic", "--curve", "top_level=wor", "--no-progress"]


# A plot written by the CLI (no privacy bound).
@pytest.mark.slow  # 2 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_plot_creates_the_output_directory(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    target = tmp_path / "new" / "dir" / "x.png"
    assert cli.main([*_SMALL_PLOT, "-o", str(target)]) == 0
    assert target.is_file()


# A plot's error message (no privacy bound).
@pytest.mark.slow  # 1 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_plot_unwritable_output_is_a_one_line_error(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert cli.main([*_SMALL_PLOT, "-o", str(blocker / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("opacus-structured: error: cannot write") and "\n" not in err


def test_coinciding_curves_are_found():
    eps = np.array([0.1, 1.0])
    rows = [dict(epsilons=eps, deltas=np.array([0.5, 0.1])),
            dict(epsilons=eps, deltas=np.array([0.4, 0.1])),
            dict(epsilons=eps, deltas=np.array([0.5, 0.1]))]
    from opacus_structured.commands.plot_structured import coinciding_curves

    assert coinciding_curves(rows) == [None, None, 0]


# ---- 4. progress ----------------------------------------------------------------------------
def test_progress_shown_only_on_a_terminal_and_never_with_no_progress(monkeypatch):
    monkeypatch.delenv(_progress.ENV, raising=False)
    monkeypatch.setattr(sys, "stderr", open(os.devnull, "w"))  # not a TTY
    assert not _progress.enabled()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert _progress.enabled() and not _progress.enabled(no_progress=True)
    monkeypatch.setenv(_progress.ENV, "0")
    assert not _progress.enabled()


@pytest.mark.slow
@pytest.mark.long  # 15-45 s: left out of CI's 30-minute budget (-m long)
def test_epsilon_and_calibrate_draw_a_bar_on_stderr_unless_no_progress(monkeypatch, capsys):
    monkeypatch.setenv(_progress.ENV, "1")
    args = ["calibrate", "poisson", "--sample-rate", "0.5", "--steps", "2", "--target-epsilon",
            "2", "--delta", "1e-5"]
    assert cli.main(args) == 0
    captured = capsys.readouterr()
    assert "calibrating poisson" in captured.err and "noise multiplier =" in captured.out
    assert cli.main([*args, "--no-progress"]) == 0
    assert capsys.readouterr().err == ""
    assert cli.main(["epsilon", "poisson", "--sample-rate", "0.5", "--steps", "2",
                     "--noise-multiplier", "1", "--delta", "1e-5"]) == 0
    assert "pricing poisson" in capsys.readouterr().err


def test_a_slow_calibration_announces_a_time_estimate(monkeypatch):
    clock = iter([0.0, 5.0])
    monkeypatch.setattr(cli._progress, "now", lambda: next(clock))
    written = []

    class Bar:
        def update(self, n):
            pass

        def write(self, text, file=None):
            written.append(text)

    f = cli._calibration_progress(lambda s: 1.0 / s, True, Bar())
    assert f(2.0) == 0.5
    assert written and "one epsilon evaluation took 5.0 s" in written[0]
    assert "expect about 70 s" in written[0]  # 14 evaluations × 5 s


# ---- 5. lazy loading; registration with Opacus still on import ------------------------------
def test_import_opacus_structured_imports_no_heavy_dependency():
    done = _python("import sys, opacus_structured\n"
                   "print(sorted(m for m in ('torch', 'opacus', 'dp_accounting', 'scipy')"
                   " if m in sys.modules))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("order", ["opacus_structured first", "opacus first"])
@pytest.mark.slow
def test_registration_with_opacus_happens_on_import(order):
    first, second = (("opacus_structured", "opacus") if order == "opacus_structured first"
                     else ("opacus", "opacus_structured"))
    done = _python(
        f"import {first}\nimport {second}\n"
        "from opacus.accountants.registry import _ACCOUNTANTS\n"
        "from opacus import PrivacyEngine\n"
        "names = ['poisson', 'gdp-full-batch', 'truncated-poisson', 'structured', "
        "'individual-gdp', 'balls-in-bins']\n"
        "print([n for n in names if n not in _ACCOUNTANTS])\n"
        "print(type(PrivacyEngine(accountant='truncated-poisson').accountant).__module__)\n")
    assert done.returncode == 0, done.stderr
    missing, module = done.stdout.split("\n")[:2]
    assert missing == "[]" and module.startswith("opacus_structured.accountants")


@pytest.mark.slow  # 5-30 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_lazy_attributes_and_registry_lookups_load_the_layers():
    done = _python(
        "import opacus_structured as o\n"
        "from opacus_structured.schemes import PoissonScheme\n"
        "print(type(PoissonScheme(0.1).sampler(100)).__name__)\n"  # sampler registry lookup
        "print(o.make_private.__module__, o.PoissonAccountant.__name__, "
        "o.accountants.__name__)\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == [
        "PoissonBatchSampler",
        "opacus_structured.engine PoissonAccountant opacus_structured.accountants"]


# A subprocess import check (test_cli_check_first's stays).
@pytest.mark.slow  # 5 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_help_and_epsilon_import_neither_torch_nor_opacus():
    done = _python(
        "import sys\nfrom opacus_structured import console\n"
        "try:\n    console.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('HELP', sorted(m for m in ('torch', 'opacus', 'dp_accounting')"
        " if m in sys.modules))\n"
        "console.main(['epsilon', 'poisson', '--sample-rate', '0.1', '--steps', '3', "
        "'--noise-multiplier', '1', '--delta', '1e-5'])\n"
        "print('EPS', sorted(m for m in ('torch', 'opacus') if m in sys.modules))\n")
    assert done.returncode == 0, done.stderr
    assert "HELP []" in done.stdout and "EPS []" in done.stdout


def test_top_level_help_lists_the_commands_the_full_parser_has(capsys):
    plugins = console.plugin_commands()
    assert plugins is not None
    _full_parser()
    assert dict(plugins) == {name: entry[0] for name, entry in cli._COMMANDS.items()}
    with pytest.raises(SystemExit):
        console.main(["--help"])
    fast = capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--help"])
    assert fast == capsys.readouterr().out


def test_staged_progress_draws_each_stage(monkeypatch, capsys):
    monkeypatch.setenv(_progress.ENV, "1")
    with _progress.bar(desc="x", show=True) as b:
        cb = _progress.staged(b, "random-allocation-mf")
        cb("lower bound", 1, 4)
        assert b.total == 4 and b.n == 1 and "lower bound" in b.desc
        cb("PLD composition", 2, 10)
        assert b.total == 10 and b.n == 2 and "PLD composition" in b.desc


# Progress lines.
@pytest.mark.slow  # 4 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_random_allocation_mf_reports_its_stages(monkeypatch, capsys):
    monkeypatch.setenv(_progress.ENV, "1")
    assert cli.main(["epsilon", "random-allocation-mf", "--batches-per-epoch", "4", "--epochs",
                     "1", "--method", "conditional", "--noise-multiplier", "1", "--delta",
                     "1e-5"]) == 0
    captured = capsys.readouterr()
    assert "random-allocation-mf: " in captured.err and "epsilon = " in captured.out
