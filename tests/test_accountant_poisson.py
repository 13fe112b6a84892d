"""The Poisson scheme and its Opacus adapter (issue 2 acceptance)."""

import math
import warnings

import pytest
import torch
from conftest import same_pld
from opacus import PrivacyEngine
from opacus.accountants import RDPAccountant
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import opacus_structured  # noqa: F401  (registers accountants)
from opacus_structured import PoissonAccountant, PoissonScheme
from opacus_structured.cli import main as cli_main

D = 1e-3


# The default run keeps σ = 1 and 2; σ = 0.6 (~2 s: its RDP orders converge slowly) runs in
# CI's slow step (issue 41: README command <= 5 min).
@pytest.mark.parametrize("sigma,q,steps", [pytest.param(0.6, 0.01, 100, marks=pytest.mark.slow),
                                           (1.0, 0.1, 100), (2.0, 0.001, 1000)])
def test_not_above_opacus_rdp(sigma, q, steps):
    acc = PoissonAccountant(discretization=D)
    acc.history = [(sigma, q, steps)]
    rdp = RDPAccountant()
    rdp.history = [(sigma, q, steps)]
    assert acc.get_epsilon(1e-5) <= rdp.get_epsilon(1e-5)


def test_matches_opacus_prv():
    acc = PoissonAccountant(discretization=1e-4)
    from opacus.accountants import PRVAccountant

    prv = PRVAccountant()
    for _ in range(200):
        acc.step(noise_multiplier=1.0, sample_rate=0.02)
        prv.step(noise_multiplier=1.0, sample_rate=0.02)
    assert acc.get_epsilon(1e-5) == pytest.approx(prv.get_epsilon(1e-5), rel=2e-2)


def test_cached_one_step_pld_is_a_fresh_build_and_survives_composition():
    # schemes/poisson.py caches the one-step PLD per (σ, q, discretization) (issue 41): it must
    # be what a fresh build from the pair gives, pricing through the accountant (which composes
    # it: one step, several, two parts) must leave it as it was, and the accountant's composed
    # PLD must be the composition of fresh builds.
    from opacus_structured.accounting import pld as pld_lib
    from opacus_structured.accounting.profiles import PairProfile
    from opacus_structured.schemes.poisson import poisson_pair

    scheme, sigma, q = PoissonScheme(0.05), 1.1, 0.05
    pair = poisson_pair(sigma, q)
    fresh = pld_lib.pld_from_profile(PairProfile(pair), PairProfile(pair.reversed()),
                                     discretization=D)
    cached = scheme.pld(sigma, discretization=D)
    assert scheme.pld(sigma, discretization=D) is cached and same_pld(cached, fresh)
    acc = PoissonAccountant(discretization=D)
    eps = []
    for steps in (1, 2, 7):
        acc.history = [(sigma, q, steps)]
        eps.append(acc.get_epsilon(1e-5))
    assert eps[0] < eps[1] < eps[2]
    assert same_pld(acc.composed_pld(), pld_lib.self_compose(fresh, 7))
    acc.history = [(sigma, q, 3), (2 * sigma, q, 4)]
    other = pld_lib.pld_from_profile(PairProfile(poisson_pair(2 * sigma, q)),
                                     PairProfile(poisson_pair(2 * sigma, q).reversed()),
                                     discretization=D)
    assert same_pld(acc.composed_pld(), pld_lib.compose([(fresh, 3), (other, 4)]))
    assert same_pld(cached, fresh)  # untouched by the compositions


def test_history_merging_and_len():
    acc = PoissonAccountant(discretization=D)
    for _ in range(3):
        acc.step(noise_multiplier=1.0, sample_rate=0.1)
    acc.step(noise_multiplier=2.0, sample_rate=0.1)
    assert acc.history == [(1.0, 0.1, 3), (2.0, 0.1, 1)]
    assert len(acc) == 4


def test_heterogeneous_equals_sum_of_parts():
    a = PoissonAccountant(discretization=D)
    a.history = [(1.0, 0.1, 5), (1.0, 0.1, 5)]
    b = PoissonAccountant(discretization=D)
    b.history = [(1.0, 0.1, 10)]
    assert a.get_epsilon(1e-5) == pytest.approx(b.get_epsilon(1e-5), rel=1e-6)


