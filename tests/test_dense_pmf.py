"""The vectorised dense-PMF routines are dp_accounting's, bit for bit (issue 41: truncated
Poisson's default B): the Chernoff truncation window of ``self_compose``, the composed PMF, ε(δ)
and the connect-the-dots PMF, on symmetric and asymmetric PLDs, sparse and dense PMFs,
infinity masses and composed PMFs with negative round-off entries."""

import math

import numpy as np
import pytest
from conftest import default_subset
from dp_accounting.pld import common, pld_pmf
from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution
from scipy import special

from opacus_structured.accounting import dense_pmf as dp
from opacus_structured.accounting import gaussian_branch as gb
from opacus_structured.accounting import numerics
from opacus_structured.accounting import pld as pld_lib
from opacus_structured.accounting import truncated_poisson as tp

TAIL = pld_lib.TAIL_MASS_TRUNCATION
NR = gb.NeighboringRelation


def _gaussian(sigma, q, d=1e-3, sens=1.0, relation=NR.ADD_OR_REMOVE_ONE):
    return gb.gaussian_pld(sigma, sens, sampling_prob=q, value_discretization_interval=d,
                           neighboring_relation=relation)


def _with_infinity_mass():
    """An asymmetric PLD whose remove direction has infinity mass 2e-6 (a grid cut short)."""
    probs = np.exp(-0.5 * (np.arange(-1500, 1501) / 400.0) ** 2)
    probs *= (1 - 2e-6) / probs.sum()
    remove = pld_pmf.DensePLDPmf(1e-3, -1000, probs, 2e-6, True)
    add = pld_pmf.DensePLDPmf(1e-3, -2000, probs[::-1].copy(), 0.0, True)
    return PrivacyLossDistribution(remove, add)


def _plds():
    """(name, PLD): dense and sparse PMFs, both relations, infinity mass, several grids."""
    out = [
        ("ar s=1 q=.1 d=1e-3", _gaussian(1.0, 0.1)),
        ("ar s=.5 q=.01 d=1e-3", _gaussian(0.5, 0.01)),
        ("ar s=2 q=.3 sens=2 d=1e-3", _gaussian(2.0, 0.3, sens=2.0)),
        ("ar s=3 q=1 d=1e-3", _gaussian(3.0, 1.0)),
        ("ro s=.7 q=.3 d=1e-3", _gaussian(0.7, 0.3, relation=NR.REPLACE_ONE)),
        ("ro s=1 q=.05 sens=2 d=2e-3", _gaussian(1.0, 0.05, 2e-3, 2.0, NR.REPLACE_ONE)),
        ("ar s=1 q=.1 d=1e-2 (sparse)", _gaussian(1.0, 0.1, 1e-2)),
        ("ar s=4 q=.02 d=2e-2 (sparse)", _gaussian(4.0, 0.02, 2e-2)),
        ("truncated Poisson B=97 d=1e-3",
         tp.truncated_poisson_pld(640, 0.1, 97, 1.0, discretization=1e-3)),
        ("zero-out B=80 (pld_from_profile)",
         tp.truncated_poisson_pld(640, 0.1, 80, 1.0, relation="zero-out", discretization=1e-3)),
        ("infinity mass", _with_infinity_mass()),
    ]
    composed = pld_lib.self_compose(_gaussian(0.8, 0.2), 6)  # negative round-off entries
    assert np.any(composed._pmf_remove._probs < 0)
    out.append(("composed (negative entries)", composed))
    return out


PLDS = _plds()

#: Default run (issue 41: README command <= 5 min): each PLD-grid test keeps the PLDs that cost
#: under a second there (dense and sparse add/remove, q = 1, sensitivity 2, infinity mass,
#: negative round-off entries) and each costlier PLD is kept in at least one of the four tests
#: (σ = 0.5 in ε(δ), replace-one σ = 0.7 in self_compose, replace-one sensitivity 2 in the bounds
#: and ε(δ), truncated Poisson B = 97 in the bounds and the round-off floor, zero-out B = 80 from
#: pld_from_profile in ε(δ)); the other cases run in CI's slow step.
_CHEAP = ("ar s=1 q=.1 d=1e-3", "ar s=2 q=.3 sens=2 d=1e-3", "ar s=3 q=1 d=1e-3",
          "ar s=1 q=.1 d=1e-2 (sparse)", "ar s=4 q=.02 d=2e-2 (sparse)", "infinity mass",
          "composed (negative entries)")


