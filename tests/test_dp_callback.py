"""DPCallback: logged ε = accountant ε, stopping at the budget, exact resume, refusals."""

import glob
import os
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")
from dp_accounting.pld import privacy_loss_distribution as dp_pld  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers.logger import Logger  # noqa: E402
from lightning_small import spy_noise  # noqa: E402
from opacus.optimizers import DPOptimizer  # noqa: E402

from lightning_callbacks.dp_callback import DPCallback  # noqa: E402
from opacus_structured.accountants.base import SchemeAccountant  # noqa: E402
from opacus_structured.accountants.noise_lineage import (  # noqa: E402
    FreshNoiseWarning,
    NoiseReplayError,
)
from opacus_structured.samplers.poisson import PoissonBatchSampler, poisson_data_loader  # noqa
from opacus_structured.schemes.poisson import PoissonScheme  # noqa: E402

DISC = 1e-3
DELTA = 1e-5
Q = 1 / 8          # 64 examples -> expected batch 8, 8 steps per epoch
SIGMA = 1.0

warnings.filterwarnings("ignore", ".*does not have many workers.*")


class MemLogger(Logger):
    def __init__(self):
        super().__init__()
        self.rows = []

    @property
    def name(self):
        return "mem"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def values(self, key):
        return [m[key] for _, m in self.rows if key in m]


class Tiny(pl.LightningModule):
    def __init__(self, batchnorm=False, dp_optimizer=False):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8),
                                 nn.BatchNorm1d(8) if batchnorm else nn.Identity(),
                                 nn.ReLU(), nn.Linear(8, 2))
        self.dp_optimizer = dp_optimizer

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        if self.dp_optimizer:
            return DPOptimizer(opt, noise_multiplier=SIGMA, max_grad_norm=1.0,
                               expected_batch_size=8)
        return opt


def data(shuffle=True):
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
    return DataLoader(ds, batch_size=8, shuffle=shuffle)


def trainer(cb, max_steps, logger=None, callbacks=(), **kw):
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=logger or False,
                      callbacks=[cb, *callbacks], enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=bool(callbacks),
                      log_every_n_steps=1, num_sanity_val_steps=0, **kw)


def callback(**kw):
    args = dict(scheme=PoissonScheme(sample_rate=Q), noise_multiplier=SIGMA, max_grad_norm=1.0,
                delta=DELTA, discretization=DISC, seed=123)
    args.update(kw)
    return DPCallback(**args)


def reference_epsilon(steps):
    acc = SchemeAccountant(PoissonScheme(sample_rate=Q), discretization=DISC)
    for _ in range(steps):
        acc.step(noise_multiplier=SIGMA, sample_rate=Q)
    return acc.get_epsilon(DELTA)


@pytest.mark.slow  # 5-30 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_logged_epsilon_equals_accountant_epsilon():
    torch.manual_seed(0)
    model, cb, logger = Tiny(), callback(), MemLogger()
    before = [p.detach().clone() for p in model.parameters()]
    t = trainer(cb, max_steps=5, logger=logger)
    t.fit(model, data())
    assert isinstance(t.optimizers[0], DPOptimizer)
    assert isinstance(t.train_dataloader.batch_sampler.inner, PoissonBatchSampler)
    assert cb.steps == 5
    logged = logger.values("dp/epsilon")
    assert len(logged) == 5
    for i, eps in enumerate(logged, start=1):
        exact = reference_epsilon(i)
        assert eps == pytest.approx(exact, rel=1e-6)  # loggers store float32...
        assert eps >= exact                            # ...rounded up, never down
    assert cb.epsilon_history[-1] == (5, reference_epsilon(5))  # exact float64 value
    assert logger.values("dp/delta") == [pytest.approx(DELTA, rel=1e-6)] * 5
    # independent peer computation (dp_accounting's Poisson-subsampled Gaussian PLD)
    peer = dp_pld.from_gaussian_mechanism(SIGMA, sampling_prob=Q,
                                          value_discretization_interval=DISC).self_compose(5)
    assert logged[-1] >= peer.get_epsilon_for_delta(DELTA) - 2e-3
    assert logged[-1] == pytest.approx(peer.get_epsilon_for_delta(DELTA), abs=2e-2)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # hooks are removed after fit: the model is a plain module again
    assert not hasattr(model, "autograd_grad_sample_hooks")


