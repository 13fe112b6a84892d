"""Issue 29, case 8: the private dataset size must not reach the sampling rate or the normaliser.

Under add/remove adjacency the dataset size n is private. Opacus' rule q = 1/len(loader) =
1/ceil(n/B) and the normaliser int(n·q) differ between the neighbours n = 600 and n = 601 at
B = 60 (q = 0.1 vs 1/11, normaliser 60 vs 54). With a declared public size (``dataset_size=``,
or ``sample_rate=`` / ``expected_batch_size=``) both are the same for the two neighbours on every
path: ``make_private`` / ``make_private_with_epsilon``, ``DPCallback`` and the forecasting
trainer. Undeclared, the old behaviour stays, recorded (``dataset_size_source="data"``) and
warned once.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from opacus import PrivacyEngine
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import opacus_structured
from opacus_structured.accountants.base import SchemeAccountant
from opacus_structured.optim import CorrelatedNoisePrivacyEngine
from opacus_structured.samplers import public_sizes
from opacus_structured.samplers.public_sizes import DatasetSizeFromDataWarning
from opacus_structured.schemes.poisson import PoissonScheme

B = 60


@pytest.fixture(autouse=True)
def _fresh_warning_registry(monkeypatch):
    monkeypatch.setattr(public_sizes, "_warned", set())


def loader_of(n, batch_size=B, seed=0):
    g = torch.Generator().manual_seed(seed)
    ds = TensorDataset(torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g))
    return DataLoader(ds, batch_size=batch_size)


def private(n, accountant="poisson", *, with_epsilon=False, batch_size=B, **kw):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    engine_cls = (CorrelatedNoisePrivacyEngine if accountant == "random-allocation-mf"
                  else PrivacyEngine)
    engine = engine_cls(accountant=accountant)
    common = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  data_loader=loader_of(n, batch_size), max_grad_norm=1.0,
                  sampler_generator=torch.Generator().manual_seed(1), **kw)
    if with_epsilon:
        out = opacus_structured.make_private_with_epsilon(
            engine, target_epsilon=3.0, target_delta=1e-5, epochs=2, discretization=1e-3,
            **common)
    else:
        out = opacus_structured.make_private(engine, noise_multiplier=1.0, **common)
    return engine, out[0], out[1], out[2]


def step(model, optimizer, loader):
    x, y = next(iter(loader))
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


# ---- make_private -----------------------------------------------------------------------------
def test_undeclared_rate_and_normaliser_read_the_private_size():
    """The finding: neighbours 600 / 601 get q = 0.1 vs 1/11 and normaliser 60 vs 54; the
    accountant now records that the size came from the data, and one warning says how to
    declare it."""
    with pytest.warns(DatasetSizeFromDataWarning, match=r"dataset_size=.*sample_rate"):
        e600, _, o600, l600 = private(600)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DatasetSizeFromDataWarning)  # once per process
        e601, _, o601, l601 = private(601)
    assert (len(l600), len(l601)) == (10, 11)
    assert (o600.expected_batch_size, o601.expected_batch_size) == (60, 54)  # Opacus' int(n·q)
    for e, n in ((e600, 600), (e601, 601)):
        rec = e.accountant.sampling_constants
        assert rec["dataset_size_source"] == "data" and rec["public"] is False
        assert rec["dataset_size"] == n


@pytest.mark.parametrize("accountant,kw", [
    ("poisson", {}), ("balls-in-bins", {"epochs": 2}), ("gdp-full-batch", {}),
    ("random-allocation-mf", {"epochs": 2}),
])
def test_declared_dataset_size_gives_neighbours_one_rate_and_one_normaliser(accountant, kw):
    runs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DatasetSizeFromDataWarning)  # nothing read from data
        for n in (600, 601):
            runs[n] = private(n, accountant, dataset_size=600, **kw)
    (e0, _, o0, l0), (e1, m1, o1, l1) = runs[600], runs[601]
    assert len(l0) == len(l1)
    assert e0.accountant.scheme == e1.accountant.scheme
    full = accountant == "gdp-full-batch"
    assert len(l0) == (1 if full else 10)
    # the public normaliser: dataset_size × q, a float, never int(n·q) of the actual n
    expected = 600.0 if full else 60.0
    assert o0.expected_batch_size == o1.expected_batch_size == expected
    assert isinstance(o1.expected_batch_size, float)
    r0, r1 = e0.accountant.sampling_constants, e1.accountant.sampling_constants
    assert r0 == r1
    assert r0["dataset_size_source"] == "declared" and r0["dataset_size"] == 600
    assert r0["sample_rate"] == (1.0 if full else 0.1)
    # the sampler draws from all 601 actual examples at the public rate
    assert len(l1.dataset) == 601
    step(m1, o1, l1)
    assert e1.accountant.history[0][1] == pytest.approx(1.0 if full else 0.1)


def test_declared_normaliser_scales_the_released_update():
    """The update Opacus releases is (clipped sum + noise) / expected_batch_size: with the
    declared size it is divided by the public 60.0 for both neighbours (checked on the
    gradient the optimizer hands to SGD, noise-free)."""
    for n in (600, 601):
        torch.manual_seed(0)
        model = nn.Linear(3, 2, bias=False)
        engine = PrivacyEngine(accountant="poisson")
        _, opt, loader = opacus_structured.make_private(
            engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=loader_of(n), noise_multiplier=1e-12, max_grad_norm=1e6,
            sampler_generator=torch.Generator().manual_seed(2), dataset_size=600)
        x, y = next(iter(loader))
        opt.zero_grad()
        F.cross_entropy(model(x), y, reduction="mean").backward()
        summed = model.weight.grad_sample.sum(0).clone()
        opt.pre_step()
        assert torch.allclose(model.weight.grad, summed / 60.0, atol=1e-6)


def test_declared_sample_rate_and_expected_batch_size():
    runs = [private(n, sample_rate=0.1, expected_batch_size=60) for n in (600, 601)]
    assert [len(r[3]) for r in runs] == [10, 10]
    assert [r[2].expected_batch_size for r in runs] == [60.0, 60.0]
    assert runs[0][0].accountant.sampling_constants == runs[1][0].accountant.sampling_constants
    # sample_rate alone: the DataLoader's (public) batch_size is the normaliser
    assert private(601, sample_rate=0.1)[2].expected_batch_size == 60.0
    with pytest.raises(ValueError, match=r"sample_rate must be 1/k.*0\.3"):
        private(600, sample_rate=0.3)
    with pytest.raises(ValueError, match="dataset_size"):
        private(600, dataset_size=0)
    with pytest.raises(ValueError, match="expected_batch_size"):
        private(600, expected_batch_size=-1.0)


def test_schemes_that_price_the_size_need_it_to_match():
    with pytest.raises(ValueError, match=r"dataset_size=600 must equal len\(dataset\) = 601"):
        private(601, "truncated-poisson", max_batch_size=80, dataset_size=600)
    e, _, o, _ = private(600, "truncated-poisson", max_batch_size=80, dataset_size=600)
    assert e.accountant.sampling_constants["dataset_size_source"] == "declared"


def test_make_private_with_epsilon_calibrates_on_public_values():
    # Batches of 6 (q = 0.01; the neighbours' loaders have 100 and 101 batches): each σ the
    # search prices also gets Poisson's RDP route, 0.12 s of CPU at q = 0.01 against ~1.1 s at
    # q = 0.1 (issue 41: README command <= 5 min); the same two calibrations are compared.
    runs = [private(n, with_epsilon=True, dataset_size=600, batch_size=6) for n in (600, 601)]
    assert (len(loader_of(600, 6)), len(loader_of(601, 6))) == (100, 101)
    assert runs[0][2].noise_multiplier == runs[1][2].noise_multiplier
    assert runs[0][2].expected_batch_size == runs[1][2].expected_batch_size == 6.0


def test_sampling_constants_round_trip_through_the_state():
    e, *_ = private(601, dataset_size=600)
    state = e.accountant.state_dict()
    fresh = SchemeAccountant(e.accountant.scheme)
    fresh.load_state_dict(state)
    assert fresh.sampling_constants == e.accountant.sampling_constants


# ---- DPCallback -------------------------------------------------------------------------------
pl = pytest.importorskip("lightning.pytorch")
from lightning_callbacks.dp_callback import DPCallback  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(3, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_callback(n, **kw):
    cb = DPCallback(scheme=PoissonScheme(sample_rate=0.1), noise_multiplier=1.0,
                    max_grad_norm=1.0, delta=1e-5, discretization=1e-3, seed=0, **kw)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, callbacks=[cb],
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(Tiny(), loader_of(n, batch_size=B))
    return cb


def test_dp_callback_undeclared_normaliser_reads_the_private_size():
    """q = 0.1 is the scheme's; int(n·q) is 60 for n = 609 and 61 for n = 610."""
    with pytest.warns(DatasetSizeFromDataWarning, match="DPCallback"):
        a = fit_callback(609)
    b = fit_callback(610)
    assert (a.optimizer.expected_batch_size, b.optimizer.expected_batch_size) == (60, 61)
    assert a.sampling_constants["dataset_size_source"] == "data"
    assert a.accountant.sampling_constants == a.sampling_constants


