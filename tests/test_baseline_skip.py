"""DLinear's baseline skip (forecasting/baseline_skip.py): the zero-shot model is unchanged, the
skip reaches seasonal naive and naive exactly, Opacus' per-window gradients of the skip are the
per-window autograd gradients, and the network survives gluonts' serialization."""

import warnings

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("gluonts")
warnings.filterwarnings("ignore", category=FutureWarning)

from gluonts.torch.distributions import NegativeBinomialOutput  # noqa: E402
from gluonts.torch.model.d_linear import DLinearEstimator  # noqa: E402
from gluonts.torch.model.d_linear.module import DLinearModel  # noqa: E402

from opacus_structured.forecasting.baseline_skip import (  # noqa: E402
    SKIP_PARAMETER,
    BaselineSkipDLinearEstimator,
    BaselineSkipDLinearModel,
    describe_skip,
    skip_parameters,
)
from opacus_structured.forecasting.data import Panel  # noqa: E402
from opacus_structured.forecasting.estimators import build_estimator, prepare_estimator  # noqa: E402,E501
from opacus_structured.forecasting.model_defaults import model_defaults  # noqa: E402
from opacus_structured.forecasting.training import train_forecaster  # noqa: E402

H, CTX, M = 5, 12, 4


def _models(season_length=M, gain=10.0):
    torch.manual_seed(0)
    plain = DLinearModel(prediction_length=H, context_length=CTX, hidden_dimension=6,
                         kernel_size=3)
    skip = BaselineSkipDLinearModel(prediction_length=H, context_length=CTX,
                                    hidden_dimension=6, kernel_size=3,
                                    season_length=season_length, skip_gain=gain)
    skip.load_state_dict(plain.state_dict())
    return plain, skip


def _inputs(batch=3):
    gen = torch.Generator().manual_seed(1)
    past = 5.0 + torch.rand(batch, CTX, generator=gen) * 3
    return past, torch.ones_like(past)


def _mean(model, past, observed):
    args, loc, scale = model(past, observed)
    return model.distr_output.distribution(args, loc=loc, scale=scale).mean


def test_plain_state_loads_with_the_skip_at_zero_and_forecasts_as_the_plain_model():
    plain, skip = _models()
    assert torch.equal(skip.baseline_skip.weight, torch.zeros(1, 2))
    past, obs = _inputs()
    for a, b in zip(plain(past, obs)[0], skip(past, obs)[0], strict=True):
        assert torch.equal(a, b)
    # a full state (with the skip) round-trips as it is
    with torch.no_grad():
        skip.baseline_skip.weight.fill_(0.25)
    again = BaselineSkipDLinearModel(prediction_length=H, context_length=CTX,
                                     hidden_dimension=6, kernel_size=3, season_length=M,
                                     skip_gain=10.0)
    again.load_state_dict(skip.state_dict())
    assert torch.equal(again.baseline_skip.weight, torch.full((1, 2), 0.25))


@pytest.mark.parametrize("season_length, weight, expected", [
    # w_1 = 1: the location is the seasonal-naive forecast y[T - m + (h mod m)]
    (M, (1.0, 0.0), lambda y: y[:, [CTX - M + (h % M) for h in range(H)]]),
    # w_2 = 1: the naive forecast (last value)
    (M, (0.0, 1.0), lambda y: y[:, -1:].expand(-1, H)),
    # m = 1 and m > context: seasonal naive is naive
    (1, (1.0, 0.0), lambda y: y[:, -1:].expand(-1, H)),
    (CTX + 1, (1.0, 0.0), lambda y: y[:, -1:].expand(-1, H)),
])
def test_skip_reaches_the_baselines_exactly(season_length, weight, expected):
    _, skip = _models(season_length=season_length, gain=10.0)
    with torch.no_grad():  # the effective weight is gain * w
        skip.baseline_skip.weight.copy_(torch.tensor([weight]) / 10.0)
    past, obs = _inputs()
    torch.testing.assert_close(_mean(skip, past, obs), expected(past), rtol=1e-5, atol=1e-5)