def test_log_every_n_steps_prices_every_step_and_logs_every_nth_and_the_last():
    torch.manual_seed(0)
    model, cb, logger = Tiny(), callback(log_every_n_steps=3), MemLogger()
    trainer(cb, max_steps=7, logger=logger).fit(model, data())
    assert cb.steps == 7 and len(cb.accountant) == 7  # every step is priced
    assert [n for n, _ in cb.epsilon_history] == [3, 6, 7]  # every 3rd and the last
    assert cb.epsilon_history[-1][1] == reference_epsilon(7)
    # Lightning may re-emit the last logged value; only the values ε was computed at appear
    from lightning_callbacks.dp_budget import float32_up

    logged = logger.values("dp/epsilon")
    assert set(logged) == {float32_up(e) for _, e in cb.epsilon_history}
    assert logged[-1] == float32_up(reference_epsilon(7))
    with pytest.raises(ValueError, match="log_every_n_steps"):
        callback(log_every_n_steps=0)


def test_the_epoch_epsilon_follows_log_every_n_steps():
    """Issue 47: ``dp/epsilon_epoch`` composed the whole history at every epoch end, whatever
    ``log_every_n_steps`` said (the forecast trainer's 2-step epochs: 50 compositions per fit,
    each growing as σ shrinks, so training slowed as ε grew). Now an epoch end computes ε only
    when it is known for the steps taken or ``log_every_n_steps`` steps passed since."""
    torch.manual_seed(0)
    model, cb, logger = Tiny(), callback(log_every_n_steps=1000), MemLogger()
    priced = []
    trainer_ = trainer(cb, max_steps=20, logger=logger)
    kind = type(cb.accountant)
    real = kind.get_epsilon

    def counting(self, delta, *args, **kwargs):
        priced.append(len(self))
        return real(self, delta, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kind, "get_epsilon", counting)
        trainer_.fit(model, data())
    assert cb.steps == 20 and trainer_.current_epoch >= 2  # several epochs ran
    assert priced == [20]  # once, at the last step: no epoch end composed the history
    assert logger.values("dp/epsilon_epoch")[-1] == logger.values("dp/epsilon")[-1]
    # the default (every step) still logs ε at every epoch end
    model, cb, logger = Tiny(), callback(), MemLogger()
    trainer(cb, max_steps=20, logger=logger).fit(model, data())
    assert len(logger.values("dp/epsilon_epoch")) >= 3


def test_no_logger_no_lightning_warning():
    torch.manual_seed(0)
    cb = callback()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no logger configured.*")
        trainer(cb, max_steps=2).fit(Tiny(), data())
    assert cb.steps == 2


def test_stops_before_exceeding_target_epsilon():
    target = (reference_epsilon(4) + reference_epsilon(5)) / 2
    torch.manual_seed(0)
    cb = callback(target_epsilon=target)
    trainer(cb, max_steps=20).fit(Tiny(), data())
    assert cb.steps == 4
    assert cb.epsilon() <= target < cb.prospective_epsilon()


def test_target_below_one_step_trains_nothing():
    cb = callback(target_epsilon=reference_epsilon(1) * 0.9)
    model = Tiny()
    before = [p.detach().clone() for p in model.parameters()]
    trainer(cb, max_steps=20).fit(model, data())
    assert cb.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_min_steps_past_budget_is_refused():
    cb = callback(target_epsilon=(reference_epsilon(2) + reference_epsilon(3)) / 2)
    with pytest.raises(RuntimeError, match="target_epsilon"):
        trainer(cb, max_steps=20, min_steps=6).fit(Tiny(), data())
    assert cb.steps == 2


