"""gluonts-native DP entry point (issue 17, deliverable 2): ``DPEstimator(estimator, ...)``
trains through ``train_forecaster`` and returns a gluonts ``PyTorchPredictor`` (subclass) that
carries its privacy report through ``serialize`` / ``Predictor.deserialize``."""

import json
import math
import shutil

import numpy as np
import pytest

pytest.importorskip("gluonts")
pytest.importorskip("lightning")

from gluonts.model.predictor import Predictor  # noqa: E402
from gluonts.torch.model.predictor import PyTorchPredictor  # noqa: E402
from gluonts.torch.model.simple_feedforward import SimpleFeedForwardEstimator  # noqa: E402
from tiny_estimators import H  # noqa: E402
from tiny_estimators import tiny_deepar as _deepar  # noqa: E402
from tiny_estimators import tiny_dlinear as _dlinear  # noqa: E402

from opacus_structured.forecasting.data import (  # noqa: E402
    Panel,
    load_us_employment,
    train_test_split,
)
from opacus_structured.forecasting.dp_estimator import (  # noqa: E402
    REPORT_FILE,
    DPEstimator,
    DPPyTorchPredictor,
)
from opacus_structured.forecasting.estimators import build_estimator, estimator_model  # noqa: E402
from opacus_structured.forecasting.training import TrainResult, train_forecaster  # noqa: E402

D = 1e-3  # coarse PLD grid (pessimistic), keeps the suite fast
TARGET, DELTA = 2.0, 1e-5


@pytest.fixture(scope="module")
def split():
    panel = load_us_employment().subset(range(0, 148, 12))  # 13 series of different lengths
    return train_test_split(panel, H)


@pytest.fixture(scope="module")
def trained(split):
    """One private DLinear run on a gluonts ListDataset with one series too short to keep."""
    train, _ = split
    with_short = Panel(train.targets + (np.ones(5, np.float32),),
                       train.starts + (train.starts[0],), train.item_ids + ("short",), "M")
    dataset = with_short.to_gluonts()  # a gluonts ListDataset
    dp = DPEstimator(_dlinear(), epsilon=TARGET, delta=DELTA, max_steps=3, discretization=D,
                     init_from="none")
    predictor = dp.train(dataset, min_length=20)
    return dp, predictor


def _quantiles(predictor, dataset, seed=0):
    import torch

    torch.manual_seed(seed)
    return [np.asarray(f.quantile(q)) for f in predictor.predict(dataset, num_samples=20)
            for q in (0.1, 0.5, 0.9)]


# ---- train returns a gluonts predictor with the report ------------------------------------------
def test_train_returns_pytorch_predictor_with_privacy_report(trained, split):
    dp, predictor = trained
    assert isinstance(predictor, PyTorchPredictor) and isinstance(predictor, DPPyTorchPredictor)
    assert predictor.prediction_length == H
    res = dp.last_result
    assert isinstance(res, TrainResult) and res.private and res.steps == 3
    rep = predictor.privacy_report
    assert 0 < rep["epsilon"] <= TARGET and rep["epsilon"] == res.epsilon
    assert rep["delta"] == DELTA and rep["target_epsilon"] == TARGET
    assert rep["noise_multiplier"] == res.noise_multiplier > 0
    assert rep["steps"] == 3 and rep["bound"] == "tight" and rep["private"] is True
    assert rep["not_private_reason"] is None and "seed" not in rep
    assert rep["model"] == "dlinear" and rep["estimator"].endswith("DLinearEstimator")
    scheme = rep["scheme"]
    assert scheme["num_series"] == 13 and scheme["batch_size"] == rep["batch_size"] == 4
    assert scheme["context_length"] == 8 and scheme["forecast_length"] == H
    assert scheme["series_length"] == split[0].min_length  # the short series is not counted
    assert (scheme["relation"], scheme["w"], scheme["theorem"]) == ("event", 1, "thm_4_4")
    # the data report: the excluded series and why
    assert rep["data"]["layout"] == "gluonts" and rep["data"]["num_series"] == 13
    assert rep["data"]["excluded"] == [{"item_id": "short", "reason": "5 steps < min_length 20"}]
    assert dp.last_data_report.num_input_series == 14
    json.dumps(rep, allow_nan=False)  # plain JSON


