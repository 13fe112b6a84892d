"""Issue 40, "Audit": the empirical audit of a tuned procedure (``audit/selection.py``).

The simulation is checked against the law it claims (the number of trials against
``draw_num_trials``, the winner's score against :math:`G(F(s))`), the attack's score against
the winner's density computed another way, then the audit itself at fixed seeds: its
Clopper–Pearson lower bound stays at or below the whole search's ``selection_epsilon`` (the
bound's stated 95 % confidence; the seeds are fixed, so each assertion is one deterministic
computation), and the attack's value against the winner's ε is computed, not assumed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special, stats

from opacus_structured.accounting import private_selection as ps
from opacus_structured.accounting.gaussian import gdp_mu
from opacus_structured.audit.selection import (
    GaussianTrial,
    LaplaceTrial,
    TrialCount,
    attack_scores,
    audit_selection,
    draw_trial_counts,
    simulate_search,
)
from opacus_structured.tuning import PureDpTrial, draw_num_trials, selection_epsilon

DELTA = 1e-5
#: σ of a Gaussian trial whose own ε is 1 at δ = 1e-5 (score = its output).
SIGMA_EPS1 = 1 / gdp_mu(1.0, DELTA)


def _pmf(count: TrialCount, kmax: int) -> np.ndarray:
    """P[K = k] for k = 0..kmax from the closed forms (not the sampler's recursion)."""
    k = np.arange(kmax + 1, dtype=np.float64)
    if not count.random:
        return (k == count.fixed).astype(float)
    if count.poisson:
        return stats.poisson.pmf(k, count.mean_trials)
    gamma, eta = ps.tnb_gamma(count.mean_trials, count.eta), count.eta
    with np.errstate(divide="ignore"):
        if eta == 0:
            log_w = k * math.log1p(-gamma) - np.log(k)
        else:
            log_w = (special.gammaln(k + eta) - special.gammaln(eta) - special.gammaln(k + 1)
                     + k * math.log1p(-gamma))
    w = np.where(k >= 1, np.exp(log_w), 0.0)
    return w / w.sum()


LAWS = [TrialCount(fixed=1), TrialCount(fixed=7), TrialCount(mean_trials=6, eta=0.0),
        TrialCount(mean_trials=6, eta=1.0), TrialCount(mean_trials=6, eta=2.5),
        TrialCount(mean_trials=4, poisson=True)]


# ---- the simulated search is the priced one ---------------------------------------------
@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0, 3.0, None])
def test_trial_counts_are_draw_num_trials(eta):
    count = (TrialCount(mean_trials=12, poisson=True) if eta is None
             else TrialCount(mean_trials=12, eta=eta))
    vectorised = draw_trial_counts(count, 3000, np.random.default_rng(5))
    rng = np.random.default_rng(5)
    scalar = [draw_num_trials(12, eta, rng) for _ in range(3000)]
    assert np.array_equal(vectorised, scalar)


@pytest.mark.parametrize("count", LAWS, ids=lambda c: c.describe())
def test_winner_score_follows_the_selection_law(count):
    """P[winner's score <= s] = G(F(s)) (Poisson: the K = 0 searches release nothing),
    simulated in many chunks of whole searches."""
    trial = GaussianTrial(noise_multiplier=1.0, steps=3, sample_rate=0.5)
    n = 40_000
    _, score, released = simulate_search(trial, count, present=True, repetitions=n,
                                         rng=np.random.default_rng(11), chunk_trials=7777)
    pmf = _pmf(count, 400)
    if count.poisson:
        expected_empty = pmf[0]
        assert abs((~released).mean() - expected_empty) < 5 * math.sqrt(expected_empty / n)
    for s in (0.5, 1.5, 3.0):
        log_f, _ = trial.log_cdf_sf(True, np.array([s]))
        g = float(np.sum(pmf[1:] * np.exp(np.arange(1, pmf.size) * log_f[0])))
        observed = np.mean(released & (score <= s))
        assert abs(observed - g) < 5 * math.sqrt(g * (1 - g) / n) + 1e-4, (s, observed, g)