def _plds_kept(plds, *extra):
    """``plds`` for ``parametrize("name,pld", ...)``: :data:`_CHEAP` and ``extra`` by default."""
    keep = [case for case in plds if case[0] in _CHEAP + extra]
    return default_subset(plds, keep, ids=[name for name, _ in plds])


def _directions(pld):
    return [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]


# ---- the Chernoff window -------------------------------------------------------------------------
@pytest.mark.parametrize("name,pld", _plds_kept(
    PLDS, "truncated Poisson B=97 d=1e-3", "ro s=1 q=.05 sens=2 d=2e-3"))
def test_bounds_are_dp_accountings(name, pld):
    for pmf in _directions(pld):
        probs = pmf.to_dense_pmf()._probs
        np.testing.assert_array_equal(dp.dense_probs(pmf), probs)
        for count in (2, 20, 1000, 10 ** 9):
            for tail in (TAIL, 1e-10, 0.0):
                assert (dp.self_convolve_bounds(probs, count, tail)
                        == common.compute_self_convolve_bounds(probs, count, tail)), (count, tail)


def test_bounds_on_the_fine_grid_of_issue_41():
    step = tp.truncated_poisson_pld(640, 0.1, 97, 1.0, discretization=1e-4)
    probs = step._pmf_remove._probs
    assert len(probs) > 190_000
    assert (dp.self_convolve_bounds(probs, 20, TAIL)
            == common.compute_self_convolve_bounds(probs, 20, TAIL))


def _odd_arrays():
    rng = np.random.default_rng(7)
    holes = rng.random(3000)
    holes[rng.random(3000) < 0.4] = 0.0
    holes[:9] = holes[-4:] = 0.0                        # zero weights at both ends
    signed = rng.normal(size=500)                       # mixed signs
    negative = -rng.random(300)                         # negative total: scipy returns NaN
    return [holes, signed, negative, np.array([0.0, 1.0]), np.array([0.25, 0.0, 0.75]),
            PLDS[-1][1]._pmf_remove._probs]


@pytest.mark.parametrize("probs", _odd_arrays(), ids=["holes", "signed", "negative", "two",
                                                      "three", "composed"])
def test_each_log_mgf_is_scipys_logsumexp(probs):
    """Every one of the 40 orders, not only the ones the screen keeps."""
    kf = np.arange(len(probs), dtype=np.float64)
    nonzero = np.flatnonzero(probs != 0)
    for order in dp._ORDERS / len(probs):
        end = int(nonzero[-1] if order > 0 else nonzero[0])
        ours = dp._log_mgf_exact(probs, kf, order, end, -1 if order > 0 else 1, nonzero)
        with np.errstate(invalid="ignore"):
            ref = special.logsumexp(np.arange(len(probs)) * order, b=probs)
        assert ours == ref or (math.isnan(ours) and math.isnan(ref)), order
    for count in (2, 50):
        assert (dp.self_convolve_bounds(probs, count, TAIL)
                == common.compute_self_convolve_bounds(probs, count, TAIL))


def test_the_screen_keeps_few_orders_and_its_error_covers_scipy():
    probs = _gaussian(1.0, 0.1)._pmf_remove._probs
    orders = dp._ORDERS / len(probs)
    c = math.log(2 / TAIL)
    approx, err = dp._screen(probs, np.arange(len(probs), dtype=float), 0, len(probs) - 1, 20,
                             c, orders)
    exact = np.array([(20 * special.logsumexp(np.arange(len(probs)) * o, b=probs) + c) / o
                      for o in orders])
    assert np.all(np.abs(approx - exact) <= err)
    assert np.all(err < 1e-3)
    mgfs = dp._log_mgfs(probs, orders, 20, c)
    assert 2 <= np.count_nonzero(~np.isnan(mgfs)) <= 8  # one or a few orders per side


# ---- the composition -----------------------------------------------------------------------------
def _same_pmf(a, b):
    assert type(a) is type(b)
    assert a._infinity_mass == b._infinity_mass
    assert a._discretization == b._discretization
    if isinstance(a, pld_pmf.SparsePLDPmf):
        assert a._loss_probs == b._loss_probs
    else:
        assert a._lower_loss == b._lower_loss
        np.testing.assert_array_equal(a._probs, b._probs)


@pytest.mark.parametrize("name,pld", _plds_kept(PLDS, "ro s=.7 q=.3 d=1e-3"))
def test_self_compose_is_dp_accountings(name, pld):
    for count in (2, 5, 20, 300):
        ref = pld.self_compose(count, tail_mass_truncation=TAIL)
        ours = dp.self_compose(pld, count, TAIL)
        assert ours._symmetric == ref._symmetric
        for a, b in zip(_directions(ours), _directions(ref), strict=True):
            _same_pmf(a, b)