def _gradients_one_window_at_a_time(net, past, obs, future, fobs):
    """The autograd gradient of every parameter for each window on its own."""
    out = []
    for i in range(past.shape[0]):
        net.zero_grad()
        net.loss(past[i:i + 1], obs[i:i + 1], future[i:i + 1], fobs[i:i + 1]).sum().backward()
        out.append({n: p.grad.clone() for n, p in net.named_parameters()})
    return out


def test_per_window_gradients_of_the_skip_are_the_autograd_ones():
    from opacus import GradSampleModule

    _, skip = _models()
    with torch.no_grad():
        skip.baseline_skip.weight.copy_(torch.tensor([[0.03, -0.02]]))
    past, obs = _inputs(batch=4)
    future = past[:, -H:] + 0.5
    fobs = torch.ones_like(future)
    expected = _gradients_one_window_at_a_time(skip, past, obs, future, fobs)
    gsm = GradSampleModule(skip, loss_reduction="sum")
    gsm.zero_grad()
    gsm._module.loss(past, obs, future, fobs).sum().backward()
    for name, param in skip.named_parameters():
        got = param.grad_sample
        for i in range(4):
            torch.testing.assert_close(got[i], expected[i][name], rtol=1e-4, atol=1e-7)
    assert skip.baseline_skip.weight.grad_sample.abs().sum() > 0
    gsm._close()


def test_estimator_predictor_serializes_with_the_skip(tmp_path):
    from gluonts.model.predictor import Predictor

    prepared = prepare_estimator("dlinear", freq="M", prediction_length=H,
                                 context_length=CTX)
    net = prepared.module.model
    assert isinstance(net, BaselineSkipDLinearModel)
    assert net.season_length == 12 and net.skip_gain == model_defaults("dlinear")["skip_gain"]
    with torch.no_grad():
        net.baseline_skip.weight.add_(torch.linspace(1e-4, 5e-4, net.baseline_skip.weight.numel()))
    prepared.create_predictor().serialize(tmp_path)
    back = Predictor.deserialize(tmp_path)
    rebuilt = back.prediction_net.model
    assert type(rebuilt) is BaselineSkipDLinearModel
    assert rebuilt.season_length == 12 and rebuilt.skip_gain == net.skip_gain
    for key, value in net.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[key], value), key


def test_build_options_and_bad_arguments():
    plain = build_estimator("dlinear", freq="M", prediction_length=H, baseline_skip=False)
    assert type(plain) is DLinearEstimator
    est = build_estimator("dlinear", freq="W", prediction_length=H, season_length=3)
    assert isinstance(est, BaselineSkipDLinearEstimator) and est.season_length == 3
    assert build_estimator("dlinear", freq="W", prediction_length=H).season_length == 52
    with pytest.raises(ValueError, match="baseline skip only"):
        build_estimator("dlinear", freq="M", prediction_length=H, baseline_skip=False,
                        season_length=12)
    with pytest.raises(ValueError, match="season_length"):
        build_estimator("dlinear", freq="M", prediction_length=H, season_length=0)
    with pytest.raises(ValueError, match="skip_gain must be > 0"):
        BaselineSkipDLinearModel(prediction_length=H, context_length=CTX, hidden_dimension=4,
                                 skip_gain=0.0)
    with pytest.raises(ValueError, match="skip_gain must be finite"):
        BaselineSkipDLinearEstimator(prediction_length=H, skip_gain=float("inf"))
    with pytest.raises(ValueError, match="no 'loc' argument"):
        BaselineSkipDLinearModel(prediction_length=H, context_length=CTX, hidden_dimension=4,
                                 distr_output=NegativeBinomialOutput())
    plain_net = DLinearModel(prediction_length=H, context_length=CTX, hidden_dimension=4)
    assert skip_parameters(plain_net) == [] and describe_skip(plain_net) is None
    assert SKIP_PARAMETER in BaselineSkipDLinearModel(
        prediction_length=H, context_length=CTX, hidden_dimension=4).state_dict()


