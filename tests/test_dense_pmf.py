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
@pytest.mark.float_sensitive
@pytest.mark.parametrize("name,pld", _plds_kept(
    PLDS, "truncated Poisson B=97 d=1e-3", "ro s=1 q=.05 sens=2 d=2e-3"))
def test_bounds_are_dp_accountings(name, pld):
    # exact: integers, decided by scipy's own log-MGF operations (one float path); the orders
    # screened out carry a rigorous error bound (test_the_screen_..._covers_scipy)
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


@pytest.mark.float_sensitive
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


@pytest.mark.float_sensitive
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


@pytest.mark.float_sensitive
@pytest.mark.parametrize("name,pld", _plds_kept(
    PLDS, "zero-out B=80 (pld_from_profile)", "ar s=.5 q=.01 d=1e-3",
    "ro s=1 q=.05 sens=2 d=2e-3"))
def test_epsilon_for_delta_is_dp_accountings(name, pld):
    # exact on every CPU: _DenseEpsilon takes libm's exp bits (np.exp only where they are the
    # same) and the loop's sequential sums, so both sides run one float path
    for composed in (pld, pld_lib.self_compose(pld, 12)):
        for delta in DELTAS:
            assert dp.epsilon_for_delta(composed, delta) == composed.get_epsilon_for_delta(delta)
            for pmf in _directions(composed):
                ours, ref = dp.epsilon_for_delta_pmf(pmf, delta), pmf.get_epsilon_for_delta(delta)
                assert ours == ref and type(ours) is type(ref), (delta, ours, ref)


@pytest.mark.float_sensitive
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


