"""The ``shuffle`` scheme: sound upper bound, labelled lower bound, sampler, accountant, and the
stock Opacus path ``PrivacyEngine(accountant="shuffle").make_private(poisson_sampling=False)``.

Independent references: the μ-GDP profile solved with scipy (no package code), dp_accounting's
pessimistic Gaussian PLD, a Monte Carlo sample of Chua et al.'s pair, and numerical integration
of the max statistic's densities.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from dp_accounting.pld import privacy_loss_distribution as dp_pld
from opacus import PrivacyEngine
from scipy import integrate, optimize, stats
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

import opacus_structured
from opacus_structured.accountants.shuffle import ShuffleAccountant
from opacus_structured.accounting import shuffle as sh
from opacus_structured.accounting.bounds import BoundKind
from opacus_structured.schemes.poisson import PoissonScheme
from opacus_structured.schemes.shuffle import ShuffleScheme

warnings.filterwarnings("ignore", message="Secure RNG turned off")
DELTA = 1e-5


def gdp_epsilon_scipy(mu: float, delta: float) -> float:
    """ε(δ) of μ-GDP from Φ alone (Dong, Roth & Su 2022, Cor. 2.13), by Brent's method."""
    def d(e):
        return stats.norm.cdf(-e / mu + mu / 2) - math.exp(e) * stats.norm.cdf(-e / mu - mu / 2)
    return optimize.brentq(lambda e: d(e) - delta, 0.0, 200.0, xtol=1e-13)


# ---- upper bound ----------------------------------------------------------------------------
@pytest.mark.parametrize("relation, sens", [("zero-out", 1.0), ("replace-one", 2.0)])
@pytest.mark.parametrize("sigma, steps", [(1.0, 10), (0.8, 11), (2.5, 95), (5.0, 1)])
def test_upper_bound_is_the_gaussian_of_the_epochs_begun(relation, sens, sigma, steps):
    scheme = ShuffleScheme(dataset_size=100, batch_size=10, relation=relation)
    epochs = math.ceil(steps / 10)          # a partial epoch is priced as a full one
    eps = scheme.epsilon(sigma, steps, DELTA)
    assert eps.route == "closed-form" and scheme.bound == BoundKind.UPPER
    assert float(eps) == pytest.approx(gdp_epsilon_scipy(sens * math.sqrt(epochs) / sigma,
                                                          DELTA), rel=1e-9)
    # dp_accounting's pessimistic PLD of the same Gaussian composition sits just above
    pld = dp_pld.from_gaussian_mechanism(sigma, sensitivity=sens,
                                         value_discretization_interval=1e-3)
    peer = pld.self_compose(epochs).get_epsilon_for_delta(DELTA)
    assert float(eps) <= peer + 1e-9 and peer - float(eps) < 0.02
    assert scheme.delta(sigma, steps, float(eps)) == pytest.approx(DELTA, rel=1e-6)


def test_steps_per_epoch_follow_torch_batch_sampler():
    for n, b in [(100, 10), (105, 10), (7, 3), (10, 10)]:
        for drop_last in (False, True):
            torch_len = len(BatchSampler(RandomSampler(range(n)), b, drop_last))
            scheme = ShuffleScheme(dataset_size=n, batch_size=b, drop_last=drop_last)
            assert scheme.steps_per_epoch() == torch_len == len(scheme.sampler(n, seed=0))


def test_noise_for_epsilon_inverts_the_closed_form():
    scheme = ShuffleScheme(dataset_size=100, batch_size=10)
    sigma = scheme.noise_for_epsilon(3.0, 50, DELTA)
    assert float(scheme.epsilon(sigma, 50, DELTA)) <= 3.0
    assert float(scheme.epsilon(sigma * 0.999, 50, DELTA)) > 3.0


@pytest.mark.parametrize("bad, match", [
    (dict(dataset_size=10), "both"), (dict(dataset_size=10, batch_size=11), "batch_size"),
    (dict(relation="add-remove"), "relation"), (dict(bound="tight"), "bound"),
    (dict(dataset_size=0, batch_size=1), "dataset_size"), (dict(drop_last=1), "drop_last")])
def test_bad_parameters_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        ShuffleScheme(**bad)


