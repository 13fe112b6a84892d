"""CorrelatedNoiseDPOptimizer and CorrelatedNoisePrivacyEngine."""

import warnings

import numpy as np
import pytest
import torch
from opacus.optimizers import DPOptimizer, DPPerLayerOptimizer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_structured.accounting import strategies as st
from opacus_structured.optim.correlated_noise import (CorrelatedNoiseDPOptimizer,
                                                      correlated_optimizer_class)
from opacus_structured.optim.privacy_engine import CorrelatedNoisePrivacyEngine

warnings.filterwarnings("ignore", message="Secure RNG turned off")


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(3, 4, generator=g, dtype=dtype)),
            nn.Parameter(torch.randn(5, dtype=dtype, generator=g))]


def _fake_step(opt, grads):
    """Drive add_noise directly: summed_grad = given clipped sums (bypasses per-sample hooks)."""
    for p, g in zip(opt.params, grads):
        p.summed_grad = g.clone()
    opt.add_noise()
    return [p.grad.detach().clone() for p in opt.params]


def _noise_stream(opt, steps):
    out = []
    for _ in range(steps):
        grads = [torch.zeros_like(p) for p in opt.params]
        out.append(_fake_step(opt, grads))
    return out


def test_b1_bit_identical_to_stock():
    def run(cls, **kw):
        params = _params()
        opt = cls(torch.optim.SGD(params, lr=0.1), noise_multiplier=1.3, max_grad_norm=0.7,
                  expected_batch_size=4, generator=torch.Generator().manual_seed(42), **kw)
        grads = [torch.ones_like(p) for p in params]
        return [_fake_step(opt, grads) for _ in range(5)]

    stock = run(DPOptimizer)
    ours = run(CorrelatedNoiseDPOptimizer, noise_correlation=[1.0])
    default = run(CorrelatedNoiseDPOptimizer)
    for a, b, c in zip(stock, ours, default):
        for x, y, z in zip(a, b, c):
            assert torch.equal(x, y) and torch.equal(x, z)


def test_b1_bit_identical_full_training_with_engine():
    """Whole make_private + training loop: same seed, same final weights, bit for bit."""
    def train(engine_cls, **kw):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
        x = torch.randn(64, 6)
        y = torch.randint(0, 2, (64,))
        loader = DataLoader(TensorDataset(x, y), batch_size=16)
        engine = engine_cls()
        model, opt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            poisson_sampling=False, noise_generator=torch.Generator().manual_seed(7), **kw)
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
        return opt, [p.detach().clone() for p in model.parameters()]

    from opacus import PrivacyEngine
    opt_a, a = train(PrivacyEngine)
    opt_b, b = train(CorrelatedNoisePrivacyEngine, noise_correlation=[1.0])
    assert type(opt_a) is DPOptimizer and isinstance(opt_b, CorrelatedNoiseDPOptimizer)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("coef", [
    st.banded_toeplitz_coefficients(12, 4),
    st.banded_sqrt_coefficients(3),
    np.array([2.0, 0.5]),
])
def test_realized_noise_solves_C_w_equals_z(coef):
    """C · w = z on materialised matrices (float64): w is the streamed noise, z the fresh draws."""
    n = 12
    params = _params(torch.float64)
    sigma, clip = 0.9, 1.5
    opt = CorrelatedNoiseDPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=sigma,
                                     max_grad_norm=clip, expected_batch_size=1,
                                     generator=torch.Generator().manual_seed(3),
                                     noise_correlation=coef)
    w = _noise_stream(opt, n)
    # Reproduce the fresh z stream: same generator seed, same draw order (param by param).
    g = torch.Generator().manual_seed(3)
    z = [[torch.normal(0, sigma * clip, size=p.shape, generator=g, dtype=torch.float64)
          for p in params] for _ in range(n)]
    C = torch.tensor(st.toeplitz_matrix(coef, n))
    for j in range(len(params)):
        W = torch.stack([w[i][j].reshape(-1) for i in range(n)])
        Z = torch.stack([z[i][j].reshape(-1) for i in range(n)])
        torch.testing.assert_close(C @ W, Z, rtol=1e-12, atol=1e-12)


