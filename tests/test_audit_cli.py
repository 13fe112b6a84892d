"""``opacus-structured audit`` (issue 19): output, plot, errors, exit status, lazy parser."""

import json
import subprocess
import sys

import numpy as np
import pytest

from opacus_structured.cli import main


def run_cli(capsys, *argv):
    code = main(["audit", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def simulated_gaussian_audit(reported_epsilon, mu=4.0, runs=300):
    """A stand-in for ``run_audit``: scores of one Gaussian release of a Dirac canary (exactly
    μ-GDP) and a reported ε of our choosing, to exercise the command's verdict."""
    from opacus_structured.audit.estimators import AuditScores

    def fake_run_audit(scheme, *, runs, seed, path, mutation, canary, progress, **flags):
        rng = np.random.default_rng(seed)
        progress(2 * runs, 2 * runs)
        return AuditScores(rng.normal(mu, 1, runs), rng.normal(0, 1, runs), reported_epsilon,
                           flags["delta"], {"scheme": scheme, "flags": flags})
    return fake_run_audit


def test_audit_json_end_to_end(capsys):
    """A real (small) audit of the Poisson pipeline: a labelled lower bound below the claim."""
    code, out, err = run_cli(capsys, "poisson", "--runs", "20", "--seed", "0", "--json",
                             "--no-progress")
    record = json.loads(out)
    assert code == 0
    assert record["kind"] == "empirical lower bound" and record["method"] == "clopper-pearson"
    assert record["runs"] == 40 and record["runs_per_side"] == 20 and record["seed"] == 0
    assert record["reported_epsilon"] > 0 and record["confidence"] == 0.95
    assert 0 <= record["epsilon_lower_bound"] <= record["reported_epsilon"]
    assert record["ratio"] == pytest.approx(record["epsilon_lower_bound"]
                                            / record["reported_epsilon"])
    assert record["violation"] is False and record["settings"]["sample_rate"] == 0.5


# The text report and a plot (test_audit_json_end_to_end stays).
@pytest.mark.slow  # 3 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_audit_text_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "roc.png"
    code, out, err = run_cli(capsys, "poisson", "--runs", "10", "--seed", "1", "--steps", "1",
                             "--plot", str(plot), "--no-progress")
    assert code == 0 and plot.stat().st_size > 10_000
    assert "EMPIRICAL LOWER BOUND" in out and "reported epsilon" in out
    assert "audited / reported" in out and f"ROC plot: {plot}" in out
    assert "no predicted curve" not in out  # the accountant's trade-off curve is drawn


def test_audit_flags_a_pipeline_leaking_more_than_reported(capsys, monkeypatch):
    """Exit status 1 and a VIOLATION line when the assumption-free lower bound exceeds the
    reported ε (a 4-GDP mechanism, ε(0.05) ≈ 9.6, reported as ε = 1); the GDP estimate above
    it is flagged as assumption-based, exit status 0."""
    from opacus_structured.audit import pipelines

    monkeypatch.setattr(pipelines, "run_audit", simulated_gaussian_audit(1.0))
    code, out, err = run_cli(capsys, "poisson", "--runs", "300", "--seed", "2", "--no-progress")
    assert code == 1 and "VIOLATION" in out and "exceeds the reported" in err
    code, out, err = run_cli(capsys, "poisson", "--runs", "300", "--seed", "2", "--method",
                             "gdp", "--json", "--no-progress")
    record = json.loads(out)
    assert code == 0 and record["exceeds_reported"] and not record["violation"]
    assert "Gaussian" in record["assumption"]
    monkeypatch.setattr(pipelines, "run_audit", simulated_gaussian_audit(20.0))
    code, out, err = run_cli(capsys, "poisson", "--runs", "300", "--seed", "2", "--json",
                             "--no-progress")
    assert code == 0 and json.loads(out)["violation"] is False


def test_audit_passes_the_truncated_design_and_the_new_paths(capsys, monkeypatch):
    """``--design add`` (truncated Poisson) and the paths ddp-ghost / ddp-bookkeeping /
    lightning reach ``run_audit`` as given; a bad design is a one-line error."""
    from opacus_structured.audit import pipelines

    seen = []
    fake = simulated_gaussian_audit(30.0)

    def recording(scheme, **kw):
        seen.append((scheme, kw["path"], kw.get("design")))
        return fake(scheme, **kw)

    monkeypatch.setattr(pipelines, "run_audit", recording)
    for scheme, argv in [("truncated-poisson", ["--design", "add", "--path", "lightning"]),
                         ("gdp-filter", ["--path", "ddp-bookkeeping"]),
                         ("balls-in-bins", ["--path", "ddp-ghost"])]:
        code, out, err = run_cli(capsys, scheme, "--runs", "20", "--seed", "0", "--json",
                                 "--no-progress", *argv)
        assert code == 0, err
    assert seen == [("truncated-poisson", "lightning", "add"),
                    ("gdp-filter", "ddp-bookkeeping", None), ("balls-in-bins", "ddp-ghost", None)]
    monkeypatch.undo()
    code, out, err = run_cli(capsys, "truncated-poisson", "--design", "remove", "--runs", "4",
                             "--no-progress")
    assert code == 2 and "design must be one of" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    (["--runs", "1"], "--runs must be >= 2, got 1"),
    (["--confidence", "1.5"], "confidence must be in [0.5, 1), got 1.5"),
    (["--noise-multiplier", "-1"], "noise_multiplier must be > 0"),
])
def test_audit_bad_input_is_one_line(capsys, argv, message):
    code, out, err = run_cli(capsys, "poisson", "--no-progress", *argv)
    assert code == 2 and message in err and err.count("\n") == 1 and out == ""


@pytest.mark.parametrize("argv", [["no-such-scheme"], ["poisson", "--num-bins", "3"], []])
def test_audit_unknown_scheme_or_flag_is_a_usage_error(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(["audit", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "usage: opacus-structured" in err
    assert ("--num-bins" in err) if "--num-bins" in argv else ("SCHEME" in err)


def test_every_audit_flag_has_help(capsys):
    from opacus_structured.audit.pipelines import audit_registry

    for scheme in audit_registry():
        with pytest.raises(SystemExit):
            main(["audit", scheme, "--help"])
        out = capsys.readouterr().out
        for line in ("--runs", "--confidence", "--method", "--seed", "--path", "--mutation",
                     "--canary", "--plot", "--json"):
            assert line in out
        assert "scheme setting" not in out  # every scheme flag has its own help line


# A subprocess import check (test_cli_check_first's stays).
@pytest.mark.slow  # 3 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_building_the_command_line_imports_no_torch():
    """The audit parser adds its torch-backed scheme flags only when `audit` is parsed; the
    estimators and the report need no torch."""
    code = ("import argparse, sys\n"
            "from opacus_structured.audit import estimators, report\n"
            "from opacus_structured.commands import audit\n"
            "p = argparse.ArgumentParser(); audit._add_arguments(p); p.format_usage()\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"
