"""``noise_multiplier=0`` (Opacus' debugging habit, its ``test_dl_seed_no_noise``) runs, and
every scheme accountant reports ε = inf with one ``NoNoiseWarning`` (issue 41)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from opacus import PrivacyEngine
from test_scheme_suite import EXAMPLES, NAMES
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import opacus_structured
from opacus_structured.accountants.base import NoNoiseWarning, SchemeAccountant


def _record(name: str, sigmas) -> SchemeAccountant:
    ex = EXAMPLES[name]
    acc = SchemeAccountant(ex.scheme, discretization=1e-3)
    rate = ex.scheme.expected_sample_rate() or 0.05
    for sigma in sigmas:
        acc.step(noise_multiplier=sigma, sample_rate=rate)
    return acc


@pytest.mark.parametrize("name", NAMES)
def test_every_scheme_accountant_reports_infinite_epsilon_with_one_warning(name):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = _record(name, [1.0, 0.0, 0.0, 1.0])
    ours = [w for w in caught if issubclass(w.category, NoNoiseWarning)]
    assert len(ours) == 1 and "noise_multiplier=0" in str(ours[0].message)
    assert ours[0].filename == __file__  # the user's line, not ours
    eps = acc.get_epsilon(EXAMPLES[name].delta)
    assert eps == math.inf and not math.isnan(eps)
    assert acc.get_delta(1.0) == 1.0
    assert acc.get_privacy_spent(delta=EXAMPLES[name].delta)[0] == math.inf
    clone = SchemeAccountant(EXAMPLES[name].scheme, discretization=1e-3)
    clone.load_state_dict(acc.state_dict())  # the round trip keeps the steps without noise
    assert clone.without_noise and clone.get_epsilon(EXAMPLES[name].delta) == math.inf


def test_noise_free_history_is_unchanged():
    acc = _record("poisson", [1.0, 1.0])
    assert not acc.without_noise and math.isfinite(acc.get_epsilon(1e-5))


def test_composed_pld_refuses_a_run_without_noise():
    with pytest.warns(NoNoiseWarning):
        acc = _record("poisson", [0.0])
    with pytest.raises(ValueError, match="noise_multiplier=0.*inf"):
        acc.composed_pld()


def test_negative_noise_still_names_the_argument():
    with pytest.raises(ValueError, match="noise_multiplier"):
        _record("poisson", [-1.0])


def _data(n=64):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g))


def _train(engine, model, opt, loader):
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("accountant,options", [
    ("poisson", {}), ("truncated-poisson", dict(max_batch_size=12)), ("gdp-full-batch", {}),
    ("shuffle", {}),
])
def test_make_private_runs_without_noise(accountant, options):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    engine = PrivacyEngine(accountant=accountant)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt, loader = opacus_structured.make_private(
            engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(), batch_size=8), noise_multiplier=0.0,
            max_grad_norm=1.0, dataset_size=64, **options)
        _train(engine, model, opt, loader)
        _train(engine, model, opt, loader)
    ours = [w for w in caught if issubclass(w.category, NoNoiseWarning)]
    assert len(ours) == 1 and ours[0].filename == __file__
    assert len(engine.accountant) > 0
    assert engine.get_epsilon(1e-5) == math.inf


def test_stock_engine_with_our_accountant_runs_without_noise():
    """Opacus' own make_private with a bound accountant of ours (no opacus_structured call)."""
    from opacus_structured.schemes.poisson import PoissonScheme

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    engine = PrivacyEngine()
    engine.accountant = SchemeAccountant(PoissonScheme())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(), batch_size=8), noise_multiplier=0.0,
            max_grad_norm=1.0)
        _train(engine, model, opt, loader)
    assert len([w for w in caught if issubclass(w.category, NoNoiseWarning)]) == 1
    assert engine.get_epsilon(1e-5) == math.inf


@pytest.mark.slow  # 5-30 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_make_private_with_epsilon_never_picks_zero_noise():
    model = nn.Linear(3, 2)
    engine = PrivacyEngine(accountant="poisson")
    _, opt, _ = opacus_structured.make_private_with_epsilon(
        engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=8), target_epsilon=50.0, target_delta=1e-5,
        epochs=1, max_grad_norm=1.0, dataset_size=64, discretization=1e-3)
    assert opt.noise_multiplier > 0