def test_template_takes_the_epoch_from_the_rate_and_refuses_a_fractional_one():
    t = ShuffleScheme()
    assert t.is_template() and t.epochs(25, sample_rate=0.1) == 3
    with pytest.raises(ValueError, match="not an integer"):
        t.epochs(5, sample_rate=0.3)
    with pytest.raises(ValueError, match="sample_rate"):
        t.epochs(5)


# ---- lower bound (Chua et al.) ------------------------------------------------------------------
def test_cube_probabilities_match_a_monte_carlo_sample_of_the_pair():
    """F_m(c) = Φ((c−m)/σ) Φ(c/σ)^{K−1} against 200 000 draws of MoG(m) (4 standard errors)."""
    rng = np.random.default_rng(0)
    k, sigma, count = 5, 1.0, 200_000
    for m in (2.0, 1.0, 0.0):
        y = rng.normal(0.0, sigma, size=(count, k))
        y[np.arange(count), rng.integers(0, k, count)] += m
        for c in (1.0, 2.0, 3.0):
            p = np.mean(y.max(axis=1) <= c)
            f = math.exp(float(sh.mog_max_log_cdf(c, m, sigma, k)))
            assert abs(p - f) < 4 * math.sqrt(f * (1 - f) / count) + 1e-12


def _exact_max_statistic_delta(sigma, k, eps, m_p, m_q):
    """δ(ε) of the max statistic's pair by quadrature of its densities (both directions)."""
    # the standard normal's pdf and cdf in plain math (scipy's scalar calls inside quad made
    # this oracle ~10x slower; same values to ~1e-16 relative; issue 41)
    def pdf(t):
        return math.exp(-0.5 * t * t) / math.sqrt(2.0 * math.pi)

    def cdf(t):
        return 0.5 * math.erfc(-t / math.sqrt(2.0))

    def dens(c, m):
        a, b = (c - m) / sigma, c / sigma
        return (pdf(a) * cdf(b) ** (k - 1)
                + (k - 1) * cdf(a) * pdf(b) * cdf(b) ** (k - 2)) / sigma
    lo, hi = -12 * sigma, max(m_p, m_q) + 14 * sigma
    out = 0.0
    for mp, mq in ((m_p, m_q), (m_q, m_p)):
        def excess(c, mp=mp, mq=mq):
            return max(dens(c, mp) - math.exp(eps) * dens(c, mq), 0.0)
        val, _ = integrate.quad(excess, lo, hi, limit=400, points=[mp, mq])
        out = max(out, val)
    return out


@pytest.mark.parametrize("sigma, k", [(1.0, 10), pytest.param(0.7, 50, marks=pytest.mark.slow)])
def test_single_epoch_lower_bound_is_below_the_exact_statistic_and_close(sigma, k):
    for eps in (0.5, 1.5, 3.0):
        exact = _exact_max_statistic_delta(sigma, k, eps, 2.0, 1.0)
        pld_route = sh.multi_epoch_delta_lower_bound(sigma, k, 1, eps, discretization=1e-3)
        assert pld_route <= exact * (1 + 1e-6) + 1e-15   # quad is accurate to ~1e-8
        assert pld_route >= 0.97 * exact - 1e-12


@pytest.mark.parametrize("relation", ["zero-out", "replace-one"])
@pytest.mark.parametrize("sigma, k, epochs", [(1.0, 10, 1), (1.0, 100, 3), (0.8, 1000, 2)])
def test_lower_bound_never_exceeds_the_upper_bound(relation, sigma, k, epochs):
    scheme = ShuffleScheme(dataset_size=10 * k, batch_size=10, relation=relation)
    lower = dataclass_replace(scheme, bound="lower")
    steps = epochs * k
    lo, up = lower.epsilon(sigma, steps, DELTA), float(scheme.epsilon(sigma, steps, DELTA))
    assert 0 < lo <= up + 1e-9
    assert lower.bound == BoundKind.LOWER and not lower.bound.is_guarantee


def dataclass_replace(scheme, **changes):
    import dataclasses
    return dataclasses.replace(scheme, **changes)