def _periodic_panel(n=8, length=60, m=4):
    rng = np.random.default_rng(0)
    targets = tuple((10 + rng.uniform(1, 3) * np.tile(rng.uniform(0, 1, m), length // m))
                    .astype(np.float32) for _ in range(n))
    return Panel(targets=targets, starts=tuple(pd.Period("2000-01", "M") for _ in range(n)),
                 item_ids=tuple(f"s{i}" for i in range(n)), freq="M")


@pytest.mark.slow  # ~35 s each on an idle 2-core VM, 75-80 s in CI next to other tests
@pytest.mark.long
@pytest.mark.parametrize("grad_sample_mode", ["hooks", "ghost"])
def test_dp_training_moves_the_skip_towards_an_exact_seasonal_naive(grad_sample_mode):
    """On exactly periodic series seasonal naive is perfect: the skip's seasonal weight must
    grow under DP-SGD (σ = 0.5, its own step size), and Adam steps it with ``skip_lr``. The
    original two-input skip from zero (the recipe's local forecasts start at a prior that ETS
    and Theta, exact here too, already share)."""
    res = train_forecaster("dlinear", _periodic_panel(), prediction_length=4,
                           context_length=12, batch_size=4, max_steps=30, lr=1e-4,
                           noise_multiplier=0.5, delta=1e-5, max_grad_norm=1e-4, seed=0,
                           skip_lr=3e-4, grad_sample_mode=grad_sample_mode,
                           estimator_kwargs={"season_length": 4,
                                             "skip_features": ("seasonal_naive", "naive")})
    net = res.prepared.module.model
    w = net.skip_gain * net.baseline_skip.weight.detach()
    assert w[0, 0] > 0.3, w
    described = describe_skip(net)
    assert described["season_length"] == 4
    assert described["weights"]["seasonal_naive"] == pytest.approx(float(w[0, 0]))
    assert described["weights"]["naive"] == pytest.approx(float(w[0, 1]))
    assert res.steps == 30 and np.isfinite(res.epsilon)


def test_skip_lr_is_checked():
    with pytest.raises(ValueError, match="skip_lr"):
        train_forecaster("dlinear", _periodic_panel(), prediction_length=4, context_length=12,
                         batch_size=4, max_steps=1, skip_lr=0.0)


@pytest.mark.slow  # ~8 s
@pytest.mark.long  # 15-45 s: left out of CI's 30-minute budget (-m long)
def test_ghost_and_hooks_release_the_same_skip_network():
    """Book-keeping (ghost) clipping and Opacus' hooks clip the same per-window gradients of the
    skip network, so with the same coins the released weights agree."""
    states = {}
    for mode in ("hooks", "ghost"):
        res = train_forecaster("dlinear", _periodic_panel(), prediction_length=4,
                               context_length=12, batch_size=4, max_steps=4, lr=1e-3,
                               noise_multiplier=0.5, delta=1e-5, max_grad_norm=1e-2, seed=3,
                               grad_sample_mode=mode, estimator_kwargs={"season_length": 4})
        states[mode] = res.prepared.module.model.state_dict()
    assert states["hooks"][SKIP_PARAMETER].abs().sum() > 0
    for key, value in states["hooks"].items():
        torch.testing.assert_close(states["ghost"][key], value, rtol=1e-4, atol=1e-6, msg=key)


def _local_model(scale=0.5):
    from opacus_structured.forecasting.baseline_skip import LOCAL_FEATURES

    torch.manual_seed(0)
    return BaselineSkipDLinearModel(prediction_length=H, context_length=CTX, hidden_dimension=6,
                                    kernel_size=3, season_length=M, skip_gain=10.0,
                                    skip_features=LOCAL_FEATURES,
                                    skip_init=(0.25, 0.0, 0.0, 0.25, 0.25), skip_scale=scale)


def test_local_skip_starts_at_its_prior_and_reaches_ets_exactly():
    """``skip_init`` sets the effective weights ``gain · w`` (also when a plain public state
    is loaded); at weight 1 on ETS the location is the window's ETS forecast, and at scale
    weight 1 the Student-t scale is ETS's h-step standard deviation."""
    from opacus_structured.forecasting.baseline_skip import SCALE_SKIP_PARAMETER
    from opacus_structured.forecasting.local_forecasts import ets_forecast

    net = _local_model()
    torch.testing.assert_close(10.0 * net.baseline_skip.weight,
                               torch.tensor([[0.25, 0.0, 0.0, 0.25, 0.25]]))
    plain = DLinearModel(prediction_length=H, context_length=CTX, hidden_dimension=6,
                         kernel_size=3)
    with torch.no_grad():
        net.baseline_skip.weight.zero_()
    net.load_state_dict(plain.state_dict())  # no skip in the state: the prior again
    torch.testing.assert_close(10.0 * net.baseline_skip.weight,
                               torch.tensor([[0.25, 0.0, 0.0, 0.25, 0.25]]))
    assert float(10.0 * net.scale_skip.weight.detach()) == pytest.approx(0.5)
    assert SCALE_SKIP_PARAMETER in net.state_dict()
    with torch.no_grad():
        net.baseline_skip.weight.copy_(torch.tensor([[0.0, 0.0, 0.0, 0.1, 0.0]]))
        net.scale_skip.weight.fill_(0.1)
    past, obs = _inputs()
    args, loc, scale = net(past, obs)
    ets, std = ets_forecast(((past - loc) / scale).double(), obs.double(), M, H)
    torch.testing.assert_close(args[1].double(), ets, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(args[2].double(), std.clamp(min=1e-4), rtol=1e-4, atol=1e-6)
    described = describe_skip(net)
    assert described["weights"]["ets"] == pytest.approx(1.0)
    assert described["scale_weight"] == pytest.approx(1.0)


def test_local_skip_per_window_gradients_depend_on_their_own_window_only():
    """The privacy claim: with the local forecasts (fitted inside each window) and the scale
    skip, Opacus' per-window gradient of every parameter equals the gradient of that window
    alone, whatever the other windows of the batch hold, padded windows included."""
    from opacus import GradSampleModule

    net = _local_model()
    past, obs = _inputs(batch=4)
    past[2, :5] = 0.0
    obs = obs.clone()
    obs[2, :5] = 0.0
    future = past[:, -H:] + 0.5
    fobs = torch.ones_like(future)
    expected = _gradients_one_window_at_a_time(net, past, obs, future, fobs)
    gsm = GradSampleModule(net, loss_reduction="sum")
    for other in (past, past * torch.tensor([1.0, 7.0, 1.0, 0.1])[:, None]):
        gsm.zero_grad()
        batch = other.clone()
        batch[0] = past[0]
        gsm._module.loss(batch, obs, future, fobs).sum().backward()
        for name, param in net.named_parameters():
            torch.testing.assert_close(param.grad_sample[0], expected[0][name], rtol=1e-4,
                                       atol=1e-7)
        for param in net.parameters():
            param.grad_sample = None
    gsm._close()


def test_local_skip_predictor_serializes(tmp_path):
    from gluonts.model.predictor import Predictor

    from opacus_structured.forecasting.baseline_skip import LOCAL_FEATURES

    prepared = prepare_estimator("dlinear", freq="M", prediction_length=H, context_length=CTX,
                                 skip_features=LOCAL_FEATURES, skip_init=(0.2,) * 5,
                                 skip_scale=0.7)
    prepared.create_predictor().serialize(tmp_path)
    rebuilt = Predictor.deserialize(tmp_path).prediction_net.model
    net = prepared.module.model
    assert rebuilt.skip_features == LOCAL_FEATURES and rebuilt.skip_scale == 0.7
    for key, value in net.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[key], value), key
    with pytest.raises(ValueError, match="skip_init must give one finite"):
        BaselineSkipDLinearModel(prediction_length=H, context_length=CTX, hidden_dimension=4,
                                 skip_features=LOCAL_FEATURES, skip_init=(1.0,))