@pytest.mark.slow  # 5-30 s: out of the README command (issue 41: <= 5 min); CI runs it
@pytest.mark.parametrize("resume_step,mode", [(3, "hooks"), (8, "hooks"), (3, "ghost")])
def test_resume_from_the_last_release_matches_uninterrupted_run(tmp_path, resume_step, mode):
    """A run stopped at ``resume_step`` and resumed from its checkpoint there (its last released
    step: provably a continuation) is bit-identical to the run that was not interrupted."""
    total = 12  # 1.5 epochs of 8 steps
    torch.manual_seed(0)
    model_a, cb_a = Tiny(), callback(grad_sample_mode=mode)
    trainer(cb_a, max_steps=total).fit(model_a, data())

    torch.manual_seed(0)  # the same run, stopped at resume_step with a checkpoint there
    model_s, cb_s = Tiny(), callback(grad_sample_mode=mode)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=resume_step, save_top_k=-1,
                           filename="{step}")
    trainer(cb_s, max_steps=resume_step, callbacks=[ckpt]).fit(model_s, data())
    path = os.path.join(tmp_path, f"step={resume_step}.ckpt")
    assert os.path.exists(path), glob.glob(str(tmp_path / "*"))

    torch.manual_seed(1)  # different init: everything must come from the checkpoint
    model_b, cb_b = Tiny(), callback(seed=999, grad_sample_mode=mode)  # seeds too
    with warnings.catch_warnings():
        warnings.simplefilter("error", FreshNoiseWarning)  # the noise is restored, not fresh
        trainer(cb_b, max_steps=total).fit(model_b, data(), ckpt_path=path)
    assert cb_b.steps == cb_a.steps == total
    assert cb_b.epsilon() == cb_a.epsilon()
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("same_callback", [True, False])
def test_resume_from_an_earlier_checkpoint_never_replays_noise(tmp_path, monkeypatch,
                                                               same_callback):
    """Issue 46, repro 17: fit with checkpoints, then fit again from an earlier one. The
    resumed steps draw fresh noise (no noise tensor of the first fit is added again), with a
    FreshNoiseWarning; the callback that went on keeps every released step."""
    drawn = spy_noise(monkeypatch)
    torch.manual_seed(0)
    model, cb = Tiny(), callback()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1,
                           filename="{step}")
    trainer(cb, max_steps=6, callbacks=[ckpt]).fit(model, data())
    first = list(drawn)
    resumed = cb if same_callback else callback()
    with pytest.warns(FreshNoiseWarning, match="already drawn 6"):
        trainer(resumed, max_steps=6).fit(model, data(),
                                          ckpt_path=os.path.join(tmp_path, "step=2.ckpt"))
    second = drawn[len(first):]
    assert len(second) == len(first) * 2 // 3  # steps 3..6 again, 4 tensors each
    assert not any(torch.equal(a, b) for a in second for b in first)
    assert resumed.steps == (10 if same_callback else 6)


def test_accepts_user_dp_optimizer_and_poisson_loader():
    loader = poisson_data_loader(data().dataset, Q, seed=5)
    cb = callback(wrap_optimizer=False, install_sampler=False, noise_multiplier=None,
                  max_grad_norm=None)
    trainer(cb, max_steps=3).fit(Tiny(dp_optimizer=True), loader)
    assert cb.steps == 3
    assert cb.epsilon() == pytest.approx(reference_epsilon(3), rel=1e-6)


# ---- misconfigurations ------------------------------------------------------------------
def test_refuses_non_dp_optimizer():
    cb = callback(wrap_optimizer=False)
    with pytest.raises(ValueError, match="DPOptimizer"):
        trainer(cb, max_steps=2).fit(Tiny(), data())


def test_refuses_shuffled_loader_with_poisson_accountant():
    cb = callback(install_sampler=False)
    with pytest.raises(ValueError, match=r"RandomSampler.*shuffling.*PoissonScheme"):
        trainer(cb, max_steps=2).fit(Tiny(), data(shuffle=True))


def test_refuses_batchnorm():
    cb = callback()
    with pytest.raises(ValueError, match=r"(?s)net.1 \(BatchNorm1d\).*ModuleValidator\.fix"):
        trainer(cb, max_steps=2).fit(Tiny(batchnorm=True), data())


def test_gradient_accumulation_is_priced_not_refused():
    """Issue 46: Trainer(accumulate_grad_batches=2) is two draws per noisy step, each priced at
    σ/√2 (tests/test_dp_accumulation.py checks the price against dp_accounting)."""
    cb = callback()
    trainer(cb, max_steps=2, accumulate_grad_batches=2).fit(Tiny(), data())
    assert cb.accountant.history == [(pytest.approx(SIGMA / 2 ** 0.5), Q, 4)]
    assert cb.steps == 4 and cb.accountant.released_steps == 2