def test_noise_covariance_matches_C_inverse():
    """Empirical covariance of w across many coordinates ≈ σ² C^{-1} C^{-T}."""
    n, coef = 6, st.banded_sqrt_coefficients(3)
    params = [nn.Parameter(torch.zeros(40000, dtype=torch.float64))]
    opt = CorrelatedNoiseDPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=1.0,
                                     max_grad_norm=1.0, expected_batch_size=1,
                                     generator=torch.Generator().manual_seed(0),
                                     noise_correlation=coef)
    W = torch.stack([s[0] for s in _noise_stream(opt, n)]).numpy()
    Cinv = np.linalg.inv(st.toeplitz_matrix(coef, n))
    np.testing.assert_allclose(np.cov(W), Cinv @ Cinv.T, atol=0.05)


def test_state_dict_resume_continues_stream():
    coef = st.banded_toeplitz_coefficients(20, 4)

    def make():
        params = _params()
        return CorrelatedNoiseDPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=1.0,
                                          max_grad_norm=1.0, expected_batch_size=1,
                                          generator=torch.Generator().manual_seed(11),
                                          noise_correlation=coef)

    full = make()
    ref = _noise_stream(full, 9)
    first = make()
    _noise_stream(first, 5)
    sd = first.state_dict()
    assert "correlated_noise" in sd and sd["correlated_noise"]["noise_step"] == 5
    resumed = make()  # fresh generator and empty buffers: everything comes from sd
    resumed.load_state_dict(sd)
    rest = _noise_stream(resumed, 4)
    for a, b in zip(ref[5:], rest):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    other = CorrelatedNoiseDPOptimizer(torch.optim.SGD(_params(), lr=0.1), noise_multiplier=1.0,
                                       max_grad_norm=1.0, expected_batch_size=1,
                                       noise_correlation=[1.0, 0.5])
    with pytest.raises(ValueError, match="noise_correlation"):
        other.load_state_dict(sd)


def test_ring_buffer_memory_and_device():
    params = _params()
    opt = CorrelatedNoiseDPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=1.0,
                                     max_grad_norm=1.0, expected_batch_size=1,
                                     noise_correlation=st.banded_sqrt_coefficients(8))
    _noise_stream(opt, 3)
    for buf, p in zip(opt._noise_buffers, params):
        assert buf.shape == (7, *p.shape) and buf.device == p.device and buf.dtype == p.dtype


@pytest.mark.parametrize("bad", [[0.0, 1.0], [1.0, -0.2], [], [float("nan")]])
def test_bad_coefficients(bad):
    with pytest.raises(ValueError, match="noise_correlation"):
        CorrelatedNoiseDPOptimizer(torch.optim.SGD(_params(), lr=0.1), noise_multiplier=1.0,
                                   max_grad_norm=1.0, expected_batch_size=1,
                                   noise_correlation=bad)


def test_mixin_class_for_other_clipping():
    cls = correlated_optimizer_class(DPPerLayerOptimizer)
    assert issubclass(cls, DPPerLayerOptimizer) and cls is correlated_optimizer_class(
        DPPerLayerOptimizer)
    from opacus.optimizers import DistributedDPOptimizer, SimpleDistributedPerLayerOptimizer

    from opacus_structured.optim.distributed import DistributedCorrelatedNoiseDPOptimizer
    # noise once, on rank 0 (tests/test_distributed.py checks the 2-process equivalence)
    assert correlated_optimizer_class(DistributedDPOptimizer) is \
        DistributedCorrelatedNoiseDPOptimizer
    with pytest.raises(ValueError, match="not supported"):
        correlated_optimizer_class(SimpleDistributedPerLayerOptimizer)


@pytest.mark.cuda
def test_cuda_buffers_on_device():
    params = [nn.Parameter(torch.zeros(10, device="cuda"))]
    opt = CorrelatedNoiseDPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=1.0,
                                     max_grad_norm=1.0, expected_batch_size=1,
                                     noise_correlation=st.banded_sqrt_coefficients(4))
    _noise_stream(opt, 3)
    assert opt._noise_buffers[0].device.type == "cuda"