def test_sparse_pmf_stays_sparse_while_dp_accounting_keeps_it_sparse():
    pmf = pld_pmf.SparsePLDPmf({-3: 0.2, 0: 0.5, 4: 0.3 - 1e-9}, 1e-2, 1e-9, True)
    for count in (1, 2, 6, 7, 40):  # 3**6 = 729 <= 1000 < 3**7
        _same_pmf(dp.self_compose_pmf(pmf, count, TAIL), pmf.self_compose(count, TAIL))
    with pytest.raises(ValueError, match="num_times"):
        dp.self_compose_pmf(pmf.to_dense_pmf(), 0, TAIL)


def test_pld_self_compose_keeps_the_guard_and_the_numerics():
    step = _gaussian(1.0, 0.1)
    composed = pld_lib.self_compose(step, 30)
    ref = step.self_compose(30, tail_mass_truncation=TAIL)
    for a, b in zip(_directions(composed), _directions(ref), strict=True):
        _same_pmf(a, b)
    rec = numerics.numerics_of(composed)
    assert rec.compositions == 30 and rec.truncated_mass == TAIL
    assert rec.roundoff == max(numerics.fft_roundoff(p._probs, 30) for p in _directions(ref))


# ---- ε(δ) ----------------------------------------------------------------------------------------
DELTAS = (0.5, 1e-5, 1e-10, 2e-6, 1.9999e-6, 1 - 1e-12)


@pytest.mark.parametrize("name,pld", _plds_kept(
    PLDS, "zero-out B=80 (pld_from_profile)", "ar s=.5 q=.01 d=1e-3",
    "ro s=1 q=.05 sens=2 d=2e-3"))
def test_epsilon_for_delta_is_dp_accountings(name, pld):
    for composed in (pld, pld_lib.self_compose(pld, 12)):
        for delta in DELTAS:
            assert dp.epsilon_for_delta(composed, delta) == composed.get_epsilon_for_delta(delta)
            for pmf in _directions(composed):
                ours, ref = dp.epsilon_for_delta_pmf(pmf, delta), pmf.get_epsilon_for_delta(delta)
                assert ours == ref and type(ours) is type(ref), (delta, ours, ref)


def test_epsilon_for_delta_edge_cases():
    d = 1e-3
    # losses above 745: exp(-loss) underflows to 0, the loop's early return max(0, loss)
    far = pld_pmf.DensePLDPmf(d, 800_000, np.full(3000, 1 / 3000), 0.0, True)
    # infinity mass above delta (inf), all mass at negative losses (0)
    heavy = pld_pmf.DensePLDPmf(d, -5000, np.full(3000, 0.9 / 3000), 0.1, True)
    low = pld_pmf.DensePLDPmf(d, -9000, np.full(3000, 1 / 3000), 0.0, True)
    for pmf in (far, heavy, low):
        for delta in (0.5, 0.2, 0.1, 0.05, 1e-3, 1e-9):
            ours, ref = dp.epsilon_for_delta_pmf(pmf, delta), pmf.get_epsilon_for_delta(delta)
            assert ours == ref and type(ours) is type(ref), (delta, ours, ref)


def test_epsilon_for_delta_with_math_exp(monkeypatch):
    """The path taken where numpy's exp is not the C library's (AVX-512): same bits."""
    monkeypatch.setattr(dp, "_LIBM_EXP", False)
    composed = pld_lib.self_compose(tp.truncated_poisson_pld(640, 0.1, 97, 1.0,
                                                             discretization=1e-3), 20)
    for delta in (1e-5, 1e-9):
        assert dp.epsilon_for_delta(composed, delta) == composed.get_epsilon_for_delta(delta)


def test_pld_epsilon_for_delta_reads_at_delta_minus_the_roundoff():
    composed = pld_lib.self_compose(_gaussian(1.0, 0.1), 20)
    cert = numerics.certify(composed, 1e-5)
    assert cert.roundoff > 0
    assert (float(pld_lib.epsilon_for_delta(composed, 1e-5))
            == composed.get_epsilon_for_delta(1e-5 - cert.roundoff))


