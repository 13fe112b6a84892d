"""Accounting core against independent oracles: closed forms, quadrature, dp_accounting."""

import math

import numpy as np
import pytest
from conftest import default_subset
from dp_accounting.pld import privacy_loss_distribution as dpl
from dp_accounting.pld import privacy_loss_mechanism as plm
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate, special, stats

from opacus_structured.accounting import (
    PERFECT_PRIVACY,
    MixturePair,
    PairProfile,
    SwitchingProfile,
    WeightedProfile,
    calibrate_noise_multiplier,
    delta_for_epsilon,
    epsilon_for_delta,
    gaussian_delta,
    gdp_delta,
    gdp_epsilon,
    gdp_mu,
    pld_from_profile,
    self_compose,
)
from opacus_structured.accounting.calibration import CalibrationError

D = 1e-3


def _mixture_pdf(mix):
    """The density of ``Σ w_i N(m_i, σ²)`` in plain ``math`` from the mixture's components (not
    the library's ``pdf``; ~100x faster than numpy scalar calls inside ``quad``, same values to
    1e-14)."""
    comps = [(float(m), float(w)) for m, w in zip(mix.means, mix.weights, strict=True)]
    s = float(mix.sigma)
    c = 1.0 / (s * math.sqrt(2.0 * math.pi))
    return lambda x: c * sum(w * math.exp(-0.5 * ((x - m) / s) ** 2) for m, w in comps)


def quad_hockey_stick(pair, eps):
    """Numerical integration of max(p - e^eps q, 0): an oracle independent of the solver."""
    lo, hi = pair.x_range()
    p, q, scale = _mixture_pdf(pair.upper), _mixture_pdf(pair.lower), math.exp(eps)

    def f(x):
        return max(p(x) - scale * q(x), 0.0)

    pts = np.linspace(lo, hi, 41)
    return sum(integrate.quad(f, a, b, limit=200, epsabs=1e-16, epsrel=1e-12)[0]
               for a, b in zip(pts[:-1], pts[1:], strict=True))


class TestGaussianClosedForms:
    def test_gdp_reference_values(self):
        # reference values (individual GDP): delta(eps=1; mu=1), eps(delta=1e-5; mu=1)
        assert gdp_delta(1.0, 1.0) == pytest.approx(0.12693673750664386, abs=1e-12)
        assert gdp_epsilon(1e-5, 1.0) == pytest.approx(4.377178, abs=2e-6)

    def test_gdp_delta_matches_dp_accounting_gaussian(self):
        eps = np.linspace(-2, 6, 33)
        for sigma in [0.5, 1.0, 3.0]:
            ref = plm.GaussianPrivacyLoss(sigma, 1.0).get_delta_for_epsilon(eps)
            np.testing.assert_allclose(gaussian_delta(eps, sigma), ref, atol=1e-12, rtol=1e-9)

    def test_gaussian_q1_pld_within_1e6_of_closed_form(self):
        # q = 1: the Poisson PLD is the plain Gaussian; delta(eps) within 1e-6 (issue 2).
        pair = MixturePair.from_components([1.0], [1.0], [0.0], [1.0], 1.0)
        pld = pld_from_profile(PairProfile(pair), PairProfile(pair.reversed()),
                               discretization=1e-4)
        for eps in [0.0, 0.5, 1.0, 2.0, 4.0]:
            assert delta_for_epsilon(pld, eps) == pytest.approx(gdp_delta(eps, 1.0), abs=1e-6)
            assert delta_for_epsilon(pld, eps) >= gdp_delta(eps, 1.0) - 1e-12  # pessimistic

    @given(mu=st.floats(0.05, 8.0), eps=st.floats(0.0, 20.0))
    @settings(max_examples=60, deadline=None)
    def test_gdp_mu_round_trip(self, mu, eps):
        delta = gdp_delta(eps, mu)
        if not 1e-300 < delta < 1:
            return
        assert gdp_mu(eps, delta) == pytest.approx(mu, rel=1e-9, abs=1e-12)

    @given(mu=st.floats(0.05, 8.0), delta=st.floats(1e-12, 0.5))
    @settings(max_examples=60, deadline=None)
    def test_gdp_epsilon_is_sound_and_inverse(self, mu, delta):
        eps = gdp_epsilon(delta, mu)
        assert gdp_delta(eps, mu) <= delta
        if eps > 0:
            assert gdp_delta(eps, mu) == pytest.approx(delta, rel=1e-6)

    @pytest.mark.parametrize("bad", [dict(delta=0.0, mu=1.0), dict(delta=1.0, mu=1.0),
                                     dict(delta=float("nan"), mu=1.0),
                                     dict(delta=1e-5, mu=-1.0)])
    def test_bad_input(self, bad):
        with pytest.raises(ValueError, match="delta|mu"):
            gdp_epsilon(**bad)