def test_refuses_loader_with_other_scheme():
    loader = poisson_data_loader(data().dataset, 0.25, seed=5)
    with pytest.raises(ValueError, match="same scheme"):
        trainer(callback(), max_steps=2).fit(Tiny(), loader)


@pytest.mark.parametrize("kwargs, name", [
    (dict(delta=0.0), "delta"),
    (dict(noise_multiplier=None), "noise_multiplier"),
    (dict(max_grad_norm=-1.0), "max_grad_norm"),
    (dict(target_epsilon=0.0), "target_epsilon"),
    (dict(loss_reduction="max"), "loss_reduction"),
    (dict(optimizer_class=torch.optim.SGD), "optimizer_class"),
    (dict(scheme=None), "scheme"),
    (dict(sampler=PoissonBatchSampler(64, 0.25, seed=0)), "disagree"),
])
def test_constructor_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        callback(**kwargs)


def test_checkpoint_from_other_scheme_starts_a_new_phase():
    # issue 46: another rate at a resume is a phase schedule (tests/test_phases.py)
    cb = callback()
    state = callback(scheme=PoissonScheme(sample_rate=0.25)).state_dict()
    cb.load_state_dict(state)
    assert len(cb.accountant.phases) == 1


def test_correlated_noise_under_independent_noise_scheme_is_refused():
    corr = pytest.importorskip("opacus_structured.optim.correlated_noise")
    cb = callback(optimizer_class=corr.CorrelatedNoiseDPOptimizer,
                  optimizer_kwargs={"noise_correlation": [1.0, 0.5]})
    with pytest.raises(ValueError, match="correlated noise"):
        trainer(cb, max_steps=1).fit(Tiny(), data())


def test_correlated_noise_optimizer_state_resumes(tmp_path, monkeypatch):
    # Plumbing only: the ring buffers of a correlated-noise optimizer go through the
    # checkpoint. The Poisson scheme does NOT price c = [1, .5]; it is made to claim so for
    # this test alone (monkeypatch), and only parameters are compared here, not ε.
    monkeypatch.setattr(PoissonScheme, "prices_correlated_noise", True)
    corr = pytest.importorskip("opacus_structured.optim.correlated_noise")
    kw = dict(optimizer_class=corr.CorrelatedNoiseDPOptimizer,
              optimizer_kwargs={"noise_correlation": [1.0, 0.5]})
    torch.manual_seed(0)
    model_a, cb_a = Tiny(), callback(**kw)
    trainer(cb_a, max_steps=4).fit(model_a, data())
    assert isinstance(cb_a.optimizer, corr.CorrelatedNoiseDPOptimizer)
    torch.manual_seed(0)  # the same run stopped at step 2: resuming there continues it
    model_s, cb_s = Tiny(), callback(**kw)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1,
                           filename="{step}")
    trainer(cb_s, max_steps=2, callbacks=[ckpt]).fit(model_s, data())
    torch.manual_seed(1)
    model_b, cb_b = Tiny(), callback(seed=7, **kw)
    trainer(cb_b, max_steps=4).fit(model_b, data(),
                                   ckpt_path=os.path.join(tmp_path, "step=2.ckpt"))
    assert cb_b.optimizer.noise_step == cb_a.optimizer.noise_step == 4
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b)
    # resuming from step 2 of the run that went on to 4 would replace released correlated
    # noise: refused before any noise is drawn (its noise needs its positions)
    ckpt_b = ModelCheckpoint(dirpath=tmp_path / "b", every_n_train_steps=2, save_top_k=-1,
                             filename="{step}")
    trainer(callback(**kw), max_steps=4, callbacks=[ckpt_b]).fit(Tiny(), data())
    with pytest.raises(NoiseReplayError, match="correlated"):
        trainer(callback(**kw), max_steps=4).fit(
            Tiny(), data(), ckpt_path=os.path.join(tmp_path / "b", "step=2.ckpt"))


