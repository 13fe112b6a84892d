"""Issue 29, case 9: a change of ``max_grad_norm`` during training is priced or refused.

The accountants price σ at one clip norm C: the noise std is σ·C and every example's
contribution is clipped to C. Lowering ``optimizer.max_grad_norm`` to 0.1 used to make Opacus'
ghost clipping noise at 0.1 while still clipping at 1.0 (σ_eff = σ/10 printed as σ), and the
correlated-noise schemes carry earlier steps' noise, scaled to their C, into later steps.

Checked on every clipping path (hooks, Opacus ghost, book-keeping via DPCallback, a hand-wired
ghost optimizer, the DDP correlated optimizer) and every registered scheme:

* independent noise: the step clips at the new norm (the clipped sum equals an independent
  per-example computation at the new C) and ε is that of the same run without a change;
* correlated noise: the step where the norm changed raises, naming the cause, before anything
  is released; nothing is priced for it;
* a norm changed between backward and step (clipping and noise would differ) raises;
* a clipping the guard cannot see (wired by hand) cannot change the norm;
* adaptive clipping (AdaClip, PrivacyEngineAdaptiveClipping) is refused.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _training import private_linear, xy_dataset
from opacus import PrivacyEngine
from opacus.optimizers import AdaClipDPOptimizer, DPOptimizerFastGradientClipping
from torch import nn
from torch.utils.data import DataLoader

import opacus_structured
from opacus_structured.accountants import REGISTERED
from opacus_structured.accountants.base import SchemeAccountant
from opacus_structured.accountants.release_guard import (
    CORRELATED_CLIP_MESSAGE,
    ClipNormChangedError,
    ClipNormLedger,
)
from opacus_structured.optim import CorrelatedNoisePrivacyEngine
from opacus_structured.schemes.poisson import PoissonScheme

warnings.filterwarnings("ignore")

N, BATCH = 60, 12          # 5 steps per epoch, as Opacus counts len(loader)
K = N // BATCH
D, DELTA, SIGMA = 1e-3, 1e-5, 1.0
OLD, NEW = 1.0, 0.05       # NEW clips every example of this model (norms ~ 0.3-1.5)

#: every registered scheme name but "structured" (needs a WindowDataset; independent noise,
#: the same optimizers) -> (engine class, make_private options, correlated noise?)
CASES = {
    "poisson": (PrivacyEngine, {}, False),
    "truncated-poisson": (PrivacyEngine, {"max_batch_size": 16}, False),
    "balls-in-bins": (PrivacyEngine, {"epochs": 2}, False),
    "gdp-full-batch": (PrivacyEngine, {}, False),
    "shuffle": (PrivacyEngine, {}, False),
    "bandmf-cyclic-poisson": (CorrelatedNoisePrivacyEngine, {"bands": 2, "epochs": 2}, True),
    "random-allocation-mf": (CorrelatedNoisePrivacyEngine,
                             {"bands": 2, "epochs": 2, "method": "renyi"}, True),
}


def _dataset():
    return xy_dataset(N, 3)


def _make(name, mode="hooks"):
    engine_class, options, _ = CASES[name]
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    engine = engine_class(accountant=name)
    out = opacus_structured.make_private(
        engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_dataset(), batch_size=BATCH), noise_multiplier=SIGMA,
        max_grad_norm=OLD, discretization=D, sampler_generator=torch.Generator().manual_seed(1),
        noise_generator=torch.Generator().manual_seed(2), grad_sample_mode=mode,
        criterion=nn.CrossEntropyLoss(), **options)
    if mode == "ghost":
        model, opt, crit, dl = out
    else:
        (model, opt, dl), crit = out, nn.CrossEntropyLoss()
    return engine, model, opt, crit, dl


def _clipped_sum(plain: nn.Module, x, y, clip):
    """Σ_b min(1, C/(‖g_b‖ + 1e-6)) g_b from one backward per example (independent of Opacus)."""
    total = [torch.zeros_like(p) for p in plain.parameters()]
    for i in range(len(x)):
        plain.zero_grad()
        nn.functional.cross_entropy(plain(x[i:i + 1]), y[i:i + 1]).backward()
        grads = [p.grad.detach().clone() for p in plain.parameters()]
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
        factor = min(1.0, clip / (float(norm) + 1e-6))
        total = [t + factor * g for t, g in zip(total, grads, strict=True)]
    return total


def _plain_copy(inner: nn.Linear) -> nn.Linear:
    plain = nn.Linear(3, 2)
    plain.load_state_dict(inner.state_dict())
    return plain


def _run(model, opt, crit, dl, steps, *, change_at=None, check_clip=False):
    """Train ``steps`` steps; set ``max_grad_norm = NEW`` before step ``change_at`` (1-based);
    with ``check_clip``, compare each released clipped sum with :func:`_clipped_sum`."""
    inner = getattr(model, "_module", model)
    seen = {}
    previous = opt.step_hook

    def hook(o):
        seen["sum"] = [p.summed_grad.detach().clone() for p in o.params]
        previous(o)

    opt.attach_step_hook(hook)
    taken, compared = 0, 0
    while taken < steps:
        for x, y in dl:
            if change_at is not None and taken + 1 == change_at:
                opt.max_grad_norm = NEW
            plain = _plain_copy(inner)
            crit(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            taken += 1
            if check_clip and len(x):
                expected = _clipped_sum(plain, x, y, opt.max_grad_norm)
                for got, want in zip(seen["sum"], expected, strict=True):
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
                compared += 1
            if taken == steps:
                break
    return compared


def test_every_registered_scheme_has_a_case():
    assert set(REGISTERED) == set(CASES) | {"structured"}


#: balls-in-bins prices its whole planned run twice here (> 5 s): slow
_NAMES = [pytest.param(n, marks=pytest.mark.slow) if n == "balls-in-bins" else n
          for n in sorted(CASES)]


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("name", _NAMES)
def test_make_private_clip_change_is_priced_or_refused(name, mode):
    correlated = CASES[name][2]
    steps = 2 if name == "gdp-full-batch" else 4
    change_at = 2 if name == "gdp-full-batch" else 3
    engine, model, opt, crit, dl = _make(name, mode)
    if correlated:
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ClipNormChangedError, match=CORRELATED_CLIP_MESSAGE):
            _run(model, opt, crit, dl, steps, change_at=change_at)
        assert len(engine.accountant) == change_at - 1   # the refused step is not priced ...
        assert opt.noise_step == change_at - 1            # ... nor noised ...
        assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        return
    compared = _run(model, opt, crit, dl, steps, change_at=change_at, check_clip=True)
    assert compared >= steps - 1
    if mode == "ghost":
        assert model.max_grad_norm == NEW   # the module clips at the optimizer's norm
    assert len(engine.accountant) == steps
    # σ is the multiplier: ε is the one of the same run without a change
    e2, m2, o2, c2, d2 = _make(name, mode)
    _run(m2, o2, c2, d2, steps)
    assert engine.get_epsilon(DELTA) == e2.get_epsilon(DELTA)


def test_issue_case_ghost_lowered_to_a_tenth_clips_at_a_tenth():
    """The issue's case: Poisson q = 0.2, ghost, max_grad_norm 1.0 -> 0.1 after 2 steps. The
    noise follows the new value and so does the clipping: σ is what is priced."""
    engine, model, opt, crit, dl = _make("poisson", "ghost")
    _run(model, opt, crit, dl, 2)
    opt.max_grad_norm = 0.1
    seen = []
    previous = opt.step_hook
    opt.attach_step_hook(lambda o: (seen.append([p.summed_grad.clone() for p in o.params]),
                                    previous(o)))
    x, y = next(iter(dl))
    plain = _plain_copy(model._module)
    crit(model(x), y).backward()
    opt.step()
    for got, want in zip(seen[0], _clipped_sum(plain, x, y, 0.1), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    # the clipped sum of a batch of b examples at C = 0.1 has norm <= 0.1 b
    norm = torch.sqrt(sum((g ** 2).sum() for g in seen[0]))
    assert float(norm) <= 0.1 * len(x) + 1e-6


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_change_between_backward_and_step_raises(mode):
    engine, model, opt, crit, dl = _make("poisson", mode)
    _run(model, opt, crit, dl, 1)
    x, y = next(iter(dl))
    crit(model(x), y).backward()
    opt.max_grad_norm = NEW      # the backward (ghost) or ... clipped at OLD
    if mode == "hooks":          # hooks clip inside step(): clipping and noise agree
        opt.step()
        assert len(engine.accountant) == 2
        return
    with pytest.raises(ClipNormChangedError, match="clipped at max_grad_norm=1 but the noise "
                                                   "is scaled to max_grad_norm=0.05"):
        opt.step()
    assert len(engine.accountant) == 1


def test_per_layer_clipping_change_of_the_total_norm_alone_raises():
    """Per-layer clipping clips with ``max_grad_norms``; changing only ``max_grad_norm`` (the
    noise norm) would noise at a norm the clipping does not use."""
    engine, model, opt, dl = private_linear(
        _dataset(), BATCH, seed=1, noise_multiplier=SIGMA, max_grad_norm=[0.6, 0.8],
        clipping="per_layer", discretization=D)
    crit = nn.CrossEntropyLoss()
    _run(model, opt, crit, dl, 2)                     # ‖(0.6, 0.8)‖ = 1.0 = max_grad_norm
    with pytest.raises(ClipNormChangedError, match="clipped at max_grad_norm=1 but the noise"):
        _run(model, opt, crit, dl, 1, change_at=1)
    opt.zero_grad()
    assert len(engine.accountant) == 2
    opt.max_grad_norms = [0.03, 0.04]                 # both follow: ‖·‖ = 0.05 = NEW
    _run(model, opt, crit, dl, 1)
    assert len(engine.accountant) == 3


def test_opacus_grad_clip_scheduler_on_the_hooks_path_is_priced():
    from opacus.schedulers import ExponentialGradClip

    engine, model, opt, crit, dl = _make("poisson", "hooks")
    scheduler = ExponentialGradClip(opt, gamma=0.5)
    for _ in range(3):
        _run(model, opt, crit, dl, 1)
        scheduler.step()
    assert opt.max_grad_norm == 0.125
    assert engine.accountant._clip_norms.changes == 2
    assert len(engine.accountant) == 3


def test_hand_wired_ghost_clipping_cannot_change_the_norm():
    """The issue's bug on a path the guard cannot see: Opacus' ghost module and optimizer built
    by hand, the accountant's hook attached by hand. The module keeps clipping at 1.0 while the
    noise follows 0.05: the change is refused (it was priced as σ before)."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    scheme = PoissonScheme(sample_rate=1 / K)
    dl = DataLoader(_dataset(), batch_sampler=scheme.sampler(N, seed=1))
    torch.manual_seed(0)
    model = GradSampleModuleFastGradientClipping(nn.Linear(3, 2), max_grad_norm=OLD)
    opt = DPOptimizerFastGradientClipping(torch.optim.SGD(model.parameters(), lr=0.1),
                                          noise_multiplier=SIGMA, max_grad_norm=OLD,
                                          expected_batch_size=BATCH)
    acc = SchemeAccountant(scheme, discretization=D)
    opt.attach_step_hook(acc.get_optimizer_hook_fn(1 / K, data_loader=dl))
    crit = DPLossFastGradientClipping(model, opt, nn.CrossEntropyLoss())
    _run(model, opt, crit, dl, 2)
    with pytest.raises(ClipNormChangedError, match="not seen to use the new value"):
        _run(model, opt, crit, dl, 1, change_at=1)
    assert model.max_grad_norm == OLD and len(acc) == 2