@pytest.mark.float_sensitive
def test_mixture_logsumexp_is_scipys_bit_for_bit():
    # mixture.py's logsumexp (issue 41: ~3x faster, no array-API dispatch) must be scipy's own
    # result for positive weights: bit for bit on scipy >= 1.15 (the same operations), to
    # double precision before. Random terms over 40 orders of magnitude, ties at the maximum,
    # -inf / +inf / NaN entries, scalar, vector and matrix shapes; and the densities themselves.
    import scipy

    from opacus_structured.accounting import mixture as mx

    exact = tuple(int(v) for v in scipy.__version__.split(".")[:2]) >= (1, 15)
    rng = np.random.default_rng(5)
    for trial in range(1500):
        k = int(rng.integers(1, 7))
        shape = tuple(int(v) for v in rng.integers(1, 5, size=trial % 3)) + (k,)
        a = rng.normal(scale=10.0 ** rng.uniform(-3, 3), size=shape)
        if trial % 5 == 0:
            a[..., :] = a[..., :1]  # ties
        if trial % 7 == 0:
            a.flat[int(rng.integers(a.size))] = (-np.inf, np.inf, np.nan)[trial % 3]
        b = rng.random(k) + 1e-3
        b /= b.sum()
        ours, ref = mx._logsumexp_last(a, b), special.logsumexp(a, b=b, axis=-1)
        assert np.shape(ours) == np.shape(ref) and type(ours) is type(ref)
        if exact:  # the same numpy calls as scipy's, in one process: one float path
            assert np.array_equal(ours, ref, equal_nan=True), (a, b)
        else:
            np.testing.assert_allclose(ours, ref, rtol=1e-15, atol=0)
    pair = MixturePair.from_components([0.0, 1.0, 3.0], [0.7, 0.2, 0.1], [0.0], [1.0], 0.9)
    x = np.linspace(-40.0, 40.0, 2001)
    z = (x[:, None] - pair.upper.means) / pair.upper.sigma
    ref = special.logsumexp(-0.5 * z * z, b=pair.upper.weights, axis=-1) - math.log(
        0.9 * math.sqrt(2 * math.pi))
    assert np.array_equal(pair.upper.logpdf(x), ref) if exact else np.allclose(
        pair.upper.logpdf(x), ref, rtol=1e-15, atol=0)
    assert pair.upper.logpdf(0.5) == pytest.approx(math.log(_mixture_pdf(pair.upper)(0.5)),
                                                   rel=1e-14)