def test_gluonts_evaluation_runs_unchanged(trained, split):
    from gluonts.evaluation import Evaluator, make_evaluation_predictions

    _, predictor = trained
    _, test = split
    forecast_it, ts_it = make_evaluation_predictions(test.to_gluonts(), predictor=predictor,
                                                     num_samples=20)
    agg, per_item = Evaluator(num_workers=0)(ts_it, forecast_it)
    assert len(per_item) == len(test)
    assert math.isfinite(agg["mean_wQuantileLoss"]) and math.isfinite(agg["MASE"])


def test_serialize_deserialize_keeps_forecasts_and_report(trained, split, tmp_path):
    _, predictor = trained
    _, test = split
    path = tmp_path / "model"  # created by serialize
    predictor.serialize(path)
    assert json.loads((path / REPORT_FILE).read_text()) == predictor.privacy_report
    config = json.loads((path / "gluonts-config.json").read_text())
    assert config["type"] == "opacus_structured.forecasting.dp_predictor.DPPyTorchPredictor"
    before = _quantiles(predictor, test.to_gluonts())
    # a predictor saved before the class moved (dp_estimator re-exports it) loads too
    old = tmp_path / "saved-before-the-split"
    shutil.copytree(path, old)
    (old / "gluonts-config.json").write_text((path / "gluonts-config.json").read_text().replace(
        "forecasting.dp_predictor.DPPyTorchPredictor",
        "forecasting.dp_estimator.DPPyTorchPredictor"))
    for where in (path, old):
        for load in (Predictor.deserialize, PyTorchPredictor.deserialize,
                     DPPyTorchPredictor.deserialize):
            back = load(where)
            assert type(back) is DPPyTorchPredictor
            assert back.privacy_report == predictor.privacy_report
            for a, b in zip(before, _quantiles(back, test.to_gluonts()), strict=True):
                np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("lstm_impl", ["fast", "opacus"])
def test_deepar_round_trip(lstm_impl, split, tmp_path):
    train, test = split
    dp = DPEstimator(_deepar(), noise_multiplier=2.0, delta=DELTA, max_steps=2,
                     discretization=D, init_from="none", lstm_impl=lstm_impl)
    predictor = dp.train(train.to_gluonts())
    rep = predictor.privacy_report
    assert rep["model"] == "deepar" and rep["steps"] == 2 and rep["private"]
    assert rep["context_length_with_lags"] == 8 + 12 - 1  # lags reach 11 steps further back
    assert rep["scheme"]["context_length"] == 19 and 0 < rep["epsilon"] < math.inf
    predictor.serialize(tmp_path)
    back = Predictor.deserialize(tmp_path)
    assert back.privacy_report == rep and back.lstm_impl == lstm_impl
    for a, b in zip(_quantiles(predictor, test.to_gluonts()),
                    _quantiles(back, test.to_gluonts()), strict=True):
        np.testing.assert_array_equal(a, b)


def test_seeded_run_is_labelled_not_private(split):
    train, _ = split
    dp = DPEstimator(_dlinear(), noise_multiplier=1.0, delta=DELTA, max_steps=1, seed=7,
                     discretization=D, init_from="none")
    rep = dp.train(train).privacy_report
    assert rep["private"] is False and rep["reproducible_noise"] is True and rep["seed"] == 7
    assert "seed=7" in rep["not_private_reason"]
    assert rep["dp_sgd"] is True and math.isfinite(rep["epsilon"])


def test_batch_size_is_the_samplers_and_epochs_work(split):
    train, _ = split
    dp = DPEstimator(_dlinear(batch_size=32), noise_multiplier=1.0, delta=DELTA, epochs=1,
                     batch_size=3, discretization=D, init_from="none")
    rep = dp.train(train).privacy_report
    # Λ = 3 (not the estimator's 32, which only sets the predictor's inference batches)
    assert rep["batch_size"] == rep["scheme"]["batch_size"] == 3
    assert rep["steps"] == rep["scheme"]["steps_per_epoch"] == len(train) // 3


# ---- train_forecaster(estimator=...) -------------------------------------------------------------
def test_train_forecaster_with_estimator_equals_the_built_one(split):
    train, _ = split
    kw = dict(noise_multiplier=1.0, delta=DELTA, max_steps=2, seed=3, discretization=D)
    built = train_forecaster("dlinear", train, prediction_length=H, context_length=8,
                             batch_size=4, estimator_kwargs=dict(hidden_dimension=2,
                                                                 kernel_size=5), **kw)
    given = train_forecaster(None, train, estimator=build_estimator(
        "dlinear", freq="M", prediction_length=H, context_length=8, batch_size=4,
        hidden_dimension=2, kernel_size=5), **kw)
    assert given.prepared.name == "dlinear" and given.epsilon == built.epsilon
    a, b = built.prepared.module.model.state_dict(), given.prepared.module.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k].numpy(), b[k].numpy())


