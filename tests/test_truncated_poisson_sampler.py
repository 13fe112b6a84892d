"""TruncatedPoissonSampler: exact batch law (enumeration + chi-square, seeded), fixed shape,
padding that contributes exactly zero under Opacus, validation, resumable state."""

import itertools
import math
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn
from torch.utils.data import TensorDataset

from opacus_structured.accountants.truncated_poisson import TruncatedPoissonAccountant
from opacus_structured.accounting import truncated_poisson as tp
from opacus_structured.samplers.truncated_poisson import (
    PaddedDataset,
    TruncatedPoissonSampler,
    masked_loss,
    truncated_poisson_data_loader,
)
from opacus_structured.schemes.truncated_poisson import TruncatedPoissonScheme

P_MIN = 1e-3  # chi-square p-value threshold (draws are seeded, so the tests are deterministic)


def real(batch, n):
    return tuple(i for i in batch if i != n)


def exact_batch_law(n, p, b):
    """P(batch = A) for every A, by enumerating the Poisson set S and the uniform truncation."""
    law = Counter()
    for size in range(n + 1):
        for s in itertools.combinations(range(n), size):
            w = p ** size * (1 - p) ** (n - size)
            if size <= b:
                law[s] += w
            else:
                subsets = list(itertools.combinations(s, b))
                for a in subsets:
                    law[a] += w / len(subsets)
    return law


def chisquare_pvalue(counts: Counter, law: Counter, draws: int) -> float:
    keys = sorted(law)
    assert set(counts) <= set(keys), "a batch outside the model's support"
    obs = np.array([counts.get(k, 0) for k in keys], dtype=float)
    exp = np.array([law[k] for k in keys]) * draws
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def test_batch_shape_is_always_b_and_indices_valid():
    n, p, b = 60, 0.2, 10
    s = TruncatedPoissonSampler(n, p, b, steps=300, seed=1)
    assert len(s) == 300 and s.padding_index == n
    sizes = []
    for batch in s:
        assert len(batch) == b
        r = real(batch, n)
        assert list(r) == sorted(set(r)) and all(0 <= i < n for i in r)
        assert batch[len(r):] == [n] * (b - len(r))  # real rows first, then padding
        sizes.append(len(r))
    assert max(sizes) == b and min(sizes) < b  # some truncated, some padded


def test_exact_batch_law_small_case_chi_square():
    # every subset's probability, truncation included, against brute-force enumeration
    n, p, b, draws = 5, 0.6, 2, 6000
    law = exact_batch_law(n, p, b)
    assert sum(law.values()) == pytest.approx(1.0)
    s = TruncatedPoissonSampler(n, p, b, steps=draws, seed=7, pad=False)
    counts = Counter(tuple(batch) for batch in s)
    assert chisquare_pvalue(counts, law, draws) > P_MIN


def test_truncation_picks_a_uniform_subset():
    # p = 1: S is everything, so the batch is the truncation alone: uniform over C(6, 3) = 20
    n, b, draws = 6, 3, 4000
    s = TruncatedPoissonSampler(n, 1.0, b, steps=draws, seed=11)
    counts = Counter(tuple(batch) for batch in s)
    law = Counter({a: 1 / math.comb(n, b) for a in itertools.combinations(range(n), b)})
    assert len(counts) == 20
    assert chisquare_pvalue(counts, law, draws) > P_MIN


def test_batch_size_law_and_inclusion_probability_match_the_model():
    n, p, b, draws = 200, 0.1, 22, 1500
    s = TruncatedPoissonSampler(n, p, b, steps=draws, seed=5)
    sizes, hits = Counter(), np.zeros(n)
    for batch in s:
        r = real(batch, n)
        sizes[len(r)] += 1
        hits[list(r)] += 1
    # number of real rows ~ min(Binomial(n, p), B) (Algorithm 1); bins pooled at both ends
    k = np.arange(0, b + 1)
    pmf = stats.binom.pmf(k, n, p)
    pmf[b] = stats.binom.sf(b - 1, n, p)
    edges = [0, 14, 16, 18, 20, 21, 22, 23]  # [0,14), [14,16), ..., {22}
    obs = [sum(sizes[j] for j in range(a, c)) for a, c in zip(edges[:-1], edges[1:], strict=True)]
    exp = [pmf[a:c].sum() * draws for a, c in zip(edges[:-1], edges[1:], strict=True)]
    assert stats.chisquare(obs, exp).pvalue > P_MIN
    # each index is in a batch with probability p w1 + q w2 = E[min(S, B)] / n
    pi = tp.inclusion_probability(n, p, b)
    assert pi < p
    sd = math.sqrt(draws * pi * (1 - pi))
    assert np.abs(hits - draws * pi).max() < 5 * sd
    assert hits.sum() / draws == pytest.approx(s.expected_batch_size, rel=0.02)
    assert stats.chisquare(hits).pvalue > P_MIN  # no index is favoured


