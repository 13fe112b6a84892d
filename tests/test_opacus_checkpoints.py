"""Every scheme's checkpoint, saved through Opacus' ``PrivacyEngine.save_checkpoint``, reloads
into a fresh engine built the way the user built the first (issue 31, item 2).

For each scheme of the registry: build an engine as a user does (``PrivacyEngine(accountant=
name)`` — the correlated-noise engine where the scheme needs it — then
``opacus_structured.make_private``), train 3 steps, save; build a second engine the same way,
``load_checkpoint``: the accountant's scheme, history and ε are the first one's. For the
accountants Opacus can build by name, the checkpoint also loads into a bare
``PrivacyEngine(accountant=name)`` (no ``make_private``: the accountant adopts the saved
scheme), and for ``"poisson"`` / ``"shuffle"`` the stock path (``engine.make_private``) saves and
loads both ways with our ``make_private``. The regression of the issue: a ``"poisson"``
checkpoint saved after ``opacus_structured.make_private`` (q = 0.1) did not load into a fresh
``PrivacyEngine(accountant="poisson")``.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from opacus import GradSampleModule, PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import opacus_structured
from opacus_structured.accountants import REGISTERED
from opacus_structured.accountants.base import register_scheme_accountant
from opacus_structured.accountants.bminsep_mc import BMinSepMonteCarloAccountant
from opacus_structured.accounting.monte_carlo import MonteCarloSettings
from opacus_structured.optim import CorrelatedNoisePrivacyEngine
from opacus_structured.schemes.bminsep_mc import BMinSepMonteCarloScheme
from opacus_structured.schemes.registry import SCHEMES, accountant_class_for

warnings.filterwarnings("ignore", message="Secure RNG turned off")

N, BATCH = 50, 5          # 10 steps per epoch: q = 0.1, the issue's rate
D = 1e-3
DELTA = 1e-5
STEPS = 3

BMINSEP = BMinSepMonteCarloScheme(bands=2, dataset_size=N, batch_size=BATCH / 2, horizon=8)


class _SmallMonteCarloAccountant(BMinSepMonteCarloAccountant):
    default_settings = MonteCarloSettings(samples=2000, seed=7, workers=1)


#: scheme name -> (engine class, accountant name, make_private options, poisson_sampling)
CASES = {
    "poisson": (PrivacyEngine, "poisson", {}, True),
    "shuffle": (PrivacyEngine, "shuffle", {}, True),
    "truncated-poisson": (PrivacyEngine, "truncated-poisson", {"max_batch_size": 8}, True),
    "balls-in-bins": (PrivacyEngine, "balls-in-bins", {"epochs": 2}, True),
    "bandmf-cyclic-poisson": (CorrelatedNoisePrivacyEngine, "bandmf-cyclic-poisson",
                              {"bands": 2, "epochs": 2}, True),
    "random-allocation-mf": (CorrelatedNoisePrivacyEngine, "random-allocation-mf",
                             {"epochs": 2, "method": "renyi"}, True),
    "gdp": (PrivacyEngine, "gdp-full-batch", {}, True),
    "structured": (PrivacyEngine, "structured", {}, True),
    "bminsep-mc": (CorrelatedNoisePrivacyEngine, "test-ckpt-bminsep", {"epochs": 2}, False),
}
#: Over 5 s on 2 busy cores (Monte Carlo pricing ~40 s; balls-in-bins ~9 s).
SLOW = {"bminsep-mc", "balls-in-bins"}


def _names(names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(names)]


def test_every_registered_scheme_has_a_checkpoint_case():
    assert sorted(CASES) == sorted(SCHEMES)


def _dataset():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 3, generator=g), torch.randint(0, 2, (N,), generator=g))


def _window_dataset():
    from opacus_structured.forecasting.windowing import WindowDataset

    g = torch.Generator().manual_seed(0)
    series = [torch.randn(12, generator=g) for _ in range(N)]
    return WindowDataset(series, context_length=3, forecast_length=2)


def _loader(name):
    if name == "structured":
        ds = _window_dataset()
        return DataLoader(ds, batch_size=BATCH, collate_fn=ds.collate)
    if name == "bminsep-mc":
        return DataLoader(_dataset(), batch_sampler=BMINSEP.sampler(N, seed=0))
    return DataLoader(_dataset(), batch_size=BATCH, shuffle=True)


def _accountant_name(name):
    engine_class, acc_name, _, _ = CASES[name]
    if name == "bminsep-mc":
        register_scheme_accountant(acc_name, BMINSEP, base=_SmallMonteCarloAccountant)
    return acc_name


def _model(name):
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def _build(name):
    """Engine, model, optimizer and loader exactly as a user builds them for ``name``."""
    engine_class, _, options, poisson_sampling = CASES[name]
    engine = engine_class(accountant=_accountant_name(name))
    model = _model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = {"sampler_generator": torch.Generator().manual_seed(1)} if poisson_sampling else {}
    model, opt, dl = opacus_structured.make_private(
        engine, module=model, optimizer=opt, data_loader=_loader(name), noise_multiplier=1.3,
        max_grad_norm=1.0, discretization=D, poisson_sampling=poisson_sampling,
        **options, **extra)
    return engine, model, opt, dl


def _train(name, model, opt, dl, steps=STEPS):
    taken = 0
    while taken < steps:
        for batch in dl:
            if name == "structured":
                loss = nn.functional.mse_loss(model.__call__(batch["past"][:, -3:]),
                                              batch["target"])
            else:
                x, y = batch
                loss = nn.functional.cross_entropy(model(x), y) if len(x) else None
            if loss is not None:
                loss.backward()
            opt.step()
            opt.zero_grad()
            taken += 1
            if taken == steps:
                break


def _save(engine, model, opt) -> io.BytesIO:
    buffer = io.BytesIO()
    engine.save_checkpoint(path=buffer, module=model, optimizer=opt)
    buffer.seek(0)
    return buffer


def _epsilon(engine):
    return float(engine.accountant.get_epsilon(DELTA if engine.accountant.mechanism() !=
                                               "test-ckpt-bminsep" else 0.5))


@pytest.mark.parametrize("name", _names(CASES))
def test_checkpoint_reloads_into_a_fresh_engine_built_the_same_way(name):
    engine, model, opt, dl = _build(name)
    steps = 1 if name == "gdp" else STEPS
    _train(name, model, opt, dl, steps)
    buffer = _save(engine, model, opt)
    fresh, model2, opt2, _ = _build(name)
    fresh.load_checkpoint(path=buffer, module=model2, optimizer=opt2)
    assert fresh.accountant.scheme == engine.accountant.scheme
    assert fresh.accountant.history == engine.accountant.history and len(fresh.accountant)
    assert _epsilon(fresh) == _epsilon(engine)


@pytest.mark.parametrize("name", _names(n for n in CASES if CASES[n][1] in REGISTERED))
def test_checkpoint_reloads_into_a_bare_engine_by_name(name):
    engine, model, opt, dl = _build(name)
    _train(name, model, opt, dl, 1 if name == "gdp" else STEPS)
    buffer = _save(engine, model, opt)
    bare = CASES[name][0](accountant=CASES[name][1])
    model2 = GradSampleModule(_model(name))     # the saved module is Opacus-wrapped
    bare.load_checkpoint(path=buffer, module=model2,
                         optimizer=torch.optim.SGD(model2.parameters(), lr=0.1))
    assert type(bare.accountant) is accountant_class_for(engine.accountant.scheme)
    assert bare.accountant.scheme == engine.accountant.scheme
    assert _epsilon(bare) == _epsilon(engine)


def test_issue_poisson_checkpoint_at_rate_0_1_reloads_into_a_fresh_poisson_engine():
    engine, model, opt, dl = _build("poisson")
    assert engine.accountant.scheme.sample_rate == pytest.approx(0.1)
    _train("poisson", model, opt, dl)
    fresh = PrivacyEngine(accountant="poisson")
    model2 = GradSampleModule(_model("poisson"))
    fresh.load_checkpoint(path=_save(engine, model, opt), module=model2,
                          optimizer=torch.optim.SGD(model2.parameters(), lr=0.1))
    assert fresh.accountant.scheme == engine.accountant.scheme
    assert fresh.get_epsilon(DELTA) == engine.get_epsilon(DELTA)


def _stock(name):
    engine = PrivacyEngine(accountant=name)
    model = _model(name)
    model, opt, dl = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_dataset(), batch_size=BATCH, shuffle=True),
        noise_multiplier=1.3, max_grad_norm=1.0, poisson_sampling=(name == "poisson"))
    return engine, model, opt, dl


@pytest.mark.parametrize("name", ["poisson", "shuffle"])
@pytest.mark.parametrize("saved_by, loaded_by", [("stock", "stock"), ("stock", "ours"),
                                                  ("ours", "stock")])
def test_stock_and_helper_paths_load_each_others_checkpoints(name, saved_by, loaded_by):
    build = {"stock": _stock, "ours": _build}
    engine, model, opt, dl = build[saved_by](name)
    _train(name, model, opt, dl)
    buffer = _save(engine, model, opt)
    fresh, model2, opt2, _ = build[loaded_by](name)
    fresh.load_checkpoint(path=buffer, module=model2, optimizer=opt2)
    assert fresh.accountant.history == engine.accountant.history
    assert fresh.get_epsilon(DELTA) == pytest.approx(engine.get_epsilon(DELTA), rel=1e-12)


def test_checkpoint_of_another_rate_starts_a_new_phase():
    # issue 46: a resume with another batch size is a phase schedule, composed, not refused
    engine, model, opt, dl = _build("poisson")
    _train("poisson", model, opt, dl)
    other = PrivacyEngine(accountant="poisson")
    model2 = _model("poisson")
    m2, o2, _ = opacus_structured.make_private(
        other, module=model2, optimizer=torch.optim.SGD(model2.parameters(), lr=0.1),
        data_loader=DataLoader(_dataset(), batch_size=10), noise_multiplier=1.0,
        max_grad_norm=1.0, discretization=D)          # q = 0.2, not the checkpoint's 0.1
    other.load_checkpoint(path=_save(engine, model, opt), module=m2, optimizer=o2)
    assert len(other.accountant.phases) == 1 and other.accountant.total_steps == STEPS
    assert float(other.get_epsilon(DELTA)) >= float(engine.get_epsilon(DELTA))
