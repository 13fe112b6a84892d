"""The sparse Rényi dynamic program of random allocation against independent computations.

Oracles: the dense log-domain program it replaced (``log_rest_sums_dense``), a direct
enumeration of all count vectors (the multinomial form, Eq. 12–13), brute force over all
``b^α`` index tuples (Eq. 5), and the exact order-2 / order-3 tuple sums.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import special

from opacus_structured.accounting import random_allocation_dp as rdp
from opacus_structured.accounting import random_allocation_mf as ra


def _banded(rng, k, b, p, low=0.0):
    N = k * b
    C = np.tril(rng.uniform(low, 1.0, (N, N)))
    return ra.gram_matrix(ra.mixture_means(C - np.tril(C, -p), k, b))


def _plan_args(G, bands):
    p = min(bands, ra.cyclic_bandwidth(G))
    Gp, tau = ra._truncate(G, p)
    w, wrap = ra._dp_plan(G.shape[0], p, Gp)
    return Gp, tau, w, wrap


def _count_vector_sums(G, sigma, A):
    """log S_α by enumerating every count vector r ∈ ℕ^b with Σr ≤ A (the multinomial form)."""
    b = G.shape[0]
    out = np.full(A + 1, -np.inf)
    for r in itertools.product(range(A + 1), repeat=b):
        m = sum(r)
        if m > A:
            continue
        rv = np.array(r, dtype=float)
        expo = (rv @ G @ rv - rv @ (np.diag(G) * 1.0)) / (2 * sigma ** 2)
        lw = expo - float(np.sum(special.gammaln(rv + 1)))
        out[m] = np.logaddexp(out[m], lw)
    return out


def test_sparse_equals_dense_on_random_banded_matrices():
    rng = np.random.default_rng(7)
    cases = 0
    for _ in range(120):
        k, b, p = int(rng.integers(1, 4)), int(rng.integers(1, 9)), int(rng.integers(1, 4))
        G = _banded(rng, k, b, p)
        Gp, _, w, wrap = _plan_args(G, int(rng.integers(1, 4)))
        A = int(rng.integers(2, 7))
        sigma = float(rng.uniform(0.3, 3.0))
        dense = rdp.log_rest_sums_dense(Gp, sigma, w, wrap, A)
        sparse = rdp.log_rest_sums_sparse(Gp, sigma, w, wrap, A)
        np.testing.assert_allclose(sparse, dense, rtol=1e-12, atol=1e-12)
        cases += wrap and w > 1
    assert cases >= 20  # the wrap-around closure was exercised


@pytest.mark.parametrize("k, b, p, bands, A", [
    (1, 4, 2, 2, 4), (2, 3, 2, 2, 4), (2, 4, 3, 3, 3), (3, 3, 1, 1, 5), (2, 5, 2, 2, 3),
    (1, 5, 3, 2, 3),  # truncated to a smaller band than the matrix has
])
def test_sparse_equals_count_vector_enumeration(k, b, p, bands, A):
    rng = np.random.default_rng(k * 100 + b * 10 + p)
    G = _banded(rng, k, b, p, low=0.2)
    Gp, _, w, wrap = _plan_args(G, bands)
    for sigma in (0.6, 1.7):
        ref = _count_vector_sums(Gp, sigma, A)
        got = rdp.log_rest_sums_sparse(Gp, sigma, w, wrap, A)
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_sparse_matches_tuple_brute_force_and_exact_orders():
    rng = np.random.default_rng(11)
    G = _banded(rng, 2, 6, 3, low=0.1)            # wraps around (k = 2)
    Gp, tau, w, wrap = _plan_args(G, 3)
    assert tau == 0.0 and wrap and w == 3
    sigma = 1.3
    log_s = rdp.log_rest_sums_sparse(Gp, sigma, w, wrap, 4)

    def rho(a):
        return (log_s[a] + special.gammaln(a + 1.0) - a * math.log(6)) / (a - 1)

    assert rho(2) == pytest.approx(ra.renyi_remove_order2_exact(G, sigma), rel=1e-12)
    assert rho(3) == pytest.approx(ra._renyi_remove_order3_exact(G, sigma), rel=1e-12)
    assert rho(4) == pytest.approx(ra.renyi_remove_bruteforce(G, sigma, 4), rel=1e-12)


def test_medium_cases_equal_dense():
    # b = 30 bins, BSR-like 3 bands over 3 epochs (wrap-around) and over one epoch (none), and
    # DP-SGD up to order 80
    c = np.array([1.0, 0.5, 0.375])
    N = 90
    C = sum(np.diag(np.full(N - j, c[j]), -j) for j in range(3))
    G = ra.gram_matrix(ra.mixture_means(C, 3, 30))
    Gp, _, w, wrap = _plan_args(G, 3)
    assert (w, wrap) == (3, True)
    for sigma in (0.4, 2.5):
        np.testing.assert_allclose(rdp.log_rest_sums_sparse(Gp, sigma, w, wrap, 7),
                                   rdp.log_rest_sums_dense(Gp, sigma, w, wrap, 7),
                                   rtol=1e-12, atol=1e-12)
    # one epoch: banded without wrap-around, to order 20 (the advisor's b = 64 row: order 53)
    G1 = ra.gram_matrix(ra.mixture_means(C[:30, :30], 1, 30))
    Gp, _, w, wrap = _plan_args(G1, 3)
    assert (w, wrap) == (3, False)
    for sigma in (0.3, 1.5):
        np.testing.assert_allclose(rdp.log_rest_sums_sparse(Gp, sigma, w, wrap, 20),
                                   rdp.log_rest_sums_dense(Gp, sigma, w, wrap, 20),
                                   rtol=1e-12, atol=1e-12)
    Gi = 10.0 * np.eye(100)
    for sigma in (0.5, 3.0):
        np.testing.assert_allclose(rdp.log_rest_sums_sparse(Gi, sigma, 1, False, 80),
                                   rdp.log_rest_sums_dense(Gi, sigma, 1, False, 80),
                                   rtol=1e-12, atol=1e-12)


def test_small_noise_does_not_overflow():
    # exponents in the thousands: the per-total scaling keeps every factor finite
    rng = np.random.default_rng(5)
    G = _banded(rng, 3, 10, 2, low=0.5)
    Gp, _, w, wrap = _plan_args(G, 2)
    dense = rdp.log_rest_sums_dense(Gp, 0.02, w, wrap, 10)
    sparse = rdp.log_rest_sums_sparse(Gp, 0.02, w, wrap, 10)
    assert np.all(np.isfinite(sparse)) and sparse[10] > 1e4
    np.testing.assert_allclose(sparse, dense, rtol=1e-12)


def test_state_sets_settle_to_the_reachable_simplex():
    for nr, wrap, A in [(2, True, 14), (2, False, 6), (0, False, 9), (1, True, 5)]:
        plan = rdp._plan(nr, wrap, A)
        last = plan.stages[-1]
        cols = 2 * nr + 1 if wrap else nr + 1
        assert len(last.next_m) == len(last.m) == math.comb(A + cols, cols)
        assert int(last.n_t.sum()) == math.comb(A + cols + 1, cols + 1)   # moves a bin
        assert len(plan.stages) <= nr + 2
        # a run (rows equal but for the oldest window count) never spans two totals
        assert np.all(np.diff(last.m) >= 0)
        assert np.array_equal(last.seg_m[last.run], last.m)


def test_dispatch_falls_back_to_dense_when_not_certified(monkeypatch):
    calls = []
    real_dense = rdp.log_rest_sums_dense
    monkeypatch.setattr(rdp, "log_rest_sums_dense",
                        lambda *a: calls.append("dense") or real_dense(*a))
    # an off-diagonal entry above the largest diagonal one: the loss bound does not apply
    G = np.array([[1.0, 2.0, 0.0], [2.0, 1.0, 0.5], [0.0, 0.5, 1.0]])
    out = rdp.log_rest_sums(G, 1.0, 3, False, 3)
    assert calls == ["dense"]
    np.testing.assert_allclose(out, _count_vector_sums(G, 1.0, 3), rtol=1e-12)
    # the issue-41 setting (234 bins, window 3, order 14) is certified by a wide margin
    assert rdp.sparse_underflow_log_bound(234, 3, True, 14) < -500
    assert rdp.sparse_underflow_log_bound(234, 3, False, 53) < -300      # the b = 64 row
    assert rdp.sparse_underflow_log_bound(3000, 2, True, 100) > -40      # -> dense
    # a bound that is not small enough sends a banded Gram matrix to the dense program too
    monkeypatch.setattr(rdp, "_MAX_LOSS_LOG", -1e9)
    Gb = _banded(np.random.default_rng(1), 2, 4, 2)
    Gp, _, w, wrap = _plan_args(Gb, 2)
    rdp.log_rest_sums(Gp, 1.0, w, wrap, 3)
    assert calls == ["dense", "dense"]
    monkeypatch.setattr(rdp, "_MAX_LOSS_LOG", -40.0)
    rdp.log_rest_sums(3.0 * np.eye(5), 1.0, 1, False, 4)       # w = 1 (DP-SGD): dense, faster
    assert calls == ["dense", "dense", "dense"]
    rdp.log_rest_sums(Gp, 1.0, w, wrap, 3)                       # certified: sparse
    assert calls == ["dense", "dense", "dense"]


def _issue41_gram(bands):
    from opacus_structured.schemes.random_allocation_mf import RandomAllocationMFScheme

    s = RandomAllocationMFScheme(strategy="bandmf", bands=bands, epochs=10,
                                 batches_per_epoch=234, method="renyi")
    return ra.gram_matrix(s.means())


@pytest.mark.slow
@pytest.mark.parametrize("bands", [4, 16])
def test_issue41_setting_sparse_equals_dense_to_order8(bands):
    """The advisor's matrices (234 bins × 10 epochs, BandMF, window 3), orders to 8 (~3 s)."""
    Gp, tau, w, wrap = _plan_args(_issue41_gram(bands), 3)
    assert (w, wrap) == (3, True) and tau > 0
    for sigma in (0.7, 4.0):
        np.testing.assert_allclose(rdp.log_rest_sums_sparse(Gp, sigma, w, wrap, 8),
                                   rdp.log_rest_sums_dense(Gp, sigma, w, wrap, 8),
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.slow
@pytest.mark.long
def test_issue41_setting_sparse_equals_dense():
    """The advisor's own evaluation: orders to 14 (the dense program: ~45 s idle)."""
    Gp, _, w, wrap = _plan_args(_issue41_gram(4), 3)
    np.testing.assert_allclose(rdp.log_rest_sums_sparse(Gp, 2.0, w, wrap, 14),
                               rdp.log_rest_sums_dense(Gp, 2.0, w, wrap, 14),
                               rtol=1e-12, atol=1e-12)
