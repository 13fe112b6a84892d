"""Issue 18, item 3: the (1 − β) upper confidence bounds on δ(ε) — KL (Chernoff–Hoeffding) and
second-moment (Maurer's lower tail for non-negative terms with a KL bound on E[X²]) — hold in at
least a (1 − β) fraction of seeded repetitions on small cases whose δ(ε) is known exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, stats

from opacus_structured.accounting.bminsep_mc import (
    BandedStrategy,
    BandMFMonteCarlo,
    sample_privacy_losses,
)
from opacus_structured.accounting.monte_carlo import (
    DELTA_BOUND_METHODS,
    MonteCarloSamples,
    delta_upper_confidence_second_moment,
)

BETA = 0.05
RUNS = 200
SAMPLES = 2000


def _exact_delta_b1_n1(q: float, sigma: float, eps: float) -> float:
    """b = 1, n = 1 (one Poisson-subsampled Gaussian): both directions by quadrature."""
    p = lambda y: (1 - q) * stats.norm.pdf(y, 0, sigma) + q * stats.norm.pdf(y, 1, sigma)  # noqa: E731
    q0 = lambda y: stats.norm.pdf(y, 0, sigma)  # noqa: E731
    lo, hi = -14 * sigma, 14 * sigma + 1
    d_p = integrate.quad(lambda y: max(0.0, p(y) - math.exp(eps) * q0(y)), lo, hi,
                         limit=500, points=[0.5], epsabs=1e-13)[0]
    d_q = integrate.quad(lambda y: max(0.0, q0(y) - math.exp(eps) * p(y)), lo, hi,
                         limit=500, points=[0.5], epsabs=1e-13)[0]
    return max(d_p, d_q)


def _exact_delta_b2_n2(p: float, c, sigma: float, eps: float) -> float:
    """b = 2, n = 2, cold start, by brute force over the participation patterns (x = (1, 0)
    w.p. p, (0, 1) w.p. (1−p)p, (0, 0) otherwise) and a fine 2-D grid."""
    g = np.linspace(-9 * sigma, 9 * sigma + 1.5, 1801)
    Y1, Y2 = np.meshgrid(g, g, indexing="ij")
    dA = (g[1] - g[0]) ** 2
    phi = lambda m1, m2: stats.norm.pdf(Y1, m1, sigma) * stats.norm.pdf(Y2, m2, sigma)  # noqa: E731
    q0 = phi(0.0, 0.0)
    pm = p * phi(c[0], c[1]) + (1 - p) * p * phi(0.0, c[0]) + (1 - p) ** 2 * q0
    d_p = np.maximum(pm - math.exp(eps) * q0, 0).sum() * dA
    d_q = np.maximum(q0 - math.exp(eps) * pm, 0).sum() * dA
    return float(max(d_p, d_q))


CASES = {
    "b1-n1": (BandMFMonteCarlo(BandedStrategy.toeplitz([1.0], 1), 0.8, "bminsep", 0.3, 1),
              1.0, lambda: _exact_delta_b1_n1(0.3, 0.8, 1.0)),
    "b2-n2": (BandMFMonteCarlo(BandedStrategy.toeplitz([0.8, 0.6], 2), 0.7, "bminsep", 0.3, 2),
              1.0, lambda: _exact_delta_b2_n2(0.3, [0.8, 0.6], 0.7, 1.0)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_delta_upper_bounds_hold_in_one_minus_beta_of_runs(case):
    mech, eps, exact = CASES[case]
    truth = exact()
    failures = dict.fromkeys(DELTA_BOUND_METHODS, 0)
    points, widths = [], {m: [] for m in DELTA_BOUND_METHODS}
    for run in range(RUNS):
        rng = np.random.default_rng(run)
        s = MonteCarloSamples(sample_privacy_losses(mech, SAMPLES, "remove", rng=rng),
                              sample_privacy_losses(mech, SAMPLES, "add", rng=rng))
        for method in DELTA_BOUND_METHODS:
            rec = s.estimate_delta(eps, BETA, method=method)
            failures[method] += rec["delta_upper"] < truth
            widths[method].append(rec["delta_upper"])
        points.append(s.empirical_delta(eps))
    # the truth is the samplers' δ: the point estimates centre on it (max of two unbiased
    # means is biased up by at most a few standard errors)
    se = np.std(points) / math.sqrt(RUNS)
    assert truth - 4 * se < np.mean(points) < truth + 4 * np.std(points), (truth, np.mean(points))
    for method in DELTA_BOUND_METHODS:
        assert failures[method] <= BETA * RUNS, (method, failures[method], truth)
        assert np.mean(widths[method]) < 3 * truth  # informative, not vacuous


def test_second_moment_bound_arguments_and_gain():
    with pytest.raises(ValueError, match="terms must lie in"):
        delta_upper_confidence_second_moment(np.array([0.5, 1.5]), 0.1)
    with pytest.raises(ValueError, match="failure_probability"):
        delta_upper_confidence_second_moment(np.array([0.5]), 1.5)
    with pytest.raises(ValueError, match="method must be one of"):
        MonteCarloSamples(np.zeros(3), np.zeros(3)).estimate_delta(1.0, method="bernstein")
    # terms mostly far below 1 (second moment ≪ mean): the second-moment bound is tighter
    rng = np.random.default_rng(0)
    x = np.where(rng.random(200_000) < 1e-3, rng.uniform(0, 0.2, 200_000), 0.0)
    from opacus_structured.accounting.monte_carlo import delta_upper_confidence

    kl = delta_upper_confidence(float(x.mean()), x.size, 1e-3)
    sm = delta_upper_confidence_second_moment(x, 1e-3)
    assert x.mean() < sm < kl
