"""Ghost norms + book-keeping (one backward): per-sample norms and the clipped sum equal those
of materialised per-sample gradients (Opacus GradSampleModule, float64) for Linear on 2-D and
3-D inputs, fallback layers (LayerNorm, Embedding, Conv1d) and FastDPLSTM; the optimizer
update equals stock DPOptimizer's for the same noise seed; misuse is refused."""

import copy

import pytest
import torch
from opacus.grad_sample import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch import nn

from opacus_structured.forecasting.fast_rnn import FastDPLSTM
from opacus_structured.optim.bookkeeping import (
    BookKeepingDPOptimizer,
    BookKeepingHooks,
    bookkeeping_optimizer_class,
)
from opacus_structured.optim.correlated_noise import CorrelatedNoiseDPOptimizer
from opacus_structured.optim.ghost_clipping import CorrelatedNoiseDPOptimizerFastGradientClipping

B, T = 6, 5


class Mixed(nn.Module):
    """Embedding -> Conv1d -> Linear (3-D) -> LayerNorm -> FastDPLSTM -> Linear (2-D)."""

    def __init__(self, recurrence="auto"):
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.conv = nn.Conv1d(4, 4, 3, padding=1)
        self.proj = nn.Linear(4, 7)
        self.norm = nn.LayerNorm(7)
        self.rnn = FastDPLSTM(7, 5, batch_first=True, recurrence=recurrence)
        self.head = nn.Linear(5, 1)

    def forward(self, tokens):
        x = self.emb(tokens)                              # (B, T, 4)
        x = self.conv(x.transpose(1, 2)).transpose(1, 2)  # (B, T, 4)
        x = self.norm(torch.tanh(self.proj(x)))           # (B, T, 7)
        out, _ = self.rnn(x)
        return self.head(out[:, -1]).squeeze(-1)          # (B,)


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 11, (B, T), generator=g), torch.randn(B, generator=g,
                                                                  dtype=torch.float64)


def _model(recurrence="auto"):
    torch.manual_seed(1)
    return Mixed(recurrence).double()


def _materialised(model, x, y, reduction):
    gsm = GradSampleModule(copy.deepcopy(model), batch_first=True, loss_reduction=reduction)
    loss = nn.functional.mse_loss(gsm(x), y, reduction=reduction)
    loss.backward()
    gs = {n.removeprefix("_module."): p.grad_sample.detach().clone()
          for n, p in gsm.named_parameters()}
    gsm._close()
    norms = torch.stack([g.reshape(B, -1).norm(dim=1) for g in gs.values()]).norm(dim=0)
    return gs, norms


@pytest.mark.parametrize("reduction,recurrence", [("mean", "python"), ("sum", "python"),
                                                  ("mean", "native")])
def test_norms_and_clipped_sum_equal_materialised(reduction, recurrence):
    model = _model(recurrence)
    x, y = _data()
    gs, norms = _materialised(model, x, y, reduction)
    clip = float(norms.median())
    hooks = BookKeepingHooks(model, max_grad_norm=clip, loss_reduction=reduction)
    nn.functional.mse_loss(model(x), y, reduction=reduction).backward()
    assert torch.allclose(hooks.per_sample_norms(), norms, rtol=1e-10, atol=0)
    coef = (clip / (norms + 1e-6)).clamp(max=1.0)
    assert (coef < 1).any() and (coef == 1).any()
    hooks.write_clipped_sum(list(model.parameters()))
    for name, p in model.named_parameters():
        want = torch.einsum("b,b...->...", coef, gs[name])
        assert torch.allclose(p.grad, want, rtol=1e-10, atol=1e-14), name
    hooks.remove_hooks()


