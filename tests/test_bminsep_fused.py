"""Issue 18: the fused (numba) b-min-sep sampler — its generator, Gaussians and exp checked
against independent references, and its law against an identity every privacy-loss
distribution satisfies. (Its losses against the log-space dynamic program on the outputs it
drew: ``test_streamed_sampler_equals_log_space_program`` in test_bminsep_mc_scale.py.)"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import special, stats

from opacus_structured.accounting import bminsep_fused as bf
from opacus_structured.accounting.bminsep_mc import (
    DIRECTIONS,
    BandedStrategy,
    BandMFMonteCarlo,
    bminsep_log_ratio,
    sampler_stream,
    streamed_bminsep_losses,
)
from opacus_structured.runners.monte_carlo import collect_privacy_losses

pytestmark = pytest.mark.skipif(not bf.fused_available(),
                                reason="the fused sampler needs numba (the [fast] extra)")


def _sqrt_coefficients(L: int) -> np.ndarray:
    c = np.cumprod([1.0] + [(2 * j - 1) / (2 * j) for j in range(1, L)])
    return c / np.linalg.norm(c)


def _splitmix64_reference(seed: int, count: int) -> list[int]:
    """Vigna's splitmix64.c in Python integers: ``x += γ; z = x; …; return z ^ (z >> 31)``."""
    mask, out, x = 2**64 - 1, [], seed
    for _ in range(count):
        x = (x + 0x9E3779B97F4A7C15) & mask
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(z ^ (z >> 31))
    return out


def test_counter_splitmix64_is_the_reference_stream():
    """Output c of key k is output c of splitmix64.c seeded with k − γ (counter-based)."""
    seed = 0x0123456789ABCDEF
    key = (seed + 0x9E3779B97F4A7C15) % 2**64
    ref = _splitmix64_reference(seed, 1000)
    np.testing.assert_array_equal(bf.splitmix64_raw(key, 0, 1000),
                                  np.array(ref, dtype=np.uint64))
    np.testing.assert_array_equal(bf.splitmix64_raw(key, 500, 10),
                                  np.array(ref[500:510], dtype=np.uint64))


def test_ziggurat_layers_have_equal_area():
    """Every layer of the table has area v (the base layer: rectangle + tail), to 1e-13."""
    X, F, r = bf.ziggurat_tables()
    assert r == pytest.approx(3.6541528853610088, abs=1e-15)  # numpy's constant
    f = lambda x: math.exp(-0.5 * x * x)  # noqa: E731
    v = r * f(r) + math.sqrt(math.pi / 2) * special.erfc(r / math.sqrt(2))
    assert X[0] * F[1] == pytest.approx(v, rel=1e-15)  # base: X_0 f(r) = r f(r) + tail
    assert X[1] == r and X[256] == 0.0 and F[256] == 1.0
    areas = X[1:256] * (F[2:257] - F[1:256])
    np.testing.assert_allclose(areas, v, rtol=1e-12)
    assert np.all(np.diff(X[1:]) < 0)


def test_fused_gaussians_are_standard_normal():
    """4·10⁶ draws: χ² over 200 equiprobable bins, KS, the tail mass beyond r (where the
    exponential tail method takes over) and the first four moments."""
    z = bf.fused_standard_normal(4_000_000, np.random.default_rng(11))
    edges = stats.norm.ppf(np.linspace(0, 1, 201)[1:-1])
    counts = np.bincount(np.searchsorted(edges, z), minlength=200)
    assert stats.chisquare(counts).pvalue > 1e-4
    assert stats.kstest(z[:1_000_000], "norm").pvalue > 1e-4
    _, _, r = bf.ziggurat_tables()
    tail = np.count_nonzero(np.abs(z) > r)
    expected = 2 * stats.norm.sf(r) * z.size
    assert abs(tail - expected) < 5 * math.sqrt(expected)
    se = 1 / math.sqrt(z.size)
    assert abs(z.mean()) < 5 * se and abs(z.var() - 1) < 5 * math.sqrt(2) * se
    assert abs(stats.skew(z)) < 5 * math.sqrt(6) * se
    assert abs(stats.kurtosis(z)) < 5 * math.sqrt(24) * se


def test_fused_exp_is_within_one_ulp():
    from opacus_structured.accounting import _bminsep_fused_kernels as K

    x = np.concatenate([np.linspace(-708, 709, 200_000),
                        np.random.default_rng(0).normal(0, 5, 200_000)]).reshape(1000, 400)
    g = x.copy()
    K.exp_rows(g, np.empty(400, np.int64), 1000, 400)
    ref = np.exp(x)
    assert np.all(np.abs(g - ref) <= np.spacing(ref))
    low = np.array([[-720.0, -1e4, -np.inf]])
    K.exp_rows(low, np.empty(3, np.int64), 1, 3)
    floor = math.exp(-708.0)  # the documented floor, to 1 ulp
    assert np.all(np.abs(low - floor) <= np.spacing(floor))