def test_shuffling_costs_more_than_poisson_at_the_same_rate():
    """Chua et al.'s point: at σ = 1, K = 100, one epoch, shuffling's lower bound is far above
    Poisson subsampling's ε at q = 1/K (what Opacus prints for a shuffled loader)."""
    scheme = ShuffleScheme(dataset_size=1000, batch_size=10)
    out = scheme.compare(1.0, 100, DELTA)
    assert out["poisson"] < 1.0 < 3.0 < out["lower"] <= out["upper"]
    assert out["poisson"] == pytest.approx(
        dp_pld.from_gaussian_mechanism(1.0, sampling_prob=0.01,
                                       value_discretization_interval=1e-3)
        .self_compose(100).get_epsilon_for_delta(DELTA), rel=1e-3)


def test_lower_bound_is_never_a_guarantee():
    lower = ShuffleScheme(dataset_size=100, batch_size=10, bound="lower")
    with pytest.raises(ValueError, match="lower bound"):
        ShuffleAccountant(lower)
    with pytest.raises(ValueError, match="never a guarantee"):
        lower.noise_for_epsilon(2.0, 10, DELTA)
    with pytest.raises(ValueError, match="never a guarantee"):
        lower.pld(1.0)
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="lower bound"):
        opacus_structured.make_private(
            PrivacyEngine(accountant="shuffle"), module=model, scheme=lower,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_dataset(), batch_size=10), noise_multiplier=1.0,
            max_grad_norm=1.0)


# ---- sampler -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n, b, drop_last", [(23, 5, False), (23, 5, True), (20, 5, False)])
def test_every_example_once_per_epoch_last_batch_as_torch(n, b, drop_last):
    s = ShuffleScheme(dataset_size=n, batch_size=b, drop_last=drop_last).sampler(n, seed=3)
    for _ in range(3):
        batches = list(s)
        sizes = [len(x) for x in batches]
        flat = [i for x in batches for i in x]
        assert len(flat) == len(set(flat))
        if drop_last:
            assert sizes == [b] * (n // b) and len(flat) == (n // b) * b
        else:
            assert sorted(flat) == list(range(n))
            assert sizes == [b] * (n // b) + ([n % b] if n % b else [])
    assert s.permutations_drawn == 3 and s.batches_drawn == 3 * len(s)


def test_permutations_are_uniform():
    """Position of example 0 in the permutation: uniform over 6 slots (χ², 3000 epochs)."""
    s = ShuffleScheme(dataset_size=6, batch_size=6).sampler(6, seed=0)
    counts = np.zeros(6)
    for _ in range(3000):
        (batch,) = list(s)
        counts[batch.index(0)] += 1
    assert stats.chisquare(counts).pvalue > 1e-3


@pytest.mark.parametrize("cut", [0, 2, 5, 7])
def test_exact_resume(cut):
    scheme = ShuffleScheme(dataset_size=23, batch_size=5)
    ref = scheme.sampler(23, seed=11)
    reference = [b for _ in range(2) for b in ref]
    run = scheme.sampler(23, seed=11)
    drawn, it = [], iter(run)
    for _ in range(cut):
        try:
            drawn.append(next(it))
        except StopIteration:
            it = iter(run)
            drawn.append(next(it))
    state = run.state_dict()
    fresh = scheme.sampler(23, seed=999)
    fresh.load_state_dict(state)
    rest = list(fresh)
    if len(drawn) + len(rest) < len(reference):
        rest += list(fresh)
    assert drawn + rest[: len(reference) - len(drawn)] == reference


# ---- accountant ----------------------------------------------------------------------------
def _dataset(n: int = 100) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g))


def _train(engine, loader, *, ours=False, epochs=1, break_after=None, sigma=1.0, **kw):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    make = (lambda **a: opacus_structured.make_private(engine, **a)) if ours \
        else engine.make_private
    model, opt, dl = make(module=model, optimizer=opt, data_loader=loader,
                          noise_multiplier=sigma, max_grad_norm=1.0, **kw)
    for _ in range(epochs):
        for i, (x, y) in enumerate(dl):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if break_after is not None and i + 1 >= break_after:
                break
    return engine, dl


