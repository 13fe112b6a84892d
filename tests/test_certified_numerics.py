"""Issue 29, case 6 / Deliver 3: every pricing route knows its numerical error.

``epsilon poisson --sample-rate 1e-4 --noise-multiplier 1 --steps 1000000 --delta 1e-12`` used
to print 0.857 .. inf depending on --discretization: at δ = 1e-12 the composed PLD's ε was FFT
round-off. The independent figures here: the Gaussian (CLT) approximation (0.855, below the
true value), dp_accounting's ``RdpAccountant`` on the same event (1.636, an upper bound), and an
exact reference composition (binary powering by *direct* convolution of non-negative arrays,
whose floating-point error is relative, not absolute) for the round-off estimate.
"""

import dataclasses
import json
import math
import warnings

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as dp_pld
from dp_accounting.rdp import rdp_privacy_accountant as rdp
from scipy import optimize, stats

from opacus_structured.accounting import numerics
from opacus_structured.accounting import pld as pld_lib
from opacus_structured.accounting.resource_guard import _dense_probs
from opacus_structured.cli import main
from opacus_structured.schemes.base import Scheme
from opacus_structured.schemes.poisson import RDP_ORDERS, PoissonScheme

Q, SIGMA, STEPS, DELTA = 1e-4, 1.0, 1_000_000, 1e-12
CASE6 = ["epsilon", "poisson", "--sample-rate", "1e-4", "--noise-multiplier", "1",
         "--steps", "1000000", "--delta", "1e-12"]
GRIDS = (1e-3, 5e-4, 2e-4, 1e-4, 5e-5, 3e-5)


def _rdp_direct(orders=None):
    acc = rdp.RdpAccountant(orders) if orders is not None else rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(SIGMA)),
                STEPS)
    return float(acc.get_epsilon(DELTA))


def _clt_epsilon():
    """ε(1e-12) of the μ-GDP that the CLT gives for T Poisson-Gaussian steps (Dong, Roth & Su
    2019, Thm 6): μ = q·√(T(e^{1/σ²} − 1)); an approximation from below here (the third and
    higher cumulants of the privacy loss are positive)."""
    mu = Q * math.sqrt(STEPS * math.expm1(1 / SIGMA ** 2))

    def delta(e):
        return stats.norm.cdf(-e / mu + mu / 2) - math.exp(e) * stats.norm.cdf(-e / mu - mu / 2)

    return optimize.brentq(lambda e: delta(e) - DELTA, 0.0, 20.0)