@pytest.mark.parametrize("count", LAWS, ids=lambda c: c.describe())
def test_attack_score_is_the_log_density_ratio_of_the_winner(count):
    """The score-only case: the winner's density is d/ds G(F(s)); its log ratio between the
    worlds, by finite differences of the pmf sum, equals :func:`attack_scores`."""
    trial = GaussianTrial(noise_multiplier=0.9, steps=4, sample_rate=0.3)
    pmf = _pmf(count, 400)
    k = np.arange(pmf.size)
    s = np.linspace(-2.0, 4.0, 13)
    h = 1e-5

    def log_density(present):
        def cdf(x):
            log_f, _ = trial.log_cdf_sf(present, x)
            return np.exp(log_f)[:, None] ** k[None, 1:] @ pmf[1:]
        return np.log((cdf(s + h) - cdf(s - h)) / (2 * h))

    expected = log_density(True) - log_density(False)
    got = attack_scores(trial, count, s, s, np.ones(s.size, dtype=bool))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_private_score_density_is_the_joint_gaussian_mixture():
    trial = GaussianTrial(noise_multiplier=1.3, steps=2, sample_rate=0.4,
                          score_noise_multiplier=2.0)
    theta, score = np.array([-1.0, 0.3, 2.2]), np.array([0.5, -0.7, 3.1])
    tau = 1.3 * math.sqrt(2)
    for present in (True, False):
        b = np.arange(3)
        w = stats.binom.pmf(b, 2, 0.4) if present else (b == 0).astype(float)
        joint = (w[None, :] * stats.norm.pdf(theta[:, None], b[None, :], tau)).sum(1) \
            * stats.norm.pdf(score, theta + present, 2.0)
        diff = trial.log_density(present, theta, score) - np.log(joint)
        np.testing.assert_allclose(diff, diff[0], atol=1e-12)  # equal up to a constant
        cdf = (w[None, :] * stats.norm.cdf(score[:, None], b[None, :] + present,
                                           math.hypot(tau, 2.0))).sum(1)
        log_f, log_s = trial.log_cdf_sf(present, score)
        np.testing.assert_allclose(np.exp(log_f), cdf, rtol=1e-12)
        np.testing.assert_allclose(np.exp(log_s), 1 - cdf, rtol=1e-10)


def test_laplace_trial_cdf():
    trial = LaplaceTrial(0.7)
    s = np.array([-3.0, 0.2, 0.9, 1.0, 5.0])
    for present in (True, False):
        log_f, log_s = trial.log_cdf_sf(present, s)
        cdf = stats.laplace.cdf(s, loc=float(present), scale=1 / 0.7)
        np.testing.assert_allclose(np.exp(log_f), cdf, rtol=1e-12)
        np.testing.assert_allclose(np.exp(log_s), 1 - cdf, rtol=1e-12)


# ---- the audit against the reported ε ---------------------------------------------------
@pytest.mark.parametrize("trial,count", [
    (GaussianTrial(SIGMA_EPS1), TrialCount(mean_trials=10, eta=1.0)),
    (GaussianTrial(SIGMA_EPS1), TrialCount(mean_trials=10, eta=0.0)),
    (GaussianTrial(SIGMA_EPS1), TrialCount(mean_trials=10, poisson=True)),
    (GaussianTrial(5.0, score_noise_multiplier=5.0), TrialCount(mean_trials=10, eta=1.0)),
    (LaplaceTrial(1.0), TrialCount(mean_trials=10, eta=1.0)),
    (LaplaceTrial(1.0), TrialCount(mean_trials=10, eta=0.0)),
    (LaplaceTrial(1.0), TrialCount(mean_trials=10, poisson=True)),
], ids=lambda x: x.describe())
def test_lower_bound_within_the_whole_search_epsilon(trial, count):
    audit = audit_selection(trial, count, repetitions=50_000, delta=DELTA, seed=1)
    expected = selection_epsilon(trial.pricing(), mean_trials=count.mean_trials,
                                 eta=count.eta, delta=DELTA)
    assert audit.reported_epsilon == expected == audit.upper_bound
    assert audit.lower_bound.confidence == 0.95
    assert audit.lower_bound.kind == "empirical lower bound"
    assert 0 < audit.lower_bound.epsilon <= audit.reported_epsilon
    assert audit.within_upper_bound


def test_fixed_number_of_runs_leaks_beyond_the_winners_epsilon():
    """Best of 20 Gaussian runs, each ε = 1 at δ = 1e-5, reporting only the winner: the
    attack's 95 % lower bound exceeds 1 (and stays below 20 runs composed)."""
    trial = GaussianTrial(SIGMA_EPS1)
    one = audit_selection(trial, TrialCount(fixed=1), repetitions=100_000, delta=DELTA)
    best = audit_selection(trial, TrialCount(fixed=20), repetitions=100_000, delta=DELTA)
    assert math.isclose(best.winner_epsilon, 1.0, rel_tol=1e-9)
    assert best.reported_epsilon == best.winner_epsilon
    assert one.lower_bound.epsilon <= one.winner_epsilon  # one run: within its own ε
    assert best.lower_bound.epsilon > best.winner_epsilon
    assert best.exceeds_winner and not one.exceeds_winner
    assert best.lower_bound.epsilon <= best.upper_bound == trial.epsilon(DELTA, trials=20)
    assert best.lower_bound.epsilon > 2 * one.lower_bound.epsilon


