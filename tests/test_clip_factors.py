"""The GDP filter and the per-sample ε tracker folded into Opacus' clipping (issue 32 items 1-2).

Checked against independent computations: per-example gradients from one backward per example
(no Opacus), and Opacus' own, unmodified ``DPOptimizer.clip_and_accumulate``. The kernel counts
use a ``TorchDispatchMode`` that counts the (non-view) ops reading or writing a tensor shaped
like a per-sample gradient.
"""

from __future__ import annotations

import pytest
import torch
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from opacus.optimizers.optimizer import DPOptimizer as StockDPOptimizer
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_callbacks.batch_indices import to_device
from lightning_callbacks.gdp_filter import IndividualGDPFilter
from lightning_callbacks.per_sample_epsilon import PerSampleEpsilonTracker
from opacus_structured.accountants.clip_factors import (
    add_clip_mask,
    add_norm_observer,
    install_clip_factors,
    remove_clip_hooks,
)
from opacus_structured.accountants.individual_gdp import per_sample_norms
from opacus_structured.accountants.release_guard import guard_optimizer

B, D_IN, D_HID, D_OUT = 6, 7, 5, 3
SIGMA, CLIP = 1.3, 0.7


def _model(seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, D_HID, bias=False), nn.Tanh(),
                         nn.Linear(D_HID, D_OUT, bias=False))


def _data(seed=1, batch=B):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, D_IN, generator=g) * 0.6  # norms on both sides of C
    y = torch.randint(0, D_OUT, (batch,), generator=g)
    return x, y


def _dp(model, *, guard=False, noise=0.0):
    gsm = GradSampleModule(model, loss_reduction="sum")
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=noise,
                      max_grad_norm=CLIP, expected_batch_size=B, loss_reduction="sum")
    if guard:
        guard_optimizer(opt)
    return gsm, opt


def _backward(gsm, opt, x, y):
    opt.zero_grad()
    nn.functional.cross_entropy(gsm(x), y, reduction="sum").backward()


def _per_example_grads(model, x, y) -> list[list[torch.Tensor]]:
    """One backward per example, without Opacus (the independent computation)."""
    out = []
    for i in range(x.shape[0]):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction="sum").backward()
        out.append([p.grad.detach().clone() for p in model.parameters()])
    model.zero_grad()
    return out


def _clipped_sum(grads, keep) -> list[torch.Tensor]:
    total = None
    for g, k in zip(grads, keep, strict=True):
        norm = torch.sqrt(sum((t.double() ** 2).sum() for t in g))
        c = min(1.0, CLIP / (float(norm) + 1e-6)) * float(k)
        part = [c * t.double() for t in g]
        total = part if total is None else [a + b for a, b in zip(total, part, strict=True)]
    return total


# ---- the fused clipping ----------------------------------------------------------------------
def test_unmasked_fused_clipping_is_bit_identical_to_opacus():
    x, y = _data()
    sums = []
    for fused in (False, True):
        model = _model()
        gsm, opt = _dp(model)
        if fused:
            assert install_clip_factors(opt)
        _backward(gsm, opt, x, y)
        opt.clip_and_accumulate()
        sums.append([p.summed_grad.clone() for p in opt.params])
    for a, b in zip(*sums, strict=True):
        assert torch.equal(a, b)


def test_finite_norms_whose_sum_overflows_are_not_zeroed():
    """Issue 46: the non-finite check reads one sum (finite iff every norm is); two finite
    per-example norms of 2e38, whose float32 sum overflows, are still clipped as Opacus clips
    them (none zeroed), and an inf row is zeroed."""
    x = torch.randn(B, 1)
    for rows, zeroed in (([2e38, 2e38], False), ([2e38, float("inf")], True)):
        sums = []
        for guard in (False, True):
            torch.manual_seed(0)
            gsm = GradSampleModule(nn.Linear(1, 1, bias=False), loss_reduction="sum")
            opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.1), noise_multiplier=0.0,
                              max_grad_norm=CLIP, expected_batch_size=B, loss_reduction="sum")
            if guard:
                guard_optimizer(opt)
            opt.zero_grad()
            gsm(x).sum().backward()
            (p,) = opt.params
            p.grad_sample = p.grad_sample.clone()
            p.grad_sample[:2] = torch.tensor(rows).view(2, 1, 1)
            assert torch.isinf(p.grad_sample.flatten(1).norm(dim=1).sum())
            opt.clip_and_accumulate()
            sums.append(p.summed_grad.clone())
        stock, ours = sums
        expected = p.grad_sample[2:].flatten() * (CLIP / (p.grad_sample[2:].abs().flatten()
                                                          + 1e-6)).clamp(max=1.0)
        if zeroed:  # Opacus: 0 * inf = NaN; ours: the row is zeroed (clip factor 0)
            assert not torch.isfinite(stock).all()
            assert torch.allclose(ours.flatten(), expected.sum() + CLIP, rtol=1e-5)
        else:
            assert torch.isfinite(ours).all() and torch.equal(stock, ours)