@pytest.mark.parametrize("discretization", GRIDS)
def test_case6_cli_certified_and_stable_across_grids(discretization, capsys):
    assert main(CASE6 + ["--discretization", str(discretization), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    eps = record["epsilon"]
    assert math.isfinite(eps)
    assert _clt_epsilon() <= eps <= _rdp_direct(list(RDP_ORDERS)) + 1e-12
    assert 0.855 <= eps <= 1.636
    # the route is named; the PLD's round-off floor that ruled it out is reported
    assert record["route"] == "rdp" and "round-off" in record["route_note"]
    assert record["pld_roundoff"] * numerics.CERTIFY_FACTOR > DELTA
    # stable as the grid gets finer: the certified route does not depend on the grid at all
    assert eps == pytest.approx(_rdp_direct(list(RDP_ORDERS)), rel=1e-12)


def test_case6_cli_text_names_the_route(capsys):
    assert main(CASE6) == 0
    out = capsys.readouterr().out
    assert "epsilon = 1.63596" in out and "[RDP route:" in out and "round-off" in out


def test_independent_figures():
    # The CLT figure of the issue, and dp_accounting's RDP accountant on the same event: with its
    # own default orders (an independent order grid) and with ours (a superset near 1).
    assert _clt_epsilon() == pytest.approx(0.855, abs=1e-3)
    ours = PoissonScheme(sample_rate=Q).epsilon(SIGMA, STEPS, DELTA)
    assert ours == pytest.approx(_rdp_direct(list(RDP_ORDERS)), rel=1e-12)
    assert ours <= _rdp_direct() + 1e-12
    assert ours.details["rdp_order"] in RDP_ORDERS
    assert not ours.details["rdp_order_at_grid_edge"]


# ---- the round-off estimate against an exact reference ------------------------------------------
def _truncate(lo, p, inf, tau=1e-30):
    """Pessimistic truncation (left mass into the first bin, right mass to infinity)."""
    i = int(np.searchsorted(np.cumsum(p), tau / 2))
    j = int(np.searchsorted(np.cumsum(p[::-1]), tau / 2))
    left, right = p[:i].sum(), p[len(p) - j:].sum()
    q = p[i:len(p) - j].copy()
    q[0] += left
    return lo + i, q, inf + right


def _exact_power(lo, p, count):
    """``count``-fold self-convolution by binary powering with np.convolve: sums of
    non-negative products, so every entry has a relative error of at most ~N·u."""
    result, base = None, (lo, p)
    while count:
        if count & 1:
            result = base if result is None else _truncate(
                result[0] + base[0], np.convolve(result[1], base[1]), 0.0)[:2]
        count >>= 1
        if count:
            base = _truncate(2 * base[0], np.convolve(base[1], base[1]), 0.0)[:2]
    return result


def _lower(pmf):
    return pmf._lower_loss if hasattr(pmf, "_lower_loss") else min(pmf._loss_probs)


@pytest.mark.parametrize("q,sigma,count", [
    (1e-4, 1.0, 100_000), (1e-3, 1.0, 10_000),
    pytest.param(1e-3, 1.0, 100_000, marks=pytest.mark.slow),
    pytest.param(0.01, 1.0, 1000, marks=pytest.mark.slow)])
def test_roundoff_floor_bounds_the_measured_error(q, sigma, count):
    step = PoissonScheme(sample_rate=q).pld(sigma, discretization=1e-3)
    composed = pld_lib.self_compose(step, count)
    floor = numerics.numerics_of(composed).roundoff
    assert floor > 0 and numerics.numerics_of(composed).compositions == count
    errors = []
    for one, many in ((step._pmf_remove, composed._pmf_remove), (step._pmf_add, composed._pmf_add)):
        ref_lo, ref = _exact_power(_lower(one), _dense_probs(one), count)
        got, got_lo = many._probs, many._lower_loss
        a, b = max(ref_lo, got_lo), min(ref_lo + len(ref), got_lo + len(got))
        err = (np.abs(got[a - got_lo:b - got_lo] - ref[a - ref_lo:b - ref_lo]).sum()
               + np.abs(got[:a - got_lo]).sum() + np.abs(got[b - got_lo:]).sum())
        assert 0 < err <= floor  # measured 0.2-0.7 of the unscaled estimate
        errors.append(err)
    assert floor <= 50 * max(errors)  # and not vacuous (the worst direction)


@pytest.mark.float_sensitive
@pytest.mark.slow
def test_case6_a_posteriori_refusal_and_ordinary_certificate():
    step = PoissonScheme(sample_rate=Q).pld(SIGMA, discretization=1e-3)
    composed = pld_lib.self_compose(step, STEPS)
    with pytest.raises(numerics.NumericalPrecisionError, match=r"delta=1e-12 .*round-off"):
        pld_lib.epsilon_for_delta(composed, DELTA)
    # the uncorrected dp_accounting value is what case 6 printed: not a certified bound
    assert composed.get_epsilon_for_delta(DELTA) != pytest.approx(_rdp_direct(), rel=0.1)
    # at a δ above the floor, ε is read at δ - floor and carries its certificate
    cert = numerics.certify(composed, 1e-6)
    eps = pld_lib.epsilon_for_delta(composed, 1e-6)
    assert eps.route == "pld" and eps.details["numerical_roundoff"] == cert.roundoff
    assert eps == composed.get_epsilon_for_delta(1e-6 - cert.roundoff)
    assert eps.details["infinity_mass"] >= eps.details["truncated_mass"] > 0
    # δ(ε) is reported with the floor added (an upper bound)
    assert pld_lib.delta_for_epsilon(composed, 1.0) == pytest.approx(
        composed.get_delta_for_epsilon(1.0) + cert.roundoff, rel=1e-12)


def test_ordinary_settings_keep_the_pld_route():
    # q = 0.01, σ = 1, 1000 steps, δ = 1e-5: the published setting; the floor is ~1e-12.
    eps = PoissonScheme(sample_rate=0.01).epsilon(1.0, 1000, 1e-5, discretization=1e-3)
    assert eps.route == "pld" and eps.details["certified_min_delta"] < 1e-10
    ref = dp_pld.from_gaussian_mechanism(1.0, sampling_prob=0.01, value_discretization_interval=1e-3,
                                         pessimistic_estimate=True).self_compose(1000)
    # read at δ - floor: the published value moves by ~1e-8 relative, nothing more
    assert eps == pytest.approx(ref.get_epsilon_for_delta(1e-5), rel=1e-6)


def test_epsilon_monotone_in_delta_across_the_route_switch():
    # q = 1e-3, 1e5 steps on the 1e-3 grid: the PLD wins above its floor (~1e-9), RDP below.
    from opacus_structured.accountants.poisson import PoissonAccountant

    acc = PoissonAccountant(discretization=1e-3)
    acc.history = [(SIGMA, 1e-3, 100_000)]
    deltas = np.logspace(-14, -3, 23)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        values = [acc.get_epsilon(float(d)) for d in deltas]
    routes = [v.route for v in values]
    assert routes[0] == "rdp" and routes[-1] == "pld"  # the switch is inside the grid
    assert all(math.isfinite(v) for v in values)
    assert all(a >= b for a, b in zip(values, values[1:]))  # non-increasing in δ
    for d, v in zip(deltas, values):
        if v.route == "pld":
            assert d >= v.details["certified_min_delta"]


def test_case6_monotone_in_delta():
    scheme = PoissonScheme(sample_rate=Q)
    values = [scheme.epsilon(SIGMA, STEPS, float(d)) for d in np.logspace(-15, -9, 13)]
    assert all(v.route == "rdp" for v in values)
    assert all(a > b for a, b in zip(values, values[1:]))


def test_accountant_warns_and_labels_the_route():
    from opacus_structured.accountants.poisson import PoissonAccountant

    acc = PoissonAccountant(discretization=1e-3)
    acc.history = [(SIGMA, Q, STEPS)]
    with pytest.warns(UserWarning, match="route 'rdp'"):
        eps, bound = acc.get_privacy_spent(delta=DELTA)
    assert eps.route == "rdp" and bound == "upper" and 0.855 <= eps <= 1.636
    # a mixed history: the RDP bound composes every part
    acc.history = [(SIGMA, Q, STEPS // 2), (2 * SIGMA, Q, STEPS // 2)]
    with pytest.warns(UserWarning, match="route 'rdp'"):
        mixed = acc.get_epsilon(DELTA)
    ref = rdp.RdpAccountant(list(RDP_ORDERS))
    for sigma in (SIGMA, 2 * SIGMA):
        ref.compose(dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(sigma)),
                    STEPS // 2)
    assert mixed.route == "rdp" and mixed == pytest.approx(ref.get_epsilon(DELTA), rel=1e-12)


@dataclasses.dataclass(frozen=True)
class _PlainGaussian(Scheme):
    """A test-only scheme without an RDP route."""

    name = "test-plain-gaussian-numerics"

    def pld(self, noise_multiplier, *, sample_rate=None, discretization=1e-4):
        return dp_pld.from_gaussian_mechanism(
            standard_deviation=noise_multiplier, pessimistic_estimate=True,
            value_discretization_interval=discretization)


def test_scheme_without_a_certified_route_refuses_clearly():
    with pytest.raises(numerics.NumericalPrecisionError) as info:
        _PlainGaussian().epsilon(50.0, 1_000_000, 1e-12, discretization=1e-3)
    msg = str(info.value)
    assert "delta=1e-12" in msg and "Use delta >=" in msg and "compositions" in msg
    assert isinstance(info.value, ValueError)  # the CLI prints it as one line, exit 2


def test_cli_prints_the_pld_route_and_its_floor(capsys):
    args = ["epsilon", "poisson", "--sample-rate", "0.01", "--noise-multiplier", "1",
            "--steps", "1000", "--delta", "1e-5", "--discretization", "1e-3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "[PLD route: numerical error <= " in out and "certified for delta >= " in out
    assert main(args + ["--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["route"] == "pld" and 0 < record["numerical_roundoff"] < 1e-10
    assert record["certified_min_delta"] == pytest.approx(
        numerics.CERTIFY_FACTOR * record["numerical_roundoff"])


def test_priced_epsilon_survives_pickle_and_deepcopy():
    import copy
    import pickle

    eps = PoissonScheme(sample_rate=0.01).epsilon(1.0, 100, 1e-5, discretization=1e-3)
    for clone in (pickle.loads(pickle.dumps(eps)), copy.deepcopy(eps)):
        assert clone == eps and clone.route == "pld" and clone.details == eps.details