def test_state_dict_round_trip():
    acc = PoissonAccountant(PoissonScheme(sample_rate=0.05), discretization=D)
    for _ in range(7):
        acc.step(noise_multiplier=1.1, sample_rate=0.05)
    state = acc.state_dict()
    other = PoissonAccountant(PoissonScheme(sample_rate=0.05), discretization=D)
    other.load_state_dict(state)
    assert other.get_epsilon(1e-5) == acc.get_epsilon(1e-5)
    assert len(other) == 7
    # another rate: a new phase (issue 46), priced by the composed PLDs (no cheaper route)
    phased = PoissonAccountant(PoissonScheme(sample_rate=0.5), discretization=D)
    phased.load_state_dict(state)
    assert len(phased.phases) == 1 and len(phased) == 0 and phased.total_steps == 7
    eps = float(acc.get_epsilon(1e-5))
    assert float(phased.get_epsilon(1e-5)) == pytest.approx(eps, rel=1e-3)
    assert float(phased.get_epsilon(1e-5)) >= eps


def test_mismatched_sample_rate_raises():
    acc = PoissonAccountant(PoissonScheme(sample_rate=0.05))
    with pytest.raises(ValueError, match="sampler"):
        acc.step(noise_multiplier=1.0, sample_rate=0.1)


@pytest.mark.parametrize("kwargs,name", [
    (dict(noise_multiplier=-1.0, sample_rate=0.1), "noise_multiplier"),
    (dict(noise_multiplier=float("nan"), sample_rate=0.1), "noise_multiplier"),
    (dict(noise_multiplier=1.0, sample_rate=0.0), "sample_rate"),
])
def test_bad_step_input(kwargs, name):
    with pytest.raises(ValueError, match=name):
        PoissonAccountant().step(**kwargs)


@pytest.mark.parametrize("bad,name", [(dict(sample_rate=1.5), "sample_rate"),
                                      (dict(sample_rate=0.0), "sample_rate"),
                                      (dict(sample_rate=float("nan")), "sample_rate")])
def test_bad_scheme_input(bad, name):
    with pytest.raises(ValueError, match=name):
        PoissonScheme(**bad)


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, float("nan")])
def test_bad_delta(delta):
    acc = PoissonAccountant()
    acc.step(noise_multiplier=1.0, sample_rate=0.1)
    with pytest.raises(ValueError, match="delta"):
        acc.get_epsilon(delta)


def test_bad_steps():
    with pytest.raises(ValueError, match="steps"):
        PoissonScheme(sample_rate=0.1).epsilon(1.0, -1, 1e-5)


def _tiny_problem():
    torch.manual_seed(0)
    X, y = torch.randn(200, 6), torch.randint(0, 2, (200,))
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(
        TensorDataset(X, y), batch_size=20)


def test_stock_privacy_engine_trains_three_steps():
    warnings.simplefilter("ignore")
    model, opt, dl = _tiny_problem()
    pe = PrivacyEngine(accountant="poisson")
    assert isinstance(pe.accountant, PoissonAccountant)
    model, opt, dl = pe.make_private(module=model, optimizer=opt, data_loader=dl,
                                     noise_multiplier=1.0, max_grad_norm=1.0)
    it = iter(dl)
    for _ in range(3):
        xb, yb = next(it)
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    assert pe.accountant.history == [(1.0, 0.1, 3)]
    expect = PoissonScheme(sample_rate=0.1).epsilon(1.0, 3, 1e-5)
    assert pe.get_epsilon(1e-5) == pytest.approx(expect, rel=1e-12)


# Opacus' own make_private_with_epsilon through our accountant (~7 s: Opacus' search prices ~20
# σ); the default run checks the same search (get_noise_multiplier with accountant="poisson",
# test_opacus_suite) and our make_private_with_epsilon (test_public_sampling_constants).
@pytest.mark.slow  # 7 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_make_private_with_epsilon_reaches_target():
    warnings.simplefilter("ignore")
    model, opt, dl = _tiny_problem()
    pe = PrivacyEngine(accountant="poisson")
    model, opt, dl = pe.make_private_with_epsilon(
        module=model, optimizer=opt, data_loader=dl, target_epsilon=2.0, target_delta=1e-5,
        epochs=5, max_grad_norm=1.0, discretization=D)
    steps = 5 * len(dl)
    eps = PoissonScheme(sample_rate=0.1).epsilon(opt.noise_multiplier, steps, 1e-5,
                                                 discretization=D)
    assert eps <= 2.0
    assert eps == pytest.approx(2.0, rel=1e-2)