def test_correlated_noise_optimizer_refuses_a_change_without_any_accountant():
    from opacus_structured.optim import CorrelatedNoiseDPOptimizer

    model = nn.Linear(3, 2)
    opt = CorrelatedNoiseDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     noise_multiplier=SIGMA, max_grad_norm=OLD,
                                     expected_batch_size=4, noise_correlation=[0.8, 0.6])
    for p in model.parameters():
        p.summed_grad = torch.zeros_like(p)
    opt.add_noise()
    state = opt.noise_state_dict()
    assert state["clip_norm"] == OLD
    opt.max_grad_norm = 0.25
    for p in model.parameters():
        p.summed_grad = torch.zeros_like(p)
    with pytest.raises(ClipNormChangedError, match=CORRELATED_CLIP_MESSAGE):
        opt.add_noise()
    assert opt.noise_step == 1
    # a resumed optimizer built with another clip norm refuses too
    fresh = CorrelatedNoiseDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       noise_multiplier=SIGMA, max_grad_norm=0.25,
                                       expected_batch_size=4, noise_correlation=[0.8, 0.6])
    fresh.load_noise_state_dict(state)
    with pytest.raises(ClipNormChangedError, match=CORRELATED_CLIP_MESSAGE):
        fresh.add_noise()
    # c = [1] is DP-SGD: independent noise, a change is fine there
    plain = CorrelatedNoiseDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       noise_multiplier=SIGMA, max_grad_norm=OLD,
                                       expected_batch_size=4, noise_correlation=[1.0])
    for norm in (OLD, 0.25):
        plain.max_grad_norm = norm
        for p in model.parameters():
            p.summed_grad = torch.zeros_like(p)
        plain.add_noise()