def test_mask_is_bit_identical_to_zeroed_rows_and_matches_per_example_grads():
    x, y = _data()
    keep = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool)
    # fused: the mask multiplies the factors
    model = _model()
    gsm, opt = _dp(model)
    add_clip_mask(opt, "test", lambda o, norms: keep)
    _backward(gsm, opt, x, y)
    opt.clip_and_accumulate()
    fused = [p.summed_grad.clone() for p in opt.params]
    # stock Opacus on grad_sample rows zeroed by hand (what the filter did before)
    model2 = _model()
    gsm2, opt2 = _dp(model2)
    _backward(gsm2, opt2, x, y)
    for p in opt2.params:
        p.grad_sample.mul_(keep.to(p.grad_sample.dtype).view(-1, 1, 1))
    StockDPOptimizer.clip_and_accumulate(opt2)
    for a, b in zip(fused, [p.summed_grad for p in opt2.params], strict=True):
        assert torch.equal(a, b)
    # and the clipped sum of the kept examples' own gradients
    expected = _clipped_sum(_per_example_grads(_model(), x, y), keep.tolist())
    for a, e in zip(fused, expected, strict=True):
        torch.testing.assert_close(a.double(), e, rtol=1e-5, atol=1e-7)


def test_observer_sees_masked_norms_and_inf_for_nonfinite_rows():
    x, y = _data()
    model = _model()
    gsm, opt = _dp(model, guard=True)
    seen = {}
    add_clip_mask(opt, "m", lambda o, norms: torch.tensor([1., 1., 0., 1., 1., 1.]))
    add_norm_observer(opt, "o", lambda o, norms: seen.setdefault("norms", norms.clone()))
    _backward(gsm, opt, x, y)
    opt.params[0].grad_sample[4, 0, 0] = float("inf")
    opt.clip_and_accumulate()
    grads = _per_example_grads(_model(), x, y)
    own = torch.tensor([float(torch.sqrt(sum((t.double() ** 2).sum() for t in g)))
                        for g in grads], dtype=torch.float64)
    norms = seen["norms"].double()
    assert norms[2] == 0 and norms[4] == float("inf")
    keep = [0, 1, 3, 5]
    torch.testing.assert_close(norms[keep], own[keep], rtol=1e-5, atol=1e-7)
    # the guard's rule: the non-finite example is left out of the sum, which stays finite
    expected = _clipped_sum(grads, [1, 1, 0, 1, 0, 1])
    for p, e in zip(opt.params, expected, strict=True):
        torch.testing.assert_close(p.summed_grad.double(), e, rtol=1e-5, atol=1e-7)


def test_other_clipping_is_left_alone_and_hooks_refuse():
    from opacus.optimizers import DPPerLayerOptimizer

    model = _model()
    opt = DPPerLayerOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                              max_grad_norm=[CLIP, CLIP], expected_batch_size=B)
    assert not install_clip_factors(opt)
    with pytest.raises(ValueError, match="clip_and_accumulate"):
        add_clip_mask(opt, "m", lambda o, n: None)
    _, opt2 = _dp(_model())
    add_norm_observer(opt2, "o", lambda o, n: None)
    remove_clip_hooks(opt2, "o")
    remove_clip_hooks(opt2, "never-added")


