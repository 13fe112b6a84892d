"""forecasting.windowing: padding rule, lags/effective context, augmentation, scaling."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opacus_structured.forecasting.windowing import WindowDataset, collate_windows
from opacus_structured.schemes.structured import StructuredScheme


def test_padding_rule_univariate():
    x = np.arange(1, 11, dtype=float)  # 1..10
    ds = WindowDataset([x], context_length=4, forecast_length=3)
    item = ds[(0, 0)]  # first start: context all padding, forecast x[0:3]
    assert item["context"].tolist() == [0, 0, 0, 0]
    assert item["target"].tolist() == [1, 2, 3]
    assert item["past_is_pad"].tolist() == [True] * 4
    item = ds[(0, 2)]
    assert item["context"].tolist() == [0, 0, 1, 2]
    assert item["past_is_pad"].tolist() == [True, True, False, False]
    item = ds[(0, 7)]  # last start T - 1 = L - L_F
    assert item["context"].tolist() == [4, 5, 6, 7] and item["target"].tolist() == [8, 9, 10]
    with pytest.raises(IndexError):
        ds[(0, 8)]
    with pytest.raises(IndexError):
        ds[(1, 0)]
    with pytest.raises(ValueError, match="forecast_length"):
        WindowDataset([np.ones(2)], context_length=4, forecast_length=3)


def test_multivariate_and_collate():
    x = np.stack([np.arange(8.0), -np.arange(8.0)], axis=1)
    ds = WindowDataset([x, x[:6]], context_length=3, forecast_length=2)
    batch = collate_windows([ds[(0, 1)], ds[(1, 4)]])
    assert batch["context"].shape == (2, 3, 2) and batch["target"].shape == (2, 2, 2)
    assert batch["context"][0, :, 0].tolist() == [0, 0, 0]
    assert batch["target"][1, :, 1].tolist() == [-4, -5]
    empty = ds.collate([])
    assert empty["context"].shape == (0, 3, 2)
    with pytest.raises(ValueError, match="empty"):
        collate_windows([])


def test_lags_extend_effective_context_and_stay_inside_window():
    x = np.arange(1, 41, dtype=float)
    ds = WindowDataset([x], context_length=4, forecast_length=2, lags=[1, 3])
    assert ds.effective_context_length == 7
    item = ds[(0, 20)]  # forecast = x[20:22] = 21, 22; past = x[13:20] = 14..20
    assert item["past"].tolist() == list(range(14, 21))
    assert item["context"].tolist() == [17, 18, 19, 20]
    # lag l at window position p reads the value l steps earlier: context step 17 -> 16, 14
    assert item["lagged"][0].tolist() == [16, 14]
    assert item["lagged"][-1].tolist() == [21, 19]  # last forecast step (22): lags 21, 19
    ok = StructuredScheme(num_series=1, series_length=40, context_length=7, forecast_length=2,
                          batch_size=1)
    ds.check_scheme(ok)
    bad = StructuredScheme(num_series=1, series_length=40, context_length=4, forecast_length=2,
                           batch_size=1)
    with pytest.raises(ValueError, match="context_length=7"):
        ds.check_scheme(bad)
    ds2 = WindowDataset.from_scheme([x], ok, lags=[1, 3])
    assert ds2.context_length == 4 and ds2.effective_context_length == 7


def test_augmentation_noise_levels_and_state():
    x = np.zeros(200)
    ds = WindowDataset([x], context_length=50, forecast_length=50, context_noise=2.0,
                       forecast_noise=0.5, value_bound=0.1, seed=3)
    items = [ds[(0, 100)] for _ in range(40)]
    ctx = torch.stack([i["past"] for i in items])
    tgt = torch.stack([i["target"] for i in items])
    assert ctx.std().item() == pytest.approx(0.2, rel=0.05)
    assert tgt.std().item() == pytest.approx(0.05, rel=0.05)
    state = ds.state_dict()
    a = ds[(0, 10)]["target"]
    ds.load_state_dict(state)
    assert torch.equal(ds[(0, 10)]["target"], a)
    with pytest.raises(ValueError, match="value_bound"):
        WindowDataset([x], context_length=5, forecast_length=5, forecast_noise=1.0)
    scheme = StructuredScheme(num_series=1, series_length=200, context_length=50,
                              forecast_length=50, batch_size=1, context_noise=2.0,
                              forecast_noise=0.5, bound="upper")
    ds.check_scheme(scheme)
    with pytest.raises(ValueError, match="augmentation"):
        WindowDataset([x], 50, 50).check_scheme(scheme)


def test_per_window_mean_scaling_uses_window_only():
    x = np.concatenate([np.full(50, 1000.0), np.full(50, 2.0)])
    ds = WindowDataset([x], context_length=5, forecast_length=2, scaling="mean")
    item = ds[(0, 80)]
    assert item["scale"].item() == pytest.approx(2.0)  # the 1000s are outside the window
    assert item["context"].tolist() == [1.0] * 5
    head = ds[(0, 2)]  # padding is excluded from the scale
    assert head["scale"].item() == pytest.approx(1000.0)
    with pytest.raises(ValueError, match="scaling"):
        WindowDataset([x], 5, 2, scaling="global")