class TestMixturePair:
    @pytest.mark.parametrize("sigma,q", [(1.0, 0.01), (0.6, 0.3), (2.0, 1.0)])
    @pytest.mark.parametrize("eps", [-1.0, -0.1, 0.0, 0.1, 1.0, 3.0])
    def test_one_sided_against_quadrature(self, sigma, q, eps):
        pair = MixturePair.from_components([0, 2], [1 - q, q], [0], [1], sigma)
        assert pair.delta(eps) == pytest.approx(quad_hockey_stick(pair, eps), rel=1e-6, abs=1e-13)
        rev = pair.reversed()
        assert rev.delta(eps) == pytest.approx(quad_hockey_stick(rev, eps), rel=1e-6, abs=1e-13)

    @pytest.mark.parametrize("sigma,q", [(1.0, 64 / 60000), (0.6, 0.3), (2.0, 1.0), (0.5, 0.999)])
    def test_closed_form_threshold_is_the_solver_s(self, sigma, q):
        """Issue 46: the Poisson pair's threshold in closed form (what makes its one-step PLD
        ~20x cheaper) against the bracketing + Newton solver on the same grid of ε, both
        directions: the same set up to rounding, the same δ up to a few ulps."""
        for pair in (MixturePair.from_components([1.0, 0.0], [q, 1 - q], [0.0], [1.0], sigma),
                     MixturePair.from_components([0.0], [1.0], [1.0, 0.0], [q, 1 - q], sigma)):
            assert pair._closed is not None
            lo, hi = pair.loss_range()
            eps = np.linspace(lo, hi, 1001)[1:-1]
            closed_x, closed_d = pair._threshold(eps), pair.delta(eps)
            object.__setattr__(pair, "_closed", None)  # the general solver
            np.testing.assert_allclose(closed_x, pair._threshold(eps), rtol=1e-9, atol=1e-9)
            np.testing.assert_allclose(closed_d, pair.delta(eps), rtol=0, atol=5e-16)
        three = MixturePair.from_components([0.0, 1.0, 2.0], [0.8, 0.1, 0.1], [0.0], [1.0], 1.0)
        assert three._closed is None  # no closed form: the solver

    @pytest.mark.parametrize("eps", [-0.5, 0.0, 0.5, 2.0])
    def test_double_mixture_against_quadrature(self, eps):
        mu = np.arange(6.0)
        p = stats.binom.pmf(np.arange(6), 5, 0.2)
        pair = MixturePair.from_components(-mu, p, mu, p, 1.3)
        assert pair.delta(eps) == pytest.approx(quad_hockey_stick(pair, eps), rel=1e-6, abs=1e-13)

    def test_matches_dp_accounting_mixture_loss(self):
        # dp_accounting's MixtureGaussianPrivacyLoss (REMOVE) as a peer on a 3-component mixture
        sens, probs, sigma = [0.0, 1.0, 2.0], [0.81, 0.18, 0.01], 1.1
        ref = plm.MixtureGaussianPrivacyLoss(sigma, sens, probs,
                                             adjacency_type=plm.AdjacencyType.REMOVE)
        ours = MixturePair.from_components(sens, probs, [0.0], [1.0], sigma)
        eps = np.linspace(0, 5, 11)
        np.testing.assert_allclose(ours.delta(eps), ref.get_delta_for_epsilon(eps),
                                   rtol=1e-7, atol=1e-14)

    def test_closed_form_sanity_values(self):
        # closed-form sanity values (sigma=1, q=0.01)
        pair = MixturePair.from_components([0, 2], [0.99, 0.01], [0], [1], 1.0)
        prof = SwitchingProfile(pair)
        expect = {0.0: 0.0068269, 0.1: 2.6080e-3, 0.5: 7.1936e-4, 1.0: 2.7364e-4,
                  2.0: 5.3967e-5, -0.1: 0.097522}
        for eps, d in expect.items():
            assert prof.delta(eps) == pytest.approx(d, rel=1e-4)

    def test_rejects_overlapping_means(self):
        with pytest.raises(ValueError, match="separated"):
            MixturePair.from_components([-1, 1], [0.5, 0.5], [0], [1], 1.0)

    def test_rejects_bad_weights_and_sigma(self):
        with pytest.raises(ValueError, match="sum to 1"):
            MixturePair.from_components([0, 1], [0.5, 0.6], [0], [1], 1.0)
        with pytest.raises(ValueError, match="sigma"):
            MixturePair.from_components([0, 1], [0.5, 0.5], [0], [1], 0.0)

    @given(q=st.floats(1e-4, 1.0), sigma=st.floats(0.4, 5.0), eps=st.floats(-3, 8))
    @settings(max_examples=50, deadline=None)
    def test_profile_identity_and_bounds(self, q, sigma, eps):
        # H_a(Q||P) = 1 - a + a H_{1/a}(P||Q) (standard identity), and max(0,1-e^eps) <= delta <= 1
        pair = MixturePair.from_components([1.0, 0.0], [q, 1 - q], [0.0], [1.0], sigma)
        a = math.exp(eps)
        lhs = pair.reversed().delta(eps)
        rhs = 1 - a + a * pair.delta(-eps)
        assert lhs == pytest.approx(rhs, abs=1e-9 * max(1.0, a))
        assert max(0.0, 1 - a) - 1e-12 <= pair.delta(eps) <= 1.0


#: steps x q x σ grid (27 cases). The default run keeps a 3 x 3 Latin square (9 cases: every
#: level of each factor three times, every pair of levels of two factors once, so 10^4 steps
#: at q = 0.1 and one step at q = 10^-3 are both in); the other 18 are ``slow`` (issue 41).
_POISSON_GRID = [(steps, q, sigma) for steps in (1, 100, 10_000) for q in (0.001, 0.01, 0.1)
                 for sigma in (0.6, 1.0, 2.0)]
_POISSON_LEVELS = ((1, 100, 10_000), (0.001, 0.01, 0.1), (0.6, 1.0, 2.0))
_POISSON_LATIN = [(_POISSON_LEVELS[0][(i + 2 * j) % 3], _POISSON_LEVELS[1][j],
                   _POISSON_LEVELS[2][i]) for i in range(3) for j in range(3)]


