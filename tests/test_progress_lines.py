"""Progress without a terminal (issue 41, item 2): where stderr is not a TTY (logs, CI,
notebooks), pretraining and DP training print plain progress lines at most every ~10 s
(time-based), and the last step; never a flood."""

import re

import pytest

from opacus_structured import _progress


class _Clock:
    """A clock that advances ``step`` seconds at every reading."""

    def __init__(self, step):
        self.t, self.step = 1000.0, step

    def __call__(self):
        self.t += self.step
        return self.t


def test_line_progress_is_rate_limited_by_time(monkeypatch):
    clock = _Clock(1.0)  # one reading per update: 1 s per unit
    monkeypatch.setattr(_progress, "now", clock)
    lines = []
    progress = _progress.LineProgress("pretraining x", 95, lines.append)
    written = [done for done in range(1, 96) if progress.update(done)]
    assert written == [10, 20, 30, 40, 50, 60, 70, 80, 90, 95]  # every 10 s, and the end
    assert lines[0] == "pretraining x: 10/95 steps (10 s elapsed, about 85 s left)"
    assert lines[-1] == "pretraining x: 95/95 steps (1.6 min elapsed)"
    # fast steps: one line for the whole run (the last)
    monkeypatch.setattr(_progress, "now", _Clock(0.001))
    lines.clear()
    progress = _progress.LineProgress("fast", 1000, lines.append)
    assert sum(progress.update(done) for done in range(1, 1001)) == 1
    assert lines == ["fast: 1000/1000 steps (1 s elapsed)"]


def test_lines_are_wanted_only_without_a_terminal(monkeypatch):
    class _Tty:
        def isatty(self):
            return True

    monkeypatch.delenv(_progress.ENV, raising=False)
    monkeypatch.setattr("sys.stderr", _Tty())
    assert not _progress.lines_wanted()  # a bar is drawn there
    monkeypatch.setattr("sys.stderr", object())  # no isatty: a pipe-like stream
    assert _progress.lines_wanted()
    monkeypatch.setenv(_progress.ENV, "0")
    assert not _progress.lines_wanted()  # progress off


def _times(lines):
    return [float(re.search(r"\((\d+) s elapsed", line).group(1)) for line in lines]


def test_pretraining_prints_rate_limited_lines(monkeypatch, tmp_path):
    """A real (tiny) pretraining run with a clock that advances 3 s per reading."""
    pytest.importorskip("gluonts")
    from opacus_structured.forecasting import pretraining

    monkeypatch.setattr(_progress, "now", _Clock(3.0))
    recipe = pretraining.PretrainRecipe(num_series=12, min_length=40, max_length=60, steps=20,
                                        batch_size=4)
    lines = []
    pretraining.pretrain("dlinear", prediction_length=4, recipe=recipe, log=lines.append)
    assert lines[-1].startswith("pretraining dlinear: 20/20 steps (")
    assert 5 <= len(lines) <= 7  # 20 readings × 3 s = 60 s: a line per ~10 s, not per step
    gaps = [b - a for a, b in zip(_times(lines), _times(lines)[1:], strict=False)]
    assert all(gap >= 9 for gap in gaps[:-1])


def test_dp_training_prints_lines_on_a_captured_stderr(monkeypatch, capsys):
    """DP training with its log on stderr, stderr captured (not a terminal), no bar: lines
    at most every ~10 s of the (patched) clock, the last step included."""
    pytest.importorskip("gluonts")
    import sys

    from opacus_structured.forecasting.data import load_us_employment, train_test_split
    from opacus_structured.forecasting.training import train_forecaster

    monkeypatch.delenv(_progress.ENV, raising=False)
    assert _progress.lines_wanted()  # pytest's capture is no terminal
    monkeypatch.setattr(_progress, "now", _Clock(4.0))
    train, _ = train_test_split(load_us_employment().subset(range(6)), 6)
    train_forecaster("dlinear", train, prediction_length=6, batch_size=3, noise_multiplier=1.0,
                     delta=1e-5, max_steps=12, seed=0, init_seed=0, progress=False,
                     discretization=1e-3, dataset_size=6, log=lambda m: print(m, file=sys.stderr))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if re.match(r"dlinear DP \(sigma=1\): ", line)]
    assert lines[-1].startswith("dlinear DP (sigma=1): 12/12 steps (")
    assert 3 <= len(lines) <= 6  # 12 steps × 4 s: a line per ~10 s, not per step
    gaps = [b - a for a, b in zip(_times(lines), _times(lines)[1:], strict=False)]
    assert all(gap >= 10 for gap in gaps[:-1])


# A forecaster's calibration for its progress lines (no privacy bound).
@pytest.mark.slow  # 2 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_noise_calibration_prints_a_heartbeat(monkeypatch, capsys):
    """σ calibrated for a target ε: its ε evaluations show up, at most every ~10 s."""
    pytest.importorskip("gluonts")
    import sys

    from opacus_structured.forecasting.data import load_us_employment, train_test_split
    from opacus_structured.forecasting.training import train_forecaster

    monkeypatch.delenv(_progress.ENV, raising=False)
    monkeypatch.setattr(_progress, "now", _Clock(4.0))
    train, _ = train_test_split(load_us_employment().subset(range(6)), 6)
    train_forecaster("dlinear", train, prediction_length=6, batch_size=3, epsilon=4.0,
                     delta=1e-5, max_steps=2, seed=0, init_seed=0, progress=False,
                     discretization=1e-3, dataset_size=6,
                     log=lambda m: print(m, file=sys.stderr))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("calibrating noise: ")]
    assert lines and all(re.fullmatch(r"calibrating noise: \d+ epsilon evaluations, last "
                                      r"sigma=\S+ gave epsilon=\S+ \(\d+ s elapsed\)", line)
                         for line in lines)
    counts = [int(line.split(": ")[1].split()[0]) for line in lines]
    assert counts == sorted(counts) and len(set(counts)) == len(counts)
    gaps = [b - a for a, b in zip(_times(lines), _times(lines)[1:], strict=False)]
    assert all(gap >= 10 for gap in gaps)