def test_train_forecaster_rejects_inconsistent_estimator_arguments(split):
    train, _ = split
    kw = dict(noise_multiplier=1.0, delta=DELTA, max_steps=1)
    est = _dlinear()
    for bad, match in ((dict(prediction_length=H + 1), "prediction_length"),
                       (dict(context_length=9), "context_length"), (dict(lr=0.5), "lr"),
                       (dict(weight_decay=0.5), "weight_decay"),
                       (dict(estimator_kwargs=dict(kernel_size=3)), "estimator_kwargs")):
        with pytest.raises(ValueError, match=match):
            train_forecaster(None, train, estimator=est, **bad, **kw)
    with pytest.raises(ValueError, match="does not match"):
        train_forecaster("deepar", train, estimator=est, **kw)
    with pytest.raises(ValueError, match="freq"):
        train_forecaster(None, train, estimator=_deepar(freq="D"), **kw)
    with pytest.raises(ValueError, match="prediction_length is required"):
        train_forecaster("dlinear", train, **kw)
    with pytest.raises(ValueError, match="model name"):
        train_forecaster(None, train, prediction_length=H, **kw)


# ---- argument errors ------------------------------------------------------------------------------
def test_estimator_model_names_supported_classes():
    from gluonts.torch.model.patch_tst import PatchTSTEstimator

    assert estimator_model(_dlinear()) == "dlinear" and estimator_model(_deepar()) == "deepar"
    assert estimator_model(SimpleFeedForwardEstimator(prediction_length=H)) == "simpleff"
    for bad in (PatchTSTEstimator(prediction_length=H, patch_len=4, context_length=8),
                object()):
        with pytest.raises(ValueError, match="DLinearEstimator.*SimpleFeedForwardEstimator"
                                             ".*DeepAREstimator"):
            DPEstimator(bad, epsilon=1.0, delta=DELTA, max_steps=1)


@pytest.mark.parametrize("kwargs,match", [
    (dict(delta=None), "delta is required"),
    (dict(delta=1.5), r"delta must be in \(0, 1\)"),
    (dict(epsilon=0.0), "epsilon must be > 0"),
    (dict(epsilon=math.inf), "epsilon must be finite"),
    (dict(epsilon=None), "pass epsilon"),
    (dict(noise_multiplier=-1.0), "noise_multiplier must be > 0"),
    (dict(epochs=2.0), "at most one of max_steps"),
    (dict(max_steps=0), "max_steps must be >= 1"),
    (dict(batch_size=0), "batch_size must be >= 1"),
    (dict(max_grad_norm=0.0), "max_grad_norm must be > 0"),
    (dict(tail_average=1.5), r"tail_average must be in \[0, 1\]"),
    (dict(seed=-1), "seed must be >= 0"),
    (dict(discretization=-1e-3), "discretization must be > 0"),
    (dict(device="tpu"), "device"),
    (dict(lstm_impl="cudnn"), "lstm_impl"),
    (dict(grad_sample_mode="fast"), "grad_sample_mode"),
])
def test_constructor_errors(kwargs, match):
    args = {**dict(epsilon=1.0, delta=DELTA, max_steps=1), **kwargs}
    with pytest.raises(ValueError, match=match):
        DPEstimator(_dlinear(), **args)


def test_estimator_setting_errors(split):
    train, _ = split
    kw = dict(epsilon=1.0, delta=DELTA, max_steps=1)
    lagged = _dlinear()
    lagged.lead_time = 1  # gluonts' base Estimator attribute (no constructor argument here)
    with pytest.raises(ValueError, match="lead_time"):
        DPEstimator(lagged, **kw)
    with pytest.raises(ValueError, match="batch_norm"):
        DPEstimator(SimpleFeedForwardEstimator(prediction_length=H, batch_norm=True), **kw)
    with pytest.raises(ValueError, match="covariates"):
        DPEstimator(_deepar(num_feat_dynamic_real=1), **kw)
    dp = DPEstimator(_dlinear(), init_from="none", **kw)
    with pytest.raises(ValueError, match="validation_data"):
        dp.train(train, validation_data=train)
    with pytest.raises(ValueError, match="batch_size=4 exceeds the 3 training series"):
        dp.train(train.subset(range(3)))
    assert dp.last_result is None