def test_distributed_correlated_optimizer_refuses_on_every_rank(monkeypatch):
    """The DDP variant adds the noise on rank 0 only; the other ranks must refuse the change
    too (else rank 0 raises while the others wait in the all-reduce)."""
    from opacus_structured.optim.distributed import DistributedCorrelatedNoiseDPOptimizer

    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 2)
    model = nn.Linear(3, 2)
    opt = DistributedCorrelatedNoiseDPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=SIGMA, max_grad_norm=OLD,
        expected_batch_size=4, noise_correlation=[0.8, 0.6])
    assert opt.rank == 1
    for norm, raises in ((OLD, False), (0.25, True)):
        opt.max_grad_norm = norm
        for p in model.parameters():
            p.summed_grad = torch.zeros_like(p)
        if raises:
            with pytest.raises(ClipNormChangedError, match=CORRELATED_CLIP_MESSAGE):
                opt.add_noise()
        else:
            opt.add_noise()


def test_adaptive_clipping_is_refused_on_every_front_door():
    model = nn.Linear(3, 2)
    common = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  data_loader=DataLoader(_dataset(), batch_size=BATCH), noise_multiplier=SIGMA,
                  max_grad_norm=OLD)
    with pytest.raises(ValueError, match="adaptive clipping"):
        opacus_structured.make_private(PrivacyEngine(accountant="poisson"), clipping="adaptive",
                                       **common)
    from opacus.utils.adaptive_clipping.adaptive_clipping_utils import (
        PrivacyEngineAdaptiveClipping,
    )
    with pytest.raises(ValueError, match="adaptive clipping"):
        opacus_structured.make_private(PrivacyEngineAdaptiveClipping(accountant="poisson"),
                                       grad_sample_mode="ghost", **common)
    # the stock path: Opacus' own make_private with our accountant
    scheme = PoissonScheme(sample_rate=1 / K)
    engine = PrivacyEngine()
    engine.accountant = SchemeAccountant(scheme, discretization=D)
    common["data_loader"] = DataLoader(_dataset(), batch_sampler=scheme.sampler(N, seed=1))
    with pytest.raises(ValueError, match="adaptive clipping"):
        engine.make_private(poisson_sampling=False, clipping="adaptive",
                            target_unclipped_quantile=0.5, clipbound_learning_rate=0.2,
                            max_clipbound=10.0, min_clipbound=0.1, unclipped_num_std=SIGMA,
                            **common)