def test_cli_epsilon_json(capsys):
    assert cli_main(["epsilon", "poisson", "--sample-rate", "0.01", "--noise-multiplier", "1",
                     "--steps", "1000", "--delta", "1e-5", "--discretization", "1e-3",
                     "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"epsilon", "delta", "noise_multiplier", "steps", "scheme"}
    assert out["epsilon"] == pytest.approx(1.8289, abs=2e-3)  # reference value (value discretization 1e-3)


@pytest.mark.slow  # 5-30 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_cli_calibrate_and_errors(capsys):
    assert cli_main(["calibrate", "poisson", "--sample-rate", "0.01", "--target-epsilon", "2",
                     "--steps", "1000", "--delta", "1e-5", "--discretization", "1e-3",
                     "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["epsilon"] <= 2.0
    assert math.isclose(out["noise_multiplier"], 0.960, rel_tol=5e-3)  # reference value 0.960
    assert cli_main(["epsilon", "poisson", "--sample-rate", "2", "--noise-multiplier", "1",
                     "--steps", "10", "--delta", "1e-5"]) == 2
    assert "sample_rate" in capsys.readouterr().err


# ---- the Rényi route is left out where a cheap lower bound proves it cannot win (issue 46) ----
@pytest.mark.parametrize("sigma,q", [(0.8, 0.001), (1.0, 0.02), (1.0, 0.125), (2.0, 0.3)])
def test_rdp_lower_curve_is_below_dp_accountings_curve(sigma, q):
    """Order by order, the anchored lower curve (exact at the anchors, convexity of
    (α-1)ρ(α), monotonicity in α, Pinsker) never exceeds dp_accounting's own curve, and the ε
    bound built from it never exceeds the route's ε."""
    import numpy as np
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    from opacus_structured.schemes import poisson

    lower = poisson._rdp_lower_curve(sigma, q)
    exact = rdp._compute_rdp_poisson_subsampled_gaussian(
        q=q, noise_multiplier=sigma, orders=np.array(poisson.RDP_ORDERS))
    finite = np.isfinite(exact)
    assert np.all(lower[finite] <= exact[finite] * (1 + 1e-12))
    anchors = [poisson.RDP_ORDERS.index(a) for a in poisson._ANCHORS if a in poisson.RDP_ORDERS]
    assert np.allclose(lower[anchors], exact[anchors], rtol=1e-12)
    for steps in (10, 300):
        parts = ((sigma, q, steps),)
        assert poisson.rdp_lower_bound(parts, 1e-5) <= poisson._rdp_of_parts(parts, 1e-5)[0]


@pytest.mark.parametrize("sigma,q,steps,skips", [(1.0, 64 / 60000, 55, True),
                                                 (1.0, 0.1, 100, True), (0.7, 0.01, 300, True),
                                                 (1.0, 1 / 6, 100, False)])
def test_skipping_the_rdp_route_changes_no_epsilon(sigma, q, steps, skips, monkeypatch):
    """get_epsilon with the skip equals get_epsilon computing every route (route included);
    the route is skipped in the usual regimes, computed at ε ≈ 12 (q = 1/6)."""
    from opacus_structured.schemes.base import Scheme

    acc = PoissonAccountant(discretization=D)
    acc.history = [(sigma, q, steps)]
    fast = acc.get_epsilon(1e-5)
    alternatives = PoissonScheme().certified_alternatives_below(acc.history, 1e-5, float(fast))
    assert (alternatives == []) == skips
    monkeypatch.setattr(PoissonScheme, "certified_alternatives_below",
                        Scheme.certified_alternatives_below)
    full = acc.get_epsilon(1e-5)
    assert float(fast) == float(full) and fast.route == full.route
