"""Issue 29, case 10: a non-finite per-sample gradient never decides whether a step is released.

One planted example (a feature set to +inf) has a non-finite gradient whenever it is sampled.

* ``torch.amp.GradScaler`` skips ``optimizer.step()`` when the raw batch gradient holds an
  inf (pinned below on an unguarded Opacus optimizer: the planted example's presence decides
  the skip). Every DP optimizer of ours refuses an enabled GradScaler at its first step,
  whatever the data (an all-finite dataset raises the same); ``enabled=False`` passes.
* Without a scaler, hooks mode and book-keeping zero the planted example's per-sample gradient
  before the sum (clip factor 0): the step is released and priced, the parameters stay finite,
  and the released clipped sum equals the clipped sum of the other examples, computed
  independently (one backward per example).
* Opacus' ghost clipping cannot take the example out of its batched second backward; its step
  raises (never a silent skip, never a NaN release).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from opacus import PrivacyEngine
from opacus.optimizers import DPOptimizer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import opacus_structured
from opacus_structured.accountants.release_guard import (
    GradScalerRefusedError,
    NonFiniteReleaseError,
    zero_nonfinite_grad_samples,
)
from opacus_structured.optim import CorrelatedNoisePrivacyEngine
from opacus_structured.schemes.poisson import PoissonScheme

warnings.filterwarnings("ignore")

N, BATCH, CLIP, SIGMA, D = 60, 12, 0.5, 1.0, 1e-3
K = N // BATCH


def _dataset(planted: bool = True):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 3, generator=g), torch.randint(0, 2, (N,), generator=g)
    if planted:
        x[0, 0] = float("inf")   # logits inf/NaN -> a non-finite per-sample gradient
    return TensorDataset(x, y)


def _clipped_sum_of_finite(params, x, y):
    """Σ over the examples with a finite gradient of min(1, C/(‖g_b‖+1e-6)) g_b, one backward
    per example on a plain copy (``params``: weight, bias)."""
    plain = nn.Linear(3, 2)
    with torch.no_grad():
        plain.weight.copy_(params[0])
        plain.bias.copy_(params[1])
    total = [torch.zeros_like(p) for p in plain.parameters()]
    for i in range(len(x)):
        plain.zero_grad()
        nn.functional.cross_entropy(plain(x[i:i + 1]), y[i:i + 1]).backward()
        grads = [p.grad.detach().clone() for p in plain.parameters()]
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            continue
        norm = float(torch.sqrt(sum((g ** 2).sum() for g in grads)))
        total = [t + min(1.0, CLIP / (norm + 1e-6)) * g for t, g in zip(total, grads, strict=True)]
    return total


def _make(mode="hooks", engine_class=PrivacyEngine, name="poisson", planted=True, **options):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    engine = engine_class(accountant=name)
    out = opacus_structured.make_private(
        engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_dataset(planted), batch_size=BATCH), noise_multiplier=SIGMA,
        max_grad_norm=CLIP, discretization=D, sampler_generator=torch.Generator().manual_seed(1),
        grad_sample_mode=mode, criterion=nn.CrossEntropyLoss(), **options)
    if mode == "ghost":
        model, opt, crit, dl = out
    else:
        (model, opt, dl), crit = out, nn.CrossEntropyLoss()
    return engine, model, opt, crit, dl


def _capture_sums(opt):
    seen = []
    previous = opt.step_hook

    def hook(o):
        seen.append([p.summed_grad.detach().clone() for p in o.params])
        previous(o)

    opt.attach_step_hook(hook)
    return seen


@pytest.mark.parametrize("kind", ["poisson", "bandmf-cyclic-poisson"])
def test_hooks_mode_releases_every_step_with_the_planted_example_zeroed(kind):
    if kind == "poisson":
        engine, model, opt, crit, dl = _make()
    else:
        engine, model, opt, crit, dl = _make(engine_class=CorrelatedNoisePrivacyEngine,
                                             name=kind, bands=2, epochs=2)
    seen = _capture_sums(opt)
    planted_steps = 0
    for step, (x, y) in enumerate(dl, start=1):
        before = [p.detach().clone() for p in model.parameters()]
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        assert len(engine.accountant) == step                       # priced
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
        assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))  # released
        for got, want in zip(seen[-1], _clipped_sum_of_finite(before, x, y), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        planted_steps += int(bool(torch.isinf(x).any()))
    assert planted_steps >= 1


def test_zeroing_covers_accumulated_grad_sample_lists():
    p = nn.Parameter(torch.zeros(2))
    p.grad_sample = [torch.tensor([[1.0, 2.0], [float("nan"), 0.0]]),
                     torch.tensor([[float("inf"), 1.0]])]
    q = nn.Parameter(torch.zeros(1))
    q.grad_sample = [torch.tensor([[3.0], [4.0]]), torch.tensor([[5.0]])]

    class Opt:
        params = [p, q]

    assert zero_nonfinite_grad_samples(Opt) == 2
    assert p.grad_sample[0].tolist() == [[1.0, 2.0], [0.0, 0.0]]
    assert q.grad_sample[0].tolist() == [[3.0], [0.0]] and q.grad_sample[1].tolist() == [[0.0]]


def test_opacus_ghost_clipping_refuses_to_release_a_non_finite_sum():
    engine, model, opt, crit, dl = _make("ghost")
    for x, y in dl:
        if not bool(torch.isinf(x).any()):
            continue
        before = [p.detach().clone() for p in model.parameters()]
        crit(model(x), y).backward()
        with pytest.raises(NonFiniteReleaseError, match="grad_sample_mode='hooks'"):
            opt.step()
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        return
    pytest.fail("the planted example was never sampled")


@pytest.mark.parametrize("planted", [True, False])
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_grad_scaler_is_refused_at_the_first_step_whatever_the_data(mode, planted):
    engine, model, opt, crit, dl = _make(mode, planted=planted)
    scaler = torch.amp.GradScaler("cpu")
    x, y = next(iter(dl))
    before = [p.detach().clone() for p in model.parameters()]
    if mode == "ghost":  # torch cannot scale Opacus' ghost loss object (not a Tensor)
        crit(model(x), y).backward()
        scaler.scale(torch.ones(()))  # the scaler is live all the same
    else:
        scaler.scale(crit(model(x), y)).backward()
    with pytest.raises(GradScalerRefusedError, match="GradScaler is refused"):
        scaler.step(opt)
    assert len(engine.accountant) == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_disabled_grad_scaler_passes_through():
    engine, model, opt, crit, dl = _make(planted=False)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    x, y = next(iter(dl))
    scaler.scale(crit(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    assert len(engine.accountant) == 1


def test_why_grad_scaler_is_refused_it_skips_on_the_planted_example():
    """Pins the torch/Opacus behaviour the refusal rests on: an unguarded Opacus DPOptimizer
    under GradScaler is stepped exactly when the batch lacks the planted example."""
    x, y = _dataset().tensors
    for batch, skipped in ((slice(0, 6), True), (slice(1, 7), False)):
        torch.manual_seed(0)
        model = opacus_structured_grad_sample_module()
        opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=SIGMA,
                          max_grad_norm=CLIP, expected_batch_size=6)
        scaler = torch.amp.GradScaler("cpu")
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(nn.functional.cross_entropy(model(x[batch]), y[batch])).backward()
        scaler.step(opt)
        unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        assert unchanged == skipped


def opacus_structured_grad_sample_module():
    from opacus import GradSampleModule

    return GradSampleModule(nn.Linear(3, 2))


# ---- DPCallback: hooks and book-keeping -------------------------------------------------
pl = pytest.importorskip("lightning.pytorch")

from lightning_callbacks.dp_callback import DPCallback  # noqa: E402


class _Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(3, 2)
        self.batches = []

    def training_step(self, batch, batch_idx):
        x, y = batch[0], batch[1]
        self.batches.append((x.clone(), y.clone(),
                             [p.detach().clone() for p in self.net.parameters()]))
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_dpcallback_releases_every_step_with_the_planted_example_zeroed(mode):
    cb = DPCallback(scheme=PoissonScheme(sample_rate=1 / K), noise_multiplier=SIGMA,
                    max_grad_norm=CLIP, delta=1e-5, discretization=D, seed=3,
                    grad_sample_mode=mode)
    module = _Module()
    sums = []

    class Capture(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            pass

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if not sums:
                sums.append(_capture_sums(cb.optimizer))

    trainer = pl.Trainer(max_steps=K, accelerator="cpu", logger=False,
                         callbacks=[cb, Capture()], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(_dataset(), batch_size=BATCH))
    assert cb.steps == K
    assert all(bool(torch.isfinite(p).all()) for p in module.net.parameters())
    seen = sums[0]
    assert len(seen) == K
    planted = 0
    for (x, y, before), got in zip(module.batches, seen, strict=True):
        for g, want in zip(got, _clipped_sum_of_finite(before, x, y), strict=True):
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)
        planted += int(bool(torch.isinf(x).any()))
    assert planted >= 1