def test_resume_mid_epoch_reproduces_the_batches():
    s = TruncatedPoissonSampler(40, 0.3, 8, steps=6, seed=123)
    it = iter(s)
    first = [next(it) for _ in range(2)]
    state = s.state_dict()
    rest = list(it)
    t = TruncatedPoissonSampler(40, 0.3, 8, steps=6, seed=999)
    t.load_state_dict(state)
    assert list(t) == rest and len(first + rest) == 6
    assert t.epoch == 1 and s.epoch == 1
    # next epoch continues identically too
    assert list(s) == list(t)
    with pytest.raises(ValueError, match="max_batch_size"):
        TruncatedPoissonSampler(40, 0.3, 9, steps=6, seed=0).load_state_dict(state)


def test_same_seed_same_batches_and_scheme_attribute():
    a = list(TruncatedPoissonSampler(30, 0.2, 5, seed=3))
    b = list(TruncatedPoissonSampler(30, 0.2, 5, generator=torch.Generator().manual_seed(3)))
    assert a == b
    s = TruncatedPoissonSampler(30, 0.2, 5, seed=3)
    assert s.scheme == TruncatedPoissonScheme(30, 0.2, 5)
    assert len(s) == s.scheme.steps_per_epoch() == 5
    scheme = TruncatedPoissonScheme(30, 0.2, 5, relation="replace-one", epoch_steps=4)
    sampler = scheme.sampler(seed=0)
    assert sampler.scheme is scheme and len(sampler) == 4
    assert 1 / len(sampler) == scheme.expected_sample_rate()


@pytest.mark.parametrize("args, kwargs, match", [
    ((10, 0.5, 0), {}, "max_batch_size"),
    ((10, 0.5, 11), {}, "max_batch_size"),
    ((10, 0.0, 3), {}, "sample_rate"),
    ((10, 1.2, 3), {}, "sample_rate"),
    ((0, 0.5, 1), {}, "dataset_size"),
    ((10, 0.5, 3), {"steps": 0}, "epoch_steps"),
    ((10, 0.5, 3), {"seed": 1, "generator": torch.Generator()}, "either"),
    ((10, 0.5, 3), {"generator": 5}, "generator"),
])
def test_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        TruncatedPoissonSampler(*args, **kwargs)


# ---- DataLoader and Opacus -------------------------------------------------------------------
def _data(n=48, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, d, generator=g), torch.randint(0, 3, (n,), generator=g))


def test_data_loader_fixed_shape_and_mask():
    ds = _data()
    loader = truncated_poisson_data_loader(ds, 0.25, 9, seed=4)
    assert len(loader) == 4
    for x, y, mask in loader:
        assert x.shape == (9, 5) and y.shape == (9,) and mask.shape == (9,)
        k = int(mask.sum())
        assert torch.all(mask[:k] == 1) and torch.all(mask[k:] == 0)
        assert torch.all(x[k:] == 0)
    padded = PaddedDataset(ds)
    assert len(padded) == 48
    with pytest.raises(IndexError):
        padded[49]
    assert PaddedDataset([{"a": torch.ones(2)}])[1]["mask"] == 0


def _dp_step(model_state, x, y, mask, *, b, sigma, seed):
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    model.load_state_dict(model_state)
    gsm = GradSampleModule(model, loss_reduction="sum")
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.1), noise_multiplier=sigma,
                      max_grad_norm=0.5, expected_batch_size=b, loss_reduction="mean",
                      generator=torch.Generator().manual_seed(seed))
    per_sample = nn.functional.cross_entropy(gsm(x), y, reduction="none")
    masked_loss(per_sample, mask).backward()
    opt.pre_step()  # clip, noise, scale by 1/B (the accountant hook is not needed here)
    return [p.grad.detach().clone() for p in gsm.parameters()]


