"""The vectorised Gaussian branch builder is dp_accounting's ``from_gaussian_mechanism``
(connect-the-dots, pessimistic), bit for bit (issue 41: truncated Poisson's default B)."""

import numpy as np
import pytest
from dp_accounting import NeighboringRelation as NR
from dp_accounting.pld import privacy_loss_distribution as dp_pld
from dp_accounting.pld import privacy_loss_mechanism as plm

from opacus_structured.accounting import gaussian_branch as gb

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


@pytest.mark.parametrize("sigma,sens,q,relation", CASES)
def test_same_pmf_and_epsilon_as_dp_accounting(sigma, sens, q, relation):
    ref = dp_pld.from_gaussian_mechanism(sigma, sensitivity=sens, sampling_prob=q,
                                         value_discretization_interval=1e-3,
                                         neighboring_relation=relation, use_connect_dots=True)
    ours = gb.gaussian_pld(sigma, sens, sampling_prob=q, value_discretization_interval=1e-3,
                           neighboring_relation=relation)
    assert ours._symmetric == ref._symmetric
    for (lo1, p1, inf1), (lo2, p2, inf2) in zip(_pmfs(ref), _pmfs(ours), strict=True):
        assert lo1 == lo2 and inf1 == inf2
        np.testing.assert_array_equal(p1, p2)
    for delta in (1e-5, 1e-7):
        assert (ours.self_compose(10).get_epsilon_for_delta(delta)
                == ref.self_compose(10).get_epsilon_for_delta(delta))


@pytest.mark.parametrize("kind", [plm.AdjacencyType.ADD, plm.AdjacencyType.REMOVE,
                                  plm.AdjacencyType.REPLACE])
def test_delta_grid_is_get_delta_for_epsilon(kind):
    loss = plm.GaussianPrivacyLoss(0.9, sensitivity=2.0, sampling_prob=0.07,
                                   adjacency_type=kind)
    eps = np.linspace(-3.0, 6.0, 901)
    if kind == plm.AdjacencyType.ADD:
        eps = np.append(eps, -np.log1p(-0.07))  # the isclose edge of the inverse
    np.testing.assert_array_equal(gb.delta_grid(loss, eps), loss.get_delta_for_epsilon(eps))


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
            np.testing.assert_array_equal(ours, ref)
            np.testing.assert_array_equal(np.signbit(ours), np.signbit(ref))
