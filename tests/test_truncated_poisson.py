"""Truncated Poisson accounting (Ganesh 2025, Theorems 3.1/3.3/3.4), scheme, accountant, CLI.

Independent oracles: the literal sum for q (Ganesh 2025), scipy quadrature of the joint pair's
hockey-stick divergence, our own exact profiles discretised once (a different route from
dp_accounting's branch PLDs), dp_accounting's TruncatedSubsampledGaussianDpEvent (upper bound),
and reference numbers computed independently with dp-accounting 0.6.
"""

import json
import math

import numpy as np
import pytest
from dp_accounting import NeighboringRelation
from dp_accounting.pld import privacy_loss_distribution as dp_pld
from scipy import integrate, stats

from opacus_structured.accountants.truncated_poisson import TruncatedPoissonAccountant
from opacus_structured.accounting import pld as pld_lib
from opacus_structured.accounting import truncated_poisson as tp
from opacus_structured.schemes.truncated_poisson import TruncatedPoissonScheme

D = 1e-3  # tests/conftest.TEST_DISCRETIZATION


def eps_of(pld, steps, delta=1e-5):
    return pld_lib.epsilon_for_delta(pld_lib.self_compose(pld, steps), delta)


def builtin_eps(n, p, b, sigma, steps, delta=1e-5, relation=NeighboringRelation.ADD_OR_REMOVE_ONE):
    pld = dp_pld.from_truncated_subsampled_gaussian_mechanism(
        n, p, b, sigma, value_discretization_interval=D, neighboring_relation=relation)
    return eps_of(pld, steps, delta)


# ---- binomial terms ----------------------------------------------------------------------------
def test_q_closed_form_equals_literal_sum_reference_table():
    # reference table: (n, p) = (10000, 0.01); q and w2 for B = 100..130.
    expected_q = [0.0092270261, 0.0093803444, 0.0094927172, 0.0096389303, 0.0097253801]
    expected_w2 = [0.513099, 0.320502, 0.169136, 0.0275315, 0.0021679]
    n, p = 10000, 0.01
    for b, q_ref, w2_ref in zip((100, 105, 110, 120, 130), expected_q, expected_w2,
                                 strict=True):
        s = np.arange(b, n)
        w2 = stats.binom.sf(b - 1, n - 1, p)
        literal = p * np.sum(stats.binom.pmf(s, n - 1, p) / w2 * b / (s + 1))
        q = tp.conditional_sampling_probability(n, p, b)
        assert q == pytest.approx(literal, rel=1e-10)
        assert q == pytest.approx(q_ref, abs=1e-10)
        assert tp.truncation_weight(n, p, b) == pytest.approx(w2_ref, rel=1e-5)
        assert q <= p


def test_q_extremes_and_inclusion_probability():
    assert tp.conditional_sampling_probability(1000, 1.0, 100) == pytest.approx(0.1)
    assert tp.truncation_weight(1000, 1.0, 100) == 1.0
    assert tp.truncation_weight(1000, 0.3, 1000) == 0.0
    # inclusion = p w1 + q w2 = E[min(S, B)] / n, by symmetry of the rows
    for n, p, b in ((1000, 0.05, 50), (37, 0.4, 9), (10, 1.0, 3)):
        k = np.arange(0, n + 1)
        e_min = np.sum(np.minimum(k, b) * stats.binom.pmf(k, n, p))
        assert tp.inclusion_probability(n, p, b) == pytest.approx(e_min / n, rel=1e-10)
        assert tp.expected_batch_size(n, p, b) == pytest.approx(e_min, rel=1e-10)


# ---- pessimism against an independent computation --------------------------------------------
def _density(mix):
    """The mixture's density in plain ``math`` from its components (not the library's ``pdf``;
    ~10x faster inside ``quad``, same values to ~1e-16 relative; issue 41)."""
    comps = [(float(m), float(w)) for m, w in zip(mix.means, mix.weights, strict=True)]
    s = float(mix.sigma)
    c = 1.0 / (s * math.sqrt(2.0 * math.pi))
    return lambda x: c * sum(w * math.exp(-0.5 * ((x - m) / s) ** 2) for m, w in comps)


