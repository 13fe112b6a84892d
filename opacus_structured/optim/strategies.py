"""Strategy matrices ``C`` for the matrix-factorization (correlated-noise) mechanism.

Pure numpy/scipy (no torch import), so the accountants can use it.

Background (Choquette-Choo et al. 2023, "Amplified banded matrix factorization", §2;
digest ``seed1-bandmf-bminsep.md`` §2 and ``seed4-random-allocation-mf.md`` §3). Training with
``n`` steps releases noisy prefix sums of the clipped-gradient sums ``G`` (rows = steps),
``A (G + C^{-1} Z)`` with ``A`` the all-ones lower-triangular workload and ``Z`` i.i.d.
``N(0, σ² clip²)``. Step ``i`` adds the noise row ``w_i = (C^{-1} Z)_i`` instead of ``z_i``.
``C = I`` is DP-SGD. By post-processing this is the Gaussian mechanism on ``C G``, so privacy is
governed by the columns of ``C`` (one column per participation) and utility by

    MSE(C) = (1/n) ‖A C^{-1}‖_F² · sens(C)²,

the mean squared error of the n prefix sums (per unit σ), where ``sens(C)`` is the
single-participation sensitivity ``max_j ‖C[:, j]‖₂``.

Conventions used throughout (they are the ones the accountants assume):

* ``C`` is lower-triangular, entrywise **non-negative** (needed for amplification).
* A *banded Toeplitz* strategy is given by its first-column coefficients
  ``c = (c_0, …, c_{b-1})``, ``C[i, j] = c_{i-j}`` for ``0 ≤ i-j < b`` (``b`` bands). It is
  **pure Toeplitz** (the last ``b-1`` columns are truncated, *not* column-normalised) and
  ``‖c‖₂ = 1``, so every participation has sensitivity ≤ 1 and σ is the noise multiplier in units
  of the clip norm (digest §2.2 pitfall and §2.4). An accountant must use exactly these
  columns: column ``j`` is ``c[:min(b, n-j)]`` (:func:`toeplitz_columns`).
* For a banded Toeplitz ``C`` the noise is generated online by forward substitution
  ``w_i = (z_i − Σ_{k=1}^{b-1} c_k w_{i−k}) / c_0`` (Algorithm 9 of Choquette-Choo et al. 2023),
  which is what :class:`opacus_structured.optim.CorrelatedNoiseDPOptimizer` does.

Families
--------
* DP-SGD: :func:`identity_strategy` (``c = [1]``).
* BandMF (McKenna 2025; Choquette-Choo et al. 2023): :func:`banded_toeplitz_coefficients`,
  the b-banded Toeplitz ``c`` minimising the prefix-sum objective below (L-BFGS-B, cached).
* BSR (banded square root, Kalinin & Lampert 2024): :func:`banded_sqrt_coefficients`, the first
  ``b`` Taylor coefficients of ``(1-x)^{-1/2}`` (= ``binom(2j, j)/4^j``).
* BISR (banded inverse square root, Kalinin et al. 2025): :func:`banded_inverse_sqrt_coefficients`
  gives the ``C^{-1}`` coefficients (Taylor coefficients of ``(1-x)^{1/2}``); ``C`` is dense.
* BandInvMF (Kalinin et al. 2025): :func:`banded_inverse_coefficients`, ``C^{-1}`` banded Toeplitz
  with ``b`` bands minimising the same objective (``C`` dense, non-negative in practice;
  checked).

BandMF objective
----------------
As in jax_privacy ``toeplitz.optimize_banded_toeplitz`` (digest §2.3).
With ``β = C^{-1} 1`` (the first column of ``A C^{-1}``; for Toeplitz ``C`` the row ``i`` of
``A C^{-1}`` is ``(β_i, β_{i-1}, …, β_0)``) the per-query error of prefix sum ``i`` is
``cumsum(β²)_i`` and

    loss(c) = mean_i cumsum(β²)_i · ‖c‖₂²  =  (1/n) ‖A C^{-1}‖_F² · ‖c‖₂²  =  MSE(C).

The loss is scale invariant (``c → s·c`` gives ``β → β/s``), so the optimum is returned with
``‖c‖₂ = 1``. It is minimised from the "optimal max-error" initialisation
``c_k = Π_{j≤k} (2j−1)/(2j)`` with the analytic gradient (adjoint of the banded solve) under the
bounds ``c_0 ≥ 1e-6``, ``c_k ≥ 0`` (non-negativity is required by the amplification analyses).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy import linalg, optimize

from .._validation import check_int

__all__ = [
    "STRATEGIES",
    "max_error_coefficients",
    "banded_sqrt_coefficients",
    "banded_inverse_sqrt_coefficients",
    "banded_toeplitz_coefficients",
    "banded_inverse_coefficients",
    "identity_strategy",
    "toeplitz_matrix",
    "toeplitz_columns",
    "inverse_toeplitz_coefficients",
    "toeplitz_prefix_sum_loss",
    "prefix_sum_mse",
    "strategy_coefficients",
    "strategy_matrix",
    "validate_coefficients",
]

#: Strategy names accepted by :func:`strategy_coefficients` / :func:`strategy_matrix` and by the
#: ``--strategy`` flag of the ``bandmf-cyclic-poisson`` scheme. All but ``banded-inverse`` /
#: ``bisr`` are banded Toeplitz ``C`` (usable by the streaming optimizer and the banded
#: accountants); the inverse families give dense ``C``.
STRATEGIES = ("optimal-banded", "identity", "banded-sqrt", "banded-inverse", "bisr")


def _check_n_bands(n, bands):
    n = check_int("n", n, minimum=1)
    bands = check_int("bands", bands, minimum=1)
    if bands > n:
        raise ValueError(f"bands must be <= n (the number of steps), got bands={bands}, n={n}")
    return n, bands


def validate_coefficients(c, *, name: str = "c") -> np.ndarray:
    """Return ``c`` as a float64 1-d array; raise unless finite, ``c_0 > 0`` and ``c ≥ 0``."""
    arr = np.asarray(c, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-d sequence of coefficients, "
                         f"got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite, got {arr!r}")
    if arr[0] <= 0:
        raise ValueError(f"{name}[0] (the diagonal of C) must be > 0, got {arr[0]!r}")
    if np.any(arr < 0):
        raise ValueError(f"{name} must be entrywise >= 0 (non-negative strategy), got {arr!r}")
    return arr


def max_error_coefficients(n: int) -> np.ndarray:
    """``r_k = Π_{j=1}^{k} (2j−1)/(2j) = binom(2k, k)/4^k`` for ``k < n`` (1, 1/2, 3/8, 5/16, …).

    The Toeplitz square root of the prefix-sum workload, optimal for max error
    (Fichtenberger, Henzinger & Upadhyay 2023).
    """
    n = check_int("n", n, minimum=1)
    k = np.arange(1, n, dtype=np.float64)
    return np.concatenate([[1.0], np.cumprod((2 * k - 1) / (2 * k))])


def banded_sqrt_coefficients(bands: int, *, normalize: bool = True) -> np.ndarray:
    """BSR (Kalinin & Lampert 2024): the first ``bands`` max-error coefficients.

    ``normalize=True`` scales to ``‖c‖₂ = 1`` (this module's convention);
    ``normalize=False`` keeps ``c_0 = 1`` (the seed-004 digest §11 convention).
    """
    c = max_error_coefficients(check_int("bands", bands, minimum=1))
    return c / np.linalg.norm(c) if normalize else c


def banded_inverse_sqrt_coefficients(bands: int) -> np.ndarray:
    """BISR (Kalinin et al. 2025): ``C^{-1}`` banded Toeplitz coefficients, the first ``bands``
    Taylor coefficients of ``√(1−x)``: ``h_0 = 1``, ``h_k = h_{k−1}(k − 3/2)/k`` (1, −1/2, −1/8, …).
    ``C`` (dense) is the inverse series (:func:`inverse_toeplitz_coefficients`), non-negative.
    """
    bands = check_int("bands", bands, minimum=1)
    k = np.arange(1, bands, dtype=np.float64)
    return np.concatenate([[1.0], np.cumprod((k - 1.5) / k)])


def identity_strategy(n: int) -> np.ndarray:
    """DP-SGD: ``C = I_n`` (banded Toeplitz with ``c = [1]``)."""
    return np.eye(check_int("n", n, minimum=1))


def toeplitz_matrix(c, n: int) -> np.ndarray:
    """The ``n×n`` lower-triangular Toeplitz matrix with first column ``c`` (zero-padded or
    truncated to length ``n``): ``C[i, j] = c[i−j]`` for ``0 ≤ i−j < len(c)``."""
    n = check_int("n", n, minimum=1)
    c = np.asarray(c, dtype=np.float64)
    if c.ndim != 1 or c.size == 0:
        raise ValueError(f"c must be a non-empty 1-d array, got shape {c.shape}")
    col = np.zeros(n)
    m = min(n, c.size)
    col[:m] = c[:m]
    return linalg.toeplitz(col, np.zeros(n))


def toeplitz_columns(c, n: int) -> list[np.ndarray]:
    """Nonzero entries of each column of the pure banded Toeplitz ``C``: column ``j`` is
    ``c[:min(len(c), n−j)]`` (the last ``len(c)−1`` columns are truncated, not renormalised).
    These are the ``c_i`` an accountant must use (digest §2.2 pitfall)."""
    n = check_int("n", n, minimum=1)
    c = np.asarray(c, dtype=np.float64)
    return [c[:min(c.size, n - j)] for j in range(n)]


def inverse_toeplitz_coefficients(c, n: int) -> np.ndarray:
    """First column of ``T(c)^{-1}`` (length ``n``): the power-series inverse of ``c``.

    ``h_0 = 1/c_0``, ``h_i = −(Σ_{k=1}^{min(i, len(c)−1)} c_k h_{i−k}) / c_0``.
    """
    n = check_int("n", n, minimum=1)
    c = np.asarray(c, dtype=np.float64)
    if c.ndim != 1 or c.size == 0 or c[0] == 0:
        raise ValueError("c must be a non-empty 1-d array with c[0] != 0")
    # Forward substitution of T(c) h = e_0 is exactly the streaming recursion.
    e0 = np.zeros(n)
    e0[0] = 1.0
    return _banded_toeplitz_solve(c, e0)


def _banded_toeplitz_solve(c: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Solve ``T(c) x = rhs`` (lower-triangular banded Toeplitz) with ``solve_banded``."""
    n = rhs.shape[0]
    b = min(c.size, n)
    ab = np.zeros((b, n))
    for k in range(b):
        ab[k, : n - k] = c[k]
    return linalg.solve_banded((b - 1, 0), ab, rhs, check_finite=False)


def _banded_toeplitz_solve_transpose(c: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Solve ``T(c)^T x = rhs`` (upper-triangular banded)."""
    n = rhs.shape[0]
    b = min(c.size, n)
    ab = np.zeros((b, n))
    for k in range(b):
        ab[b - 1 - k, k:] = c[k]
    return linalg.solve_banded((0, b - 1), ab, rhs, check_finite=False)


def toeplitz_prefix_sum_loss(c, n: int, *, return_grad: bool = False):
    """BandMF objective ``mean(cumsum(β²)) · ‖c‖²`` with ``β = T(c)^{-1} 1`` (module docstring).

    Equals :func:`prefix_sum_mse` of ``toeplitz_matrix(c, n)`` when ``c`` is non-increasing in
    absolute value (then column 0 has the largest norm). With ``return_grad`` also returns the
    analytic gradient: ``∂f/∂c_k = −Σ_{i≥k} λ_i β_{i−k}`` where ``λ = T(c)^{-T} ∇_β f`` and
    ``f = (1/n) Σ_i (n−i) β_i²``.
    """
    n = check_int("n", n, minimum=1)
    c = np.asarray(c, dtype=np.float64)
    beta = _banded_toeplitz_solve(c, np.ones(n))
    weights = (n - np.arange(n)) / n
    f = float(np.sum(weights * beta**2))
    norm2 = float(c @ c)
    loss = f * norm2
    if not return_grad:
        return loss
    lam = _banded_toeplitz_solve_transpose(c, 2.0 * weights * beta)
    b = min(c.size, n)
    grad_f = np.array([-(lam[k:] @ beta[: n - k]) for k in range(b)])
    if c.size > b:
        grad_f = np.concatenate([grad_f, np.zeros(c.size - b)])
    return loss, grad_f * norm2 + f * 2.0 * c


def _log_loss_and_grad(x: np.ndarray, n: int):
    """``log`` of the BandMF loss and its gradient, for L-BFGS-B.

    The log keeps the scale of the problem O(1); a singular or overflowing trial point (roots of
    ``c(x)`` inside the unit disk make ``β`` grow geometrically) returns a large finite value so
    the line search backtracks instead of failing.
    """
    with np.errstate(all="ignore"):
        try:
            loss, grad = toeplitz_prefix_sum_loss(x, n, return_grad=True)
        except (np.linalg.LinAlgError, ValueError):
            return 1e4, np.zeros_like(x)
    if not (math.isfinite(loss) and loss > 0 and np.all(np.isfinite(grad))):
        return 1e4, np.zeros_like(x)
    return math.log(loss), grad / loss


@functools.lru_cache(maxsize=128)
def _optimal_banded(n: int, bands: int, max_iter: int) -> tuple[float, ...]:
    if bands == 1:
        return (1.0,)
    x0 = max_error_coefficients(bands)
    x0 = x0 / np.linalg.norm(x0)
    bounds = [(1e-3, None)] + [(0.0, None)] * (bands - 1)
    x = x0
    for _ in range(3):  # restart from the normalised point (the loss is scale invariant)
        res = optimize.minimize(_log_loss_and_grad, x, args=(n,), jac=True, method="L-BFGS-B",
                                bounds=bounds,
                                options={"maxiter": max_iter, "ftol": 0.0, "gtol": 1e-12,
                                         "maxcor": 30})
        x = np.asarray(res.x, dtype=np.float64)
        x = x / np.linalg.norm(x)
    # Never return something worse than the (feasible) initialisation.
    if not toeplitz_prefix_sum_loss(x, n) <= toeplitz_prefix_sum_loss(x0, n):
        x = x0
    return tuple(float(v) for v in x)


def banded_toeplitz_coefficients(n: int, bands: int, *, max_iter: int = 500) -> np.ndarray:
    """BandMF: b-banded Toeplitz coefficients optimised for the prefix-sum workload.

    Minimises ``mean(cumsum(β²)) · ‖c‖²`` (module docstring; jax_privacy
    ``optimize_banded_toeplitz(n, bands)`` with ``reduction_fn=mean``) over ``c ∈ R^bands``,
    ``c ≥ 0``, by L-BFGS-B with an analytic gradient from the max-error initialisation.

    Args:
        n: number of training steps (size of ``C``), ≥ 1.
        bands: number of bands ``b``, ``1 ≤ b ≤ n``. ``b = 1`` gives DP-SGD (``[1.0]``).
        max_iter: L-BFGS-B iteration cap.

    Returns:
        ``c`` (float64, length ``bands``) with ``‖c‖₂ = 1`` and ``c ≥ 0``: the first column of the
        pure Toeplitz ``C`` (no column normalisation; see :func:`toeplitz_columns`). Results are
        cached per ``(n, bands, max_iter)``; a fresh copy is returned each call.
    """
    n, bands = _check_n_bands(n, bands)
    max_iter = check_int("max_iter", max_iter, minimum=1)
    return np.array(_optimal_banded(n, bands, max_iter))


def _bandinv_loss(h: np.ndarray, n: int) -> float:
    # C^{-1} = T(h) banded: beta = T(h) 1 = cumsum(h) (saturating); sens^2 = ||T(h)^{-1}[:, 0]||^2.
    hp = np.zeros(n)
    hp[: h.size] = h
    beta = np.cumsum(hp)
    weights = (n - np.arange(n)) / n
    c_full = inverse_toeplitz_coefficients(h, n)
    return float(np.sum(weights * beta**2) * (c_full @ c_full))


@functools.lru_cache(maxsize=64)
def _optimal_banded_inverse(n: int, bands: int, max_iter: int) -> tuple[float, ...]:
    if bands == 1:
        return (1.0,)
    x0 = banded_inverse_sqrt_coefficients(bands)
    bounds = [(1.0, 1.0)] + [(None, None)] * (bands - 1)  # scale invariant: fix h_0 = 1
    res = optimize.minimize(lambda x: _bandinv_loss(x, n), x0, method="L-BFGS-B",
                            bounds=bounds, options={"maxiter": max_iter})
    h = np.asarray(res.x, dtype=np.float64)
    if not np.isfinite(_bandinv_loss(h, n)) or _bandinv_loss(h, n) > _bandinv_loss(x0, n):
        h = x0
    c_full = inverse_toeplitz_coefficients(h, n)
    if np.any(c_full < -1e-12):
        # A negative C breaks the amplification analyses: fall back to BISR (non-negative).
        h = x0
        c_full = inverse_toeplitz_coefficients(h, n)
    h = h * np.linalg.norm(c_full)  # scale so the strategy C has max column norm 1
    return tuple(float(v) for v in h)


def banded_inverse_coefficients(n: int, bands: int, *, max_iter: int = 300) -> np.ndarray:
    """BandInvMF (Kalinin et al. 2025): ``C^{-1}`` is b-banded Toeplitz with coefficients ``h``.

    Minimises the same prefix-sum MSE ``(1/n)‖A C^{-1}‖_F² · ‖C[:, 0]‖²`` (for Toeplitz ``C`` the
    first column has the largest norm), over ``h`` with ``h_0 = 1`` fixed (scale invariance),
    from the BISR initialisation, with a finite-difference L-BFGS-B. If the optimum's ``C`` had a
    negative entry the (non-negative) BISR coefficients are returned instead.

    Returns ``h`` (length ``bands``) scaled so the dense strategy ``C = T(h)^{-1}`` has
    ``max_j ‖C[:, j]‖₂ = 1``. The streaming noise is ``w_i = Σ_k h_k z_{i−k}``.
    """
    n, bands = _check_n_bands(n, bands)
    max_iter = check_int("max_iter", max_iter, minimum=1)
    return np.array(_optimal_banded_inverse(n, bands, max_iter))


def prefix_sum_mse(C, *, sensitivity: float | None = None) -> float:
    """Prefix-sum MSE ``(1/n) ‖A C^{-1}‖_F² · sens²`` of a strategy matrix (per unit σ²).

    ``sensitivity`` defaults to the single-participation sensitivity ``max_j ‖C[:, j]‖₂``; pass
    e.g. ``sqrt(k)`` times it for ``k`` participations under min-separation.
    """
    C = np.asarray(C, dtype=np.float64)
    if C.ndim != 2 or C.shape[0] != C.shape[1] or C.shape[0] == 0:
        raise ValueError(f"C must be a non-empty square matrix, got shape {C.shape}")
    if not np.all(np.isfinite(C)):
        raise ValueError("C must be finite")
    if np.any(np.triu(C, 1) != 0):
        raise ValueError("C must be lower-triangular")
    if np.any(np.diag(C) == 0):
        raise ValueError("C must be invertible (non-zero diagonal)")
    n = C.shape[0]
    if sensitivity is None:
        sensitivity = float(np.max(np.linalg.norm(C, axis=0)))
    elif not (math.isfinite(sensitivity) and sensitivity > 0):
        raise ValueError(f"sensitivity must be a finite number > 0, got {sensitivity!r}")
    B = np.cumsum(linalg.solve_triangular(C, np.eye(n), lower=True), axis=0)  # A C^{-1}
    return float(np.sum(B**2) / n * sensitivity**2)


def strategy_coefficients(name: str, n: int, bands: int) -> np.ndarray:
    """First-column coefficients of a banded Toeplitz strategy by name.

    ``"optimal-banded"`` (BandMF), ``"identity"`` (DP-SGD, ``bands`` ignored → ``[1]``),
    ``"banded-sqrt"`` (BSR, unit norm). Inverse families have dense ``C``: use
    :func:`strategy_matrix`.
    """
    if name == "optimal-banded":
        return banded_toeplitz_coefficients(n, bands)
    if name == "identity":
        _check_n_bands(n, 1)
        return np.array([1.0])
    if name == "banded-sqrt":
        _check_n_bands(n, bands)
        return banded_sqrt_coefficients(bands)
    if name in ("banded-inverse", "bisr"):
        raise ValueError(f"strategy {name!r} has a dense C (banded C^-1); it has no banded "
                         f"first-column coefficients: use strategy_matrix()")
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {name!r}")


def strategy_matrix(name: str, n: int, bands: int = 1) -> np.ndarray:
    """The ``n×n`` strategy matrix ``C`` of a named family (see :data:`STRATEGIES`)."""
    if name in ("banded-inverse", "bisr"):
        n, bands = _check_n_bands(n, bands)
        if name == "bisr":
            h = banded_inverse_sqrt_coefficients(bands)
            c = inverse_toeplitz_coefficients(h, n)
            return toeplitz_matrix(c / np.linalg.norm(c), n)
        return toeplitz_matrix(inverse_toeplitz_coefficients(banded_inverse_coefficients(n, bands), n), n)
    return toeplitz_matrix(strategy_coefficients(name, n, bands), n)
