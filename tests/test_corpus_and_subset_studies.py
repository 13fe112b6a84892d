"""The study harnesses of issue 30's last levers: ``benchmarks/fine_tune_subset_study.py``
trains exactly the subset it names and releases DLinear's own layout, and
``benchmarks/corpus_disjointness.py`` sums at every phase and finds a coarser-frequency copy."""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("gluonts")
warnings.filterwarnings("ignore", category=FutureWarning)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import fine_tune_subset_study as subset_study  # noqa: E402

from opacus_structured.forecasting import training  # noqa: E402
from opacus_structured.forecasting.data import Panel  # noqa: E402
from opacus_structured.forecasting.estimators import prepare_estimator  # noqa: E402

H, CTX = 4, 12


def _panel(n=6, length=48):
    rng = np.random.default_rng(0)
    return Panel(tuple((10 + np.cumsum(rng.normal(0, 1, length))).astype(np.float32)
                       for _ in range(n)), tuple(pd.Period("2000-01", "M") for _ in range(n)),
                 tuple(f"s{i}" for i in range(n)), "M")


def _public_state():
    torch.manual_seed(7)
    prepared = prepare_estimator("dlinear", freq="M", prediction_length=H, context_length=CTX,
                                 batch_size=4)
    return {k: v.detach().clone() for k, v in prepared.module.model.state_dict().items()}


@pytest.mark.slow  # 5-30 s: out of the README command (issue 41: <= 5 min); CI runs it
@pytest.mark.parametrize("subset,moved", [
    # the skip (baseline_skip and, with the recipe's local forecasts, scale_skip) always trains
    ("head", {"args_proj", "baseline_skip", "scale_skip"}),
    pytest.param("bias", {"args_proj", "baseline_skip", "scale_skip", "linear_seasonal.bias",
                          "linear_trend.bias"}, marks=pytest.mark.slow),
    ("lora-2", {"args_proj", "baseline_skip", "scale_skip", "linear_seasonal.weight",
                "linear_trend.weight"}),
    pytest.param("all", {"args_proj", "baseline_skip", "scale_skip", "linear_seasonal",
                         "linear_trend"}, marks=pytest.mark.slow),
])
def test_subset_harness_trains_only_its_subset_and_releases_dlinear(subset, moved):
    state = _public_state()
    stock = training._window_module
    subset_study.install(subset)
    try:
        res = training.train_forecaster("dlinear", _panel(), prediction_length=H,
                                        context_length=CTX, batch_size=4, max_steps=3, lr=1e-2,
                                        seed=0, epsilon=4.0, delta=1e-5, dataset_size=6,
                                        init_state=state, init_public=True,
                                        trained_parameters="all")  # the harness chooses
    finally:
        training._window_module = stock
    net = subset_study.released(res.prepared.module.model)
    after = net.state_dict()
    assert set(after) == set(state)  # DLinear's own layout (adapters merged)
    for name, before in state.items():
        changed = not torch.equal(after[name], before)
        assert changed == any(name.startswith(m) for m in moved), (subset, name)
    assert all(p.requires_grad for p in net.parameters())
    assert res.create_predictor(zero_shot_weight=0.25) is not None


def test_disjointness_aggregate_sums_at_every_phase():
    import corpus_disjointness as cd

    sums = cd.aggregate([np.arange(7.0)], 3)
    assert [(i, list(y)) for i, y in sums] == [(0, [3.0, 12.0]), (0, [6.0, 15.0])]
    # phase 2 leaves one full block only: left out (a window needs two values)


def test_disjointness_finds_a_quarterly_panel_that_is_a_summed_monthly_series():
    import corpus_disjointness as cd

    rng = np.random.default_rng(1)
    monthly = [np.exp(np.cumsum(rng.normal(0, 0.05, 150))) * 100 for _ in range(3)]
    quarterly_corpus = [np.exp(np.cumsum(rng.normal(0, 0.05, 60))) for _ in range(3)]
    corpora = {"M": (monthly, ["m0", "m1", "m2"]), "Q": (quarterly_corpus, ["q0", "q1", "q2"]),
               "Y": ([], [])}
    copy = 2.5 * monthly[1][1:148].reshape(-1, 3).sum(axis=1)  # by quarter, phase 1
    other = np.exp(np.cumsum(rng.normal(0, 0.05, 49)))
    hits = cd.compare("Q", [other, copy], corpora)
    assert {h["corpus"] for h in hits} == {"m1"} and all(h["at"] == "Q" for h in hits)
    assert cd.compare("Q", [other], corpora) == []


def test_lags_study_swaps_deepar_lags_and_caches_their_weights_apart(monkeypatch, tmp_path):
    import deepar_lags_study as lags_study

    from opacus_structured.forecasting import estimators, pretraining

    monkeypatch.setenv("OPACUS_STRUCTURED_CACHE", str(tmp_path))
    monkeypatch.setattr(estimators, "build_estimator", estimators.build_estimator)
    monkeypatch.setattr(estimators, "_stock_build_estimator", estimators.build_estimator,
                        raising=False)
    monkeypatch.setattr(estimators, "_stock_cache", str(tmp_path), raising=False)
    lags_study.use_lags("one-season", 24)
    est = estimators.prepare_estimator("deepar", freq="h", prediction_length=4).estimator
    assert list(est.lags_seq) == [1, 2, 3, 24, 25]
    assert pretraining.cache_dir() == str(tmp_path / "lags-one-season" / "pretrained")
    lags_study.use_lags("monthly", 24)
    est = estimators.prepare_estimator("deepar", freq="h", prediction_length=4).estimator
    assert list(est.lags_seq) == [1, 2, 3, 12, 13]  # the product's lags
    assert pretraining.cache_dir() == str(tmp_path / "pretrained")