def _quad_delta(branches, eps, reverse=False):
    """H_{e^eps} of the joint (r, x+z) pair by quadrature: sum_r w_r int (p_r - e^eps q_r)_+."""
    total = 0.0
    for w, pair in branches:
        P, Q = (pair.lower, pair.upper) if reverse else (pair.upper, pair.lower)
        P, Q = _density(P), _density(Q)
        lo, hi = pair.x_range()
        def f(x, P=P, Q=Q):
            return max(P(x) - math.exp(eps) * Q(x), 0.0)

        val, _ = integrate.quad(f, lo - 5, hi + 5, points=[0.0, 1.0, 2.0], limit=400,
                                epsabs=1e-13, epsrel=1e-10)
        total += w * val
    return total


@pytest.mark.parametrize("relation", tp.RELATIONS)
def test_one_step_pld_upper_bounds_exact_mixture_and_is_close(relation):
    n, p, b, sigma = 1000, 0.05, 55, 0.8
    pld = tp.truncated_poisson_pld(n, p, b, sigma, relation, discretization=D)
    branches = tp.branch_pairs(n, p, b, sigma, relation)
    assert len(branches) == 2 and branches[1][0] == pytest.approx(tp.truncation_weight(n, p, b))
    eps_grid = np.linspace(-0.5, 3.0, 12)
    for reverse, pmf in ((False, pld._pmf_remove), (True, getattr(pld, "_pmf_add", None))):
        pmf = pmf if pmf is not None else pld._pmf_remove  # symmetric (replace-one)
        for e in eps_grid:
            exact = sum(w * (pair.reversed() if reverse else pair).delta(e) for w, pair in branches)
            got = pmf.get_delta_for_epsilon(float(e))
            assert got >= exact - 1e-12, (relation, reverse, e)
            assert got <= exact + 2e-3 * max(exact, 1e-6) + 1e-9, (relation, reverse, e)
        for e in (0.0, 1.3):  # scipy quadrature, independent of MixturePair's solver
            quad = _quad_delta(branches, e, reverse)
            assert pmf.get_delta_for_epsilon(e) >= quad - 1e-9
            assert pmf.get_delta_for_epsilon(e) <= quad * (1 + 2e-3) + 1e-9


@pytest.mark.parametrize("relation", tp.RELATIONS)
def test_composed_epsilon_matches_independent_profile_route(relation):
    # dp_accounting branch PLDs mixed vs our exact joint profile discretised once.
    n, p, b, sigma, steps = 1000, 0.05, 60, 1.0, 50
    ours = eps_of(tp.truncated_poisson_pld(n, p, b, sigma, relation, discretization=D), steps)
    remove, add = tp.truncated_poisson_profiles(n, p, b, sigma, relation)
    other = eps_of(pld_lib.pld_from_profile(remove, add, discretization=D), steps)
    assert ours == pytest.approx(other, abs=3e-3)


# ---- acceptance relations ----------------------------------------------------------------------
# The default run keeps B = 65; B = 50 (3 s, the same three relations) runs in CI's slow step
# (issue 41: README command <= 5 min).
@pytest.mark.parametrize("b", [pytest.param(50, marks=pytest.mark.slow), 65])
def test_never_above_dp_accounting_event(b):
    n, p, sigma, steps = 1000, 0.05, 1.0, 10
    for relation, builtin_rel in (("add-remove", NeighboringRelation.ADD_OR_REMOVE_ONE),
                                  ("zero-out", NeighboringRelation.REPLACE_SPECIAL),
                                  ("replace-one", NeighboringRelation.REPLACE_ONE)):
        ours = tp.truncated_poisson_epsilon(n, p, b, sigma, steps, 1e-5, relation,
                                            discretization=D)
        ref = builtin_eps(n, p, b, sigma, steps, relation=builtin_rel)
        assert ours <= ref + 1e-9, (relation, b)


def test_order_ar_le_zo_le_ro_and_monotone_in_b_towards_poisson():
    n, p, sigma, steps = 1000, 0.05, 1.0, 10
    prev = math.inf
    poisson = tp.poisson_epsilon(p, sigma, steps, 1e-5, discretization=D)
    for b in (50, 65, 80, 100):
        e = {r: tp.truncated_poisson_epsilon(n, p, b, sigma, steps, 1e-5, r, discretization=D)
             for r in tp.RELATIONS}
        assert e["add-remove"] <= e["zero-out"] + 1e-9 <= e["replace-one"] + 2e-9
        assert poisson - 1e-9 <= e["add-remove"] <= prev
        prev = e["add-remove"]
    assert prev == pytest.approx(poisson, abs=1e-6)


