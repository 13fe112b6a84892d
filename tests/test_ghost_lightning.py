"""DPCallback(grad_sample_mode="ghost"): ghost norms + book-keeping in Lightning's single
backward give the same training as hooks mode (same sampler, noise, parameters, ε), also with
correlated noise, FastDPLSTM and the individual GDP filter / per-sample ε tracker."""

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from lightning_callbacks.dp_callback import DPCallback  # noqa: E402
from lightning_callbacks.gdp_filter import IndividualGDPFilter  # noqa: E402
from lightning_callbacks.per_sample_epsilon import PerSampleEpsilonTracker  # noqa: E402
from opacus_structured.accounting.individual_gdp import budget_from_steps  # noqa: E402
from opacus_structured.forecasting.fast_rnn import FastDPLSTM  # noqa: E402
from opacus_structured.indexed_dataset import IndexedDataset  # noqa: E402
from opacus_structured.optim.bookkeeping import BookKeepingHooks  # noqa: E402
from opacus_structured.optim.correlated_noise import CorrelatedNoiseDPOptimizer  # noqa: E402
from opacus_structured.schemes.bandmf_cyclic_poisson import (  # noqa: E402
    BandMFCyclicPoissonScheme,
)
from opacus_structured.schemes.poisson import PoissonScheme  # noqa: E402

warnings.filterwarnings("ignore")
DISC, DELTA, SIGMA = 1e-3, 1e-5, 1.0


class Seq(pl.LightningModule):
    """Linear on 3-D input -> FastDPLSTM -> LayerNorm -> Linear head; an unmodified module."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(3, 6)
        self.rnn = FastDPLSTM(6, 5, batch_first=True)
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch[0], batch[1]
        out, _ = self.rnn(torch.tanh(self.inp(x)))
        return F.cross_entropy(self.head(self.norm(out[:, -1])), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


def _data(n=48, indexed=False):
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, 4, 3, generator=g), torch.randint(0, 2, (n,), generator=g))
    if indexed:
        ds = IndexedDataset(ds)
    return DataLoader(ds, batch_size=8)


def _fit(mode, steps=4, callbacks=(), indexed=False, **kw):
    args = dict(scheme=PoissonScheme(sample_rate=1 / 6), noise_multiplier=SIGMA,
                max_grad_norm=0.5, delta=DELTA, discretization=DISC, seed=5,
                grad_sample_mode=mode)
    args.update(kw)
    cb = DPCallback(**args)
    model = Seq()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False,
                         callbacks=[cb, *callbacks], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         num_sanity_val_steps=0)
    trainer.fit(model, _data(indexed=indexed))
    return cb, model


def _assert_same(a, b):
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.slow  # 5-30 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_ghost_equals_hooks_poisson():
    cb_h, m_h = _fit("hooks")
    cb_g, m_g = _fit("ghost")
    assert isinstance(cb_g.optimizer.bookkeeper, BookKeepingHooks)
    assert type(cb_g.optimizer).__name__.startswith("BookKeeping")
    _assert_same(m_g, m_h)
    assert cb_g.steps == cb_h.steps == 4 and cb_g.epsilon() == cb_h.epsilon()
    moved = max(float((p - q).abs().max()) for p, q in zip(m_g.parameters(), Seq().parameters(),
                                                            strict=True))
    assert moved > 1e-3
    assert not hasattr(m_g, "autograd_grad_sample_hooks")  # hooks removed after fit


def test_ghost_equals_hooks_bandmf_correlated_noise():
    scheme = BandMFCyclicPoissonScheme(dataset_size=48, batch_size=4, bands=2,
                                       strategy="banded-sqrt")
    kw = dict(scheme=scheme, optimizer_class=CorrelatedNoiseDPOptimizer,
              optimizer_kwargs={"noise_correlation": scheme.noise_correlation(16)})
    cb_h, m_h = _fit("hooks", steps=5, **kw)
    cb_g, m_g = _fit("ghost", steps=5, **kw)
    assert cb_g.optimizer.noise_step == cb_h.optimizer.noise_step == 5
    _assert_same(m_g, m_h)
    assert cb_g.epsilon() == cb_h.epsilon()


def test_gdp_filter_and_tracker_in_ghost_mode_equal_hooks_mode():
    n = 48
    states = {}
    for mode in ("hooks", "ghost"):
        filt = IndividualGDPFilter(n, budget_from_steps(2, SIGMA) * 1.3)
        tracker = PerSampleEpsilonTracker(n)
        cb, model = _fit(mode, steps=4, callbacks=[filt, tracker], indexed=True,
                         scheme=PoissonScheme(sample_rate=1.0))
        states[mode] = (filt, tracker, model)
    (f_h, t_h, m_h), (f_g, t_g, m_g) = states["hooks"], states["ghost"]
    assert f_g.active_counts() == f_h.active_counts()
    assert f_h.active_counts()[0] == n and f_h.active_counts()[-1] < n  # some were dropped
    torch.testing.assert_close(t_g.mu_squared(), t_h.mu_squared(), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(f_g.accountant.observed_mu_sq, f_h.accountant.observed_mu_sq,
                               rtol=1e-5, atol=1e-9)
    _assert_same(m_g, m_h)


def test_ghost_mode_refusals():
    with pytest.raises(ValueError, match="grad_sample_mode"):
        DPCallback(scheme=PoissonScheme(sample_rate=0.1), delta=DELTA, noise_multiplier=1.0,
                   max_grad_norm=1.0, grad_sample_mode="fast")
    with pytest.raises(ValueError, match="wrap the optimizer"):
        DPCallback(scheme=PoissonScheme(sample_rate=0.1), delta=DELTA, wrap_optimizer=False,
                   grad_sample_mode="ghost")
    from opacus.optimizers import DPPerLayerOptimizer

    with pytest.raises(ValueError, match="optimizer_class"):
        _fit("ghost", steps=1, optimizer_class=DPPerLayerOptimizer,
             optimizer_kwargs={})


def test_forecaster_deepar_ghost_equals_hooks():
    """The DP forecasting trainer with book-keeping (DeepAR: embedding, FastDPLSTM, distribution
    head) takes the same steps as with Opacus hooks."""
    pytest.importorskip("gluonts")
    from opacus_structured.forecasting.data import load_us_employment, train_test_split
    from opacus_structured.forecasting.training import train_forecaster

    train, _ = train_test_split(load_us_employment().subset(range(0, 148, 18)), 6)
    kw = dict(seed=0, prediction_length=6, context_length=8, batch_size=4, noise_multiplier=1.0,
              delta=1e-5, max_steps=3, discretization=1e-3, lr=1e-2, max_grad_norm=0.05,
              estimator_kwargs=dict(num_layers=2, hidden_size=4, lags_seq=[1, 2, 12],
                                    num_parallel_samples=5))
    res = {mode: train_forecaster("deepar", train, grad_sample_mode=mode, **kw)
           for mode in ("hooks", "ghost")}
    assert res["ghost"].steps == res["hooks"].steps == 3
    assert res["ghost"].epsilon == res["hooks"].epsilon
    a = dict(res["ghost"].prepared.module.model.named_parameters())
    b = dict(res["hooks"].prepared.module.model.named_parameters())
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="lstm_impl='fast'"):
        train_forecaster("deepar", train, grad_sample_mode="ghost", lstm_impl="opacus", **kw)
    with pytest.raises(ValueError, match="grad_sample_mode"):
        train_forecaster("deepar", train, grad_sample_mode="fast", **kw)
