"""The forecast mixture with the public zero-shot model (forecasting/zero_shot_mixture.py):
every prefix of the sample paths holds the public share, the stratified draws match the mixture
CDF (1 - w) F_DP + w F_public within 1/n, the public half is exactly the initial weights, the
predictor survives gluonts' serialization, and bad weights are refused naming the argument."""

import math
import warnings

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("gluonts")
warnings.filterwarnings("ignore", category=FutureWarning)

from opacus_structured.forecasting.data import Panel  # noqa: E402
from opacus_structured.forecasting.dp_predictor import DPPyTorchPredictor  # noqa: E402
from opacus_structured.forecasting.estimators import prepare_estimator  # noqa: E402
from opacus_structured.forecasting.model_defaults import check_zero_shot_weight, model_defaults  # noqa: E402
from opacus_structured.forecasting.training import train_forecaster  # noqa: E402
from opacus_structured.forecasting.zero_shot_mixture import (  # noqa: E402
    ZeroShotMixtureModule,
    public_rows,
    zero_shot_mixture_predictor,
)

H, CTX = 4, 12


def _panel(n=6, length=48):
    rng = np.random.default_rng(0)
    targets = tuple((10 + np.cumsum(rng.normal(0, 1, length))).astype(np.float32)
                    for _ in range(n))
    return Panel(targets=targets, starts=tuple(pd.Period("2000-01", "M") for _ in range(n)),
                 item_ids=tuple(f"s{i}" for i in range(n)), freq="M")


def _public_state(model="dlinear"):
    torch.manual_seed(7)
    prepared = prepare_estimator(model, freq="M", prediction_length=H, context_length=CTX,
                                 batch_size=4)
    return {k: v.detach().clone() for k, v in prepared.module.model.state_dict().items()}


def _train(weight=None, model="dlinear", **kw):
    return train_forecaster(model, _panel(), prediction_length=H, context_length=CTX,
                            batch_size=4, max_steps=2, lr=1e-2, seed=0,
                            init_state=_public_state(model), init_public=True,
                            zero_shot_weight=weight, **kw)


@pytest.mark.parametrize("weight", [0.0, 0.1, 0.25, 1 / 3, 0.5, 0.9])
def test_every_prefix_holds_the_public_share(weight):
    mask = public_rows(200, weight)
    counts = torch.cumsum(mask.to(torch.int64), 0)
    for m in range(1, 201):
        assert int(counts[m - 1]) == math.floor(m * weight + 1e-12)


def test_recipe_rows_have_a_valid_weight_and_deepar_mixes():
    for name in ("dlinear", "deepar", "simpleff"):
        check_zero_shot_weight(model_defaults(name)["zero_shot_weight"])
    # issue 47: DLinear's release is the fine-tuned network alone (w = 0 won its study)
    assert model_defaults("dlinear")["zero_shot_weight"] == 0.0
    assert model_defaults("deepar")["zero_shot_weight"] == 0.1


@pytest.mark.parametrize("bad", [1.0, -0.1, float("nan"), float("inf"), "x", None])
def test_bad_weights_are_refused_naming_the_argument(bad):
    with pytest.raises(ValueError, match="zero_shot_weight"):
        check_zero_shot_weight(bad)
    with pytest.raises(ValueError, match="--zero-shot-weight"):
        check_zero_shot_weight(bad, "--zero-shot-weight")


def test_stratified_mixture_matches_the_mixture_cdf_within_one_over_n():
    """The released samples against the two models' own CDFs: with one draw per probability
    stratum, the share of a component's n draws below x is within 1/n of its CDF at x."""
    res = _train(0.25)
    predictor = res.create_predictor()
    net = predictor.prediction_net
    assert isinstance(net, ZeroShotMixtureModule) and net.public_weight == 0.25
    n_total = 4000
    net.num_samples = n_total
    past = torch.as_tensor(np.stack([t[-CTX:] for t in _panel().targets]))
    observed = torch.ones_like(past)
    with torch.no_grad():
        paths = net(past, observed)
        dists = [m.model.distr_output.distribution(*m(past, observed))
                 for m in (net.private, net.public)]
    assert paths.shape == (past.shape[0], n_total, H)
    mask = public_rows(n_total, 0.25)
    n_pub = int(mask.sum())
    n_priv = n_total - n_pub
    for q in (0.05, 0.3, 0.5, 0.8, 0.95):
        x = dists[0].icdf(torch.full_like(dists[0].mean, q))  # a point of each (series, step)
        with torch.no_grad():
            f_priv, f_pub = (d.cdf(x) for d in dists)
        emp_priv = (paths[:, ~mask] <= x[:, None]).double().mean(1)
        emp_pub = (paths[:, mask] <= x[:, None]).double().mean(1)
        assert torch.all((emp_priv - f_priv.double()).abs() <= 1.0 / n_priv + 1e-6)
        assert torch.all((emp_pub - f_pub.double()).abs() <= 1.0 / n_pub + 1e-6)
        mixture = 0.75 * f_priv.double() + 0.25 * f_pub.double()
        emp = (paths <= x[:, None]).double().mean(1)
        assert torch.all((emp - mixture).abs() <= 2.0 / n_total + 1e-6)