@pytest.mark.parametrize("relation", tp.RELATIONS)
def test_b_equals_n_is_plain_poisson(relation):
    pld = tp.truncated_poisson_pld(200, 0.1, 200, 1.0, relation, discretization=D)
    ref = tp.poisson_pld(0.1, 1.0, relation, discretization=D)
    assert eps_of(pld, 30) == eps_of(ref, 30)
    # also when the truncation weight underflows (B far above n p)
    big = tp.truncated_poisson_pld(10000, 0.01, 400, 1.0, relation, discretization=D)
    assert tp.truncation_weight(10000, 0.01, 400) < 1e-100
    # abs 1e-7: each ε is read at δ minus its own composition's round-off floor (numerics.py)
    assert eps_of(big, 30) == pytest.approx(
        eps_of(tp.poisson_pld(0.01, 1.0, relation, discretization=D), 30), abs=1e-7)


def test_p_one_is_sensitivity_two_poisson_at_rate_b_over_n():
    # always truncate -> fixed-size sampling; Thm 3.1 = sens-2 Poisson at
    # rate B/n (add/remove, tight); replace-one = the +-2 pair; dp_accounting uses the +-2 pair.
    n, b, sigma = 1000, 100, 2.0
    ar = tp.truncated_poisson_pld(n, 1.0, b, sigma, discretization=D)
    ref = dp_pld.from_gaussian_mechanism(sigma, sensitivity=2, sampling_prob=b / n,
                                         value_discretization_interval=D)
    for e in (0.0, 0.5, 1.0, 2.0):
        assert ar.get_delta_for_epsilon(e) == pytest.approx(ref.get_delta_for_epsilon(e),
                                                            rel=1e-12, abs=1e-15)
    assert eps_of(ar, 1) == pytest.approx(1.68454, abs=1e-3)  # reference value
    ro = tp.truncated_poisson_pld(n, 1.0, b, sigma, "replace-one", discretization=D)
    ro_ref = dp_pld.from_gaussian_mechanism(sigma / 2, sampling_prob=b / n,
                                            value_discretization_interval=D,
                                            neighboring_relation=NeighboringRelation.REPLACE_ONE)
    assert eps_of(ro, 1) == pytest.approx(eps_of(ro_ref, 1), abs=1e-12)
    assert builtin_eps(n, 1.0, b, sigma, 1) == pytest.approx(1.78915, abs=1e-3)  # §8.3


def test_tight_never_above_baseline():
    n, p, sigma, steps = 1000, 0.05, 1.0, 100
    for b in (80, 90, 110, 130):
        tight = tp.truncated_poisson_epsilon(n, p, b, sigma, steps, 1e-5, discretization=D)
        base = tp.truncated_poisson_epsilon(n, p, b, sigma, steps, 1e-5, analysis="baseline",
                                            discretization=D)
        assert tight <= base + 1e-7  # the two compositions' round-off floors differ (~1e-8)


def test_baseline_is_feasible_and_smallest_on_grid():
    n, p, b, sigma, steps, delta = 10000, 0.01, 170, 1.0, 200, 1e-5
    poisson = pld_lib.self_compose(tp.poisson_pld(p, sigma, discretization=D), steps)
    eta = tp.truncation_eta(n, p, b, steps)
    assert 0 < eta <= steps * stats.binom.sf(b, n, p)
    eps = tp.baseline_epsilon(poisson, eta, delta)
    # feasibility: Poisson is (eps, delta - e^eps eta)-DP, hence truncated is (eps, delta)-DP
    assert pld_lib.delta_for_epsilon(poisson, eps) + math.exp(eps) * eta <= delta * (1 + 1e-9)
    assert tp.baseline_delta(poisson, eta, eps) <= delta * (1 + 1e-9)
    # one grid step lower is infeasible
    assert tp.baseline_delta(poisson, eta, eps - 2 * D) > delta
    assert tp.baseline_epsilon(poisson, 1e-3, delta) == math.inf