@pytest.mark.parametrize("kw", [{"dataset_size": 600}, {"expected_batch_size": 60.0}])
def test_dp_callback_declared_constants_are_equal_for_neighbours(kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DatasetSizeFromDataWarning)
        a, b = fit_callback(609, **kw), fit_callback(610, **kw)
    assert a.sample_rate == b.sample_rate == 0.1
    assert a.optimizer.expected_batch_size == b.optimizer.expected_batch_size == 60.0
    assert a.sampling_constants["dataset_size_source"] == "declared"
    assert a.sampling_constants["expected_batch_size"] == 60.0
    assert a.accountant.history == b.accountant.history == [(1.0, 0.1, 1)]


class TinyOwnDP(Tiny):
    def __init__(self, normaliser):
        super().__init__()
        self.normaliser = normaliser

    def configure_optimizers(self):
        from opacus.optimizers import DPOptimizer

        return DPOptimizer(torch.optim.SGD(self.parameters(), lr=0.1), noise_multiplier=1.0,
                           max_grad_norm=1.0, expected_batch_size=self.normaliser)


@pytest.mark.parametrize("normaliser", [60.0, 61])
def test_dp_callback_checks_a_module_dp_optimizer_against_the_declared_normaliser(normaliser):
    cb = DPCallback(scheme=PoissonScheme(sample_rate=0.1), noise_multiplier=1.0,
                    max_grad_norm=1.0, delta=1e-5, discretization=1e-3, seed=0,
                    wrap_optimizer=False, dataset_size=600)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, callbacks=[cb],
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, num_sanity_val_steps=0)
    if normaliser == 61:
        with pytest.raises(ValueError, match=r"expected_batch_size=61 .*normaliser 60\.0"):
            trainer.fit(TinyOwnDP(normaliser), loader_of(610))
        return
    trainer.fit(TinyOwnDP(normaliser), loader_of(610))
    assert cb.sampling_constants["dataset_size_source"] == "declared"
    assert cb.optimizer.expected_batch_size == 60.0