def test_adaptive_clipping_is_refused_by_dpcallback():
    pytest.importorskip("lightning.pytorch")
    from lightning_callbacks.dp_callback import DPCallback

    with pytest.raises(ValueError, match="adaptive clipping"):
        DPCallback(scheme=PoissonScheme(sample_rate=0.1), delta=DELTA, noise_multiplier=SIGMA,
                   max_grad_norm=OLD, optimizer_class=AdaClipDPOptimizer)


def test_ledger_round_trips_through_the_accountant_state():
    engine, model, opt, crit, dl = _make("poisson", "hooks")
    _run(model, opt, crit, dl, 3, change_at=2)
    state = engine.accountant.state_dict()
    assert state["clip_norm"] == {"norm": NEW, "changes": 1}
    restored = SchemeAccountant(engine.accountant.scheme, discretization=D)
    restored.load_state_dict(state)
    assert restored._clip_norms.state_dict() == state["clip_norm"]
    legacy = dict(state)
    legacy.pop("clip_norm")     # a state written before the ledger existed
    fresh = SchemeAccountant(engine.accountant.scheme, discretization=D)
    fresh.load_state_dict(legacy)
    assert fresh._clip_norms.norm is None
    assert ClipNormLedger().state_dict() == {"norm": None, "changes": 0}