# ---- reference numbers ---------------------------------------------------------------------------
def test_reference_single_step():
    n, p, b = 1000, 0.05, 60
    assert tp.truncated_poisson_epsilon(n, p, b, 1.0, 1, 1e-5, discretization=D) == \
        pytest.approx(3.96098, abs=1e-3)
    assert builtin_eps(n, p, b, 1.0, 1) == pytest.approx(4.00916, abs=1e-3)
    assert tp.poisson_epsilon(p, 1.0, 1, 1e-5, discretization=D) == pytest.approx(1.03279,
                                                                                 abs=1e-3)


# The default run keeps B = 50 (the widest gap between the bounds); 60, 70 and 80 (~2 s each,
# the same code path) run in CI's slow step (issue 41: README command <= 5 min).
@pytest.mark.parametrize("b, thm31, builtin_ar, builtin_ro", [
    (50, 13.3597, 14.3911, 14.6796),
    pytest.param(60, 8.5986, 8.8714, 9.5138, marks=pytest.mark.slow),
    pytest.param(70, 5.4435, 5.5016, 6.2744, marks=pytest.mark.slow),
    pytest.param(80, 3.5467, 3.5499, 4.9108, marks=pytest.mark.slow),
])
def test_reference_config_a2(b, thm31, builtin_ar, builtin_ro):
    n, p, sigma, steps = 1000, 0.05, 1.0, 100
    assert tp.truncated_poisson_epsilon(n, p, b, sigma, steps, 1e-5, discretization=D) == \
        pytest.approx(thm31, abs=1e-3)
    assert builtin_eps(n, p, b, sigma, steps) == pytest.approx(builtin_ar, abs=1e-3)
    assert builtin_eps(n, p, b, sigma, steps, relation=NeighboringRelation.REPLACE_ONE) == \
        pytest.approx(builtin_ro, abs=1e-3)
    assert tp.truncated_poisson_epsilon(n, p, b, sigma, steps, 1e-5, "replace-one",
                                        discretization=D) == pytest.approx(builtin_ro, abs=1e-3)
    assert tp.truncated_poisson_epsilon(n, p, b, sigma, steps, 1e-5, analysis="baseline",
                                        discretization=D) == math.inf  # reference: all infeasible