def test_bandmf_scheme_sampler_optimizer_and_epsilon():
    # A scheme that carries its dataset size gets its own sampler installed; the default
    # accountant is the scheme's (one PLD per cycle of `bands` steps: the generic per-epoch
    # chunking used to under-report here), checked against the direct composition.
    from opacus_structured.accounting import pld as pld_lib
    from opacus_structured.optim.correlated_noise import CorrelatedNoiseDPOptimizer
    from opacus_structured.samplers.cyclic_poisson import CyclicPoissonBatchSampler
    from opacus_structured.schemes.bandmf_cyclic_poisson import BandMFCyclicPoissonScheme

    scheme = BandMFCyclicPoissonScheme(dataset_size=64, batch_size=4, bands=2,
                                       strategy="banded-sqrt")
    cb = callback(scheme=scheme, optimizer_class=CorrelatedNoiseDPOptimizer,
                  optimizer_kwargs={"noise_correlation": scheme.noise_correlation(16)})
    torch.manual_seed(0)
    t = trainer(cb, max_steps=5)
    t.fit(Tiny(), data())
    assert isinstance(t.train_dataloader.batch_sampler.inner, CyclicPoissonBatchSampler)
    assert isinstance(cb.optimizer, CorrelatedNoiseDPOptimizer)
    pld = scheme.pld(SIGMA, discretization=DISC)
    direct = pld_lib.epsilon_for_delta(pld_lib.self_compose(pld, 3), DELTA)  # ceil(5/2) cycles
    assert cb.epsilon() == pytest.approx(direct, rel=1e-9)
    wrong = BandMFCyclicPoissonScheme(dataset_size=65, batch_size=4, bands=2)
    with pytest.raises(ValueError, match="dataset_size=65"):
        trainer(callback(scheme=wrong), max_steps=1).fit(Tiny(), data())


def test_bminsep_scheme_trains_only_with_the_c_it_prices():
    """b-min-sep BandMF under DPCallback: the scheme prices one banded C (optimised for its
    ``horizon``); the callback's default optimizer (independent noise) is refused, the
    correlated-noise optimizer streaming ``scheme.noise_correlation()`` trains, and the labelled
    estimate is the scheme's own at the steps taken (mid-run steps < bands included)."""
    from opacus_structured.accounting.monte_carlo import MonteCarloEpsilon, MonteCarloSettings
    from opacus_structured.optim.correlated_noise import CorrelatedNoiseDPOptimizer
    from opacus_structured.samplers.bminsep import BMinSepBatchSampler
    from opacus_structured.schemes.bminsep_mc import BMinSepMonteCarloScheme

    scheme = BMinSepMonteCarloScheme(bands=2, dataset_size=64, batch_size=8, horizon=6)
    with pytest.raises(ValueError, match=r"scheme.noise_correlation\(\)"):
        trainer(callback(scheme=scheme, allow_estimate=True), max_steps=1).fit(Tiny(), data())
    settings = MonteCarloSettings(samples=4000, workers=1, seed=3)
    cb = callback(scheme=scheme, allow_estimate=True, delta=MC_DELTA,
                  accountant=SchemeAccountant(scheme, settings=settings),
                  optimizer_class=CorrelatedNoiseDPOptimizer,
                  optimizer_kwargs={"noise_correlation": scheme.noise_correlation()})
    torch.manual_seed(0)
    t = trainer(cb, max_steps=6)
    t.fit(Tiny(), data())
    assert isinstance(t.train_dataloader.batch_sampler.inner, BMinSepBatchSampler)
    assert cb.optimizer.noise_coefficients == pytest.approx(scheme.noise_correlation())
    eps = cb.epsilon()
    assert isinstance(eps, MonteCarloEpsilon) and cb.steps == 6
    assert float(eps) == float(scheme.epsilon(SIGMA, 6, MC_DELTA, settings=settings))


def test_balls_in_bins_scheme_in_callback():
    from opacus_structured.accountants.bandmf import BallsInBinsAccountant
    from opacus_structured.schemes.balls_in_bins import BallsInBinsScheme

    scheme = BallsInBinsScheme(num_bins=8, epochs=2)
    cb = callback(scheme=scheme)
    torch.manual_seed(0)
    trainer(cb, max_steps=10).fit(Tiny(), data())
    assert isinstance(cb.accountant, BallsInBinsAccountant) and cb.steps == 10
    assert cb.epsilon() == pytest.approx(scheme.epsilon(SIGMA, 16, DELTA, discretization=DISC))