def test_random_number_of_runs_still_leaks_beyond_the_winners_epsilon_for_a_pure_trial():
    """Laplace trials (pure ε = 1), K geometric of mean 10 as ``PrivateSelection`` draws it:
    the attack beats the winner's ε and stays within the search's 3ε."""
    trial = LaplaceTrial(1.0)
    audit = audit_selection(trial, TrialCount(mean_trials=10, eta=1.0), repetitions=50_000,
                            delta=DELTA)
    assert audit.winner_epsilon == 1.0
    assert audit.reported_epsilon == selection_epsilon(PureDpTrial(1.0), mean_trials=10,
                                                       eta=1.0, delta=DELTA)
    assert audit.exceeds_winner
    assert audit.within_upper_bound


def test_gaussian_random_search_measured_against_the_winner():
    """Gaussian trials at ε = 1, δ = 1e-5, K geometric of mean 10: the audit's value next to
    the winner's ε is measured (below it at this budget: the Gaussian's ε at δ = 1e-5 sits in
    tails the runs do not reach); the attack still sees more than in one run."""
    trial = GaussianTrial(SIGMA_EPS1)
    one = audit_selection(trial, TrialCount(fixed=1), repetitions=50_000, delta=DELTA)
    search = audit_selection(trial, TrialCount(mean_trials=10, eta=1.0), repetitions=50_000,
                             delta=DELTA)
    assert search.lower_bound.epsilon > one.lower_bound.epsilon
    assert search.within_upper_bound


def test_audit_is_deterministic_and_rows_are_labelled():
    trial, count = LaplaceTrial(0.5), TrialCount(fixed=3)
    a = audit_selection(trial, count, repetitions=2000, delta=DELTA, seed=4)
    b = audit_selection(trial, count, repetitions=2000, delta=DELTA, seed=4)
    assert a.lower_bound == b.lower_bound and a.estimate == b.estimate
    row = a.row()
    assert row["method"] == "clopper-pearson" and row["repetitions_per_side"] == 2000
    assert row["upper_bound"] == 1.5 and row["reported_epsilon"] == 0.5
    assert a.scores.runs == 4000


def test_argument_errors():
    with pytest.raises(ValueError, match="either fixed"):
        TrialCount()
    with pytest.raises(ValueError, match="either fixed"):
        TrialCount(fixed=2, mean_trials=3)
    with pytest.raises(ValueError, match="poisson"):
        TrialCount(mean_trials=3)
    with pytest.raises(ValueError, match="fixed= takes no"):
        TrialCount(fixed=2, eta=1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        GaussianTrial(0.0)
    with pytest.raises(ValueError, match="sample_rate"):
        GaussianTrial(1.0, sample_rate=1.5)
    with pytest.raises(ValueError, match="repetitions"):
        audit_selection(LaplaceTrial(1.0), TrialCount(fixed=1), repetitions=1, delta=DELTA)


# ---- heavier reproductions --------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.long  # 30-40 s: out of CI's 30-minute budget; the fast tests check the same bounds at smaller counts
def test_benchmark_table_holds_at_a_million_runs():
    """The guide's table at 10^6 searches per side: every random search within its
    selection ε; the fixed best-of-50 and the random searches over pure trials beyond the
    winner's ε (the Gaussian random searches' values are measured, not asserted against it)."""
    gauss, lap = GaussianTrial(SIGMA_EPS1), LaplaceTrial(1.0)
    for trial in (gauss, lap):
        for count in (TrialCount(mean_trials=10, eta=1.0), TrialCount(mean_trials=10, eta=0.0),
                      TrialCount(mean_trials=10, poisson=True)):
            audit = audit_selection(trial, count, repetitions=1_000_000, delta=DELTA)
            assert audit.within_upper_bound, audit.row()
            if trial is lap:
                assert audit.exceeds_winner, audit.row()
    best = audit_selection(gauss, TrialCount(fixed=50), repetitions=1_000_000, delta=DELTA)
    assert best.exceeds_winner and best.within_upper_bound