def test_gram_and_materialised_linear_norms_agree():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(3, 9, 4, generator=g, dtype=torch.float64)
    gr = torch.randn(3, 9, 2, generator=g, dtype=torch.float64)
    want = torch.einsum("bto,bti->boi", gr, a).pow(2).sum((1, 2))
    # T(i+o) = 54 > i·o = 8: materialised branch; transpose roles for the Gram branch
    assert torch.allclose(BookKeepingHooks._linear_weight_sq_norms(a, gr), want, rtol=1e-12)
    a2, g2 = a[:, :1], gr[:, :1]
    assert torch.allclose(BookKeepingHooks._linear_weight_sq_norms(a2, g2),
                          torch.einsum("bto,bti->boi", g2, a2).pow(2).sum((1, 2)), rtol=1e-12)
    big_a = torch.randn(3, 2, 40, generator=g, dtype=torch.float64)
    big_g = torch.randn(3, 2, 30, generator=g, dtype=torch.float64)  # Gram branch
    assert torch.allclose(BookKeepingHooks._linear_weight_sq_norms(big_a, big_g),
                          torch.einsum("bto,bti->boi", big_g, big_a).pow(2).sum((1, 2)),
                          rtol=1e-12)


def test_mask_removes_examples():
    model = _model()
    x, y = _data()
    gs, norms = _materialised(model, x, y, "sum")
    hooks = BookKeepingHooks(model, max_grad_norm=1e9, loss_reduction="sum")
    nn.functional.mse_loss(model(x), y, reduction="sum").backward()
    mask = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.float64)
    hooks.set_mask(lambda n: mask if torch.allclose(n, norms, rtol=1e-10) else None)
    hooks.write_clipped_sum(list(model.parameters()))
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, torch.einsum("b,b...->...", mask, gs[name]),
                              rtol=1e-10, atol=1e-14), name
    hooks.remove_hooks()


def _step(model, opt, x, y):
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


@pytest.mark.parametrize("correlated", [False, True])
def test_optimizer_update_equals_stock_hooks_mode(correlated):
    x, y = _data()
    ref, bk = _model(), _model()
    norms = _materialised(ref, x, y, "mean")[1]
    clip = float(norms.median())
    kw = dict(noise_multiplier=0.8, max_grad_norm=clip, expected_batch_size=B)
    coefs = [1.0, 0.4, 0.2]
    gsm = GradSampleModule(ref, batch_first=True, loss_reduction="mean")
    base = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt_ref = (CorrelatedNoiseDPOptimizer(base, noise_correlation=coefs, **kw,
                                          generator=torch.Generator().manual_seed(3))
               if correlated else DPOptimizer(base, **kw,
                                              generator=torch.Generator().manual_seed(3)))
    hooks = BookKeepingHooks(bk, max_grad_norm=clip)
    cls = (bookkeeping_optimizer_class(CorrelatedNoiseDPOptimizerFastGradientClipping)
           if correlated else BookKeepingDPOptimizer)
    extra = {"noise_correlation": coefs} if correlated else {}
    opt_bk = cls(torch.optim.SGD(bk.parameters(), lr=0.5), **kw, **extra,
                 generator=torch.Generator().manual_seed(3))
    opt_bk.attach_bookkeeper(hooks)
    for step in range(3):
        xs, ys = _data(step)
        _step(gsm, opt_ref, xs, ys)
        _step(bk, opt_bk, xs, ys)
    for (n, p), q in zip(bk.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-9, atol=1e-12), n
    moved = max(float((p - q).abs().max()) for p, q in zip(bk.parameters(),
                                                            _model().parameters(), strict=True))
    assert moved > 1e-3
    gsm._close()
    hooks.remove_hooks()


