"""Monte Carlo accountant for BandMF + b-min-sep (Dong & Ganesh, arXiv:2602.09338).

Oracles: brute-force enumeration of every participation pattern (n <= 9), the balls-in-bins
formula, dp_accounting-based PLDs (Poisson / cyclic Poisson), and pinned reference values: PLD
ε of the paper's production setting (§7.4: |D| = 14,745,600, B̄ = 1793, 7200 steps, 256 bands,
δ = 1.301e-8), Appendix A's sample counts (δ′ = δ_t/2), and ε of the setting of §7.1
(n = 1024, |D|/B̄ = 128, δ = 1e-3) with 4 max-error bands at σ = 1.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os

import numpy as np
import pytest
from scipy import special

from opacus_structured.accounting import pld as pld_lib
from opacus_structured.accounting.bminsep_mc import (
    BandedStrategy,
    BandMFMonteCarlo,
    balls_in_bins_log_ratio,
    bminsep_log_ratio,
    bminsep_sampling_prob,
    bminsep_stationary_rate,
    cyclic_poisson_log_ratio,
    sample_bminsep_participation,
    sample_other_counts,
    sample_privacy_losses,
    truncated_bminsep_log_ratios,
)
from opacus_structured.accounting.bounds import BoundKind
from opacus_structured.accounting.certification import (
    cyclic_poisson_fallback,
    sigma_grid,
    unamplified_fallback,
)
from opacus_structured.accounting.mixture import MixturePair
from opacus_structured.accounting.monte_carlo import (
    MonteCarloEpsilon,
    MonteCarloSamples,
    base_delta,
    delta_upper_confidence,
    empirical_delta,
    empirical_epsilon,
    hoeffding_failure_probability,
    kl_bernoulli,
    minimum_samples,
    overall_delta,
)
from opacus_structured.accounting.profiles import PairProfile
from opacus_structured.runners.monte_carlo import (
    MonteCarloSettings,
    certify_noise_multiplier,
    collect_privacy_losses,
    sample_losses,
)

TEST_DISCRETIZATION = 1e-3


def max_error_c(bands):
    """Unit-norm truncated max-error coefficients Π_{j≤k}(2j−1)/(2j) (the reference grid)."""
    c = np.cumprod([1.0] + [(2 * j - 1) / (2 * j) for j in range(1, bands)])
    return c / np.linalg.norm(c)


# ---------------------------------------------------------------------------------------------
# Brute force: enumerate the sensitive example's Markov chain (independent of the DP code)
# ---------------------------------------------------------------------------------------------
def chain_pmf(n, p, b, warm, k_u=1):
    """{x: probability} over all participation vectors of Algorithm 1/2 (k_u: Theorem 6.1)."""
    out = {}
    starts = [(0, 1.0)]
    if warm and b > 1:
        starts = [(0, 1 / (1 + (b - 1) * p))] + [(a, p / (1 + (b - 1) * p)) for a in range(1, b)]
    pj = [math.comb(k_u, j) * p**j * (1 - p) ** (k_u - j) for j in range(k_u + 1)]

    def rec(i, x, prob):
        if i >= n:
            out[tuple(x)] = out.get(tuple(x), 0.0) + prob
            return
        for j in range(k_u + 1):
            if pj[j] == 0:
                continue
            x2 = list(x)
            x2[i] = j
            rec(i + (b if j > 0 else 1), x2, prob * pj[j])

    for a, w in starts:
        rec(a, [0] * n, w)
    return out


def mixture_log_ratio(y, C, sigma, modes):
    """ln Σ_w w·N(C m, σ²)(y)/N(0, σ²)(y) for a list of (weight, mode)."""
    vals = []
    for w, m in modes:
        if w == 0:
            continue
        v = C @ np.asarray(m, float)
        vals.append(math.log(w) + (2 * v @ y - v @ v) / (2 * sigma**2))
    return special.logsumexp(vals)


@pytest.mark.parametrize("warm", [False, True])
def test_recursion_equals_brute_force(warm):
    # Theorem 5.1: exact agreement with enumeration for n <= 9, cold and warm.
    rng = np.random.default_rng(1)
    worst = 0.0
    for n in range(1, 10):
        for b in range(1, 5):
            L = int(rng.integers(1, b + 1))
            c = rng.random(L) + 0.1
            st = BandedStrategy.toeplitz(c, n)
            C = st.matrix()
            for p in (0.3, 0.8, 1.0):
                sigma = float(rng.uniform(0.4, 1.5))
                y = rng.normal(size=n) * 1.5 + 0.3
                pmf = chain_pmf(n, p, b, warm)
                expected = mixture_log_ratio(y, C, sigma, [(w, x) for x, w in pmf.items()])
                got = bminsep_log_ratio(y, st, p, b, sigma, warm_start=warm)
                worst = max(worst, abs(got - expected))
    assert worst < 1e-10


def test_general_banded_columns_brute_force():
    # Non-Toeplitz banded C (e.g. column-normalised): the DP uses the actual columns.
    rng = np.random.default_rng(2)
    n, b = 8, 3
    C = np.tril(rng.random((n, n)) + 0.1) * (np.subtract.outer(np.arange(n), np.arange(n)) < 3)
    st = BandedStrategy.from_matrix(C)
    assert st.bands == 3 and np.allclose(st.matrix(), C)
    y = rng.normal(size=(n, 5))
    got = bminsep_log_ratio(y, st, 0.4, b, 0.8, warm_start=True)
    pmf = chain_pmf(n, 0.4, b, True)
    for s in range(5):
        exp = mixture_log_ratio(y[:, s], C, 0.8, [(w, x) for x, w in pmf.items()])
        assert abs(got[s] - exp) < 1e-10


def test_multi_attribution_brute_force():
    # Theorem 6.1: x_i ~ Binom(k_u, p) when available.
    rng = np.random.default_rng(3)
    for n in range(1, 8):
        for b in (1, 2, 3):
            for k_u in (2, 3):
                st = BandedStrategy.toeplitz(rng.random(min(b, 2)) + 0.1, n)
                y = rng.normal(size=n)
                got = bminsep_log_ratio(y, st, 0.35, b, 0.9, max_user_examples=k_u)
                pmf = chain_pmf(n, 0.35, b, False, k_u)
                exp = mixture_log_ratio(y, st.matrix(), 0.9, [(w, x) for x, w in pmf.items()])
                assert abs(got - exp) < 1e-10


@pytest.mark.parametrize("warm", [False, True])
def test_truncated_recursions_brute_force(warm):
    # Appendix D / Corollary D.2: P = mix N(C x), x ∈ {0,1,2}; Q = mix N(C y'), y' ∈ {0,-1}.
    rng = np.random.default_rng(4)
    n, b, B, p, sigma = 7, 2, 3, 0.45, 0.9
    st = BandedStrategy.toeplitz([0.8, 0.6], n)
    C = st.matrix()
    r = np.array([1, 3, 5, 2, 4, 0, 3])
    y = rng.normal(size=n) + 0.5
    pmf = chain_pmf(n, p, b, warm)
    modes_p, modes_q = [], []
    for x, w in pmf.items():
        part = [i for i in range(n) if x[i]]
        trunc = [i for i in part if r[i] >= B]
        for keep in itertools.product([0, 1], repeat=len(trunc)):
            pr = w
            mp = np.array(x, float)
            mq = np.zeros(n)
            for i, kept in zip(trunc, keep, strict=True):
                s = B / (r[i] + 1)
                pr *= s if kept else 1 - s
                mp[i] = 2.0 if kept else 0.0
                mq[i] = -1.0 if kept else 0.0
            modes_p.append((pr, mp))
            modes_q.append((pr, mq))
    lp, lq = truncated_bminsep_log_ratios(y, r, st, p, b, sigma, B, warm_start=warm)
    assert abs(lp - mixture_log_ratio(y, C, sigma, modes_p)) < 1e-10
    assert abs(lq - mixture_log_ratio(y, C, sigma, modes_q)) < 1e-10


def test_last_columns_norm_order_regression():
    # jax_privacy (snapshot 2026-08-11) sets squared_norms[-L+1:] = cumsum(c²)[:-1],
    # i.e. the last b−1 column norms in REVERSED order, under-counting the loss. Ours must use
    # ‖c_{n−1}‖² = c_0², ‖c_{n−2}‖² = c_0² + c_1², … and match brute force.
    n, b = 7, 3
    c = np.array([0.8, 0.5, 0.33])
    st = BandedStrategy.toeplitz(c, n)
    np.testing.assert_allclose(st.squared_norms[-2:], [c[0] ** 2 + c[1] ** 2, c[0] ** 2])
    np.testing.assert_allclose(st.squared_norms[:-2], np.sum(c**2))
    rng = np.random.default_rng(5)
    y = rng.normal(size=n) + 1.0
    p, sigma = 0.5, 0.7
    ours = bminsep_log_ratio(y, st, p, b, sigma)
    exact = mixture_log_ratio(y, st.matrix(), sigma,
                              [(w, x) for x, w in chain_pmf(n, p, b, False).items()])
    assert abs(ours - exact) < 1e-12
    # The reversed-norm variant (the reference's line) differs and is smaller (under-counts).
    bad = st.squared_norms.copy()
    bad[-(b - 1):] = np.cumsum(c**2)[:-1]
    assert not np.allclose(bad, st.squared_norms)
    cols = st.columns.copy()
    lr_bad = (2 * st.window_dots(y[:, None])[:, 0] - bad) / (2 * sigma**2)
    buf = np.zeros(b)
    for i in range(n - 1, -1, -1):
        buf[i % b] = np.logaddexp(math.log1p(-p) + buf[(i + 1) % b],
                                  math.log(p) + lr_bad[i] + buf[i % b])
    assert buf[0] < exact - 1e-3
    assert cols.shape == (n, 3)


def test_warm_start_p1_is_balls_in_bins():
    # §4: warm start (Algorithm 2) with p = 1, b = T is balls-in-bins (an exact identity).
    rng = np.random.default_rng(6)
    for n, T, L in [(20, 4, 4), (33, 5, 2), (9, 3, 1)]:
        st = BandedStrategy.toeplitz(max_error_c(L), n)
        y = rng.normal(size=(n, 50)) + 0.2
        a = bminsep_log_ratio(y, st, 1.0, T, 0.8, warm_start=True)
        bib = balls_in_bins_log_ratio(y, st, T, 0.8)
        cyc = cyclic_poisson_log_ratio(y, st, 1.0, T, 0.8)
        np.testing.assert_allclose(a, bib, atol=1e-10)
        np.testing.assert_allclose(cyc, bib, atol=1e-10)


def test_participation_sampler_matches_chain():
    # Sampler law = the enumerated Markov chain (chi-square style tolerance, 4 sigma).
    rng = np.random.default_rng(7)
    n, p, b = 6, 0.4, 3
    for warm in (False, True):
        pmf = chain_pmf(n, p, b, warm)
        S = 40000
        x = sample_bminsep_participation(n, p, b, S, rng, warm_start=warm)
        keys, counts = np.unique(x.T, axis=0, return_counts=True)
        emp = {tuple(k.astype(int)): c / S for k, c in zip(keys, counts, strict=True)}
        assert set(emp) <= set(pmf)
        for key, prob in pmf.items():
            se = math.sqrt(prob * (1 - prob) / S)
            assert abs(emp.get(key, 0.0) - prob) < 4 * se + 1e-4
        gaps = [np.diff(np.nonzero(x[:, s])[0]) for s in range(200)]
        assert all(np.all(g >= b) for g in gaps)


def test_warm_start_stationary_rate_and_other_counts():
    rng = np.random.default_rng(8)
    m, B, b, n = 1000, 50, 5, 40
    p = bminsep_sampling_prob(m, B, b)
    assert math.isclose(1 / (1 / p + b - 1), B / m)
    x = sample_bminsep_participation(n, p, b, 20000, rng, warm_start=True)
    rate = x.mean(axis=1)
    assert np.all(np.abs(rate - B / m) < 5 * math.sqrt(B / m / 20000))
    r = sample_other_counts(n, p, b, m - 1, 400, rng, warm_start=True)
    assert abs(r.mean() - (m - 1) * B / m) < 1.0


# ---------------------------------------------------------------------------------------------
# Monte Carlo δ and the tail bounds
# ---------------------------------------------------------------------------------------------
def test_evr_sample_counts_table():
    # Appendix A's recipe δ' = δ_t/2; min s with δ_{o,min} <= δ_t (references to 3-4 digits).
    for dt, s_ref, rel in [(1e-3, 7.50e4, 5e-3), (1e-5, 1.075e7, 5e-4), (2e-6, 5.93e7, 1e-3),
                           (1.301e-8, 1.18e10, 5e-3)]:
        s = minimum_samples(dt / 2, dt)
        assert abs(s / s_ref - 1) < rel, (dt, s)
        assert overall_delta(s, dt / 2) <= dt < overall_delta(s - 1, dt / 2)
    # At s = 7.5e9 and δ_t = 1.301e-8 the admissible δ' is ≈ 5.14e-9 (δ_t/2.53).
    dp = base_delta(7_500_000_000, 1.301e-8)
    assert abs(dp / 5.14e-9 - 1) < 2e-3
    assert overall_delta(7_500_000_000, dp) <= 1.301e-8


def test_kl_and_confidence_bound():
    assert kl_bernoulli(0.1, 0.1) == 0
    assert math.isclose(kl_bernoulli(0.2, 0.5), 0.2 * math.log(0.4) + 0.8 * math.log(1.6))
    assert math.isclose(hoeffding_failure_probability(100, 0.5, 0.2),
                        math.exp(-100 * kl_bernoulli(0.2, 0.5)))
    assert hoeffding_failure_probability(100, 0.1, 0.2) == 1.0
    s, q = 10000, 1e-3
    u = delta_upper_confidence(0.01, s, q)
    assert u > 0.01 and math.isclose(s * kl_bernoulli(0.01, u), math.log(1 / q), rel_tol=1e-6)
    # coverage: empirical frequency of truth > UCB is below q (Bernoulli means, 2000 trials)
    rng = np.random.default_rng(9)
    true = 0.02
    means = rng.binomial(500, true, size=2000) / 500
    miss = np.mean([delta_upper_confidence(mh, 500, 0.05) < true for mh in means])
    assert miss <= 0.05


def test_empirical_delta_and_epsilon():
    losses = np.array([0.0, 1.0, 2.0, 3.0])
    assert math.isclose(empirical_delta(losses, 1.0),
                        (-math.expm1(-1.0) - math.expm1(-2.0)) / 4)
    eps = empirical_epsilon(losses, 0.1)
    assert math.isclose(empirical_delta(losses, eps), 0.1, rel_tol=1e-6)
    with pytest.raises(ValueError, match="delta"):
        empirical_epsilon(losses, 0.0)
    with pytest.raises(ValueError, match="NaN"):
        empirical_delta([np.nan], 1.0)


def test_estimate_is_labelled_monte_carlo():
    rng = np.random.default_rng(10)
    samples = MonteCarloSamples(rng.normal(0.5, 1, 4000), rng.normal(-0.5, 1, 4000))
    est = samples.estimate(0.05, failure_probability=1e-2)
    assert est.kind is BoundKind.MONTE_CARLO and est.to_dict()["kind"] == "monte-carlo"
    assert "Monte Carlo" in str(est) and "probability" in str(est)
    assert est.epsilon >= est.point_epsilon
    val = MonteCarloEpsilon(est)
    assert float(val) == est.epsilon
    assert "Monte Carlo" in f"{val:.3f}" and "Monte Carlo" in str(val)
    assert json.loads(json.dumps({"e": val}))["e"] == est.epsilon


def _poisson_pld_eps(q, sigma, steps, delta):
    pair = MixturePair.from_components([1.0, 0.0], [q, 1 - q], [0.0], [1.0], sigma)
    pld = pld_lib.pld_from_profile(PairProfile(pair), PairProfile(pair.reversed()),
                                   discretization=TEST_DISCRETIZATION)
    composed = pld_lib.self_compose(pld, steps)
    return pld_lib.epsilon_for_delta(composed, delta), composed


def _within_mc_error(losses, epsilon, delta_ref, z=4.5):
    terms = -np.expm1(np.minimum(epsilon - losses, 0.0))
    se = terms.std(ddof=1) / math.sqrt(losses.size)
    return abs(terms.mean() - delta_ref) <= z * se + 1e-12, terms.mean(), se


def test_b1_matches_poisson_pld():
    # §4: b = 1 is Poisson DP-SGD; the MC δ at the PLD's ε agrees within MC error.
    n, q, sigma, delta = 128, 1 / 16, 1.0, 1e-2
    eps, composed = _poisson_pld_eps(q, sigma, n, delta)
    mech = BandMFMonteCarlo(BandedStrategy.toeplitz([1.0], n), sigma, "bminsep", q, 1)
    s = collect_privacy_losses(mech, 20000, seed=1, workers=1)
    d_mc = s.empirical_delta(eps)
    d_pld = pld_lib.delta_for_epsilon(composed, eps)
    se = max(np.std(-np.expm1(np.minimum(eps - s.remove, 0))),
             np.std(-np.expm1(np.minimum(eps - s.add, 0)))) / math.sqrt(20000)
    assert abs(d_mc - d_pld) < 4.5 * se + 2e-3 * d_pld  # PLD discretisation is pessimistic


@pytest.mark.parametrize("q, steps, delta, sigma, eps_ref, unit", [
    # production DP-SGD Poisson lower bound (§7.4): q = 1793/14,745,600, 7200 steps
    (1793 / 14_745_600, 7200, 1.301e-8, 0.36, 10.64, 0.01),
    (1793 / 14_745_600, 7200, 1.301e-8, 0.368, 9.905, 0.001),
    (1793 / 14_745_600, 7200, 1.301e-8, 0.37, 9.735, 0.001),
    # untruncated cyclic Poisson, production parameters (q = 256·1793/14,745,600, 29 cycles)
    (0.031128, 29, 1.301e-8, 0.627, 8.12, 0.01),
    (0.031128, 29, 1.301e-8, 0.56, 10.63, 0.01),
    (0.031128, 29, 1.301e-8, 0.60, 9.02, 0.01),
    # the b = 1 identity's PLD side (n = 1024, p0 = 1/128, δ = 1e-3)
    (1 / 128, 1024, 1e-3, 0.8, 1.495, 0.001),
    (1 / 128, 1024, 1e-3, 1.0, 0.880, 0.001),
])
def test_pld_reference_values(q, steps, delta, sigma, eps_ref, unit):
    # dp_accounting PLDs at discretisation 1e-3, quoted to 3-4 significant digits; ours (pessimistic connect-the-dots, same discretisation) must agree to
    # the quoted digits (0.6 units of the last digit).
    eps, composed = _poisson_pld_eps(q, sigma, steps, delta)
    # the composed PLD read as dp_accounting reads it matches the quoted digits; the certified
    # ε (read at δ minus the composition's round-off floor, issue 29 case 6) is never below it
    raw = composed.get_epsilon_for_delta(delta)
    assert abs(raw - eps_ref) <= 0.6 * unit, raw
    assert eps >= raw


def test_cpu_grid_small_sample():
    # Reference row (L = 4, σ = 1): n = 1024, p0 = 1/128, δ = 1e-3, warm start, C = max-error.
    # cyclic Poisson (PLD) 2.099; b-min-sep b=4 1.561; balls-in-bins T=128 7.059.
    n, p0, delta, sigma = 1024, 1 / 128, 1e-3, 1.0
    c = max_error_c(4)
    st = BandedStrategy.toeplitz(c, n)
    eps_cyc, _ = _poisson_pld_eps(4 * p0, sigma, math.ceil(n / 4), delta)
    assert abs(eps_cyc - 2.099) < 0.01
    p = p0 / (1 - 3 * p0)
    bms = BandMFMonteCarlo(st, sigma, "bminsep", p, 4, warm_start=True)
    s = collect_privacy_losses(bms, 6000, seed=11, workers=1)
    # δ̃ at the reference ε is 1e-3 within MC error (remove direction dominates).
    ok, mean, se = _within_mc_error(s.remove, 1.561, delta)
    assert ok, (mean, se)
    assert empirical_delta(s.add, 1.561) < 3e-4
    bib = BandMFMonteCarlo(st, sigma, "balls-in-bins", 1.0, 128)
    sb = collect_privacy_losses(bib, 3000, seed=12, workers=1)
    ok, mean, se = _within_mc_error(sb.remove, 7.059, delta)
    assert ok, (mean, se)


@pytest.mark.slow
def test_cpu_grid_reproduction_full():
    # The reference row with 1e5 samples per direction (5e4 for balls-in-bins) and the b = 1
    # identity: δ̃ at the reference ε equals δ = 1e-3 within MC error (4 standard errors).
    n, p0, delta, sigma = 1024, 1 / 128, 1e-3, 1.0
    st = BandedStrategy.toeplitz(max_error_c(4), n)
    cases = [
        (BandMFMonteCarlo(st, sigma, "bminsep", p0 / (1 - 3 * p0), 4, warm_start=True),
         100_000, 1.561),
        (BandMFMonteCarlo(st, sigma, "balls-in-bins", 1.0, 128), 50_000, 7.059),
        (BandMFMonteCarlo(BandedStrategy.toeplitz([1.0], n), sigma, "bminsep", p0, 1),
         100_000, 0.880),  # b = 1: Poisson PLD 0.880
    ]
    for mech, count, eps_ref in cases:  # ~2 min on one core
        s = collect_privacy_losses(mech, count, seed=0, workers=1)
        worst = s.remove if empirical_delta(s.remove, eps_ref) >= empirical_delta(
            s.add, eps_ref) else s.add
        ok, mean, se = _within_mc_error(worst, eps_ref, delta, z=4.0)
        assert ok, (mech.sampling, mean, se)


# ---------------------------------------------------------------------------------------------
# Shards, resume, backends
# ---------------------------------------------------------------------------------------------
def test_shards_merge_exactly_and_resume(tmp_path):
    st = BandedStrategy.toeplitz(max_error_c(2), 16)
    mech = BandMFMonteCarlo(st, 0.9, "bminsep", 0.2, 2, warm_start=True)
    full = collect_privacy_losses(mech, 2500, seed=3, shard_size=1000, workers=1)
    d = str(tmp_path / "run")
    assert collect_privacy_losses(mech, 2500, seed=3, shard_size=1000, workers=1,
                                  directory=d, shards=[0, 2]) is None
    assert sorted(os.listdir(d)) == ["add-0.npz", "add-2.npz", "meta.json", "remove-0.npz",
                                     "remove-2.npz"]
    resumed = collect_privacy_losses(mech, 2500, seed=3, shard_size=1000, workers=1, directory=d)
    np.testing.assert_array_equal(full.remove, resumed.remove)
    np.testing.assert_array_equal(full.add, resumed.add)
    merged = (MonteCarloSamples(full.remove[:1000], full.add[:1000])
              + MonteCarloSamples(full.remove[1000:], full.add[1000:]))
    assert merged.empirical_delta(0.5) == full.empirical_delta(0.5)
    other = BandMFMonteCarlo(st, 1.0, "bminsep", 0.2, 2, warm_start=True)
    with pytest.raises(ValueError, match="another run"):
        collect_privacy_losses(other, 2500, seed=3, shard_size=1000, workers=1, directory=d)


def test_process_pool_equals_inline():
    st = BandedStrategy.toeplitz([1.0], 8)
    mech = BandMFMonteCarlo(st, 1.0, "bminsep", 0.3, 1)
    a = collect_privacy_losses(mech, 600, seed=5, shard_size=200, workers=1)
    b = collect_privacy_losses(mech, 600, seed=5, shard_size=200, workers=2)
    np.testing.assert_array_equal(a.remove, b.remove)


def test_torch_backend_cpu_agrees_in_distribution():
    torch = pytest.importorskip("torch")
    del torch
    st = BandedStrategy.toeplitz(max_error_c(3), 64)
    for mech in (BandMFMonteCarlo(st, 0.8, "bminsep", 0.1, 3, warm_start=True),
                 BandMFMonteCarlo(st, 0.8, "bminsep", 0.1, 3, max_user_examples=2),
                 BandMFMonteCarlo(st, 0.8, "cyclic-poisson", 0.3, 3),
                 BandMFMonteCarlo(st, 0.8, "balls-in-bins", 1.0, 8),
                 BandMFMonteCarlo(st, 0.8, "bminsep", 0.1, 3, truncated_batch_size=3,
                                  dataset_size=60),
                 BandMFMonteCarlo(st, 0.8, "bminsep", 0.1, 3, warm_start=True,
                                  truncated_batch_size=2, dataset_size=60)):
        for direction in ("remove", "add"):
            a = sample_privacy_losses(mech, 6000, direction, seed=1)
            b = sample_losses(mech, 6000, direction, seed=1, device="cpu")
            eps = float(np.quantile(a, 0.9))
            ta = -np.expm1(np.minimum(eps - a, 0))
            tb = -np.expm1(np.minimum(eps - b, 0))
            se = math.hypot(ta.std(), tb.std()) / math.sqrt(6000)
            assert abs(ta.mean() - tb.mean()) < 5 * se


def _torch_equality_mechanisms():
    rng = np.random.default_rng(21)
    n = 30
    st3 = BandedStrategy.toeplitz(max_error_c(3), n)
    cols = np.tril(rng.random((n, n)) + 0.1) * (np.subtract.outer(np.arange(n), np.arange(n)) < 2)
    st_gen = BandedStrategy.from_matrix(cols)
    st_fft = BandedStrategy.toeplitz(max_error_c(50), 70)  # numpy uses FFT correlation here
    return [
        BandMFMonteCarlo(st3, 0.8, "bminsep", 0.2, 3),
        BandMFMonteCarlo(st3, 0.8, "bminsep", 0.2, 4, warm_start=True),
        BandMFMonteCarlo(st3, 0.7, "bminsep", 1.0, 3, warm_start=True),
        BandMFMonteCarlo(st_gen, 0.9, "bminsep", 0.3, 2, warm_start=True),
        BandMFMonteCarlo(st3, 0.8, "bminsep", 0.2, 3, max_user_examples=3),
        BandMFMonteCarlo(st3, 0.8, "bminsep", 1.0, 3, max_user_examples=2),
        BandMFMonteCarlo(st3, 0.8, "cyclic-poisson", 0.3, 4),
        BandMFMonteCarlo(st3, 0.8, "balls-in-bins", 1.0, 5),
        BandMFMonteCarlo(st_fft, 1.2, "bminsep", 0.05, 50, warm_start=True),
        BandMFMonteCarlo(st3, 0.8, "bminsep", 0.25, 3, truncated_batch_size=3, dataset_size=40),
        BandMFMonteCarlo(st3, 0.8, "bminsep", 0.25, 3, warm_start=True, truncated_batch_size=2,
                         dataset_size=40),
    ]


def test_torch_log_ratios_equal_numpy_for_fixed_inputs():
    # Gap closed in the torch backend: every variant (incl. truncated + padded and
    # multi-attribution) evaluates the same dynamic program as numpy: same y (and same other
    # counts r) -> the same log-ratio vector to 1e-10 (float64, CPU).
    pytest.importorskip("torch")
    from opacus_structured.runners.bminsep_mc_torch import TorchBandMF

    rng = np.random.default_rng(22)
    for mech in _torch_equality_mechanisms():
        n, S = mech.iterations, 64
        y = rng.normal(size=(n, S)) * 1.3 + 0.4
        tb = TorchBandMF(mech, "cpu")
        if mech.truncated_batch_size is None:
            want = mech.log_ratio(y)
            got = tb.log_ratio(y).numpy()
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
        else:
            r = sample_other_counts(n, mech.sampling_prob, mech.min_sep, mech.dataset_size - 1,
                                    S, rng, warm_start=mech.warm_start)
            assert np.any(r >= mech.truncated_batch_size)  # the truncated branch is exercised
            want_p, want_q = truncated_bminsep_log_ratios(
                y, r, mech.strategy, mech.sampling_prob, mech.min_sep, mech.noise_multiplier,
                mech.truncated_batch_size, warm_start=mech.warm_start)
            got_p, got_q = tb.truncated_log_ratios(y, r)
            np.testing.assert_allclose(got_p.numpy(), want_p, rtol=0, atol=1e-10)
            np.testing.assert_allclose(got_q.numpy(), want_q, rtol=0, atol=1e-10)
        assert np.all(np.isfinite(want if mech.truncated_batch_size is None else want_p))


def test_torch_samplers_match_numpy_in_distribution():
    # The torch participation / other-count samplers have the numpy laws (means per step).
    pytest.importorskip("torch")
    from opacus_structured.runners.bminsep_mc_torch import TorchBandMF

    st = BandedStrategy.toeplitz(max_error_c(3), 20)
    S = 20000
    for warm, k_u in ((False, 1), (True, 1), (False, 3)):
        mech = BandMFMonteCarlo(st, 1.0, "bminsep", 0.15, 3, warm_start=warm,
                                max_user_examples=k_u)
        tb = TorchBandMF(mech, "cpu")
        tb.gen.manual_seed(0)
        xt = tb.participation(S).numpy()
        xn = sample_bminsep_participation(20, 0.15, 3, S, np.random.default_rng(0),
                                          warm_start=warm, max_user_examples=k_u)
        se = np.sqrt(xt.var(1) + xn.var(1)) / math.sqrt(S) + 1e-12
        assert np.all(np.abs(xt.mean(1) - xn.mean(1)) < 5 * se)
    mech = BandMFMonteCarlo(st, 1.0, "bminsep", 0.15, 3, warm_start=True,
                            truncated_batch_size=3, dataset_size=25)
    tb = TorchBandMF(mech, "cpu")
    tb.gen.manual_seed(1)
    rt = tb.other_counts(S).numpy()
    rn = sample_other_counts(20, 0.15, 3, 24, S, np.random.default_rng(1), warm_start=True)
    se = np.sqrt(rt.var(1) + rn.var(1)) / math.sqrt(S)
    assert np.all(np.abs(rt.mean(1) - rn.mean(1)) < 5 * se)
    # stationary warm start: E r_i = 24 * p0, p0 = p / (1 + (b-1) p), at every step
    p0 = 0.15 / (1 + 2 * 0.15)
    assert np.all(np.abs(rt.mean(1) - 24 * p0) < 5 * rt.std(1) / math.sqrt(S))


def test_accounting_never_imports_torch_nor_the_runner():
    # The math stays torch-free and process-free: no module of opacus_structured.accounting
    # imports torch or the runner layer, at module level or inside a function.
    import ast
    import pathlib

    import opacus_structured.accounting as acc

    modules = sorted(pathlib.Path(acc.__file__).parent.glob("*.py"))
    assert {m.stem for m in modules} >= {"bminsep_mc", "monte_carlo", "certification"}
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith("torch"), (path.name, name)
                assert "runners" not in name and "concurrent" not in name, (path.name, name)


@pytest.mark.cuda
def test_torch_backend_cuda():
    st = BandedStrategy.toeplitz(max_error_c(4), 256)
    mech = BandMFMonteCarlo(st, 1.0, "bminsep", 0.05, 4, warm_start=True)
    a = sample_privacy_losses(mech, 20000, "remove", seed=2)
    b = sample_losses(mech, 20000, "remove", seed=2, device="cuda")
    eps = float(np.quantile(a, 0.95))
    ta, tb = -np.expm1(np.minimum(eps - a, 0)), -np.expm1(np.minimum(eps - b, 0))
    assert abs(ta.mean() - tb.mean()) < 5 * math.hypot(ta.std(), tb.std()) / math.sqrt(20000)


@pytest.mark.cuda
def test_torch_log_ratios_equal_numpy_on_cuda():
    from opacus_structured.runners.bminsep_mc_torch import TorchBandMF

    rng = np.random.default_rng(23)
    for mech in _torch_equality_mechanisms():
        n, S = mech.iterations, 64
        y = rng.normal(size=(n, S)) + 0.4
        tb = TorchBandMF(mech, "cuda")
        if mech.truncated_batch_size is None:
            np.testing.assert_allclose(tb.log_ratio(y).cpu().numpy(), mech.log_ratio(y),
                                       rtol=0, atol=1e-9)
        else:
            r = sample_other_counts(n, mech.sampling_prob, mech.min_sep, mech.dataset_size - 1,
                                    S, rng, warm_start=mech.warm_start)
            want = truncated_bminsep_log_ratios(
                y, r, mech.strategy, mech.sampling_prob, mech.min_sep, mech.noise_multiplier,
                mech.truncated_batch_size, warm_start=mech.warm_start)
            for g, w in zip(tb.truncated_log_ratios(y, r), want, strict=True):
                np.testing.assert_allclose(g.cpu().numpy(), w, rtol=0, atol=1e-9)


# ---------------------------------------------------------------------------------------------
# Algorithm 5
# ---------------------------------------------------------------------------------------------
def test_sigma_grid():
    g = sigma_grid(1.0, 1.05)
    np.testing.assert_allclose(g, [1.0, 1.01, 1.01**2, 1.01**3, 1.01**4])
    with pytest.raises(ValueError, match="ratio"):
        sigma_grid(1.0, 2.0, ratio=1.0)


def test_algorithm5_certifies_and_is_sound_for_poisson():
    # b = 1: the chosen σ can be checked against the exact (PLD) δ of Poisson DP-SGD.
    n, q, eps, dt = 16, 0.25, 2.0, 0.05
    mech = BandMFMonteCarlo(BandedStrategy.toeplitz([1.0], n), 1.0, "bminsep", q, 1)
    res = certify_noise_multiplier(mech, eps, dt, sigma_min=0.5, ratio=1.05, seed=0)
    assert res.overall_delta <= dt and res.base_delta == dt / 2
    assert res.num_samples == minimum_samples(dt / 2, dt)
    assert res.noise_multiplier <= res.fallback.noise_multiplier
    assert "Theorem A.1" in res.statement
    if not res.fallback_used:
        assert res.verified[-2][1] is True or len(res.verified) == 1
        _, composed = _poisson_pld_eps(q, res.noise_multiplier, n, 0.5)
        # the verified σ is (ε, δ_t)-DP in truth (overwhelmingly likely; pessimistic PLD)
        assert pld_lib.delta_for_epsilon(composed, eps) <= dt
    # the scan stops at the first failure, scanning from the top
    sig = [v[0] for v in res.verified]
    assert sig == sorted(sig, reverse=True)
    assert all(v[1] for v in res.verified[:-1])


def test_fallbacks():
    n = 64
    st = BandedStrategy.toeplitz(max_error_c(4), n)
    mech = BandMFMonteCarlo(st, 1.0, "bminsep", 0.05, 4, warm_start=True)
    fb = unamplified_fallback(mech, 2.0, 1e-3)
    from opacus_structured.accounting.gaussian import gaussian_delta
    assert gaussian_delta(2.0, fb.noise_multiplier, math.sqrt(16)) <= 1e-3
    cp = cyclic_poisson_fallback(mech, 0.01, 2.0, 1e-3, discretization=TEST_DISCRETIZATION)
    assert cp.epsilon <= 2.0 and cp.noise_multiplier < fb.noise_multiplier
    # Theorem A.1 (b): the fallback must be (ε, δ')-DP; one certified at a larger δ is refused.
    loose = unamplified_fallback(mech, 2.0, 2e-2)
    with pytest.raises(ValueError, match="fallback"):
        certify_noise_multiplier(mech, 2.0, 1e-2, sigma_min=1.0, fallback=loose)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
def test_validation_errors():
    st = BandedStrategy.toeplitz([1.0, 0.5, 0.2], 10)
    y = np.zeros(10)
    with pytest.raises(ValueError, match="min_sep"):
        bminsep_log_ratio(y, st, 0.1, 2, 1.0)
    with pytest.raises(ValueError, match="sampling_prob"):
        bminsep_log_ratio(y, st, 1.5, 3, 1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        bminsep_log_ratio(y, st, 0.1, 3, 0.0)
    with pytest.raises(ValueError, match="non-negative"):
        BandedStrategy.toeplitz([1.0, -0.1], 5)
    with pytest.raises(ValueError, match="y must have shape"):
        bminsep_log_ratio(np.zeros(9), st, 0.1, 3, 1.0)
    with pytest.raises(ValueError, match="min_sep"):
        bminsep_sampling_prob(1000, 100, 11)
    with pytest.raises(ValueError, match="warm start"):
        BandMFMonteCarlo(st, 1.0, "bminsep", 0.1, 3, warm_start=True, max_user_examples=2)
    with pytest.raises(ValueError, match="dataset_size"):
        BandMFMonteCarlo(st, 1.0, "bminsep", 0.1, 3, truncated_batch_size=5)
    with pytest.raises(ValueError, match="sampling"):
        BandMFMonteCarlo(st, 1.0, "uniform", 0.1, 3)
    with pytest.raises(ValueError, match="target_delta"):
        minimum_samples(1e-3, 5e-4)


def test_truncated_sampler_end_to_end():
    st = BandedStrategy.toeplitz(max_error_c(2), 12)
    mech = BandMFMonteCarlo(st, 0.8, "bminsep", 0.3, 2, warm_start=True,
                            truncated_batch_size=4, dataset_size=10)
    s = collect_privacy_losses(mech, 800, seed=0, workers=1)
    assert np.all(np.isfinite(s.remove)) and np.all(np.isfinite(s.add))
    # Sanity: the remove-direction mean is KL(P‖Q) ≥ 0 up to MC error (exactness of the
    # recursions is checked against brute force above).
    assert s.remove.mean() > -3 * s.remove.std() / math.sqrt(800)
    d = mech.to_dict()
    assert BandMFMonteCarlo.from_dict(json.loads(json.dumps(d))) == mech


# ---------------------------------------------------------------------------------------------
# Scheme, Opacus accountant, CLI
# ---------------------------------------------------------------------------------------------
SMALL_RUN = MonteCarloSettings(samples=3000, workers=1, seed=0)


def _small_scheme(**kw):
    from opacus_structured.schemes.bminsep_mc import BMinSepMonteCarloScheme

    args = dict(bands=2, dataset_size=320, batch_size=10, warm_start=True, strategy="max-error")
    args.update(kw)
    return BMinSepMonteCarloScheme(**args)


def test_scheme_is_labelled_monte_carlo():
    scheme = _small_scheme()
    assert scheme.bound is BoundKind.MONTE_CARLO
    assert math.isclose(scheme.sampling_prob, 10 / (320 - 10))
    with pytest.raises(ValueError, match="Monte Carlo"):
        scheme.pld(1.0)
    eps = scheme.epsilon(1.0, 32, 1e-2, settings=SMALL_RUN)
    assert isinstance(eps, MonteCarloEpsilon) and "Monte Carlo" in f"{eps:.4g}"
    est = scheme.estimate(1.0, 32, 1e-2, settings=SMALL_RUN)
    assert est.epsilon == float(eps) and est.epsilon >= est.point_epsilon and est.seed == 0
    assert 0 <= scheme.delta(1.0, 32, float(eps), settings=SMALL_RUN) <= 1
    from opacus_structured.schemes import Scheme
    assert Scheme.from_dict(scheme.to_dict()) == scheme
    with pytest.raises(ValueError, match="min_sep"):
        _small_scheme(bands=40)
    with pytest.raises(ValueError, match="settings"):
        scheme.epsilon(1.0, 32, 1e-2, settings={"samples": 10})


def test_scheme_describes_the_mechanism_and_settings_the_run():
    # The frozen scheme holds only the mechanism; samples, seed, q, workers, device and
    # progress are MonteCarloSettings, and q belongs to the run (it changes no batch).
    scheme = _small_scheme()
    fields = set(scheme.to_dict()) - {"scheme"}
    assert fields == {"bands", "dataset_size", "batch_size", "min_sep", "warm_start", "truncate",
                      "max_user_examples", "sampling_probability", "strategy", "horizon"}
    with pytest.raises(TypeError, match="samples"):
        _small_scheme(samples=100)
    # without a seed, every run draws a fresh one and records it
    free = MonteCarloSettings(samples=500, workers=1)
    a, b = (scheme.estimate(1.0, 8, 0.05, settings=free) for _ in range(2))
    assert a.seed is not None and b.seed is not None and a.seed != b.seed
    again = scheme.estimate(1.0, 8, 0.05, settings=dataclasses.replace(free, seed=a.seed))
    assert again.epsilon == a.epsilon  # the audit: the recorded seed reproduces the estimate
    # a different confidence changes the statement, not the samples
    loose = scheme.estimate(1.0, 8, 0.05, settings=dataclasses.replace(
        free, seed=a.seed, failure_probability=0.1))
    assert loose.point_epsilon == a.point_epsilon and loose.epsilon <= a.epsilon
    assert MonteCarloSettings.from_dict(json.loads(json.dumps(SMALL_RUN.to_dict()))) == SMALL_RUN
    for bad, name in ((dict(samples=0), "samples"), (dict(seed=-1), "seed"),
                      (dict(failure_probability=1.0), "failure_probability"),
                      (dict(workers=0), "workers"), (dict(device=3), "device"),
                      (dict(shard_size=0), "shard_size"), (dict(progress="yes"), "progress")):
        with pytest.raises(ValueError, match=name):
            MonteCarloSettings(**bad)


def test_scheme_rate_from_batch_size_or_given_exactly():
    # One formula for p = B/(N - (b-1)B) (accounting.bminsep_mc); a scheme may also be given p
    # (a sampler's rate) if it agrees with batch_size, and keeps it exactly.
    from opacus_structured.schemes.bminsep_mc import BMinSepMonteCarloScheme

    scheme = _small_scheme(min_sep=4)
    assert scheme.sampling_prob == bminsep_sampling_prob(320, 10, 4)
    p = 0.0371
    own = BMinSepMonteCarloScheme.from_sampling_probability(320, p, 4, warm_start=True)
    assert own.sampling_prob == p and own.bands == 1
    assert own.batch_size == pytest.approx(320 * bminsep_stationary_rate(p, 4))
    with pytest.raises(ValueError, match="sampling_probability"):
        _small_scheme(sampling_probability=0.5)


def test_accountant_adapter():
    from opacus_structured.accountants.base import (
        AccountantNotAttachedError,
        register_scheme_accountant,
    )
    from opacus_structured.accountants.bminsep_mc import BMinSepMonteCarloAccountant

    scheme = _small_scheme()
    acc = BMinSepMonteCarloAccountant(scheme, settings=SMALL_RUN)
    acc.step(noise_multiplier=1.0, sample_rate=10 / 320, num_steps=32)
    eps = acc.get_epsilon(1e-2)
    assert isinstance(eps, MonteCarloEpsilon) and acc.bound is BoundKind.MONTE_CARLO
    assert float(eps) == float(scheme.epsilon(1.0, 32, 1e-2, settings=SMALL_RUN))
    est, kind = acc.get_privacy_spent(delta=1e-2)
    assert kind is BoundKind.MONTE_CARLO and est.kind is BoundKind.MONTE_CARLO
    assert est.epsilon == float(eps)
    state = acc.state_dict()
    assert state["monte_carlo"] == SMALL_RUN.to_dict()
    acc2 = BMinSepMonteCarloAccountant(scheme, settings=SMALL_RUN)
    acc2.load_state_dict(state)
    assert len(acc2) == 32 and float(acc2.get_epsilon(1e-2)) == float(eps)
    cls = register_scheme_accountant("bminsep-mc-test", scheme, base=BMinSepMonteCarloAccountant)
    assert cls().bound is BoundKind.MONTE_CARLO
    with pytest.raises(AccountantNotAttachedError, match="recorded no step"):
        BMinSepMonteCarloAccountant(scheme, settings=SMALL_RUN).get_epsilon(1e-2)


def test_accountant_resumes_the_checkpoint_run_and_refuses_another_seed():
    from opacus_structured.accountants.bminsep_mc import BMinSepMonteCarloAccountant

    scheme = _small_scheme()
    run = MonteCarloSettings(samples=400, workers=1)  # seed: fresh entropy, fixed per accountant
    a, b = BMinSepMonteCarloAccountant(scheme, settings=run), BMinSepMonteCarloAccountant(scheme)
    assert a.settings.seed is not None and b.settings.seed is not None
    assert a.settings.seed != b.settings.seed and b.settings.samples == 100_000
    a.step(noise_multiplier=1.0, sample_rate=10 / 320, num_steps=6)
    eps = float(a.get_epsilon(0.05))
    assert float(a.get_epsilon(0.05)) == eps  # one seed per accountant: the same estimate
    state = json.loads(json.dumps(a.state_dict()))
    assert state["monte_carlo"]["seed"] == a.settings.seed
    # built without settings, or with the seed left open: continues the checkpoint's run
    for resumed in (BMinSepMonteCarloAccountant(scheme),
                    BMinSepMonteCarloAccountant(scheme, settings=run)):
        resumed.load_state_dict(state)
        assert resumed.settings.seed == a.settings.seed and resumed.settings.samples == 400
        assert float(resumed.get_epsilon(0.05)) == eps
    # a different explicit seed, or other samples, is refused with the way out
    other = dataclasses.replace(run, seed=a.settings.seed + 1)
    with pytest.raises(ValueError, match="Monte Carlo seed"):
        BMinSepMonteCarloAccountant(scheme, settings=other).load_state_dict(state)
    with pytest.raises(ValueError, match="samples"):
        BMinSepMonteCarloAccountant(scheme, settings=MonteCarloSettings(
            samples=401, seed=a.settings.seed)).load_state_dict(state)
    # an accountant that already reported from its own seed does not switch silently
    c = BMinSepMonteCarloAccountant(scheme, settings=run)
    c.step(noise_multiplier=1.0, sample_rate=10 / 320, num_steps=6)
    c.get_epsilon(0.05)
    with pytest.raises(ValueError, match="Monte Carlo seed"):
        c.load_state_dict(state)
    loaded = BMinSepMonteCarloAccountant(scheme, settings=MonteCarloSettings.from_dict(
        state["monte_carlo"]))
    loaded.load_state_dict(state)
    assert float(loaded.get_epsilon(0.05)) == eps


def test_cli_epsilon_and_command(capsys):
    from opacus_structured.cli import main

    flags = ["--bands", "2", "--dataset-size", "320", "--batch-size", "10", "--samples", "2000",
             "--warm-start", "--strategy", "max-error", "--workers", "1", "--seed", "0"]
    assert main(["epsilon", "bminsep-mc", *flags, "--noise-multiplier", "1.0", "--steps", "32",
                 "--delta", "1e-2"]) == 0
    out = capsys.readouterr().out
    assert "Monte Carlo estimate" in out and "not a deterministic bound" in out
    # the run's flags become the scheme's pricing options (MonteCarloSettings), not fields
    from opacus_structured.cli import build_parser
    from opacus_structured.schemes.bminsep_mc import BMinSepMonteCarloScheme

    args = build_parser().parse_args(["epsilon", "bminsep-mc", *flags, "--noise-multiplier",
                                      "1.0", "--steps", "32", "--delta", "1e-2"])
    assert BMinSepMonteCarloScheme.pricing_options_from_cli_args(args) == {
        "settings": MonteCarloSettings(samples=2000, seed=0, workers=1)}
    assert main(["bminsep-mc", "estimate", *flags, "--noise-multiplier", "1.0", "--steps", "32",
                 "--delta", "1e-2", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["kind"] == rec["bound"] == BoundKind.MONTE_CARLO.value  # JSON shows the value
    assert "probability" in rec["statement"]
    assert main(["bminsep-mc", "estimate", *flags, "--noise-multiplier", "1.0", "--steps", "32",
                 "--delta", "2"]) == 2  # bad delta: clean error, exit 2
    cert = ["--bands", "1", "--dataset-size", "160", "--batch-size", "10", "--strategy",
            "max-error", "--workers", "1", "--seed", "0"]
    assert main(["bminsep-mc", "certify", *cert, "--steps", "16", "--delta", "0.05",
                 "--target-epsilon", "2", "--sigma-min", "1.2", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["bound"] == "algorithm-5" and rec["overall_delta"] <= 0.05
    assert rec["noise_multiplier"] <= rec["verified"][0][0] * 1.0101 or rec["fallback_used"]


# ---------------------------------------------------------------------------------------------
# Multi-attribution through the scheme and the CLI (Algorithm 3, Theorem 6.1)
# ---------------------------------------------------------------------------------------------
def _multi_scheme(**kw):
    args = dict(bands=2, dataset_size=400, batch_size=8, max_user_examples=2,
                sampling_probability=0.05, strategy="max-error")
    args.update(kw)
    from opacus_structured.schemes.bminsep_mc import BMinSepMonteCarloScheme

    return BMinSepMonteCarloScheme(**args)


def test_scheme_multi_attribution_dp_equals_brute_force():
    # The scheme's mechanism is Theorem 6.1's recursion: for n <= 9 its ln(P/Q)(y) equals the
    # enumeration of every x with x_i ~ Binom(k_u, p) when available (chain_pmf, independent).
    rng = np.random.default_rng(31)
    for k_u, p, bands, b in ((2, 0.3, 2, 2), (3, 0.2, 2, 3), (2, 1.0, 1, 2), (3, 0.45, 3, 3)):
        scheme = _multi_scheme(bands=bands, min_sep=b, max_user_examples=k_u,
                               sampling_probability=p)
        for n in (1, 4, 9):
            mech = scheme.mechanism(0.9, n)
            assert mech.max_user_examples == k_u and not mech.warm_start
            C = mech.strategy.matrix()
            pmf = chain_pmf(n, p, b, False, k_u)
            y = rng.normal(size=(n, 3)) + 0.5
            got = mech.log_ratio(y)
            for s_ in range(3):
                exp = mixture_log_ratio(y[:, s_], C, 0.9, [(w, x) for x, w in pmf.items()])
                assert abs(got[s_] - exp) < 1e-10


def test_scheme_multi_attribution_delta_matches_quadrature():
    # n = 2, b = 2, k_u = 2: the exact hockey-stick divergences of the (brute-force enumerated)
    # 2-D Gaussian mixture P vs Q = N(0, σ²I) by quadrature; the scheme's Monte Carlo δ̃ in
    # both directions agrees within MC error.
    scheme, count = _multi_scheme(sampling_probability=0.3), 20000
    sigma, eps, n = 0.8, 0.4, 2
    mech = scheme.mechanism(sigma, n)
    C = mech.strategy.matrix()
    h = 0.01
    g = np.arange(-6.5, 6.5 + 2 * 2 * C.max(), h)
    Y1, Y2 = np.meshgrid(g, g, indexing="ij")

    def dens(mean):
        return np.exp(-((Y1 - mean[0]) ** 2 + (Y2 - mean[1]) ** 2) / (2 * sigma**2)) / (
            2 * math.pi * sigma**2)

    P = sum(w * dens(C @ np.array(x, float)) for x, w in chain_pmf(n, 0.3, 2, False, 2).items())
    Q = dens(np.zeros(2))
    d_remove = float(np.sum(np.maximum(0, P - math.exp(eps) * Q)) * h * h)
    d_add = float(np.sum(np.maximum(0, Q - math.exp(eps) * P)) * h * h)
    s = collect_privacy_losses(mech, count, seed=3, workers=1)
    for losses, exact in ((s.remove, d_remove), (s.add, d_add)):
        terms = -np.expm1(np.minimum(eps - losses, 0))
        se = terms.std() / math.sqrt(losses.size)
        assert abs(terms.mean() - exact) < 4.5 * se + 1e-4, (terms.mean(), exact, se)
    assert d_remove > 0.01  # a non-trivial check
    # a second example per user costs privacy: δ̃ is clearly larger than with k_u = 1
    single = collect_privacy_losses(dataclasses.replace(mech, max_user_examples=1),
                                    count, seed=3, workers=1)
    assert s.empirical_delta(eps) > single.empirical_delta(eps) + 0.01


def test_scheme_multi_attribution_validation_and_round_trip():
    from opacus_structured.schemes import Scheme

    scheme = _multi_scheme()
    assert scheme.sampling_prob == 0.05 and scheme.max_user_examples == 2
    assert Scheme.from_dict(json.loads(json.dumps(scheme.to_dict()))) == scheme
    with pytest.raises(ValueError, match="warm start"):
        _multi_scheme(warm_start=True)
    with pytest.raises(ValueError, match="sampling_probability"):
        _multi_scheme(sampling_probability=None)
    with pytest.raises(ValueError, match="sampling_probability"):
        _multi_scheme(max_user_examples=1)
    with pytest.raises(ValueError, match="sampling_probability must be in"):
        _multi_scheme(sampling_probability=1.5)
    with pytest.raises(ValueError, match="max_user_examples"):
        _multi_scheme(max_user_examples=0)
    with pytest.raises(ValueError, match="truncate"):
        _multi_scheme(truncate=10)
    # the cyclic Poisson fallback prices one example per user: refuse (never under-report)
    with pytest.raises(ValueError, match="max_user_examples"):
        cyclic_poisson_fallback(scheme.mechanism(1.0, 8), 8 / 400, 2.0, 1e-3)
    fb = unamplified_fallback(scheme.mechanism(1.0, 8), 2.0, 1e-3)
    assert "sensitivity" in fb.description


def test_cli_multi_attribution(capsys):
    from opacus_structured.cli import main

    flags = ["--bands", "2", "--dataset-size", "400", "--batch-size", "8", "--samples", "2000",
             "--strategy", "max-error", "--workers", "1", "--seed", "0",
             "--max-user-examples", "2", "--sampling-prob", "0.05"]
    run = ["--noise-multiplier", "1.0", "--steps", "16", "--delta", "1e-2"]
    assert main(["bminsep-mc", "estimate", *flags, *run, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["parameters"]["max_user_examples"] == 2 and rec["kind"] == BoundKind.MONTE_CARLO.value
    assert rec["parameters"]["sampling_prob"] == 0.05
    assert main(["epsilon", "bminsep-mc", *flags, *run]) == 0
    assert "Monte Carlo" in capsys.readouterr().out
    assert main(["bminsep-mc", "estimate", *flags, "--warm-start", *run]) == 2
    assert "warm start" in capsys.readouterr().err
    assert main(["bminsep-mc", "estimate", *flags[:-2], *run]) == 2  # no --sampling-prob
    assert "sampling" in capsys.readouterr().err
    assert main(["bminsep-mc", "certify", *flags, "--steps", "8", "--delta", "0.05",
                 "--target-epsilon", "2", "--sigma-min", "1.2", "--fallback",
                 "cyclic-poisson"]) == 2


def test_too_few_samples_is_infinite_and_says_so():
    samples = MonteCarloSamples(np.zeros(100), np.zeros(100))
    est = samples.estimate(1e-3, failure_probability=1e-3)
    assert math.isinf(est.epsilon) and est.point_epsilon == 0.0
    assert "cannot support" in est.statement


# ---- the C a training run streams (horizon) ---------------------------------------------------
def test_optimal_banded_training_needs_a_horizon_and_prices_the_streamed_c():
    from opacus_structured.accounting.strategies import strategy_coefficients

    free = _small_scheme(strategy="optimal-banded", warm_start=False)
    with pytest.raises(ValueError, match="horizon=<the run's planned optimizer steps>"):
        free.noise_correlation()
    with pytest.raises(ValueError, match="horizon"):
        free.check_noise_correlation([1.0])
    with pytest.raises(ValueError, match="horizon"):
        _small_scheme(horizon=1)  # fewer steps than bands
    planned = dataclasses.replace(free, horizon=12)
    c = planned.noise_correlation()
    np.testing.assert_allclose(c, strategy_coefficients("optimal-banded", 12, 2), rtol=1e-12)
    assert planned.noise_correlation(30) == c  # the run's length does not change the scheme's C
    planned.check_noise_correlation(c)
    # any other noise is a different mechanism: independent noise, C optimised for another
    # length, more bands, a dense BLT strategy
    for other in ([1.0], list(strategy_coefficients("optimal-banded", 20, 2)),
                  list(strategy_coefficients("optimal-banded", 12, 3))):
        with pytest.raises(ValueError, match=r"scheme.noise_correlation\(\)"):
            planned.check_noise_correlation(other)
    with pytest.raises(ValueError, match="BLT"):
        planned.check_noise_correlation(type("BLT", (), {"buf_decay": [0.5]})())
    # mid-run and past the horizon, the accountant prices the first t rows of the streamed C
    for t in (1, 5, 12, 20):
        np.testing.assert_array_equal(planned.mechanism(1.0, t).strategy.columns,
                                      BandedStrategy.toeplitz(c, t).columns)
    # at t = horizon it is the run of exactly `horizon` steps that a horizon-free scheme prices
    run = MonteCarloSettings(samples=2000, workers=1, seed=5)
    assert planned.epsilon(1.0, 12, 0.05, settings=run) == free.epsilon(1.0, 12, 0.05,
                                                                          settings=run)
    # strategies that do not depend on the run length need no horizon; one band is DP-SGD
    sqrt = _small_scheme(strategy="banded-sqrt")
    sqrt.check_noise_correlation(strategy_coefficients("banded-sqrt", 4, 2))
    one = _small_scheme(bands=1, min_sep=2, strategy="optimal-banded")
    assert one.noise_correlation() == [1.0]
    one.check_noise_correlation([1.0])


def test_horizon_flag_reaches_the_scheme():
    import argparse

    from opacus_structured.schemes.bminsep_mc import BMinSepMonteCarloScheme

    parser = argparse.ArgumentParser()
    BMinSepMonteCarloScheme.add_cli_arguments(parser)
    args = parser.parse_args(["--bands", "2", "--dataset-size", "100", "--batch-size", "10",
                              "--horizon", "40"])
    assert BMinSepMonteCarloScheme.from_cli_args(args).horizon == 40
