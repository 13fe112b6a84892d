"""The per-series backtest combination (forecasting/backtest_combination.py): its weights against
a row-at-a-time numpy computation, the closed-form cases (a line: drift is exact and takes the
weight; a constant: every method is exact and the weights are equal), the fallback of rows that
cannot be backtested, and the per-window property the privacy analysis rests on (a row's
combination, and Opacus' per-window gradient through the skip, depend on that row only)."""

import numpy as np
import pytest
import torch

from opacus_structured.forecasting.backtest_combination import (
    FALLBACK_WEIGHTS,
    MIN_ERROR,
    POWER,
    backtest_combination,
    backtest_weights,
)
from opacus_structured.forecasting.local_forecasts import METHODS, local_forecasts

H, M, T = 6, 4, 18


def _panel(batch=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(T, dtype=torch.float64)
    y = (1.0 + 0.05 * torch.rand(batch, 1, generator=gen, dtype=torch.float64) * t
         + 0.3 * torch.sin(2 * torch.pi * t / M)
         + 0.1 * torch.randn(batch, T, generator=gen, dtype=torch.float64).cumsum(1))
    return y, torch.ones_like(y)


def _weights_one_row_at_a_time(y, obs, power=POWER):
    """The module docstring's recipe, one row at a time, errors and weights in numpy."""
    out = []
    for i in range(y.shape[0]):
        fits = local_forecasts(y[i:i + 1, :T - H], obs[i:i + 1, :T - H], M, H)[0].numpy()
        err = np.abs(fits - y[i, T - H:].numpy()[:, None]).mean(0)
        inv = np.maximum(err, MIN_ERROR) ** -power
        out.append(inv / inv.sum())
    return np.array(out)


@pytest.mark.parametrize("power", [1.0, 2.0])
def test_weights_are_the_row_at_a_time_inverse_backtest_errors(power):
    y, obs = _panel()
    v = backtest_weights(y, obs, T, M, H, power=power).numpy()
    np.testing.assert_allclose(v, _weights_one_row_at_a_time(y, obs, power), rtol=1e-9)
    np.testing.assert_allclose(v.sum(1), 1.0, rtol=1e-12)
    combined = backtest_combination(y, obs, T, M, H, power=power).numpy()
    full = local_forecasts(y, obs, M, H).numpy()
    np.testing.assert_allclose(combined, (full * v[:, None, :]).sum(-1), rtol=1e-12)


def test_a_line_is_forecast_by_drift_and_a_constant_by_every_method_equally():
    t = torch.arange(T, dtype=torch.float64)
    line = (2.0 + 0.1 * t)[None]
    obs = torch.ones_like(line)
    v = backtest_weights(line, obs, T, M, H)[0]
    assert float(v[METHODS.index("drift")]) > 1 - 1e-6
    expected = 2.0 + 0.1 * torch.arange(T, T + H, dtype=torch.float64)
    torch.testing.assert_close(backtest_combination(line, obs, T, M, H)[0], expected,
                               rtol=1e-6, atol=1e-6)
    const = torch.full((1, T), 3.0, dtype=torch.float64)
    v = backtest_weights(const, obs, T, M, H)[0]
    torch.testing.assert_close(v, torch.full((len(METHODS),), 1 / len(METHODS),
                                             dtype=torch.float64))
    torch.testing.assert_close(backtest_combination(const, obs, T, M, H)[0],
                               torch.full((H,), 3.0, dtype=torch.float64))


def test_rows_that_cannot_be_backtested_get_the_public_fallback():
    y, obs = _panel(batch=3)
    obs = obs.clone()
    obs[0, -2] = 0.0                     # a held-out step is missing
    obs[1, :T - H - 2] = 0.0             # fewer than H observed steps before the held-out ones
    y = y * obs
    v = backtest_weights(y, obs, T, M, H)
    fallback = torch.tensor([FALLBACK_WEIGHTS.get(k, 0.0) for k in METHODS],
                            dtype=torch.float64)
    torch.testing.assert_close(v[0], fallback)
    torch.testing.assert_close(v[1], fallback)
    assert not torch.allclose(v[2], fallback)
    # candidates without ETS and Theta: uniform fallback; an input of at most H steps: fallback
    v = backtest_weights(y[:, :H], obs[:, :H], H, M, H, candidates=("naive", "drift"))
    torch.testing.assert_close(v, torch.full((3, 2), 0.5, dtype=torch.float64))
    assert torch.isfinite(backtest_combination(y, obs, T, M, H)).all()


def test_each_row_depends_on_its_own_values_only():
    y, obs = _panel(batch=4)
    alone = backtest_combination(y[1:2], obs[1:2], T, M, H)
    other = y.clone()
    other[0] *= 7.0
    other[2:] = 0.1 * torch.randn(2, T, dtype=torch.float64)
    torch.testing.assert_close(backtest_combination(other, obs, T, M, H)[1:2], alone,
                               rtol=1e-12, atol=1e-12)


def test_history_methods_read_the_whole_row_and_the_others_their_window():
    """With ETS fitted on the history, the backtest fits ETS on all steps before the held-out
    ones and the window methods on the last ``window`` of them."""
    from opacus_structured.forecasting.local_forecasts import local_forecasts_with_history

    y, obs = _panel(batch=2)
    window = 10
    v = backtest_weights(y, obs, window, M, H, history_methods=("ets",)).numpy()
    fits = local_forecasts_with_history(y[:, :T - H], obs[:, :T - H], window, M, H, METHODS,
                                        ("ets",)).numpy()
    err = np.abs(fits - y[:, T - H:].numpy()[:, :, None]).mean(1)
    inv = np.maximum(err, MIN_ERROR) ** -POWER
    np.testing.assert_allclose(v, inv / inv.sum(1, keepdims=True), rtol=1e-9)


def test_bad_arguments_name_themselves():
    y, obs = _panel(batch=2)
    with pytest.raises(ValueError, match="power must be > 0"):
        backtest_weights(y, obs, T, M, H, power=0.0)
    with pytest.raises(ValueError, match="distinct names from"):
        backtest_weights(y, obs, T, M, H, candidates=("ets", "arima"))
    with pytest.raises(ValueError, match="y and observed must both be"):
        backtest_weights(y, obs[:, 1:], T, M, H)
    with pytest.raises(ValueError, match="forecasts must be"):
        backtest_combination(y, obs, T, M, H, forecasts=torch.zeros(2, H, 3))


def test_skip_with_the_combination_keeps_per_window_gradients_per_window():
    """The privacy claim through the network: with the combination among the skip's features,
    Opacus' per-window gradients equal each window's own autograd gradients, whatever the
    other windows hold."""
    pytest.importorskip("gluonts")
    from opacus import GradSampleModule

    from opacus_structured.forecasting.baseline_skip import (
        FEATURES,
        BaselineSkipDLinearModel,
        describe_skip,
    )

    torch.manual_seed(0)
    ctx = 12
    net = BaselineSkipDLinearModel(prediction_length=H // 2, context_length=ctx,
                                   hidden_dimension=6, kernel_size=3, season_length=M,
                                   skip_gain=10.0, skip_features=FEATURES,
                                   skip_init=(0.0,) * 5 + (1.0,), skip_scale=0.5)
    assert describe_skip(net)["weights"]["combination"] == pytest.approx(1.0)
    gen = torch.Generator().manual_seed(3)
    past = 5.0 + torch.rand(3, ctx, generator=gen) * 3
    obs = torch.ones_like(past)
    future = past[:, -(H // 2):] + 0.5
    fobs = torch.ones_like(future)
    net.zero_grad(set_to_none=True)
    net.loss(past[:1], obs[:1], future[:1], fobs[:1]).sum().backward()
    expected = {n: p.grad.clone() for n, p in net.named_parameters()}
    gsm = GradSampleModule(net, loss_reduction="sum")
    for scale in (1.0, 9.0):
        gsm.zero_grad()
        batch = past.clone()
        batch[1:] *= scale
        gsm._module.loss(batch, obs, future, fobs).sum().backward()
        for name, param in net.named_parameters():
            torch.testing.assert_close(param.grad_sample[0], expected[name], rtol=1e-4,
                                       atol=1e-7)
        for param in net.parameters():
            param.grad_sample = None
    gsm._close()
    with pytest.raises(ValueError, match="combination"):
        BaselineSkipDLinearModel(prediction_length=H, context_length=ctx, hidden_dimension=4,
                                 skip_features=("naive", "blend"))