def test_reference_config_a1():
    n, p, sigma, steps = 10000, 0.01, 1.0, 1000
    assert tp.poisson_epsilon(p, sigma, steps, 1e-5, discretization=D) == \
        pytest.approx(1.8282, abs=1e-3)
    for b, thm31 in ((120, 5.2285), (140, 1.9680), (150, 1.8304)):
        assert tp.truncated_poisson_epsilon(n, p, b, sigma, steps, 1e-5, discretization=D) == \
            pytest.approx(thm31, abs=1e-3)
    for b, base in ((160, math.inf), (165, 1.9371), (170, 1.8328), (180, 1.8283)):
        got = tp.truncated_poisson_epsilon(n, p, b, sigma, steps, 1e-5, analysis="baseline",
                                           discretization=D)
        assert got == base if math.isinf(base) else got == pytest.approx(base, abs=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("b, thm31, builtin_ar", [(130, 3.6698, 3.6841)])
def test_reference_config_a1_fine_grid(b, thm31, builtin_ar):
    n, p, sigma, steps = 10000, 0.01, 1.0, 1000
    assert tp.truncated_poisson_epsilon(n, p, b, sigma, steps, 1e-5, discretization=1e-4) == \
        pytest.approx(thm31, abs=1e-3)
    pld = dp_pld.from_truncated_subsampled_gaussian_mechanism(n, p, b, sigma)
    assert eps_of(pld, steps) == pytest.approx(builtin_ar, abs=1e-3)


# ---- overhead helpers -----------------------------------------------------------------------------
def test_smallest_max_batch_size_meets_target_and_is_minimal():
    n, p, sigma, steps, delta, over = 1000, 0.05, 1.0, 50, 1e-5, 0.05
    b = tp.smallest_max_batch_size(n, p, sigma, steps, delta, over, discretization=D)
    ref = tp.poisson_epsilon(p, sigma, steps, delta, discretization=D)
    eps_b = tp.truncated_poisson_epsilon(n, p, b, sigma, steps, delta, discretization=D)
    eps_b1 = tp.truncated_poisson_epsilon(n, p, b - 1, sigma, steps, delta, discretization=D)
    assert eps_b <= 1.05 * ref < eps_b1
    assert 70 < b < 90  # reference: overhead ~ 1% at B = 80, ~56% at B = 70


def test_largest_sample_rate_meets_target():
    n, b, sigma, steps, delta, over = 1000, 60, 1.0, 20, 1e-5, 0.1
    p = tp.largest_sample_rate(n, b, sigma, steps, delta, over, rtol=1e-2, discretization=D)
    eps = tp.truncated_poisson_epsilon(n, p, b, sigma, steps, delta, discretization=D)
    assert eps <= 1.1 * tp.poisson_epsilon(p, sigma, steps, delta, discretization=D)
    p_up = p * 1.02
    eps_up = tp.truncated_poisson_epsilon(n, p_up, b, sigma, steps, delta, discretization=D)
    assert eps_up > 1.1 * tp.poisson_epsilon(p_up, sigma, steps, delta, discretization=D)
    assert 0.02 < p < 0.06
    assert tp.largest_sample_rate(100, 100, 1.0, 10, 1e-5, 0.0, discretization=D) == 1.0


# ---- validation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(dataset_size=100, sample_rate=0.1, max_batch_size=0), "max_batch_size"),
    (dict(dataset_size=100, sample_rate=0.1, max_batch_size=101), "max_batch_size"),
    (dict(dataset_size=100, sample_rate=0.0, max_batch_size=10), "sample_rate"),
    (dict(dataset_size=100, sample_rate=1.5, max_batch_size=10), "sample_rate"),
    (dict(dataset_size=100, sample_rate=float("nan"), max_batch_size=10), "sample_rate"),
    (dict(dataset_size=0, sample_rate=0.1, max_batch_size=1), "dataset_size"),
    (dict(dataset_size=10.5, sample_rate=0.1, max_batch_size=1), "dataset_size"),
    (dict(dataset_size=100, sample_rate=0.1, max_batch_size=2.5), "max_batch_size"),
    (dict(dataset_size=100, sample_rate=0.1, max_batch_size=10, relation="swap"), "relation"),
    (dict(dataset_size=100, sample_rate=0.1, max_batch_size=10, analysis="rdp"), "analysis"),
    (dict(dataset_size=100, sample_rate=0.1, max_batch_size=10, epoch_steps=0), "epoch_steps"),
])
def test_bad_input_raises_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TruncatedPoissonScheme(**kwargs)


def test_bad_input_functions():
    with pytest.raises(ValueError, match="noise_multiplier"):
        tp.truncated_poisson_pld(100, 0.1, 10, 0.0)
    with pytest.raises(ValueError, match="delta"):
        tp.truncated_poisson_epsilon(100, 0.1, 10, 1.0, 5, 1.0)
    with pytest.raises(ValueError, match="max_overhead"):
        tp.smallest_max_batch_size(100, 0.1, 1.0, 5, 1e-5, -0.1)
    with pytest.raises(ValueError, match="analysis"):
        tp.truncated_poisson_epsilon(100, 0.1, 10, 1.0, 5, 1e-5, analysis="x")
    with pytest.raises(ValueError, match="eta"):
        tp.baseline_epsilon(None, 2.0, 1e-5)


# ---- scheme, accountant, CLI ---------------------------------------------------------------------
def test_scheme_basics_and_serialisation():
    s = TruncatedPoissonScheme(1000, 0.05, 60)
    assert s.steps_per_epoch() == 20 and s.expected_sample_rate() == pytest.approx(0.05)
    assert TruncatedPoissonScheme(1000, 0.03, 60).steps_per_epoch() == 33
    assert TruncatedPoissonScheme(1000, 0.05, 60, epoch_steps=7).expected_sample_rate() == 1 / 7
    assert TruncatedPoissonScheme.from_dict(s.to_dict()) == s
    assert s.epsilon(1.0, 1, 1e-5, discretization=D) == pytest.approx(3.96098, abs=1e-3)
    assert s.epsilon(1.0, 0, 1e-5) == 0.0
    with pytest.raises(ValueError, match="sample_rate"):
        s.epsilon(1.0, 1, 1e-5, sample_rate=0.5, discretization=D)
    base = TruncatedPoissonScheme(1000, 0.05, 60, analysis="baseline")
    with pytest.raises(ValueError, match="baseline"):
        base.pld(1.0)
    d = s.delta(1.0, 1, 3.96, discretization=D)
    assert 1e-5 <= d < 1.1e-5