def test_public_half_is_the_initial_weights_and_private_half_the_released_ones():
    res = _train(0.25)
    net = res.create_predictor().prediction_net
    for key, value in _public_state().items():
        assert torch.equal(net.public.model.state_dict()[key], value)
    assert net.private.model is res.prepared.module.model
    # the released weights are unchanged (their privacy record still covers them)
    assert res.privacy_record["weights"] == res.weights_hash
    assert res.zero_shot_mixture == {"weight": 0.25, "public_start": True, "note": None}
    assert res.summary()["zero_shot_mixture"]["weight"] == 0.25


def test_weight_zero_is_gluonts_own_predictor_of_the_fine_tuned_network():
    res = _train(0.25)
    alone = res.create_predictor(zero_shot_weight=0.0)
    assert alone.prediction_net is res.prepared.module
    assert type(alone.forecast_generator).__name__ == "DistributionForecastGenerator"
    # a public start keeps the public weights at w = 0 too: a mixture can be asked for later
    unmixed = _train(0.0)
    assert unmixed.zero_shot_mixture == {"weight": 0.0, "public_start": True, "note": None}
    assert unmixed.create_predictor().prediction_net is unmixed.prepared.module
    later = unmixed.create_predictor(zero_shot_weight=0.25).prediction_net
    assert isinstance(later, ZeroShotMixtureModule) and later.public_weight == 0.25
    with pytest.raises(ValueError, match="zero_shot_weight"):
        res.create_predictor(zero_shot_weight=1.0)
    with pytest.raises(ValueError, match="already forecasts a zero-shot mixture"):
        zero_shot_mixture_predictor(res.create_predictor(), _public_state(), 0.5)


def test_recipe_weight_needs_public_weights_and_a_given_one_raises_without(monkeypatch):
    from opacus_structured.forecasting import model_defaults as md

    monkeypatch.setitem(md.MODEL_DEFAULTS["dlinear"], "zero_shot_weight", 0.25)
    res = train_forecaster("dlinear", _panel(), prediction_length=H, context_length=CTX,
                           batch_size=4, max_steps=1, lr=1e-2, seed=0)
    assert res.zero_shot_weight == 0.0 and res.public_state is None
    assert "does not apply" in res.zero_shot_note and "random initial weights" in \
        res.zero_shot_note
    assert res.create_predictor().prediction_net is res.prepared.module
    with pytest.raises(ValueError, match="zero_shot_weight=0.25 mixes in the public"):
        train_forecaster("dlinear", _panel(), prediction_length=H, context_length=CTX,
                         batch_size=4, max_steps=1, lr=1e-2, seed=0, zero_shot_weight=0.25)
    with pytest.raises(ValueError, match="zero_shot_weight"):
        _train(1.5)


class _Paths(torch.nn.Module):
    """A sampling model (as DeepAR): ``forward`` returns ``per_call`` constant paths."""

    def __init__(self, value, per_call):
        super().__init__()
        self.value, self.per_call = value, per_call

    def forward(self, past, num_parallel_samples=None):  # DeepAR's keyword, ignored here
        return torch.full((past.shape[0], self.per_call, H), float(self.value))


@pytest.mark.parametrize("per_call_public", [3, 40, 100])
def test_sampling_models_contribute_their_own_paths_in_the_public_rows(per_call_public):
    net = ZeroShotMixtureModule.__new__(ZeroShotMixtureModule)
    torch.nn.Module.__init__(net)
    net.private, net.public = _Paths(0, 100), _Paths(1, per_call_public)
    net.public_weight, net.num_samples = 0.25, 7  # num_samples: distribution models only
    out = net(torch.zeros(2, CTX))
    mask = public_rows(100, 0.25)
    assert out.shape == (2, 100, H)
    assert torch.all(out[:, mask] == 1) and torch.all(out[:, ~mask] == 0)


@pytest.mark.parametrize("model", ["dlinear", "deepar"])
def test_mixture_predictor_survives_gluonts_serialization(tmp_path, model):
    from gluonts.model.predictor import Predictor

    res = _train(0.25, model=model)
    predictor = DPPyTorchPredictor.from_predictor(res.create_predictor(),
                                                  privacy_report={"epsilon": None})
    predictor.serialize(tmp_path)
    again = Predictor.deserialize(tmp_path)
    assert isinstance(again.prediction_net, ZeroShotMixtureModule)
    assert again.prediction_net.public_weight == 0.25
    for key, value in predictor.prediction_net.state_dict().items():
        assert torch.equal(again.prediction_net.state_dict()[key], value)
    ds = _panel().to_gluonts()
    torch.manual_seed(3)
    a = next(iter(predictor.predict(ds, num_samples=50))).samples
    torch.manual_seed(3)
    b = next(iter(again.predict(ds, num_samples=50))).samples
    np.testing.assert_array_equal(a, b)
    assert a.shape == (50, H) and np.all(np.isfinite(a))