# ---- issue 22: no epsilon from a callback that priced nothing ----------------------------
def test_epsilon_of_a_callback_never_attached_raises():
    from opacus_structured.accountants.base import AccountantNotAttachedError

    cb = callback()
    with pytest.raises(AccountantNotAttachedError, match="never attached to a Trainer"):
        cb.epsilon()
    with pytest.raises(AccountantNotAttachedError, match="callbacks=\\[dp\\]"):
        cb.prospective_epsilon()
    # after fit started and before any step, 0 is the honest value
    cb = callback(target_epsilon=reference_epsilon(1) * 0.9)
    trainer(cb, max_steps=5).fit(Tiny(), data())
    assert cb.steps == 0 and cb.epsilon() == 0.0


def test_restored_callback_reports_its_steps_without_fit():
    torch.manual_seed(0)
    trained = callback()
    trainer(trained, max_steps=3).fit(Tiny(), data())
    restored = callback()
    restored.load_state_dict(trained.state_dict())
    assert restored.steps == 3
    assert restored.epsilon() == trained.epsilon() == pytest.approx(reference_epsilon(3),
                                                                    rel=1e-12)
    assert restored.prospective_epsilon() == pytest.approx(reference_epsilon(4), rel=1e-12)


def test_gdp_scheme_gets_a_full_batch_sampler():
    from lightning_callbacks.batch_indices import FullBatchSampler
    from opacus_structured.schemes.gdp import GDPScheme

    torch.manual_seed(0)
    cb = callback(scheme=GDPScheme())
    t = trainer(cb, max_steps=3)
    t.fit(Tiny(), data())
    assert isinstance(t.train_dataloader.batch_sampler.inner, FullBatchSampler)
    assert cb.optimizer.expected_batch_size == 64
    # μ-GDP is priced in closed form (μ = √T/σ, issue 20): exact, and the peer's pessimistic
    # PLD of the same composed Gaussian can only lie above it, by its discretisation
    exact = GDPScheme().gdp_epsilon(SIGMA, 3, DELTA)
    peer = dp_pld.from_gaussian_mechanism(SIGMA, value_discretization_interval=DISC)
    peer_eps = peer.self_compose(3).get_epsilon_for_delta(DELTA)
    assert cb.epsilon() == pytest.approx(exact, rel=1e-9)
    assert exact <= peer_eps <= exact + 3 * DISC


# ---- issue 22: a Monte Carlo estimate keeps its label ------------------------------------
MC_DELTA = 1e-2  # the Monte Carlo upper estimate needs a delta its samples can resolve


class PoissonMonteCarloAccountant(SchemeAccountant):
    """Poisson DP-SGD at q = 1/8 priced by Monte Carlo. b-min-sep sampling with b = 1 and a
    one-band strategy *is* Poisson sampling with independent noise, so
    ``BMinSepMonteCarloScheme`` estimates exactly this mechanism (a real estimate: labelled
    ``MonteCarloEpsilon``, bound kind "monte-carlo")."""

    def __init__(self):
        from opacus_structured.accounting.monte_carlo import MonteCarloSettings
        from opacus_structured.schemes.bminsep_mc import BMinSepMonteCarloScheme

        super().__init__(PoissonScheme(sample_rate=Q))
        self.mc = BMinSepMonteCarloScheme(bands=1, min_sep=1, dataset_size=64, batch_size=8)
        self.mc_settings = MonteCarloSettings(samples=20_000, workers=1, seed=0)

    @property
    def bound(self):
        from opacus_structured.accounting.bounds import BoundKind

        return BoundKind.MONTE_CARLO

    def get_epsilon(self, delta, **kwargs):
        sigma = min(s for s, _, n in self.history if n)
        return self.mc.epsilon(sigma, len(self), delta, settings=self.mc_settings)


def mc_callback(**kw):
    return callback(accountant=PoissonMonteCarloAccountant(), delta=MC_DELTA, **kw)


def test_monte_carlo_accountant_is_refused_without_opt_in():
    assert PoissonMonteCarloAccountant().mc.sampling_prob == Q
    with pytest.raises(ValueError, match=r"(?s)monte-carlo estimate.*allow_estimate=True"):
        mc_callback()
    with pytest.raises(ValueError, match="stop_on_estimate=True"):
        mc_callback(allow_estimate=True, target_epsilon=5.0)
    with pytest.raises(ValueError, match="stop_on_estimate"):
        callback(stop_on_estimate=True)  # a guarantee has nothing to opt into
    # the default accountant of a Monte Carlo scheme is refused the same way
    from opacus_structured.schemes.bminsep_mc import BMinSepMonteCarloScheme

    mc = BMinSepMonteCarloScheme(bands=1, dataset_size=64, batch_size=8)
    with pytest.raises(ValueError, match="allow_estimate=True"):
        callback(scheme=mc)
    assert callback(scheme=mc, allow_estimate=True).epsilon_metric == "dp/epsilon_mc_estimate"