# ---- connect the dots ----------------------------------------------------------------------------
@pytest.mark.parametrize("lower,size", [(-400, 5000), (10, 1001), (-3, 1000), (7, 1)])
def test_connect_dots_is_dp_accountings(lower, size):
    eps = (lower + np.arange(size)) * 1e-3
    deltas = np.clip(0.3 * np.exp(-np.maximum(eps, 0.0) * 2.0) - 1e-17 * np.arange(size), 0, 1)
    deltas[size // 2:size // 2 + 1] += 5e-13  # within dp_accounting's tolerance: repaired
    upper = lower + size - 1
    _same_pmf(dp.connect_dots_fixed_gap(1e-3, lower, upper, deltas),
              pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(1e-3, lower, upper, deltas))


def test_connect_dots_refuses_what_dp_accounting_refuses():
    deltas = np.linspace(0.5, 0.0, 2000)
    for bad in (deltas[::-1], np.append(deltas[:-1], -0.1), deltas[:-1]):
        with pytest.raises(ValueError) as ours:
            dp.connect_dots_fixed_gap(1e-3, 0, 1999, bad)
        with pytest.raises(ValueError) as ref:
            pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(1e-3, 0, 1999, bad)
        assert str(ours.value) == str(ref.value)


# ---- deciding ε <= threshold without the round-off FFTs (pld.epsilon_at_most) ---------------------
@pytest.mark.parametrize("name,pld", _plds_kept(PLDS[:6] + PLDS[8:],
                                                "truncated Poisson B=97 d=1e-3"))
def test_roundoff_bounds_bracket_the_recorded_floor(name, pld):
    for count in (2, 20, 300):
        raw = dp.self_compose(pld, count, TAIL)
        lo, hi = numerics.roundoff_bounds(raw, pld, count)
        composed = numerics.after_self_compose(dp.self_compose(pld, count, TAIL), pld, count,
                                               TAIL)
        assert lo <= numerics.numerics_of(composed).roundoff <= hi


# The default run keeps 0, 1 and 20 compositions; 2 (~5 s, the same composed path as 20) runs in
# CI's slow step (issue 41: README command <= 5 min).
@pytest.mark.parametrize("count", [0, 1, pytest.param(2, marks=pytest.mark.slow), 20])
def test_epsilon_at_most_is_the_same_decision_and_the_same_epsilon(count):
    step = tp.truncated_poisson_pld(640, 0.1, 97, 1.0, discretization=1e-3)
    ref = pld_lib.epsilon_for_delta(pld_lib.self_compose(step, count), 1e-5)
    for threshold in (ref, np.nextafter(ref, 0), np.nextafter(ref, 9), ref - 1e-12,
                      ref + 1e-12, ref * 0.999, ref * 1.001, 0.0, math.inf):
        passed, eps = pld_lib.epsilon_at_most(step, count, 1e-5, threshold)
        assert passed == (ref <= threshold), threshold
        got = eps()
        assert float(got) == float(ref) and type(got) is type(ref)
        assert getattr(got, "details", None) == getattr(ref, "details", None)


def test_epsilon_at_most_refuses_where_epsilon_for_delta_refuses():
    step = _gaussian(1.0, 0.1)
    with pytest.raises(numerics.NumericalPrecisionError) as ref:
        pld_lib.epsilon_for_delta(pld_lib.self_compose(step, 50), 1e-14)
    with pytest.raises(numerics.NumericalPrecisionError) as ours:
        pld_lib.epsilon_at_most(step, 50, 1e-14, 10.0)
    assert str(ours.value) == str(ref.value)


def test_search_reports_the_same_with_and_without_progress():
    """With a progress callback every ε on the asked grid is computed (exactly); without, only
    the returned B's: the same B and ε either way."""
    seen = []
    args = (400, 1 / 8, 1.1, 16, 1e-5, 0.01)
    quiet = tp.max_batch_size_search(*args, discretization=2e-3)
    loud = tp.max_batch_size_search(*args, discretization=2e-3,
                                    progress=lambda b, e: seen.append((b, e)))
    assert quiet == loud and seen and (quiet[0], quiet[1]) in seen
    for b, e in seen:
        assert e == tp.truncated_poisson_epsilon(*args[:2], b, *args[2:5], discretization=2e-3)


def test_a_clear_decision_skips_the_roundoff_fft(monkeypatch):
    calls = []
    real = numerics.after_self_compose
    monkeypatch.setattr(numerics, "after_self_compose",
                        lambda *a: calls.append(1) or real(*a))
    step = _gaussian(1.0, 0.1)
    ref = pld_lib.epsilon_for_delta(pld_lib.self_compose(step, 20), 1e-5)
    calls.clear()
    for threshold, expected in ((ref * 1.001, True), (ref * 0.999, False)):
        passed, eps = pld_lib.epsilon_at_most(step, 20, 1e-5, threshold)
        assert passed is expected and not calls
        assert eps() == ref and len(calls) == 1
        calls.clear()