# ---- DPCallback: hooks and book-keeping (ghost) -----------------------------------------
def _fit_callback(mode, scheme, *, change_at=None, steps=4, **kw):
    pl = pytest.importorskip("lightning.pytorch")
    from lightning_callbacks.dp_callback import DPCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Linear(3, 2)
            self.batches = []

        def training_step(self, batch, batch_idx):
            x, y = batch[0], batch[1]
            self.batches.append((x.clone(), y.clone(), _plain_copy(self.net)))
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cb = DPCallback(scheme=scheme, noise_multiplier=SIGMA, max_grad_norm=OLD, delta=DELTA,
                    discretization=D, seed=3, grad_sample_mode=mode, **kw)
    sums, norms = [], []

    class Change(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if not sums:  # first batch: capture every released clipped sum from now on
                previous = cb.optimizer.step_hook
                cb.optimizer.attach_step_hook(lambda o: (
                    sums.append([p.summed_grad.detach().clone() for p in o.params]),
                    norms.append(float(o.max_grad_norm)), previous(o)))
                sums.append(None)
            if change_at is not None and trainer.global_step + 1 == change_at:
                cb.optimizer.max_grad_norm = NEW

    module = Module()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False,
                         callbacks=[cb, Change()], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(_dataset(), batch_size=BATCH))
    return cb, module, sums[1:], norms


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_dpcallback_clip_change_clips_at_the_new_norm_and_keeps_epsilon(mode):
    scheme = PoissonScheme(sample_rate=1 / K)
    cb, module, sums, norms = _fit_callback(mode, scheme, change_at=3)
    assert norms == [OLD, OLD, NEW, NEW] and cb.steps == 4
    for (x, y, plain), got, clip in zip(module.batches, sums, norms, strict=True):
        for g, want in zip(got, _clipped_sum(plain, x, y, clip), strict=True):
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)
    if mode == "ghost":  # book-keeping clipped at the optimizer's norm, not its attach value
        assert cb.optimizer.bookkeeper.max_grad_norm == NEW
    reference, *_ = _fit_callback(mode, scheme)
    assert cb.epsilon() == reference.epsilon()


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_dpcallback_clip_change_under_correlated_noise_is_refused(mode):
    from opacus_structured.optim.correlated_noise import CorrelatedNoiseDPOptimizer
    from opacus_structured.schemes.bandmf_cyclic_poisson import BandMFCyclicPoissonScheme

    scheme = BandMFCyclicPoissonScheme(dataset_size=N, batch_size=BATCH, bands=2)
    with pytest.raises(ClipNormChangedError, match=CORRELATED_CLIP_MESSAGE):
        _fit_callback(mode, scheme, change_at=3, optimizer_class=CorrelatedNoiseDPOptimizer,
                      optimizer_kwargs={"noise_correlation": scheme.noise_correlation(10)})