def test_misuse_is_refused():
    x, y = _data()
    # a module run twice in one step (parameter tying)
    lin = nn.Linear(3, 3).double()
    hooks = BookKeepingHooks(lin, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="more than once"):
        lin(lin(torch.randn(2, 3, dtype=torch.float64)))
    hooks.remove_hooks()
    # a parameter used outside any hooked module would be released unclipped
    model = nn.Linear(3, 1).double()
    free = nn.Parameter(torch.ones(1, dtype=torch.float64))
    hooks = BookKeepingHooks(model, max_grad_norm=1.0)
    out = model(torch.randn(4, 3, dtype=torch.float64)).squeeze(-1) * free
    out.sum().backward()
    with pytest.raises(ValueError, match="unclipped"):
        hooks.write_clipped_sum(list(model.parameters()) + [free])
    hooks.remove_hooks()
    # mask outside [0, 1], wrong length, no backward yet
    model = _model()
    hooks = BookKeepingHooks(model, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="no per-sample gradients"):
        hooks.per_sample_norms()
    nn.functional.mse_loss(model(x), y).backward()
    hooks.set_mask(torch.full((B,), 2.0))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        hooks.clipping_coefficients()
    hooks.set_mask(torch.ones(B + 1))
    with pytest.raises(ValueError, match="entries"):
        hooks.clipping_coefficients()
    hooks.remove_hooks()
    with pytest.raises(ValueError, match="max_grad_norm"):
        BookKeepingHooks(model, max_grad_norm=0.0)
    with pytest.raises(ValueError, match="DPOptimizerFastGradientClipping"):
        bookkeeping_optimizer_class(DPOptimizer)
    opt = BookKeepingDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 noise_multiplier=1.0, max_grad_norm=2.0, expected_batch_size=B)
    with pytest.raises(ValueError, match="clip at"):
        opt.attach_bookkeeper(BookKeepingHooks(nn.Linear(2, 2), max_grad_norm=1.0))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_empty_batch_releases_noise_only(reduction):
    """A Poisson step may draw no example: the clipped sum is 0, the update is noise only."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)).double()
    before = [p.detach().clone() for p in m.parameters()]
    hooks = BookKeepingHooks(m, max_grad_norm=1.0, loss_reduction=reduction)
    opt = BookKeepingDPOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), noise_multiplier=1.0,
                                 max_grad_norm=1.0, expected_batch_size=4,
                                 loss_reduction=reduction,
                                 generator=torch.Generator().manual_seed(1))
    opt.attach_bookkeeper(hooks)
    opt.zero_grad()
    x, y = torch.randn(0, 3, dtype=torch.float64), torch.randint(0, 2, (0,))
    nn.functional.cross_entropy(m(x), y, reduction=reduction).backward()
    assert hooks.per_sample_norms().shape == (0,)
    opt.step()
    for p, q in zip(m.parameters(), before, strict=True):
        assert torch.isfinite(p).all() and not torch.equal(p, q)
    hooks.remove_hooks()


def test_embedding_with_padding_and_repeated_tokens_equals_brute_force():
    """Embedding rows are summed per (example, token) and the padding row gets no gradient,
    as torch's own per-example backward (Opacus' grad sampler would charge the padding row)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Embedding(9, 3, padding_idx=0), nn.Flatten(),
                          nn.Linear(12, 1)).double()
    idx = torch.tensor([[1, 1, 0, 0], [2, 3, 2, 2], [0, 0, 0, 5], [8, 7, 6, 5]])
    y = torch.randn(4, dtype=torch.float64)
    grads = []
    for b in range(4):
        model.zero_grad()
        ((model(idx[b:b + 1]).squeeze(-1) - y[b:b + 1]) ** 2).sum().backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
    norms = torch.stack([torch.cat([g.reshape(-1) for g in gb]).norm() for gb in grads])
    clip = float(norms.median())
    coef = (clip / (norms + 1e-6)).clamp(max=1.0)
    model.zero_grad()
    hooks = BookKeepingHooks(model, max_grad_norm=clip, loss_reduction="sum")
    ((model(idx).squeeze(-1) - y) ** 2).sum().backward()
    assert torch.allclose(hooks.per_sample_norms(), norms, rtol=1e-12)
    hooks.write_clipped_sum(list(model.parameters()))
    for k, p in enumerate(model.parameters()):
        want = sum(coef[b] * grads[b][k] for b in range(4))
        assert torch.allclose(p.grad, want, rtol=1e-12, atol=1e-15), k
    assert torch.equal(model[0].weight.grad[0], torch.zeros(3, dtype=torch.float64))
    hooks.remove_hooks()