@pytest.mark.parametrize("shuffle", [True, False])
def test_stock_opacus_path_prices_the_epochs(shuffle):
    engine, dl = _train(PrivacyEngine(accountant="shuffle"),
                        DataLoader(_dataset(), batch_size=10, shuffle=shuffle), epochs=2,
                        poisson_sampling=False)
    acc = engine.accountant
    assert acc.scheme == ShuffleScheme(dataset_size=100, batch_size=10)
    assert len(acc) == 20 and acc.epoch_noise_multipliers() == [1.0, 1.0]
    assert engine.get_epsilon(DELTA) == pytest.approx(gdp_epsilon_scipy(math.sqrt(2), DELTA),
                                                      rel=1e-9)


def test_a_loop_that_breaks_mid_epoch_pays_for_every_permutation():
    """Three passes of 3 steps each are 3 permutations: 3 epochs, not ceil(9/10) = 1."""
    engine, _ = _train(PrivacyEngine(accountant="shuffle"),
                       DataLoader(_dataset(), batch_size=10, shuffle=True), epochs=3,
                       break_after=3, poisson_sampling=False)
    assert len(engine.accountant) == 9
    assert engine.get_epsilon(DELTA) == pytest.approx(gdp_epsilon_scipy(math.sqrt(3), DELTA),
                                                      rel=1e-9)


@pytest.mark.parametrize("poisson_sampling", [True, False])
def test_our_make_private_by_name(poisson_sampling):
    loader = DataLoader(_dataset(), batch_size=10, shuffle=True, drop_last=True)
    extra = {"sampler_generator": torch.Generator().manual_seed(0)} if poisson_sampling else {}
    engine, dl = _train(PrivacyEngine(), loader, ours=True, scheme="shuffle",
                        poisson_sampling=poisson_sampling, relation="replace-one", **extra)
    assert engine.accountant.scheme == ShuffleScheme(dataset_size=100, batch_size=10,
                                                     drop_last=True, relation="replace-one")
    assert engine.get_epsilon(DELTA) == pytest.approx(gdp_epsilon_scipy(2.0, DELTA), rel=1e-9)


def test_poisson_accountant_refuses_a_shuffled_loader_naming_shuffle():
    with pytest.raises(ValueError, match=r"'shuffle'.*poisson_sampling=True"):
        _train(PrivacyEngine(accountant="poisson"),
               DataLoader(_dataset(), batch_size=10, shuffle=True), poisson_sampling=False)


def test_sampling_with_replacement_is_not_shuffle():
    loader = DataLoader(_dataset(), batch_size=10,
                        sampler=RandomSampler(_dataset(), replacement=True))
    with pytest.raises(ValueError, match="shuffle"):
        _train(PrivacyEngine(accountant="shuffle"), loader, poisson_sampling=False)


def test_offline_history_mixed_noise_and_state_round_trip():
    acc = ShuffleAccountant(ShuffleScheme(dataset_size=100, batch_size=10))
    acc.step(noise_multiplier=2.0, sample_rate=0.1, num_steps=15)
    acc.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=10)
    # epochs: [0,10) at 2; [10,20) at min(2, 1) = 1; [20,25) at 1
    assert acc.epoch_noise_multipliers() == [2.0, 1.0, 1.0]
    mu = math.sqrt(1 / 4 + 1 + 1)
    assert acc.get_epsilon(DELTA) == pytest.approx(gdp_epsilon_scipy(mu, DELTA), rel=1e-9)
    clone = ShuffleAccountant()
    clone.load_state_dict(acc.state_dict())
    assert clone.scheme == acc.scheme and clone.get_epsilon(DELTA) == acc.get_epsilon(DELTA)
    with pytest.raises(ValueError, match="sample_rate"):
        acc.step(noise_multiplier=1.0, sample_rate=0.2)


def test_stock_make_private_with_epsilon_by_name():
    engine = PrivacyEngine(accountant="shuffle")
    model = nn.Linear(3, 2)
    _, opt, dl = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_dataset(), batch_size=10, shuffle=True), target_epsilon=4.0,
        target_delta=DELTA, epochs=2, max_grad_norm=1.0, poisson_sampling=False)
    sigma = opt.noise_multiplier
    eps = gdp_epsilon_scipy(math.sqrt(2) / sigma, DELTA)
    assert 3.9 < eps <= 4.0


def test_poisson_template_still_works_with_rate_from_the_hook():
    assert PoissonScheme().is_template() and not PoissonScheme(0.1).is_template()