@pytest.mark.parametrize("analysis", ["tight", "baseline"])
def test_accountant_matches_scheme_and_round_trips(analysis):
    s = TruncatedPoissonScheme(10000, 0.01, 170, analysis=analysis)
    acc = TruncatedPoissonAccountant(s, discretization=D)
    hook_rate = 1 / s.steps_per_epoch()
    acc.step(noise_multiplier=1.0, sample_rate=hook_rate, num_steps=150)
    acc.step(noise_multiplier=1.2, sample_rate=hook_rate, num_steps=50)
    assert len(acc) == 200
    eps = acc.get_epsilon(1e-5)
    ref = s.epsilon_for_segments([(1.0, 150), (1.2, 50)], 1e-5, discretization=D)
    assert eps == ref and math.isfinite(eps)
    assert acc.get_delta(eps) <= 1e-5 * (1 + 1e-6)
    assert acc.get_privacy_spent(delta=1e-5) == (eps, "upper")
    restored = TruncatedPoissonAccountant(s, discretization=D)
    restored.load_state_dict(acc.state_dict())
    assert restored.history == acc.history and restored.get_epsilon(1e-5) == eps
    other = TruncatedPoissonAccountant(TruncatedPoissonScheme(10000, 0.01, 160,
                                                              analysis=analysis),
                                       discretization=D)
    if analysis == "tight":  # another B at a resume: a new phase (issue 46), composed
        other.load_state_dict(acc.state_dict())
        assert len(other.phases) == 1 and other.total_steps == 200
        assert other.get_epsilon(1e-5) >= eps * (1 - 1e-9)
    else:  # the baseline has no PLD to compose: refused, naming the cause
        with pytest.raises(ValueError, match="baseline"):
            other.load_state_dict(acc.state_dict())
    with pytest.raises(ValueError, match="sample_rate"):
        acc.step(noise_multiplier=1.0, sample_rate=0.5)


def test_accountant_needs_a_scheme_and_registers_with_opacus():
    from opacus.accountants.registry import _ACCOUNTANTS

    from opacus_structured.accountants import register_scheme_accountant
    from opacus_structured.accountants.base import UnboundAccountantError

    # registered under its bare name *unbound* (Opacus' registry builds accountants without
    # arguments): it refuses to price, naming opacus_structured.make_private; scheme-bound names
    # price their scheme
    assert _ACCOUNTANTS["truncated-poisson"] is TruncatedPoissonAccountant
    unbound = TruncatedPoissonAccountant()
    assert unbound.scheme is None
    unbound.history = [(1.0, 0.05, 10)]
    with pytest.raises(UnboundAccountantError, match="opacus_structured.make_private"):
        unbound.get_epsilon(1e-5)
    from opacus_structured.schemes.poisson import PoissonScheme

    with pytest.raises(ValueError, match="TruncatedPoissonScheme"):
        TruncatedPoissonAccountant(PoissonScheme(0.05))  # another scheme: refused
    scheme = TruncatedPoissonScheme(1000, 0.05, 70)
    cls = register_scheme_accountant("truncated-poisson-test", scheme,
                                     base=TruncatedPoissonAccountant)
    acc = cls(discretization=D)
    assert isinstance(acc, TruncatedPoissonAccountant) and acc.scheme == scheme
    assert _ACCOUNTANTS["truncated-poisson-test"] is cls


def test_cli_epsilon_and_bad_flags(capsys):
    from opacus_structured.cli import main

    rc = main(["epsilon", "truncated-poisson", "--dataset-size", "1000", "--sample-rate", "0.05",
               "--max-batch-size", "60", "--noise-multiplier", "1", "--steps", "1",
               "--delta", "1e-5", "--discretization", "1e-3", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["epsilon"] == pytest.approx(3.96098, abs=1e-3)
    assert out["parameters"]["relation"] == "add-remove"
    rc = main(["epsilon", "truncated-poisson", "--dataset-size", "10", "--sample-rate", "0.05",
               "--max-batch-size", "60", "--noise-multiplier", "1", "--steps", "1",
               "--delta", "1e-5"])
    assert rc == 2
    assert "max_batch_size" in capsys.readouterr().err