class TestPLD:
    @pytest.mark.parametrize("steps, q, sigma", default_subset(_POISSON_GRID, _POISSON_LATIN))
    def test_poisson_vs_dp_accounting(self, sigma, q, steps):
        pair = MixturePair.from_components([1.0, 0.0], [q, 1 - q], [0.0], [1.0], sigma)
        ours = pld_from_profile(PairProfile(pair), PairProfile(pair.reversed()), discretization=D)
        ref = dpl.from_gaussian_mechanism(sigma, sampling_prob=q, value_discretization_interval=D)
        e_ours = epsilon_for_delta(self_compose(ours, steps), 1e-5)
        e_ref = epsilon_for_delta(self_compose(ref, steps), 1e-5)
        assert e_ours == pytest.approx(e_ref, rel=1e-3)

    def test_weighted_profile_with_perfect_privacy(self):
        # (1-rho) max(0, 1-e^eps) + rho H: at eps >= 0 it is rho * H (Theorem F.1 shape)
        pair = MixturePair.from_components([2.0, 0.0], [0.1, 0.9], [0.0], [1.0], 1.0)
        prof = WeightedProfile([0.7, 0.3], [PERFECT_PRIVACY, PairProfile(pair)])
        assert prof.delta(0.5) == pytest.approx(0.3 * pair.delta(0.5), rel=1e-12)
        assert prof.delta(-0.5) == pytest.approx(
            0.7 * (1 - math.exp(-0.5)) + 0.3 * pair.delta(-0.5), rel=1e-12)

    def test_pld_is_pessimistic(self):
        pair = MixturePair.from_components([0, 2], [0.9, 0.1], [0], [1], 1.0)
        pld = pld_from_profile(SwitchingProfile(pair), discretization=1e-2)
        eps = np.linspace(-1, 4, 26) + 0.0037  # off-grid: interpolation must stay above
        exact = SwitchingProfile(pair).delta(eps)
        assert np.all(delta_for_epsilon(pld, eps) >= exact * (1 - 1e-12))

    def test_zero_compositions(self):
        assert self_compose(None or pld_from_profile(PERFECT_PRIVACY), 0) is None
        assert epsilon_for_delta(None, 1e-5) == 0.0


class TestCalibration:
    def test_gaussian_calibration_is_sound(self):
        def f(s):
            return gdp_epsilon(1e-5, 1.0 / s)

        sigma = calibrate_noise_multiplier(f, 1.0, rtol=1e-4)
        assert f(sigma) <= 1.0
        assert f(sigma * (1 - 2e-4)) > 1.0 - 1e-2

    @pytest.mark.parametrize("target", [0.05, 1.0, 8.0])
    def test_scaled_start_keeps_the_contract_with_fewer_costly_evaluations(self, target):
        """``initial="scaled"`` (the forecast job's first-run search, issue 41): the same
        contract as doubling from σ = 1 (ε(σ) ≤ target < ε(σ(1 - rtol))), checked against the
        closed-form GDP ε of a composed Gaussian (64 steps), with every evaluation within
        a factor 2 of the answer (small σ, whose PLDs are wide, are the costly ones)."""
        steps = 64

        def f(s):
            return gdp_epsilon(1e-7, math.sqrt(steps) / s)

        asked = {"scaled": [], 1.0: []}
        sigmas = {}
        for initial, seen in asked.items():
            sigmas[initial] = calibrate_noise_multiplier(
                f, target, rtol=1e-2, initial=initial, progress=lambda s, e, seen=seen:
                seen.append(s))
        for sigma in sigmas.values():
            assert f(sigma) <= target < f(sigma * (1 - 1e-2))
        scaled = [s for s in asked["scaled"] if s < 1e4]  # 1e4: the reachability check
        assert all(sigmas["scaled"] / 2 < s < 2 * sigmas["scaled"] for s in scaled)
        assert len(asked["scaled"]) < len(asked[1.0])
        assert len(set(asked[1.0])) == len(asked[1.0])  # each σ evaluated once (remembered)

    def test_scaled_start_falls_back_and_refuses_what_doubling_refuses(self):
        # ε(σ_max) = 0 gives no guess: the doubling search from σ = 1 runs instead
        def step(s):
            return 0.0 if s > 100 else 2.0 / s

        assert calibrate_noise_multiplier(step, 1.0, rtol=1e-3, initial="scaled") == \
            calibrate_noise_multiplier(step, 1.0, rtol=1e-3)
        with pytest.raises(CalibrationError, match="target_epsilon"):
            calibrate_noise_multiplier(lambda s: 10.0, 1.0, initial="scaled")
        # the smallest σ searched already meets the target: returned as is
        assert calibrate_noise_multiplier(lambda s: 1e-4 / s, 1.0, initial="scaled",
                                          min_sigma=1e-3, max_sigma=10.0) == 1e-3
        with pytest.raises(ValueError, match="initial"):
            calibrate_noise_multiplier(lambda s: 1.0 / s, 1.0, initial="guess")

    def test_unreachable_target(self):
        with pytest.raises(CalibrationError, match="target_epsilon"):
            calibrate_noise_multiplier(lambda s: 10.0, 1.0)

    def test_bad_target(self):
        with pytest.raises(ValueError, match="target_epsilon"):
            calibrate_noise_multiplier(lambda s: 1.0, -1.0)