def test_monte_carlo_estimate_is_logged_labelled_and_never_as_dp_epsilon():
    from opacus_structured.accounting.monte_carlo import MonteCarloEpsilon

    torch.manual_seed(0)
    cb, logger = mc_callback(allow_estimate=True), MemLogger()
    trainer(cb, max_steps=4, logger=logger).fit(Tiny(), data())
    assert cb.steps == 4 and not cb.is_guarantee
    keys = {k for _, m in logger.rows for k in m}
    assert "dp/epsilon" not in keys and "dp/epsilon_epoch" not in keys
    logged = logger.values("dp/epsilon_mc_estimate")
    assert len(logged) == 4
    eps = cb.epsilon()
    assert isinstance(eps, MonteCarloEpsilon) and "Monte Carlo" in f"{eps:.3f}"
    assert logged[-1] == pytest.approx(float(eps), rel=1e-6) and logged[-1] >= float(eps)
    for steps, value in cb.epsilon_history:
        assert isinstance(value, MonteCarloEpsilon)
        exact = cb.accountant.mc.epsilon(SIGMA, steps, MC_DELTA,
                                         settings=cb.accountant.mc_settings)
        assert float(value) == float(exact)
    # an upper estimate at confidence 1 - 1e-3: above the certified PLD value of the same run
    pld = SchemeAccountant(PoissonScheme(sample_rate=Q), discretization=DISC)
    pld.step(noise_multiplier=SIGMA, sample_rate=Q, num_steps=4)
    assert float(eps) >= pld.get_epsilon(MC_DELTA) - 1e-3


def test_monte_carlo_estimate_stops_training_only_when_allowed():
    acc = PoissonMonteCarloAccountant()
    target = (float(acc.mc.epsilon(SIGMA, 2, MC_DELTA, settings=acc.mc_settings))
              + float(acc.mc.epsilon(SIGMA, 3, MC_DELTA, settings=acc.mc_settings))) / 2
    torch.manual_seed(0)
    cb = mc_callback(allow_estimate=True, stop_on_estimate=True, target_epsilon=target)
    trainer(cb, max_steps=10).fit(Tiny(), data())
    assert cb.steps == 2


# ---- the accountant is attached to the loader trained on (issue 23) ----------------------
def test_accountant_is_attached_to_the_installed_loader():
    torch.manual_seed(0)
    cb = callback()
    trainer(cb, max_steps=2).fit(Tiny(), data())
    assert cb.accountant.attached and cb.steps == 2


def test_sampler_of_another_dataset_size_is_refused():
    # same scheme, wrong dataset: the accountant's loader check (make_private's rules) refuses
    loader = DataLoader(data().dataset, batch_sampler=PoissonBatchSampler(100, Q, seed=0))
    with pytest.raises(ValueError, match="draws from 100 examples"):
        trainer(callback(), max_steps=1).fit(Tiny(), loader)


def test_individual_gdp_accountant_prices_the_full_batch_worst_case_and_says_so():
    # An accountant without attach() (not a SchemeAccountant) is fed the steps; under Poisson
    # sampling it charges every step 1/σ and warns that it uses no amplification.
    import math

    from opacus_structured.accountants.individual_gdp import IndividualGDPAccountant
    from opacus_structured.accounting.gaussian import gdp_epsilon

    torch.manual_seed(0)
    cb = callback(accountant=IndividualGDPAccountant())
    with pytest.warns(UserWarning, match="individual-gdp does not use subsampling amplification"):
        trainer(cb, max_steps=3).fit(Tiny(), data())
    assert cb.steps == 3
    assert cb.epsilon() == pytest.approx(gdp_epsilon(DELTA, math.sqrt(3) / SIGMA), rel=1e-12)
    assert cb.epsilon() > reference_epsilon(3)  # never below the amplified population ε
    assert cb.state_dict()["accountant"]["amplification"] == "not used (sample_rate=0.125 < 1)"
