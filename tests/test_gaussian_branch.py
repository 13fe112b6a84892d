"""The vectorised Gaussian branch builder is dp_accounting's ``from_gaussian_mechanism``
(connect-the-dots, pessimistic), to within the rounding of its transcendental functions (issue
41: truncated Poisson's default B; issue 46: on every CPU).

Our inverse privacy loss runs numpy's array ``log`` / ``exp`` / ``log1p`` / ``logaddexp``;
dp_accounting's runs ``math``'s scalar ones. On an AVX2 CPU numpy calls the C library, so the
two agree bit for bit; on AVX-512 numpy uses its own SIMD code, whose last bits differ (an
Intel Xeon: 220 PMF entries of the replace-one pair at σ = 0.7 differ, by up to 4.4e-13). The
tests therefore bound the difference (:data:`DELTA_ATOL`, :data:`PMF_ATOL`) and bracket ε by
dp_accounting's own ε at δ ± the largest hockey-stick difference the two PMFs allow."""

import math

import numpy as np
import pytest
from dp_accounting import NeighboringRelation as NR
from dp_accounting.pld import privacy_loss_distribution as dp_pld
from dp_accounting.pld import privacy_loss_mechanism as plm

from opacus_structured.accounting import gaussian_branch as gb
from opacus_structured.accounting import numerics

pytestmark = pytest.mark.float_sensitive

#: |ours - dp_accounting's| for a grid δ_k = μ_upper(x) - e^ε μ_lower(x) (two terms in [0, 2]):
#: each side rounds the CDFs, the product and the difference (<= 8 u, u = 2^-53), and their x
#: differ by a few ulp, to which δ is insensitive to first order (x is where the densities of
#: μ_upper and e^ε μ_lower cross); 16 u in all (seen: 1 u on an Intel Xeon with AVX-512, 0 on
#: an AMD with AVX2).
DELTA_ATOL = 16 * 2.0 ** -53
#: The connect-the-dots probability p_k = (Δδ_k - e^d Δδ_{k-1}) / (e^d - 1) moves by at most
#: (2 + 2 e^d) / (e^d - 1) times a δ error: ~4 DELTA_ATOL / d = 7.1e-12 at d = 1e-3 (seen 4.4e-13).
D = 1e-3
PMF_ATOL = (2 + 2 * math.exp(D)) / math.expm1(D) * DELTA_ATOL
#: dp_accounting's self_compose truncation (a pessimistic move to infinity, per direction).
TAIL = 1e-15

# The default run keeps each relation, sensitivity 2 and q = 1 once (issue 41: README command
# <= 5 min); σ = 0.5 and replace-one at sensitivity 2 run in CI's slow step.
CASES = [  # (sigma, sensitivity, q, relation)
    (1.0, 1.0, 0.1, NR.ADD_OR_REMOVE_ONE),
    (1.0, 2.0, 0.0834, NR.ADD_OR_REMOVE_ONE),
    pytest.param(0.5, 1.0, 0.01, NR.ADD_OR_REMOVE_ONE, marks=pytest.mark.slow),
    (2.0, 1.0, 1.0, NR.ADD_OR_REMOVE_ONE),
    (0.7, 1.0, 0.3, NR.REPLACE_ONE),
    pytest.param(1.0, 2.0, 0.05, NR.REPLACE_ONE, marks=pytest.mark.slow),
    pytest.param(1.0, 2.0, 1.0, NR.REPLACE_ONE, marks=pytest.mark.slow),
    (1.3, 1.0, 0.2, NR.REPLACE_SPECIAL),
]


def _pmfs(pld):
    return [(pmf._lower_loss, pmf._probs, pmf._infinity_mass)
            for pmf in (pld._pmf_remove, pld._pmf_add)]