# ---- the forecasting trainer (unit: series) ----------------------------------------------------
def _panels():
    pytest.importorskip("gluonts")
    from opacus_structured.forecasting.data import load_us_employment, train_test_split

    panel = load_us_employment()
    order = sorted(range(len(panel)), key=lambda i: panel.lengths[i])
    small = panel.subset(order[:4])               # N = 4 series
    plus = panel.subset(order[:4] + [order[-1]])  # N + 1: one more (the longest) series
    return train_test_split(small, 6)[0], train_test_split(plus, 6)[0]


class _Normaliser(pl.Callback):
    def on_train_end(self, trainer, pl_module):
        self.value = trainer.optimizers[0].expected_batch_size


def train(panel, **kw):
    from opacus_structured.forecasting.training import train_forecaster

    probe = _Normaliser()
    res = train_forecaster("simpleff", panel, prediction_length=6, context_length=8,
                           batch_size=2, noise_multiplier=1.0, delta=1e-5, epochs=1,
                           discretization=1e-3, estimator_kwargs={"hidden_dimensions": [4]},
                           callbacks=[probe], seed=0, **kw)
    return res, probe.value


def test_trainer_declared_number_of_series_is_shared_by_neighbours():
    small, plus = _panels()
    assert (len(small), len(plus)) == (4, 5) and small.min_length == plus.min_length
    with warnings.catch_warnings():
        warnings.simplefilter("error", DatasetSizeFromDataWarning)
        a, norm_a = train(small, dataset_size=4)
        b, norm_b = train(plus, dataset_size=4)
    assert a.scheme == b.scheme and a.scheme.num_series == 4
    assert a.accountant.history == b.accountant.history  # same rate, same steps (epochs=1)
    assert a.steps == b.steps == 2                        # floor(4/2) from the public N
    assert norm_a == norm_b == 2.0
    assert a.sampling_constants == b.sampling_constants
    assert a.sampling_constants["dataset_size_source"] == "declared"
    assert a.summary()["sampling_constants"]["dataset_size"] == 4


def test_trainer_undeclared_reads_the_panel_and_refuses_bad_declarations():
    small, plus = _panels()
    with pytest.warns(DatasetSizeFromDataWarning, match="train_forecaster"):
        a, _ = train(small)
    assert a.sampling_constants["dataset_size_source"] == "data"
    with pytest.raises(ValueError, match=r"dataset_size=6 declares more series.*\(5\)"):
        train(plus, dataset_size=6)
    with pytest.raises(ValueError, match="top_level='wor'"):
        train(plus, dataset_size=4, top_level="shuffle")


def test_structured_scheme_over_more_series_is_priced_by_the_public_count():
    from opacus_structured.schemes.structured import StructuredScheme

    base = dict(series_length=30, context_length=4, forecast_length=3, batch_size=2)
    public = StructuredScheme(num_series=4, **base)
    assert public.implemented_by(StructuredScheme(num_series=5, **base))
    assert not public.implemented_by(StructuredScheme(num_series=3, **base))
    assert not StructuredScheme(num_series=4, top_level="shuffle", **base).implemented_by(
        StructuredScheme(num_series=5, top_level="shuffle", **base))
    # the public count prices at least what the panel's own count does (ρ = 2/4 >= 2/5)
    assert public.epsilon(1.0, 10, 1e-5, discretization=1e-3) >= StructuredScheme(
        num_series=5, **base).epsilon(1.0, 10, 1e-5, discretization=1e-3)
    assert math.isclose(public.series_sampling_rate(), 0.5)