@pytest.mark.parametrize("sigma", [0.0, 1.0])
def test_padding_contributes_exactly_zero_under_opacus(sigma):
    torch.manual_seed(0)
    state = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)).state_dict()
    ds = PaddedDataset(_data())
    b = 9
    idx = [3, 7, 20, 31, 48, 48, 48, 48, 48]  # 4 real rows + 5 padding slots (index n = 48)
    x, y, mask = (torch.stack(t) for t in zip(*(ds[i] for i in idx), strict=True))
    with_padding = _dp_step(state, x, y, mask, b=b, sigma=sigma, seed=1)
    # same real rows alone, same noise draws, same public normaliser B
    real_only = _dp_step(state, x[:4], y[:4], mask[:4], b=b, sigma=sigma, seed=1)
    for g1, g2 in zip(with_padding, real_only, strict=True):
        assert torch.allclose(g1, g2, rtol=0, atol=1e-7)
    if sigma == 0:
        assert any(g.abs().sum() > 0 for g in with_padding)


def test_padded_rows_have_zero_per_sample_gradients_even_with_garbage_inputs():
    from opacus import GradSampleModule

    model = GradSampleModule(nn.Linear(5, 3), loss_reduction="sum")
    x = torch.randn(6, 5)
    x[4:] = 1e3  # padding content does not matter
    mask = torch.tensor([1.0, 1, 1, 1, 0, 0])
    y = torch.zeros(6, dtype=torch.long)
    masked_loss(nn.functional.cross_entropy(model(x), y, reduction="none"), mask).backward()
    for p in model.parameters():
        assert torch.all(p.grad_sample[4:] == 0) and p.grad_sample[:4].abs().sum() > 0


def test_privacy_engine_integration_with_accountant():
    from opacus import PrivacyEngine

    ds = _data(n=40)
    loader = truncated_poisson_data_loader(ds, 0.25, 12, seed=2)
    scheme = loader.batch_sampler.scheme
    model = nn.Sequential(nn.Linear(5, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = PrivacyEngine()
    engine.accountant = TruncatedPoissonAccountant(scheme, discretization=1e-3)
    model, opt, loader = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                             noise_multiplier=1.0, max_grad_norm=1.0,
                                             poisson_sampling=False)
    for x, y, mask in loader:
        assert x.shape[0] == 12
        opt.zero_grad()
        masked_loss(nn.functional.cross_entropy(model(x), y, reduction="none"), mask,
                    normalizer=12).backward()
        opt.step()
    assert len(engine.accountant) == len(loader) == 4
    eps = engine.get_epsilon(1e-5)
    assert eps == pytest.approx(scheme.epsilon(1.0, 4, 1e-5, discretization=1e-3))
    assert math.isfinite(eps) and eps > 0


def test_make_private_with_epsilon_through_a_registered_configured_accountant():
    from opacus import PrivacyEngine

    from opacus_structured.accountants import register_scheme_accountant

    loader = truncated_poisson_data_loader(_data(n=400), 0.05, 30, seed=0)
    scheme = loader.batch_sampler.scheme
    register_scheme_accountant("truncated-poisson-sampler-test", scheme,
                               base=TruncatedPoissonAccountant)
    engine = PrivacyEngine(accountant="truncated-poisson-sampler-test")
    model = nn.Linear(5, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = engine.make_private_with_epsilon(
        module=model, optimizer=opt, data_loader=loader, target_epsilon=3.0, target_delta=1e-5,
        epochs=2, max_grad_norm=1.0, poisson_sampling=False, discretization=1e-3)
    for _ in range(2):
        for x, y, mask in loader:
            opt.zero_grad()
            masked_loss(nn.functional.cross_entropy(model(x), y, reduction="none"), mask,
                        normalizer=30).backward()
            opt.step()
    assert len(engine.accountant) == 40
    assert engine.accountant.get_epsilon(1e-5, discretization=1e-3) <= 3.0