class _SkewedNumpy:
    """numpy, except that ``exp`` is one ulp above the C library's on every other argument, as
    numpy's AVX-512 ``exp`` differs on a share of them (750 of the 16,384 that
    ``_numpy_exp_is_math_exp`` checks on an Intel Xeon): forces the ``math.exp`` path of
    ``_DenseEpsilon`` on any CPU (an AVX2 machine never takes it by itself)."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def exp(x, *args, **kwargs):
        r = np.asarray(np.exp(x, *args, **kwargs))
        skew = np.isfinite(r) & (np.arange(r.size).reshape(r.shape) % 2 == 0)
        return np.where(skew, np.nextafter(r, np.inf), r)


@pytest.fixture
def libm_exp_path(monkeypatch):
    """The process as on an AVX-512 CPU: numpy's exp disagrees with libm's, and the check that
    decides the ε(δ) path sees it afresh."""
    monkeypatch.setattr(dp, "_LIBM_EXP", None)
    monkeypatch.setattr(dp, "np", _SkewedNumpy())
    assert dp._numpy_exp_is_math_exp() is False


def _hockey_stick(pmf, eps):
    r"""δ(ε) of a dense PMF, directly: infinity mass + :math:`\sum_{\ell > \varepsilon} p\,(1 -
    e^{\varepsilon - \ell})` (``expm1`` of a negative argument: no overflow at any loss), summed
    exactly (``math.fsum``)."""
    losses = (pmf._lower_loss + np.arange(len(pmf._probs))) * pmf._discretization
    above = losses > eps
    terms = np.asarray(pmf._probs)[above] * -np.expm1(eps - losses[above])
    return pmf._infinity_mass + math.fsum(terms.tolist())


def _independent_epsilon(pmf, delta):
    """The smallest ε >= 0 with δ(ε) <= δ (:func:`_hockey_stick`, bisection to 1e-13; δ(ε) is
    non-increasing), inf where the infinity mass exceeds δ."""
    if pmf._infinity_mass > delta:
        return math.inf
    if _hockey_stick(pmf, 0.0) <= delta:
        return 0.0
    lo, hi = 0.0, (pmf._lower_loss + len(pmf._probs)) * pmf._discretization
    while hi - lo > 1e-13 * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if _hockey_stick(pmf, mid) <= delta else (mid, hi)
    return hi


def _two_atoms(lower_loss, d, upper_mass, extra=()):
    """Mass ``upper_mass`` at loss 1, the rest at ``lower_loss`` (grid ``d``), ``extra``
    (index, prob) entries on top: a PMF reaching below -709.78, where exp(-loss) overflows."""
    n = int(round((1.0 - lower_loss) / d)) + 1
    probs = np.zeros(n)
    probs[-1], probs[0] = upper_mass, 1 - upper_mass
    for i, p in extra:
        probs[i] += p
    return pld_pmf.DensePLDPmf(d, int(round(lower_loss / d)), probs, 0.0, True)


#: ε(δ) of the forced libm path against the direct computation. The loop's ε solves δ(ε) = δ
#: exactly on the segment where it stops, from partial sums of n terms: each carries at most
#: n·u of relative error (u = 2^-53), which moves ε by at most n·u·(U + δ)/(U - δ) + n·u; with
#: n <= 1e5 and (U + δ)/(U - δ) <= 1e3 on these PMFs that is < 3e-8 (the bisection: 1e-13).
#: Safe side: ours >= the direct ε - tolerance; above it by at most the tolerance too.
_EPS_TOL = 3e-8


@pytest.mark.float_sensitive
def test_epsilon_for_delta_on_the_forced_libm_path(libm_exp_path):
    """The path taken where numpy's exp is not the C library's (AVX-512), forced: ε(δ) within
    :data:`_EPS_TOL` of a direct computation, never below it, and dp_accounting's own loop's
    value bit for bit where that loop returns (it evaluates the same ``math.exp`` and the same
    sequential sums: one float path); below loss -709.78, where dp_accounting's ``math.exp``
    raises ``OverflowError`` (issue 46), the exact value."""
    composed = pld_lib.self_compose(tp.truncated_poisson_pld(640, 0.1, 97, 1.0,
                                                             discretization=1e-3), 20)
    for delta in (1e-5, 1e-9):
        assert dp.epsilon_for_delta(composed, delta) == composed.get_epsilon_for_delta(delta)
    # mass 0.3 at loss 1, 0.7 at -800: δ(ε) = 0.3 (1 - e^(ε - 1)) for 0 <= ε <= 1
    pmf = _two_atoms(-800.0, 1e-2, 0.3)
    cases = [(pmf, 0.1, 1 + math.log(2 / 3)),   # stops at a positive loss: dp_accounting's too
             (pmf, 0.15, 1 - math.log(2)),
             (pmf, 0.2, 0.0),                    # δ(0) = 0.3 (1 - 1/e) < 0.2
             (pmf, 0.5, 0.0),                    # passes loss -800: dp_accounting raises
             # a negative round-off entry below -709.78 after a positive one: inf + (-inf)
             (_two_atoms(-800.0, 1e-2, 0.3, [(5000, 1e-12), (4000, -1e-300)]), 0.5, 0.0)]
    for pmf, delta, exact in cases:
        ours = dp.epsilon_for_delta_pmf(pmf, delta)
        assert ours == pytest.approx(exact, abs=_EPS_TOL) and ours >= exact - _EPS_TOL
        assert ours == pytest.approx(_independent_epsilon(pmf, delta), abs=_EPS_TOL)
        try:
            ref = pmf.get_epsilon_for_delta(delta)
        except OverflowError:
            assert exact == 0.0  # only where the loop passes loss -709.78
        else:
            assert ours == ref
    # a Gaussian pair, a PMF with infinity mass, a composed one with negative entries
    for name in ("ar s=1 q=.1 d=1e-3", "infinity mass", "composed (negative entries)"):
        pld = dict(PLDS)[name]
        for pmf in _directions(pld):
            for delta in (1e-5, 1e-3, 0.5, 1.9999e-6):
                ours, direct = dp.epsilon_for_delta_pmf(pmf, delta), _independent_epsilon(
                    pmf, delta)
                if math.isinf(direct):
                    assert ours == direct, (name, delta)
                    continue
                assert ours >= direct - _EPS_TOL, (name, delta, ours, direct)
                assert ours <= direct + _EPS_TOL, (name, delta, ours, direct)
                assert ours == pmf.get_epsilon_for_delta(delta), (name, delta)


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