def test_mask_of_wrong_shape_raises():
    x, y = _data()
    gsm, opt = _dp(_model())
    add_clip_mask(opt, "m", lambda o, norms: torch.ones(3))
    _backward(gsm, opt, x, y)
    with pytest.raises(ValueError, match="shape"):
        opt.clip_and_accumulate()


# ---- the callbacks, attached to a plain Opacus loop --------------------------------------------
def _train(attach, steps=4, num_examples=50, guard=True, seed=3):
    """``steps`` steps of a plain Opacus loop; ``attach(opt) -> [callbacks]``; returns the
    optimizer, the callbacks and the batches' indices."""
    model = _model()
    gsm, opt = _dp(model, guard=guard, noise=SIGMA)
    cbs = attach(opt)
    g = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(steps):
        x, y = _data(seed=10 + step)
        idx = torch.randperm(num_examples, generator=g)[:B]
        for cb in cbs:
            cb.set_batch_indices(idx)
        _backward(gsm, opt, x, y)
        opt.step()
        batches.append((idx, x, y))
    return opt, cbs, batches


def test_tracker_attached_records_opacus_norms_exactly():
    def attach(opt):
        t = PerSampleEpsilonTracker(50)
        assert t.attach(opt)
        return [t]

    opt, (tracker,), batches = _train(attach, steps=1, guard=False)
    idx, x, y = batches[0]
    mu_sq = torch.full((50,), 1.0 / SIGMA ** 2, dtype=torch.float64)  # unsampled: worst case
    for i, g in zip(idx.tolist(), _per_example_grads(_model(), x, y), strict=True):
        n = float(torch.sqrt(sum((t.double() ** 2).sum() for t in g)))
        mu_sq[i] = (min(n, CLIP) / (SIGMA * CLIP)) ** 2
    torch.testing.assert_close(tracker.mu_squared(), mu_sq, rtol=1e-5, atol=1e-9)
    assert tracker.steps == 1