def test_fused_p_one_runs_in_log_space():
    st = BandedStrategy.toeplitz([1.0, 0.5, 0.25], 40)
    mech = BandMFMonteCarlo(st, 0.7, "bminsep", 1.0, 3)
    loss, y = streamed_bminsep_losses(mech, 200, "remove", np.random.default_rng(1), block=16,
                                      return_outputs=True, accelerator="fused")
    np.testing.assert_allclose(loss, bminsep_log_ratio(y, st, 1.0, 3, 0.7), rtol=1e-9,
                               atol=1e-9)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_fused_law_satisfies_the_likelihood_ratio_identity(direction):
    """For any pair (P, Q), E_{y~P}[e^{−ln(P/Q)(y)}] = 1 (and with P, Q swapped): a check of
    the *law* of the drawn outputs (Gaussians and participation), independent of the code that
    computes the loss — a wrong variance, mean or participation rate moves it off 1. Also the
    loss distribution equals the numpy stream's (two-sample KS)."""
    n, b = 120, 4
    st = BandedStrategy.toeplitz(_sqrt_coefficients(b), n)
    mech = BandMFMonteCarlo(st, 0.8, "bminsep", 0.08, b, warm_start=True)
    loss = streamed_bminsep_losses(mech, 60_000, direction, np.random.default_rng(7),
                                   accelerator="fused")
    w = np.exp(-loss)
    assert abs(w.mean() - 1.0) < 5 * w.std() / math.sqrt(w.size)
    other = streamed_bminsep_losses(mech, 20_000, direction, np.random.default_rng(8),
                                    accelerator="numpy")
    assert stats.ks_2samp(loss, other).pvalue > 1e-4


def test_fused_stream_is_reproducible_and_named():
    st = BandedStrategy.toeplitz(_sqrt_coefficients(4), 50)
    mech = BandMFMonteCarlo(st, 1.0, "bminsep", 0.1, 4, warm_start=True)
    a = streamed_bminsep_losses(mech, 300, "remove", np.random.default_rng(5), accelerator="fused")
    c = streamed_bminsep_losses(mech, 300, "remove", np.random.default_rng(5), accelerator="fused")
    np.testing.assert_array_equal(a, c)
    other_block = streamed_bminsep_losses(mech, 300, "remove", np.random.default_rng(5),
                                          accelerator="fused", block=16)
    np.testing.assert_allclose(other_block, a, rtol=1e-12, atol=1e-12)  # block: not the stream
    assert sampler_stream(mech, "fused") == "fused"
    assert sampler_stream(mech, "numba") == "numpy"
    trunc = BandMFMonteCarlo(st, 1.0, "bminsep", 0.1, 4, truncated_batch_size=3, dataset_size=9)
    assert sampler_stream(trunc, "fused") == "numpy"  # only plain b-min-sep has a fused kernel
    with pytest.raises(ValueError, match="accelerator must be one of"):
        sampler_stream(mech, "gpu")


def test_fused_without_numba_is_a_clear_error_and_auto_falls_back(monkeypatch):
    """Without numba: ``accelerator="fused"`` names the extra; ``"auto"`` draws the numpy
    stream and says so through :func:`sampler_stream`."""
    st = BandedStrategy.toeplitz([1.0, 0.5], 20)
    mech = BandMFMonteCarlo(st, 1.0, "bminsep", 0.1, 2)
    monkeypatch.setattr(bf, "_KERNELS", [None])
    with pytest.raises(ValueError, match=r"fused sampler needs numba .*\[fast\]"):
        streamed_bminsep_losses(mech, 10, "remove", np.random.default_rng(0),
                                accelerator="fused")
    assert sampler_stream(mech) == "numpy"
    a = streamed_bminsep_losses(mech, 50, "remove", np.random.default_rng(0))
    b = streamed_bminsep_losses(mech, 50, "remove", np.random.default_rng(0),
                                accelerator="numpy")
    np.testing.assert_array_equal(a, b)


def test_shard_directory_records_the_stream(tmp_path):
    """A directory written by one stream is never resumed by the other."""
    st = BandedStrategy.toeplitz([1.0, 0.5], 12)
    mech = BandMFMonteCarlo(st, 1.0, "bminsep", 0.2, 2)
    d = tmp_path / "run"
    first = collect_privacy_losses(mech, 100, seed=1, shard_size=50, workers=1, directory=str(d))
    meta = json.loads((d / "meta.json").read_text())
    assert meta["stream"] == "fused"
    again = collect_privacy_losses(mech, 100, seed=1, shard_size=50, workers=1,
                                   directory=str(d))
    np.testing.assert_array_equal(first.remove, again.remove)
    meta["stream"] = "numpy"
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="'numpy' random stream, and this run draws the "
                                         "'fused' stream"):
        collect_privacy_losses(mech, 100, seed=1, shard_size=50, workers=1, directory=str(d))