def test_engine_with_cyclic_poisson_scheme_end_to_end():
    from opacus_structured.accountants.bandmf import BandMFCyclicPoissonAccountant
    from opacus_structured.schemes.bandmf_cyclic_poisson import BandMFCyclicPoissonScheme

    torch.manual_seed(0)
    x, y = torch.randn(256, 5), torch.randint(0, 2, (256,))
    scheme = BandMFCyclicPoissonScheme(dataset_size=256, batch_size=16, bands=4)
    engine = CorrelatedNoisePrivacyEngine(scheme=scheme)
    assert isinstance(engine.accountant, BandMFCyclicPoissonAccountant)
    from opacus.data_loader import wrap_collate_with_empty
    from torch.utils.data._utils.collate import default_collate
    loader = DataLoader(TensorDataset(x, y), batch_sampler=scheme.sampler(seed=0),
                        collate_fn=wrap_collate_with_empty(collate_fn=default_collate,
                                                           sample_empty_shapes=[(0, 5), (0,)],
                                                           dtypes=[torch.float32, torch.int64]))
    model = nn.Linear(5, 2)
    coef = scheme.noise_correlation(steps=len(loader))
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False, noise_correlation=coef)
    assert opt.bands == 4
    for xb, yb in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    assert opt.noise_step == len(loader) == 16
    eps = engine.get_epsilon(1e-5)
    assert eps == pytest.approx(scheme.epsilon(1.0, 16, 1e-5), rel=1e-9)


# ---- BLT (dense C, streamed with d buffers) ------------------------------------------------
def test_blt_noise_solves_C_w_equals_z_and_resumes():
    n = 15
    blt = st.blt_strategy(n, 3).normalized(n)
    params = _params(torch.float64)
    sigma, clip = 0.9, 1.5

    def make(seed=3):
        return CorrelatedNoiseDPOptimizer(torch.optim.SGD(_params(torch.float64), lr=0.1),
                                          noise_multiplier=sigma, max_grad_norm=clip,
                                          expected_batch_size=1,
                                          generator=torch.Generator().manual_seed(seed),
                                          noise_correlation=blt)

    opt = make()
    w = _noise_stream(opt, n)
    assert all(b.shape[0] == 3 for b in opt._noise_buffers)  # d buffers, whatever n is
    g = torch.Generator().manual_seed(3)
    z = [[torch.normal(0, sigma * clip, size=p.shape, generator=g, dtype=torch.float64)
          for p in params] for _ in range(n)]
    C = torch.tensor(st.toeplitz_matrix(blt.coefficients(n), n))  # the dense C
    assert abs(float(torch.linalg.norm(C[:, 0])) - 1.0) < 1e-12
    for j in range(len(params)):
        W = torch.stack([w[i][j].reshape(-1) for i in range(n)])
        Z = torch.stack([z[i][j].reshape(-1) for i in range(n)])
        torch.testing.assert_close(C @ W, Z, rtol=1e-10, atol=1e-10)
    # resume mid-stream from a state dict: the same stream continues
    first = make()
    _noise_stream(first, 6)
    resumed = make(seed=99)
    resumed.load_state_dict(first.state_dict())
    for a, b in zip(w[6:], _noise_stream(resumed, n - 6)):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    banded = CorrelatedNoiseDPOptimizer(torch.optim.SGD(_params(torch.float64), lr=0.1),
                                        noise_multiplier=sigma, max_grad_norm=clip,
                                        expected_batch_size=1, noise_correlation=[1.0, 0.5])
    with pytest.raises(ValueError, match="noise_correlation"):
        banded.load_state_dict(first.state_dict())


def test_blt_engine_priced_by_random_allocation_mf_only():
    from opacus_structured.schemes.bandmf_cyclic_poisson import BandMFCyclicPoissonScheme
    from opacus_structured.schemes.random_allocation_mf import RandomAllocationMFScheme

    scheme = RandomAllocationMFScheme(strategy="blt", bands=2, epochs=2, batches_per_epoch=4)
    N = scheme.num_steps
    good = st.blt_strategy(N, 2).normalized(N)
    scheme.check_noise_correlation(good)  # exactly the scheme's C
    with pytest.raises(ValueError, match="does not generate"):
        scheme.check_noise_correlation(st.BufferedToeplitz((0.5,), (0.3,)).normalized(N))
    with pytest.raises(ValueError, match="dense C"):
        BandMFCyclicPoissonScheme(dataset_size=64, batch_size=4, bands=4
                                  ).check_noise_correlation(good)
    x, y = torch.randn(32, 6), torch.randint(0, 2, (32,))
    model = nn.Linear(6, 2)
    sampler = scheme.sampler(32, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, y), batch_sampler=sampler)
    engine = CorrelatedNoisePrivacyEngine(scheme=scheme)
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False, noise_correlation=good)
    assert opt.noise_coefficients is good
    other = nn.Linear(6, 2)
    with pytest.raises(ValueError, match="independent noise"):
        CorrelatedNoisePrivacyEngine().make_private(
            module=other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=1.0,
            max_grad_norm=1.0, poisson_sampling=False, noise_correlation=good)