def test_fused_and_manual_paths_agree_step_by_step():
    """With σ-scaled noise drawn from the same generator, the fused run (filter + tracker
    attached) and the manual run (norms from grad_sample, inactive rows zeroed in place,
    stock Opacus clipping) release identical weights and keep identical state."""
    budget = 1.5 / SIGMA
    runs = []
    for fused in (True, False):
        torch.manual_seed(0)
        model = _model()
        gsm, opt = _dp(model, noise=SIGMA)
        opt.generator = torch.Generator().manual_seed(7)
        filt = IndividualGDPFilter(8, budget, require_full_batch=False)
        tracker = PerSampleEpsilonTracker(8)
        if fused:
            assert filt.attach(opt) and tracker.attach(opt)
        g = torch.Generator().manual_seed(3)
        for step in range(8):
            x, y = _data(seed=10 + step)
            idx = torch.randperm(8, generator=g)[:B]
            if fused:
                filt.set_batch_indices(idx)
                tracker.set_batch_indices(idx)
            _backward(gsm, opt, x, y)
            if not fused:
                norms = per_sample_norms(opt.params)
                active = filt.mask_and_record(opt.params, idx, norms, SIGMA, CLIP)
                tracker.update(idx, norms * active, SIGMA, CLIP)
            opt.step()
        runs.append(([p.detach().clone() for p in model.parameters()],
                     filt.accountant.observed_mu_sq.clone(), tracker.mu_squared().clone(),
                     filt.active_counts()))
    (w1, f1, t1, a1), (w2, f2, t2, a2) = runs
    assert a1 == a2 and min(a1) < B  # the filter did remove examples
    for a, b in zip(w1, w2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(f1, f2, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(t1, t2, rtol=1e-6, atol=1e-12)


def test_attached_callback_without_indices_raises():
    x, y = _data()
    gsm, opt = _dp(_model(), noise=SIGMA)
    filt = IndividualGDPFilter(50, 1.0, require_full_batch=False)
    assert filt.attach(opt)
    _backward(gsm, opt, x, y)
    with pytest.raises(ValueError, match="set_batch_indices"):
        opt.step()
    gsm, opt = _dp(_model(), noise=SIGMA)
    tracker = PerSampleEpsilonTracker(50)
    assert tracker.attach(opt)
    tracker.set_batch_indices(torch.arange(B - 1))
    _backward(gsm, opt, x, y)
    with pytest.raises(ValueError, match="rows"):
        opt.step()


# ---- no extra pass over grad_sample -----------------------------------------------------------
_VIEWS = {"view", "_unsafe_view", "reshape", "alias", "detach", "as_strided", "expand",
          "unsqueeze", "squeeze", "t", "transpose", "permute", "slice", "select", "lift_fresh"}


class _PerSampleOps(TorchDispatchMode):
    """Counts non-view ops with an input or output shaped like a per-sample gradient."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes = {tuple(s) for s in shapes}
        self.ops: list[str] = []
        self.scalar_reads = 0

    def _hit(self, obj) -> bool:
        if isinstance(obj, torch.Tensor):
            return tuple(obj.shape) in self.shapes
        if isinstance(obj, (list, tuple)):
            return any(self._hit(o) for o in obj)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.scalar_reads += 1
        if name not in _VIEWS and (self._hit(args) or self._hit(list((kwargs or {}).values()))
                                   or self._hit(out)):
            self.ops.append(name)
        return out


def _per_sample_shapes(batch=B):
    return [(batch, D_HID, D_IN), (batch, D_HID * D_IN), (batch, D_OUT, D_HID),
            (batch, D_OUT * D_HID)]


def _count_step(kind: str):
    x, y = _data()
    gsm, opt = _dp(_model(), guard=(kind != "stock"), noise=SIGMA)
    cbs = []
    if kind == "filter+tracker":
        cbs = [IndividualGDPFilter(10 ** 6, 2.0, require_full_batch=False),
               PerSampleEpsilonTracker(10 ** 6)]
        for cb in cbs:
            assert cb.attach(opt)
    idx = torch.arange(B)
    for _ in range(2):  # the second step is counted (state already on its device)
        for cb in cbs:
            cb.set_batch_indices(idx)
        _backward(gsm, opt, x, y)
        mode = _PerSampleOps(_per_sample_shapes())
        with mode:
            opt.step()
    return mode


def test_filter_and_tracker_add_no_op_on_per_sample_gradients():
    stock, guarded, both = (_count_step(k) for k in ("stock", "guarded", "filter+tracker"))
    assert stock.ops  # the counter sees Opacus' norm pass and clipped sum
    assert sorted(guarded.ops) == sorted(stock.ops)
    assert sorted(both.ops) == sorted(stock.ops)


def test_tracker_step_work_does_not_grow_with_dataset_size_and_never_reads_a_scalar():
    counts = []
    for n in (10 ** 3, 10 ** 6):
        x, y = _data()
        gsm, opt = _dp(_model(), noise=SIGMA)  # no guard: its non-finite check reads a bool
        tracker = PerSampleEpsilonTracker(n)
        assert tracker.attach(opt)
        for _ in range(2):
            tracker.set_batch_indices(torch.arange(B) * (n // B))
            _backward(gsm, opt, x, y)
            mode = _PerSampleOps([])
            with mode:
                opt.step()
        counts.append(mode)
        ops = _AllOps()
        tracker.set_batch_indices(torch.arange(B))
        _backward(gsm, opt, x, y)
        with ops:
            opt.step()
        counts.append(ops)
    assert counts[0].scalar_reads == counts[2].scalar_reads == 0  # no .item() / bool()
    assert counts[1].ops == counts[3].ops  # the same ops at N = 10^3 and 10^6
    assert all(max(s) < 10 ** 3 for s in counts[3].sizes)  # none is O(N)


class _AllOps(TorchDispatchMode):
    """Every op with the largest tensor it touches."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.sizes: list[list[int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in (*args, *(kwargs or {}).values(), out)
                   if isinstance(a, torch.Tensor)]
        if func.overloadpacket.__name__ not in ("index_add_", "index_put_"):
            self.sizes.append([t.numel() for t in tensors] or [0])
        self.ops.append(func.overloadpacket.__name__)
        return out


def test_to_device_keeps_values():
    idx = torch.tensor([3, 1, 2])
    assert to_device(idx, "cpu") is idx
    if torch.cuda.is_available():  # pragma: no cover - CUDA only
        assert to_device(idx, "cuda").cpu().tolist() == [3, 1, 2]
