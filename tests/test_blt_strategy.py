"""BLT (buffered linear Toeplitz) strategies: objective, gradient, streaming inverse, optimum.

Oracles: the dense ``prefix_sum_mse`` of the materialised ``C`` (independent of the O(n·d)
recursions), central finite differences for the analytic gradient, a dense triangular solve
for the streaming noise, and the separately optimised full-band Toeplitz (BandMF with b = n)
for the quality of the optimum (BLT is near-optimal among Toeplitz strategies: McMahan et al.
2024).
"""

from __future__ import annotations

import numpy as np
import pytest

from opacus_structured.accounting import strategies as st
from opacus_structured.accounting.strategies import BufferedToeplitz, blt_strategy


def test_coefficients_and_loss_match_dense_computation():
    blt = BufferedToeplitz((0.9, 0.5, 0.99), (0.2, 0.1, 0.05))
    n = 40
    c = blt.coefficients(n)
    k = np.arange(1, n)
    expected = 0.2 * 0.9 ** (k - 1) + 0.1 * 0.5 ** (k - 1) + 0.05 * 0.99 ** (k - 1)
    np.testing.assert_allclose(c, np.concatenate([[1.0], expected]), rtol=1e-13)
    C = st.toeplitz_matrix(c, n)
    assert blt.prefix_sum_mse(n) == pytest.approx(st.prefix_sum_mse(C), rel=1e-11)
    # scale invariance: the normalised C has the same MSE and unit sensitivity
    cn = blt.normalized_coefficients(n)
    assert np.linalg.norm(cn) == pytest.approx(1.0)
    assert st.prefix_sum_mse(st.toeplitz_matrix(cn, n)) == pytest.approx(blt.prefix_sum_mse(n))


def test_analytic_gradient_matches_finite_differences():
    theta, omega, n = np.array([0.93, 0.6]), np.array([0.3, 0.15]), 60
    _, grad = st._blt_loss_and_grad(theta, omega, n)
    x, h = np.concatenate([theta, omega]), 1e-6
    fd = []
    for i in range(x.size):
        e = np.zeros_like(x)
        e[i] = h
        up = st._blt_loss_and_grad((x + e)[:2], (x + e)[2:], n)[0]
        dn = st._blt_loss_and_grad((x - e)[:2], (x - e)[2:], n)[0]
        fd.append((up - dn) / (2 * h))
    np.testing.assert_allclose(grad, fd, rtol=1e-6)


def test_streaming_inverse_solves_c_w_equals_z():
    blt = blt_strategy(50, 3)
    z = np.random.default_rng(0).normal(size=(50, 7))
    w = blt.inverse_apply(z)
    C = st.toeplitz_matrix(blt.coefficients(50), 50)
    np.testing.assert_allclose(C @ w, z, atol=1e-12)


def test_optimum_is_near_the_best_toeplitz_and_beats_baselines():
    n = 64
    blt = blt_strategy(n, 3)
    mse = st.prefix_sum_mse(st.strategy_matrix("blt", n, 3))
    assert mse == pytest.approx(blt.prefix_sum_mse(n), rel=1e-10)
    full = st.toeplitz_prefix_sum_loss(st.banded_toeplitz_coefficients(n, n), n)
    bsr_full = st.prefix_sum_mse(st.toeplitz_matrix(st.banded_sqrt_coefficients(n), n))
    assert mse <= 1.01 * full            # 3 buffers: within 1 % of the dense Toeplitz optimum
    assert mse < bsr_full < st.prefix_sum_mse(np.eye(n))
    assert blt_strategy(n, 1).prefix_sum_mse(n) >= mse - 1e-12   # more buffers never hurt
    assert np.all(np.array(blt.buf_decay) <= 1) and np.all(np.array(blt.output_scale) >= 0)
    assert list(blt.buf_decay) == sorted(blt.buf_decay, reverse=True)


@pytest.mark.parametrize("kwargs, match", [
    (dict(buf_decay=(1.2,), output_scale=(0.1,)), "buf_decay"),
    (dict(buf_decay=(0.5,), output_scale=(-0.1,)), "output_scale"),
    (dict(buf_decay=(0.5, 0.2), output_scale=(0.1,)), "equal length"),
    (dict(buf_decay=(), output_scale=()), "non-empty"),
])
def test_bad_parameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BufferedToeplitz(**kwargs)


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="bands must be <= n"):
        blt_strategy(3, 4)
    with pytest.raises(ValueError, match="n"):
        blt_strategy(0, 1)
    with pytest.raises(ValueError, match="dense C"):
        st.strategy_coefficients("blt", 10, 2)
