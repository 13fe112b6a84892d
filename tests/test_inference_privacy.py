"""Inference-time privacy (issue 17, deliverable 5): Poisson subsampling in the time domain plus
Gaussian input noise (Schuchardt et al. 2025, App. H, applying Koga et al. 2022, Thm 3.2).

The closed form is checked against computations that share none of its code:
- the hockey-stick divergence of the mechanism's actual output distributions, integrated
  numerically (scipy.integrate.quad) — tight for the released series, an upper bound for a
  forecast computed from it;
- dp_accounting's optimistic and pessimistic PLDs of one use, composed by FFT, bracketing the
  binomial-mixture formula for several uses;
- the analytic Gaussian mechanism (dp_accounting) at subsampling rate 1.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch
from dp_accounting.pld import pld_pmf, privacy_loss_distribution
from dp_accounting.pld.privacy_loss_mechanism import GaussianPrivacyLoss
from scipy import integrate, optimize, stats

from opacus_structured.accounting.bounds import BoundKind
from opacus_structured.accounting.inference_privacy import (
    FORECAST_BOUND,
    RELEASE_BOUND,
    calibrate_time_domain_noise,
    noiseless_delta,
    time_domain_delta,
    time_domain_epsilon,
)
from opacus_structured.forecasting.private_inference import (
    InferencePrivacyReport,
    private_forecast,
    privatize_series,
)


# ---- independent references ---------------------------------------------------------------------
def _mixture(components):
    """Scalar and vectorised densities of Σ w N(m, s²), ``components`` = [(w, m, s), ...]."""
    w, m, sd = (np.array(c, dtype=np.float64) for c in zip(*components, strict=True))
    norm = w / (sd * math.sqrt(2 * math.pi))
    comps = list(zip(norm.tolist(), m.tolist(), sd.tolist(), strict=True))

    def scalar(y):
        return sum(a * math.exp(-0.5 * ((y - mu) / s) ** 2) for a, mu, s in comps)

    def vector(y):
        return (norm * np.exp(-0.5 * ((y[:, None] - m) / sd) ** 2)).sum(axis=1)

    return scalar, vector


def _hockey_stick(p, q, eps, lo, hi):
    """∫ max(0, p − e^ε q) dy over [lo, hi]: the sign changes of p − e^ε q are located on a
    grid and refined by brentq, and the smooth integrand is integrated between them by
    adaptive quadrature (scipy.integrate.quad). Continuous parts only."""
    (ps, pv), (qs, qv) = p, q
    c = math.exp(eps)
    g = lambda y: ps(y) - c * qs(y)  # noqa: E731
    grid = np.linspace(lo, hi, 4001)
    gv = pv(grid) - c * qv(grid)
    cuts = [lo]
    for i in np.nonzero(np.sign(gv[:-1]) * np.sign(gv[1:]) < 0)[0]:
        cuts.append(optimize.brentq(g, grid[i], grid[i + 1], xtol=1e-14))
    cuts.append(hi)
    total = 0.0
    for a, b in itertools.pairwise(cuts):
        if g(0.5 * (a + b)) > 0:
            total += integrate.quad(g, a, b, epsabs=1e-14, epsrel=1e-11, limit=200)[0]
    return total


def _epsilon_from_profile(delta_of_eps, delta, hi=40.0):
    if delta_of_eps(0.0) <= delta:
        return 0.0
    return optimize.brentq(lambda e: delta_of_eps(e) - delta, 0.0, hi, xtol=1e-10)


def _true_epsilon(p, q, delta, lo, hi):
    """ε(δ) of the pair (p, q) in both directions, from the integrated hockey-stick."""
    return max(_epsilon_from_profile(lambda e: _hockey_stick(p, q, e, lo, hi), delta),
               _epsilon_from_profile(lambda e: _hockey_stick(q, p, e, lo, hi), delta))


def _forecast_density(x1, c, r, s):
    """T = 2, mean imputation, forecast = mean of the released series, x = (x1, c)."""
    return _mixture([(r * r, (x1 + c) / 2, s / math.sqrt(2)),  # both kept
                     (r * (1 - r), x1, s),                     # first kept (second := first)
                     ((1 - r) * r, c, s)])                     # second kept


def _one_use_pmf(z, r, pessimistic, d=1e-3):
    """dp_accounting PLD pmf of one use: loss 0 w.p. 1 − r, the Gaussian loss w.p. r."""
    g = privacy_loss_distribution.from_gaussian_mechanism(
        z, sensitivity=1.0, value_discretization_interval=d, pessimistic_estimate=pessimistic,
        use_connect_dots=pessimistic)  # the optimistic estimate uses privacy buckets
    pmf = g._pmf_remove
    if isinstance(pmf, pld_pmf.SparsePLDPmf):  # pragma: no cover - depends on dp_accounting
        pmf = pmf.to_dense_pmf()
    lower = min(pmf._lower_loss, 0)
    upper = max(pmf._lower_loss + len(pmf._probs) - 1, 0)
    probs = np.zeros(upper - lower + 1)
    probs[pmf._lower_loss - lower: pmf._lower_loss - lower + len(pmf._probs)] = r * pmf._probs
    probs[-lower] += 1.0 - r
    return privacy_loss_distribution.PrivacyLossDistribution(pld_pmf.DensePLDPmf(
        d, lower, probs, r * pmf._infinity_mass, pessimistic))


# ---- the formula --------------------------------------------------------------------------------
def test_one_use_is_rate_times_gaussian_profile():
    """m = 1 is r · δ_N(ε; 1/z), written out with Φ (the calibration used for App. H)."""
    for z, r in [(0.5, 0.3), (1.0, 0.75), (3.0, 0.5), (10.0, 1.0)]:
        mu = 1.0 / z
        for eps in [0.0, 0.1, 1.0, 4.0]:
            ref = r * (stats.norm.cdf(-eps / mu + mu / 2)
                       - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2))
            got = time_domain_delta(eps, noise_multiplier=z, subsampling_rate=r)
            assert got == pytest.approx(ref, rel=1e-9, abs=1e-15)


@pytest.mark.float_sensitive
def test_rate_one_is_the_gaussian_mechanism():
    eps = np.array([0.0, 0.25, 1.0, 3.0])  # float arrays: dp_accounting mishandles ints
    for z, n in [(1.0, 1), (2.0, 1), (2.0, 4), (5.0, 9)]:
        ref = GaussianPrivacyLoss(z / math.sqrt(n), sensitivity=1.0).get_delta_for_epsilon(eps)
        got = time_domain_delta(eps, noise_multiplier=z, subsampling_rate=1.0, releases=n)
        np.testing.assert_allclose(got, ref, rtol=1e-7, atol=1e-14)


def test_tight_for_the_released_series_by_quadrature():
    """T = 1, constant imputation, forecast = the released value: the output is
    (1 − r) δ_0 + r N(x, σ²). The exact ε of x = v against x' = 0 (both directions) equals
    the formula: the bound is attained."""
    v = 1.0
    for z, r, delta in [(1.0, 0.5, 1e-3), (2.0, 0.75, 1e-4), (0.7, 0.2, 1e-5)]:
        s = z * v
        p = _mixture([(r, v, s)])
        q = _mixture([(r, 0.0, s)])
        # the atom at the fill value 0 has equal mass under both: (1 − r)(1 − e^ε) ≤ 0 adds 0
        true_eps = _true_epsilon(p, q, delta, -14 * s - v, 14 * s + v)
        ours = time_domain_epsilon(delta, noise_multiplier=z, subsampling_rate=r)
        assert ours >= true_eps - 1e-7
        assert ours == pytest.approx(true_eps, rel=1e-5, abs=1e-7)
    assert RELEASE_BOUND is BoundKind.TIGHT and FORECAST_BOUND is BoundKind.UPPER


def test_upper_bound_for_a_forecast_by_quadrature():
    """T = 2, mean imputation, forecast = mean of the released series. Masks: both kept
    (N((x1+x2)/2, σ²/2)), one kept (N(x_kept, σ²)), none (atom at the fill value). The exact ε
    of the forecast for x = (v, c) against x' = (0, c) is below the formula (post-processing),
    and not absurdly so."""
    v, c = 1.0, 0.3
    out = []
    for z, r, delta in [(1.0, 0.5, 1e-3), (2.0, 0.75, 1e-4), (0.8, 0.3, 1e-4)]:
        s = z * v
        p, q = _forecast_density(v, c, r, s), _forecast_density(0.0, c, r, s)
        true_eps = _true_epsilon(p, q, delta, -14 * s - v, 14 * s + v)
        ours = time_domain_epsilon(delta, noise_multiplier=z, subsampling_rate=r)
        assert ours >= true_eps
        assert ours <= 3.0 * true_eps + 0.1
        out.append((ours, true_eps))
    assert any(o > t * 1.01 for o, t in out)  # the forecast really leaks less: not tight here


@pytest.mark.float_sensitive
@pytest.mark.parametrize("z,r,m", [(1.0, 0.5, 1), (1.5, 0.3, 4), (2.0, 0.75, 12),
                                   (3.0, 0.1, 30)])
def test_composition_bracketed_by_dp_accounting_plds(z, r, m):
    """m uses = m-fold composition of one use; dp_accounting's optimistic and pessimistic PLDs
    (FFT composition) bracket the binomial-mixture closed form."""
    delta = 1e-5
    pess = _one_use_pmf(z, r, True).self_compose(m).get_epsilon_for_delta(delta)
    opt = _one_use_pmf(z, r, False).self_compose(m).get_epsilon_for_delta(delta)
    ours = time_domain_epsilon(delta, noise_multiplier=z, subsampling_rate=r, releases=m)
    assert opt - 1e-9 <= ours <= pess + 1e-9
    assert pess - opt < 0.02 * max(ours, 0.1)  # the bracket is narrow: ours is pinned down
    # releases and changed steps enter only through their product
    if m % 2 == 0:
        alt = time_domain_epsilon(delta, noise_multiplier=z, subsampling_rate=r,
                                  releases=m // 2, changed_steps=2)
        assert alt == ours


# ---- monotonicity, calibration ------------------------------------------------------------------
def test_monotone():
    zs = [0.3, 0.5, 1.0, 2.0, 4.0, 8.0]
    eps_z = [time_domain_epsilon(1e-5, noise_multiplier=z, subsampling_rate=0.5) for z in zs]
    assert all(a > b for a, b in itertools.pairwise(eps_z))
    rs = [0.05, 0.2, 0.5, 0.9, 1.0]
    eps_r = [time_domain_epsilon(1e-5, noise_multiplier=1.0, subsampling_rate=r) for r in rs]
    assert all(a < b for a, b in itertools.pairwise(eps_r))
    ns = [1, 2, 5, 20]
    eps_n = [time_domain_epsilon(1e-5, noise_multiplier=2.0, subsampling_rate=0.5, releases=n)
             for n in ns]
    assert all(a < b for a, b in itertools.pairwise(eps_n))
    deltas = time_domain_delta(np.linspace(0, 6, 25), noise_multiplier=1.0,
                               subsampling_rate=0.5, releases=3)
    assert np.all(np.diff(deltas) < 0) and np.all(np.isfinite(deltas))


@pytest.mark.parametrize("eps,delta,r,n,w", [(1.0, 1e-4, 1.0, 1, 1), (1.0, 1e-4, 0.5, 1, 1),
                                             (0.5, 1e-4, 0.75, 1, 1), (4.0, 1e-6, 0.2, 10, 3),
                                             (8.0, 1e-5, 0.5, 100, 1)])
def test_calibration_round_trip(eps, delta, r, n, w):
    z = calibrate_time_domain_noise(eps, delta, subsampling_rate=r, releases=n, changed_steps=w)
    kw = dict(subsampling_rate=r, releases=n, changed_steps=w)
    assert time_domain_epsilon(delta, noise_multiplier=z, **kw) <= eps
    assert time_domain_delta(eps, noise_multiplier=z, **kw) <= delta
    # smallest: a hair less noise misses the target
    assert time_domain_delta(eps, noise_multiplier=z * (1 - 1e-6), **kw) > delta


def test_subsampling_lowers_the_calibrated_noise():
    """App. H, Tables 11–13 setting (δ = 1e-4): smaller r, less noise for the same ε."""
    z = [calibrate_time_domain_noise(1.0, 1e-4, subsampling_rate=r) for r in (1.0, 0.75, 0.5)]
    assert z[0] > z[1] > z[2]
    assert z[0] == pytest.approx(3.1857, rel=1e-3)  # analytic Gaussian at (1, 1e-4)


def test_extremes_never_nan_or_hang():
    assert time_domain_epsilon(1e-5, noise_multiplier=1e6, subsampling_rate=0.5) >= 0.0
    assert time_domain_epsilon(0.5, noise_multiplier=1.0, subsampling_rate=1e-9) == 0.0
    assert time_domain_delta(1e3, noise_multiplier=0.01, subsampling_rate=1.0) >= 0.0
    with pytest.raises(ValueError, match="noise_multiplier"):
        time_domain_epsilon(1e-5, noise_multiplier=1e-6, subsampling_rate=1.0)
    with pytest.raises(ValueError, match="delta"):
        calibrate_time_domain_noise(1.0, 0.6, subsampling_rate=0.5)  # ≥ 1 − (1 − r)
    assert noiseless_delta(0.5, releases=3) == pytest.approx(0.875)
    assert calibrate_time_domain_noise(1.0, 0.49, subsampling_rate=0.5) > 0


# ---- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,name", [
    (dict(noise_multiplier=0.0), "noise_multiplier"),
    (dict(noise_multiplier=-1.0), "noise_multiplier"),
    (dict(noise_multiplier=float("nan")), "noise_multiplier"),
    (dict(noise_multiplier=float("inf")), "noise_multiplier"),
    (dict(subsampling_rate=0.0), "subsampling_rate"),
    (dict(subsampling_rate=1.5), "subsampling_rate"),
    (dict(subsampling_rate=float("nan")), "subsampling_rate"),
    (dict(releases=0), "releases"),
    (dict(releases=1.5), "releases"),
    (dict(changed_steps=0), "changed_steps"),
    (dict(releases=10**4, changed_steps=10**3), "releases \\* changed_steps"),
])
def test_bad_accounting_input_names_the_argument(kwargs, name):
    base = dict(noise_multiplier=1.0, subsampling_rate=0.5)
    with pytest.raises(ValueError, match=name):
        time_domain_epsilon(1e-5, **{**base, **kwargs})
    with pytest.raises(ValueError, match=name):
        time_domain_delta(1.0, **{**base, **kwargs})


def test_bad_targets_name_the_argument():
    for d in (0.0, 1.0, -1e-5, float("nan")):
        with pytest.raises(ValueError, match="delta"):
            time_domain_epsilon(d, noise_multiplier=1.0, subsampling_rate=0.5)
        with pytest.raises(ValueError, match="delta"):
            calibrate_time_domain_noise(1.0, d, subsampling_rate=0.5)
    for e in (-1.0, float("nan"), float("inf"), "x"):
        with pytest.raises(ValueError, match="epsilon"):
            time_domain_delta(e, noise_multiplier=1.0, subsampling_rate=0.5)
    for e in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="epsilon"):
            calibrate_time_domain_noise(e, 1e-5, subsampling_rate=0.5)
    with pytest.raises(ValueError, match="rtol"):
        calibrate_time_domain_noise(1.0, 1e-5, subsampling_rate=0.5, rtol=0.0)


# ---- the torch glue ----------------------------------------------------------------------------
def test_release_follows_the_mechanism():
    """One long constant series: the kept fraction is r, the kept values are x + N(0, (zv)²),
    the dropped ones all equal the mean of the kept ones."""
    n, r, z, v, x = 40_000, 0.3, 2.0, 0.5, 7.0
    out, rep = privatize_series(torch.full((n,), x), subsampling_rate=r, sensitivity=v,
                                delta=1e-5, noise_multiplier=z, seed=0)
    assert out.shape == (n,) and out.dtype == torch.float32
    values, counts = torch.unique(out, return_counts=True)
    fill = values[counts.argmax()]
    kept = out[out != fill]
    assert counts.max() == n - rep.kept_steps
    assert rep.kept_steps / n == pytest.approx(r, abs=0.01)
    assert float(fill) == pytest.approx(float(kept.double().mean()), abs=1e-4)
    assert float(kept.double().mean()) == pytest.approx(x, abs=0.03)
    assert float(kept.double().std()) == pytest.approx(z * v, rel=0.03)
    assert rep.noise_std == pytest.approx(z * v)
    assert rep.epsilon == time_domain_epsilon(1e-5, noise_multiplier=z, subsampling_rate=r)


def test_forecast_report_and_labels():
    series = torch.linspace(0, 1, 24, dtype=torch.float64)
    calls = []

    def model(s):
        calls.append(s.clone())
        assert not torch.is_grad_enabled()
        return s[-4:].mean().repeat(3)

    fc, rep = private_forecast(model, series, subsampling_rate=0.5, sensitivity=0.1,
                               delta=1e-4, epsilon=2.0, releases=3)
    assert isinstance(rep, InferencePrivacyReport) and fc.shape == (3,)
    assert calls[0].dtype == torch.float64 and not torch.equal(calls[0], series)
    assert rep.private and rep.not_private_reason is None and rep.bound == "upper"
    assert rep.epsilon <= 2.0 and rep.target_epsilon == 2.0 and rep.releases == 3
    assert rep.noise_multiplier == calibrate_time_domain_noise(
        2.0, 1e-4, subsampling_rate=0.5, releases=3)
    assert "separate" in rep.scope and "training" in rep.scope
    assert "seed" not in rep.as_dict() and rep.as_dict()["private"] is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        rep.epsilon = 0.0
    # fresh OS entropy by default: two calls differ
    a, _ = privatize_series(series, subsampling_rate=0.5, sensitivity=0.1, delta=1e-4,
                            noise_multiplier=1.0)
    b, _ = privatize_series(series, subsampling_rate=0.5, sensitivity=0.1, delta=1e-4,
                            noise_multiplier=1.0)
    assert not torch.equal(a, b)
    # seeded: reproducible, labelled not private
    kw = dict(subsampling_rate=0.5, sensitivity=0.1, delta=1e-4, noise_multiplier=1.0)
    s1, r1 = privatize_series(series, seed=5, **kw)
    s2, _ = privatize_series(series, seed=5, **kw)
    assert torch.equal(s1, s2) and not r1.private and "seed=5" in r1.not_private_reason
    assert r1.as_dict()["seed"] == 5
    _, r3 = privatize_series(series, generator=torch.Generator().manual_seed(1), **kw)
    assert not r3.private and "generator" in r3.not_private_reason
    assert torch.equal(series, torch.linspace(0, 1, 24, dtype=torch.float64))  # not modified


def test_value_range_clips_and_constant_imputation():
    kw = dict(subsampling_rate=1.0, sensitivity=1.0, delta=1e-4, noise_multiplier=1e-3, seed=0)
    out, rep = privatize_series([-5.0, 0.5, 9.0], value_range=(0.0, 1.0), **kw)
    assert out.dtype == torch.float64  # a list of Python floats is float64
    assert torch.allclose(out, torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64), atol=0.01)
    assert rep.covers_any_substitution and rep.value_range == (0.0, 1.0)
    _, rep = privatize_series([1.0], value_range=(0.0, 2.0), **kw)
    assert not rep.covers_any_substitution
    out, rep = privatize_series(np.arange(50.0), subsampling_rate=0.2, sensitivity=1.0,
                                delta=1e-4, noise_multiplier=1.0, imputation="constant",
                                fill_value=-3.0, seed=1)
    assert int((out == -3.0).sum()) == 50 - rep.kept_steps
    assert "1 time step" in rep.relation


@pytest.mark.parametrize("kwargs,name", [
    (dict(subsampling_rate=0.0), "subsampling_rate"),
    (dict(sensitivity=0.0), "sensitivity"),
    (dict(sensitivity=float("inf")), "sensitivity"),
    (dict(delta=1.0), "delta"),
    (dict(noise_multiplier=None), "exactly one of noise_multiplier and epsilon"),
    (dict(epsilon=1.0), "exactly one of noise_multiplier and epsilon"),
    (dict(noise_multiplier=-2.0), "noise_multiplier"),
    (dict(noise_multiplier=None, epsilon=0.0), "epsilon"),
    (dict(releases=0), "releases"),
    (dict(changed_steps=-1), "changed_steps"),
    (dict(imputation="last"), "imputation"),
    (dict(fill_value=float("nan")), "fill_value"),
    (dict(value_range=(1.0, 0.0)), "value_range"),
    (dict(value_range=(0.0,)), "value_range"),
    (dict(value_range=(0.0, float("inf"))), "value_range"),
    (dict(seed=1, generator=torch.Generator()), "either generator or seed"),
    (dict(seed=-1), "seed"),
    (dict(generator=1), "generator"),
])
def test_bad_glue_input_names_the_argument(kwargs, name):
    base = dict(subsampling_rate=0.5, sensitivity=1.0, delta=1e-4, noise_multiplier=1.0)
    with pytest.raises(ValueError, match=name):
        private_forecast(lambda s: s, [1.0, 2.0], **{**base, **kwargs})


def test_bad_series_and_model():
    kw = dict(subsampling_rate=0.5, sensitivity=1.0, delta=1e-4, noise_multiplier=1.0)
    for bad in ([], [[1.0, 2.0]], [1.0, float("nan")], [1.0, float("inf")], [True, False],
                ["a", "b"]):
        with pytest.raises(ValueError, match="series"):
            private_forecast(lambda s: s, bad, **kw)
    with pytest.raises(ValueError, match="model_fn"):
        private_forecast(None, [1.0], **kw)