def _epsilon_bracket(ours, ref, count, delta):
    """dp_accounting's ε at δ + τ and δ - τ, with τ a bound on |δ_ours(ε) - δ_ref(ε)| after
    ``count`` compositions: the L¹ distance of the one-step PMFs composes at most additively
    (``count`` times; the hockey-stick weights lie in [0, 1]), plus each composition's FFT
    round-off (:func:`.numerics.fft_roundoff`) and truncated tail. ε(δ) is non-increasing, so
    ours must lie in [ε_ref(δ + τ), ε_ref(δ - τ)]."""
    l1 = max(float(np.abs(np.asarray(a._probs) - np.asarray(b._probs)).sum())
             + abs(a._infinity_mass - b._infinity_mass)
             for a, b in zip(_directions(ref), _directions(ours), strict=True))
    composed = [pld.self_compose(count) for pld in (ours, ref)]
    roundoff = sum(max(numerics.fft_roundoff(pmf._probs, count) for pmf in _directions(c))
                   for c in composed)
    tau = count * l1 + roundoff + 2 * TAIL
    return (composed[0].get_epsilon_for_delta(delta),
            composed[1].get_epsilon_for_delta(delta + tau),
            composed[1].get_epsilon_for_delta(delta - tau))


def _directions(pld):
    return [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]


@pytest.mark.parametrize("sigma,sens,q,relation", CASES)
def test_same_pmf_and_epsilon_as_dp_accounting(sigma, sens, q, relation):
    ref = dp_pld.from_gaussian_mechanism(sigma, sensitivity=sens, sampling_prob=q,
                                         value_discretization_interval=D,
                                         neighboring_relation=relation, use_connect_dots=True)
    ours = gb.gaussian_pld(sigma, sens, sampling_prob=q, value_discretization_interval=D,
                           neighboring_relation=relation)
    assert ours._symmetric == ref._symmetric
    for (lo1, p1, inf1), (lo2, p2, inf2) in zip(_pmfs(ref), _pmfs(ours), strict=True):
        # the grid bounds are dp_accounting's own scalar code on the same inputs: exact
        assert lo1 == lo2 and len(p1) == len(p2)
        assert abs(inf1 - inf2) <= DELTA_ATOL  # the last grid δ
        np.testing.assert_allclose(p2, p1, rtol=0, atol=PMF_ATOL)
    for delta in (1e-5, 1e-7):
        eps, low, high = _epsilon_bracket(ours, ref, 10, delta)
        assert low <= eps <= high, (delta, low, eps, high)


@pytest.mark.parametrize("kind", [plm.AdjacencyType.ADD, plm.AdjacencyType.REMOVE,
                                  plm.AdjacencyType.REPLACE])
def test_delta_grid_is_get_delta_for_epsilon(kind):
    loss = plm.GaussianPrivacyLoss(0.9, sensitivity=2.0, sampling_prob=0.07,
                                   adjacency_type=kind)
    eps = np.linspace(-3.0, 6.0, 901)
    if kind == plm.AdjacencyType.ADD:
        eps = np.append(eps, -np.log1p(-0.07))  # the isclose edge of the inverse
    np.testing.assert_allclose(gb.delta_grid(loss, eps), loss.get_delta_for_epsilon(eps),
                               rtol=0, atol=DELTA_ATOL)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="standard_deviation"):
        gb.gaussian_pld(0.0)
    with pytest.raises(ValueError, match="sampling_prob"):
        gb.gaussian_pld(1.0, sampling_prob=1.5)
    with pytest.raises(ValueError, match="neighboring_relation"):
        gb.gaussian_pld(1.0, neighboring_relation="swap")


@pytest.mark.parametrize("kind", [plm.AdjacencyType.ADD, plm.AdjacencyType.REMOVE,
                                  plm.AdjacencyType.REPLACE])
@pytest.mark.parametrize("q", [0.02, 0.3, 1.0])
def test_mu_cdfs_are_dp_accountings_bit_for_bit(kind, q):
    """The cdf / log-cdf of the pair without scipy.stats' wrapper: the same bits (sign of zero
    included) at finite points, ±inf and NaN."""
    x = np.concatenate([np.linspace(-60.0, 60.0, 20001),
                        [np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-300, -40.5]])
    for sigma, sens in [(0.5, 1.0), (1.0, 2.0), (3.0, 1.0)]:
        loss = plm.GaussianPrivacyLoss(sigma, sensitivity=sens, sampling_prob=q,
                                       adjacency_type=kind)
        with np.errstate(all="ignore"):
            pairs = [(gb._mu_upper_cdf(loss, x), loss.mu_upper_cdf(x)),
                     (gb._mu_lower_log_cdf(loss, x), loss.mu_lower_log_cdf(x))]
        for ours, ref in pairs:
            # exact: both sides evaluate the same numpy/scipy array calls (one float path)
            np.testing.assert_array_equal(ours, ref)
            np.testing.assert_array_equal(np.signbit(ours), np.signbit(ref))
