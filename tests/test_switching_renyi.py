"""Issue 47 item 5: structured selection at the equivalent event's price.

The Rényi curve of a switching two-component dominating pair (Schuchardt et al. 2025, Thm
4.2/4.4/4.5/G.1), :mod:`opacus_structured.accounting.switching_renyi`, checked against
independent computations:

* its closed-form hockey-stick curves against dp_accounting's ``GaussianPrivacyLoss`` (remove
  and add) and against our ``MixturePair.delta`` (root finding, another route);
* the Rényi divergence of the switching pair against scipy quadrature of the pair itself
  (:math:`\\int_{P>Q} Q(P/Q)^\\lambda + \\int_{P>Q} P(Q/P)^\\lambda + m_0`, no identity used);
* the correction's bracket against scipy quadrature of the correction integral;
* the curve against dp_accounting's RDP of the equivalent event (never below it; equal where the
  switching correction vanishes);
* the PLD route (the bound used elsewhere) at least the switching route where both apply, and at
  least the true pair's Rényi divergence (quadrature) where the switching route does not apply;
* the issue's acceptance: the structured setting priced <= 1.2x the equivalent event's
  selection price (dp_accounting's ``RepeatAndSelectDpEvent``), and never below it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event as E
from dp_accounting.pld import privacy_loss_mechanism as plm
from dp_accounting.rdp import rdp_privacy_accountant as R
from scipy import integrate, stats

from opacus_structured.accountants.base import SchemeAccountant
from opacus_structured.accounting import private_selection as ps
from opacus_structured.accounting import structured as st
from opacus_structured.accounting import switching_renyi as sw
from opacus_structured.accounting.profiles import PairProfile
from opacus_structured.schemes.structured import StructuredScheme
from opacus_structured.tuning import ROUTES, TrialCost, pricing, selection_epsilon

DELTA = 1e-5
ORDERS = ps.DEFAULT_ORDERS
#: the issue's setting: 100 series of length 50, context 10, horizon 5, batch 5, sigma 2, 100 steps
SETTING = dict(num_series=100, series_length=50, context_length=10, forecast_length=5,
               batch_size=5)
Q_SETTING = 0.05 * 15 / 46  # rho * r


def _accountant(steps=100, sigma=2.0, **overrides):
    scheme = StructuredScheme(**{**SETTING, **overrides})
    acc = SchemeAccountant(scheme, discretization=1e-3)
    acc.step(noise_multiplier=sigma, sample_rate=scheme.expected_sample_rate(),
             num_steps=steps)
    return acc


def _event(q=Q_SETTING, s=1.0, steps=100):
    return E.SelfComposedDpEvent(E.PoissonSampledDpEvent(q, E.GaussianDpEvent(s)), steps)


def _event_selection(event, mean=10, eta=1.0):
    acc = R.RdpAccountant(list(ORDERS))
    acc.compose(E.RepeatAndSelectDpEvent(event, mean, eta))
    return acc.get_epsilon(DELTA)


def _pair_renyi_quadrature(lam, s, p):
    """D_λ of the switching pair by quadrature of the pair itself (scale 1/s: P = (1-p)N(0, s)
    + p N(1, s), Q = N(0, s); P > Q exactly where x > 1/2)."""
    def P(x):
        return (1 - p) * stats.norm.pdf(x, 0, s) + p * stats.norm.pdf(x, 1, s)

    def Q(x):
        return stats.norm.pdf(x, 0, s)

    def ratio(x):  # P/Q, stably
        return 1 - p + p * math.exp((2 * x - 1) / (2 * s * s))

    hi = 0.5 + 40 * s
    kw = dict(epsabs=1e-15, epsrel=1e-12, limit=400)
    t1 = integrate.quad(lambda x: Q(x) * ratio(x) ** lam, 0.5, hi, **kw)[0]
    t2 = integrate.quad(lambda x: P(x) * ratio(x) ** -lam, 0.5, hi, **kw)[0]
    m0 = 1 - (stats.norm.sf(0.5 / s) * (1 - p) + p * stats.norm.sf(-0.5 / s)) \
        - stats.norm.sf(0.5 / s)
    return math.log(t1 + t2 + m0) / (lam - 1)


# ---- the equivalence ---------------------------------------------------------------------------
def test_theorem_4_4_is_the_switching_profile_of_the_equivalent_event():
    profile = st.thm_4_4(2.0, 0.05, 15 / 46)
    s, p = sw.equivalent_subsampled_gaussian(profile)
    assert s == 1.0 and p == pytest.approx(Q_SETTING, rel=1e-14)
    # the same form per epoch (4.2) and with augmentation (G.1); not for two-sided pairs
    assert sw.equivalent_subsampled_gaussian(st.thm_4_2(3.0, 0.2)) == (1.5, pytest.approx(0.2))
    assert sw.equivalent_subsampled_gaussian(st.thm_e_1(1.0, 1, 0.2)) is None
    assert sw.equivalent_subsampled_gaussian(st.thm_f_1(1.0, 1, 0.1, 0.2)) is None
    assert sw.equivalent_subsampled_gaussian(st.thm_e_8(1.0, 15, 0.02)) is None
    assert sw.equivalent_subsampled_gaussian(st.thm_4_3(1.0, 2, 0.2)) is None  # 3 components
    assert sw.equivalent_subsampled_gaussian(PairProfile(profile.pair)) is None


@pytest.mark.parametrize("s,p", [(1.0, Q_SETTING), (0.6, 0.3), (4.0, 1e-3)])
def test_closed_forms_match_dp_accounting_and_the_mixture_pair(s, p):
    eps = np.array([0.0, 1e-3, 0.01, 0.1, 0.5, 1.0, 2.0, 4.0])
    rem = sw.switching_delta(eps, s, p, direction="remove")
    add = sw.switching_delta(eps, s, p, direction="add")
    for adjacency, ours in ((plm.AdjacencyType.REMOVE, rem), (plm.AdjacencyType.ADD, add)):
        loss = plm.GaussianPrivacyLoss(s, sensitivity=1.0, sampling_prob=p,
                                       adjacency_type=adjacency)
        peer = np.array([loss.get_delta_for_epsilon(float(e)) for e in eps])
        np.testing.assert_allclose(ours, peer, rtol=1e-9, atol=1e-17)
    pair = st.thm_4_4(2 * s, 1.0, p).pair  # the same pair at scale 2 (means 0 and 2)
    np.testing.assert_allclose(rem, pair.delta(eps), rtol=1e-7, atol=1e-15)
    np.testing.assert_allclose(add, pair.reversed().delta(eps), rtol=1e-7, atol=1e-15)
    assert np.all(add[eps >= -math.log1p(-p)] == 0.0)


# ---- the Rényi curve -------------------------------------------------------------------------
@pytest.mark.parametrize("s,p", [(1.0, Q_SETTING), (0.7, 0.05), (2.0, 0.4)])
def test_switching_rdp_matches_quadrature_of_the_pair(s, p):
    """Integer orders: within 1e-4, never below by more than quadrature round-off; fractional
    orders (the chord of the convex log-moment): never below."""
    orders = np.array([2.0, 3.0, 5.0, 8.0])
    ours = sw.switching_rdp(orders, s, p)
    truth = np.array([_pair_renyi_quadrature(lam, s, p) for lam in orders])
    assert np.all(ours >= truth * (1 - 1e-9))
    np.testing.assert_allclose(ours, truth, rtol=1e-4)
    frac = np.array([1.5, 2.5])
    assert np.all(sw.switching_rdp(frac, s, p)
                  >= np.array([_pair_renyi_quadrature(lam, s, p) for lam in frac]) * (1 - 1e-9))


def test_correction_bracket_holds_the_integral():
    s, p = 1.0, Q_SETTING
    orders = np.array([1.5, 2.0, 4.0, 10.0])
    lower, upper = sw.switching_correction_bounds(orders, s, p)

    def integrand(e, lam):
        rem = sw.switching_delta(np.array([e]), s, p)[0]
        add = sw.switching_delta(np.array([e]), s, p, direction="add")[0]
        return math.exp(-lam * e) * (rem - add)

    for lam, lo, hi in zip(orders, lower, upper, strict=True):
        value = integrate.quad(integrand, 0, 40, args=(lam,), points=[-math.log1p(-p)],
                               epsabs=1e-16, epsrel=1e-11, limit=400)[0]
        assert lo <= value <= hi
        assert hi - lo <= 1e-3 * hi  # the default grid's gap
    with pytest.raises(ValueError, match="orders must be"):
        sw.switching_correction_bounds([1.0], s, p)
    with pytest.raises(ValueError, match="grid must be"):
        sw.switching_correction_bounds([2.0], s, p, grid=np.array([0.1, 0.2]))


def test_equivalent_event_rdp_is_dp_accountings_at_integer_orders():
    orders = np.array([2.0, 3.0, 7.0, 32.0, 256.0, 1024.0])
    for s, p in ((1.0, Q_SETTING), (0.5, 0.3), (3.0, 1.0), (10.0, 0.9)):
        acc = R.RdpAccountant(list(orders))
        acc.compose(E.PoissonSampledDpEvent(p, E.GaussianDpEvent(s)))
        peer = np.asarray(acc._rdp)
        ours = sw.equivalent_event_rdp(orders, s, p)
        np.testing.assert_allclose(ours, peer, rtol=1e-9)
        assert np.all(ours >= peer * (1 - 1e-14))  # the rounding allowance is on the safe side
    with pytest.raises(ValueError, match="integers"):
        sw.equivalent_event_rdp([2.5], 1.0, 0.1)


def test_switching_rdp_against_the_equivalent_event():
    """At integer orders never below dp_accounting's RDP of the equivalent event, equal (1e-9)
    at orders >= 16, where the switching correction's factor exp(-λε) has vanished, within
    1.7x below; fractional orders lie on the chord of the log-moment (convexity)."""
    orders = np.arange(2.0, 64.0)
    ours = sw.switching_rdp(orders, 1.0, Q_SETTING)
    acc = R.RdpAccountant(list(orders))
    acc.compose(E.PoissonSampledDpEvent(Q_SETTING, E.GaussianDpEvent(1.0)))
    event = np.asarray(acc._rdp)
    assert np.all(ours >= event)
    high = orders >= 16
    np.testing.assert_allclose(ours[high], event[high], rtol=1e-9)
    assert np.all(ours <= 1.7 * event)
    mid = sw.switching_rdp(np.array([2.5, 1.5]), 1.0, Q_SETTING)
    k2, k3 = ours[0], 2 * ours[1]  # (λ-1) D at 2 and 3
    assert mid[0] == pytest.approx((k2 + k3) / 2 / 1.5, rel=1e-12)
    assert mid[1] == pytest.approx(k2 / 2 / 0.5, rel=1e-12)


def test_edge_rates_and_errors():
    orders = np.array([2.0, 4.0])
    # p = 1: the pair N(1, s) vs N(0, s) is symmetric, the switching pair is the Gaussian's
    gaussian = sw.switching_rdp(orders, 2.0, 1.0)
    assert np.all(gaussian >= orders / 8)
    np.testing.assert_allclose(gaussian, orders / 8, rtol=1e-4)
    np.testing.assert_array_equal(sw.switching_rdp(orders, 2.0, 0.0), np.zeros(2))
    with pytest.raises(ValueError, match="epsilon must be >= 0"):
        sw.switching_delta([-0.1], 1.0, 0.1)
    with pytest.raises(ValueError, match="direction"):
        sw.switching_delta([0.1], 1.0, 0.1, direction="both")
    with pytest.raises(ValueError, match="rate"):
        sw.switching_rdp(orders, 1.0, 1.5)
    with pytest.raises(ValueError, match="noise_multiplier"):
        sw.switching_rdp(orders, 0.0, 0.1)


# ---- pricing a structured trial ----------------------------------------------------------------
def test_structured_selection_at_the_equivalent_events_price():
    """The issue's acceptance: <= 1.2x dp_accounting's RepeatAndSelectDpEvent of the equivalent
    event (the price was 6.09 by the PLD route), and never below it."""
    acc = _accountant()
    ours = selection_epsilon(acc, mean_trials=10, eta=1, delta=DELTA)
    peer = _event_selection(_event())
    assert ours.route == "switching-pair" and ours.note == ROUTES["switching-pair"]
    assert peer <= ours <= 1.2 * peer
    assert ours == pytest.approx(3.232, abs=0.005)  # pinned; the event: 2.985
    assert peer == pytest.approx(2.985, abs=0.005)
    assert ours >= float(acc.get_epsilon(DELTA))  # a search costs at least one run


def test_structured_trial_with_its_score():
    acc = _accountant()
    ours = selection_epsilon(TrialCost(acc, (4.0,)), mean_trials=3, eta=1, delta=DELTA)
    peer = _event_selection(E.ComposedDpEvent([_event(), E.GaussianDpEvent(4.0)]), mean=3)
    assert ours.route == "switching-pair"
    assert peer <= ours <= 1.2 * peer


def test_the_pld_route_is_never_below_the_switching_route():
    """Where both apply, the pessimistic PLD's Rényi divergences are at least the switching
    pair's at the integer orders (where dp_accounting's A is exact; at fractional orders its
    series is an upper bound, at high orders the PLD's finite part leaves its tail to δ), so
    the route the pricing now takes is the tighter one; its selection price was 2x."""
    acc = _accountant()
    pld = acc.scheme.pld(2.0, discretization=1e-3)
    orders = np.arange(2.0, 17.0)
    (rdp, _tail), = ps.pld_renyi(pld, orders)
    exact = sw.switching_rdp(orders, 1.0, Q_SETTING)
    assert np.all(rdp >= exact * (1 - 1e-6))
    old = min(_selected(*route) for route in _pld_routes(acc))
    new = selection_epsilon(acc, mean_trials=10, eta=1, delta=DELTA)
    assert old == pytest.approx(6.09, abs=0.05)  # the figure (d = 1e-3)
    assert new < old / 1.8


def _selected(orders, rdp, tail, _label):
    selected = ps.repeat_and_select_rdp(orders, rdp, mean_trials=10, eta=1)
    try:
        return ps.epsilon_with_tail(orders, selected, DELTA, tail_mass=tail, mean_trials=10)
    except ValueError:  # this cut's tail mass is too large for δ: the route does not apply
        return math.inf


def _pld_routes(acc):
    parts = pricing._unit_parts(acc, 1e-3)
    out = []
    for cut in pricing.CUTS:
        rdp, tail = np.zeros_like(ORDERS), 0.0
        for pld, count in parts:
            r, t = ps.pld_renyi(pld, ORDERS, cut=cut)[0]
            rdp, tail = rdp + count * r, tail + count * t
        out.append((ORDERS, rdp, tail, "pld-renyi"))
    return out


def test_per_epoch_and_augmented_units_take_the_switching_route():
    det = _accountant(steps=40, top_level="deterministic")  # 20 steps an epoch: 2 epochs
    eps = selection_epsilon(det, mean_trials=5, eta=1, delta=DELTA)
    r = 15 / 46
    assert eps.route == "switching-pair"
    assert eps >= _event_selection(_event(q=r, steps=2), mean=5)
    aug = _accountant(steps=20, bound="upper", context_noise=0.5, forecast_noise=0.5)
    assert selection_epsilon(aug, mean_trials=5, eta=1, delta=DELTA).route == "switching-pair"


def test_two_sided_pairs_take_the_mixture_route_and_the_pld_stays_above_the_pair():
    """Theorem E.1 (``bound="upper"``, a two-sided pair) has no switching form: the mixture
    route prices it (``tests/test_mixture_renyi.py``); the PLD route's Rényi divergence is at
    least the pair's own (quadrature), an independent lower bound."""
    acc = _accountant(steps=40, top_level="deterministic", bound="upper")
    assert selection_epsilon(acc, mean_trials=3, eta=1, delta=DELTA).route == "mixture-pair"
    pair = acc.scheme.profile(2.0).pair
    orders = np.array([2.0, 4.0])
    (rdp, _), = ps.pld_renyi(acc.scheme.pld(2.0, discretization=1e-3), orders)
    lo, hi = pair.x_range()
    for lam, bound in zip(orders, rdp, strict=True):
        moment = integrate.quad(
            lambda x, lam=lam: math.exp(lam * pair.upper.logpdf(np.array([x]))[0]
                                        + (1 - lam) * pair.lower.logpdf(np.array([x]))[0]),
            lo, hi, epsabs=1e-14, epsrel=1e-10, limit=400)[0]
        assert bound >= math.log(moment) / (lam - 1)
    upper = _accountant(steps=10, bound="upper")  # Thm F.1, weighted two-sided
    assert selection_epsilon(upper, mean_trials=3, eta=1, delta=DELTA).route == "mixture-pair"


def test_every_route_is_labelled():
    from opacus_structured.tuning import PureDpTrial

    assert selection_epsilon(_event(), mean_trials=3, eta=1, delta=DELTA).route == "event"
    assert selection_epsilon(PureDpTrial(0.5), mean_trials=3, eta=1, delta=DELTA).route \
        == "pure-dp"
    assert set(ROUTES) == {"event", "pure-dp", "gdp", "renyi-accountant", "switching-pair",
                           "mixture-pair", "pld-renyi"}
