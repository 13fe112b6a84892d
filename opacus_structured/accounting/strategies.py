"""Strategy matrices ``C`` for the matrix-factorization (correlated-noise) mechanism.

Pure numpy/scipy (no torch import), so the accountants can use it.

Background (Choquette-Choo et al. 2023, "Amplified banded matrix factorization", §2; Dong &
Ganesh, "Privacy Amplification for BandMF via b-Min-Sep Subsampling", arXiv:2602.09338, §2;
Schuchardt & Kalinin, "Sampling-Free Privacy Accounting for Matrix Mechanisms under Random
Allocation", §3). Training with
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
  of the clip norm (Choquette-Choo et al. 2023, §2). An accountant must use exactly these
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
* BLT (buffered linear Toeplitz; Dvijotham et al. 2024, McMahan et al. 2024):
  :class:`BufferedToeplitz` / :func:`blt_strategy`. ``C`` and ``C^{-1}`` are dense Toeplitz but
  ``C`` has a rational generating function, ``c_0 = 1``, ``c_k = Σ_j ω_j θ_j^{k−1}`` (``k ≥ 1``),
  so the noise ``C^{-1}z`` streams with ``d`` buffers instead of ``n`` past noise vectors.

BandMF objective
----------------
As in jax_privacy ``toeplitz.optimize_banded_toeplitz``.
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

import dataclasses
import functools
import math

import numpy as np
from scipy import linalg, optimize

from .._validation import check_int, check_lower_triangular_matrix

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
    "BufferedToeplitz",
    "blt_strategy",
]

#: Strategy names accepted by :func:`strategy_coefficients` / :func:`strategy_matrix` (schemes
#: choose their ``--strategy`` choices among them). All but ``banded-inverse`` / ``bisr`` /
#: ``blt`` are banded Toeplitz ``C`` (usable by the streaming optimizer and the banded
#: accountants); those three give dense ``C``.
STRATEGIES = ("optimal-banded", "identity", "banded-sqrt", "max-error", "banded-inverse", "bisr",
              "blt")


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
    ``normalize=False`` keeps ``c_0 = 1`` (the convention of Schuchardt & Kalinin's tables).
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
    These are the ``c_i`` an accountant must use (not the un-normalised ones)."""
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
    C = check_lower_triangular_matrix("C", C)
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
    ``"banded-sqrt"`` (BSR, unit norm), ``"max-error"`` (the same ``bands`` unit-norm truncated
    max-error coefficients ``Π_{j≤k}(2j−1)/(2j)``, without the ``bands ≤ n`` check: a run of
    ``n < bands`` steps uses the first ``n``). Inverse families have dense ``C``: use
    :func:`strategy_matrix`.
    """
    if name == "max-error":
        return banded_sqrt_coefficients(check_int("bands", bands, minimum=1))
    if name == "optimal-banded":
        return banded_toeplitz_coefficients(n, bands)
    if name == "identity":
        _check_n_bands(n, 1)
        return np.array([1.0])
    if name == "banded-sqrt":
        _check_n_bands(n, bands)
        return banded_sqrt_coefficients(bands)
    if name in ("banded-inverse", "bisr", "blt"):
        raise ValueError(f"strategy {name!r} has a dense C; it has no banded "
                         f"first-column coefficients: use strategy_matrix()")
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {name!r}")


def strategy_matrix(name: str, n: int, bands: int = 1) -> np.ndarray:
    """The ``n×n`` strategy matrix ``C`` of a named family (see :data:`STRATEGIES`).

    For ``"blt"`` the ``bands`` argument is the number of buffers ``d`` of the optimised
    :class:`BufferedToeplitz` (:func:`blt_strategy`); ``C`` is scaled to unit first-column norm.
    """
    if name == "blt":
        n, bands = _check_n_bands(n, bands)
        return toeplitz_matrix(blt_strategy(n, bands).normalized(n).coefficients(n), n)
    if name in ("banded-inverse", "bisr"):
        n, bands = _check_n_bands(n, bands)
        if name == "bisr":
            h = banded_inverse_sqrt_coefficients(bands)
            c = inverse_toeplitz_coefficients(h, n)
            return toeplitz_matrix(c / np.linalg.norm(c), n)
        return toeplitz_matrix(inverse_toeplitz_coefficients(banded_inverse_coefficients(n, bands), n), n)
    return toeplitz_matrix(strategy_coefficients(name, n, bands), n)


# ---------------------------------------------------------------------------------------------
# BLT: buffered linear Toeplitz strategies
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BufferedToeplitz:
    r"""A buffered linear Toeplitz (BLT) strategy ``C`` (Dvijotham et al. 2024, "Efficient and
    near-optimal noise generation for streaming differential privacy"; McMahan et al. 2024).

    ``C`` is lower-triangular Toeplitz with generating function
    ``c(x) = 1 + Σ_j ω_j x / (1 − θ_j x)``, i.e. ``c_0 = 1`` and
    ``c_k = Σ_{j=1}^{d} ω_j θ_j^{k−1}`` for ``k ≥ 1``, with buffer decays ``θ_j ∈ [0, 1]``
    (``buf_decay``) and output scales ``ω_j`` (``output_scale``). With ``θ, ω ≥ 0`` every
    ``c_k ≥ 0`` (the non-negativity the amplification analyses need).

    **Streaming noise** (Algorithm 3 of McMahan et al. 2024): ``w = C^{-1} z`` is
    ``w_t = z_t − Σ_j ω_j s_{j,t}``, ``s_{j,t+1} = θ_j s_{j,t} + w_t`` (``s_{j,0} = 0``),
    because ``Σ_{k≥1} c_k w_{t−k} = Σ_j ω_j Σ_{k≥1} θ_j^{k−1} w_{t−k}``. The state is ``d``
    buffers of the parameter's shape — memory ``d·|θ|`` for any horizon ``n``.

    Scaling: the raw ``C`` has ``c_0 = 1``; ``scale`` multiplies it (``C = scale · C_raw``,
    default 1). :meth:`normalized_coefficients` / :meth:`normalized` divide by the norm of the
    first column (``‖c_{0:n}‖₂``, the single-participation sensitivity; Toeplitz columns are
    prefixes of the first, so it is the largest) — the convention of this module. Pass
    ``blt.normalized(n)`` as ``noise_correlation`` to the correlated-noise optimizer: it streams
    ``w = C^{-1} z = C_raw^{-1} z / scale`` with ``d`` buffers per parameter.
    """

    buf_decay: tuple[float, ...]
    output_scale: tuple[float, ...]
    scale: float = 1.0

    def __post_init__(self):
        theta = np.asarray(self.buf_decay, dtype=np.float64).ravel()
        omega = np.asarray(self.output_scale, dtype=np.float64).ravel()
        if theta.size == 0 or theta.size != omega.size:
            raise ValueError(f"buf_decay and output_scale must be non-empty and of equal length, "
                             f"got {theta.size} and {omega.size}")
        if not (np.all(np.isfinite(theta)) and np.all((theta >= 0) & (theta <= 1))):
            raise ValueError(f"buf_decay must lie in [0, 1], got {theta!r}")
        if not (np.all(np.isfinite(omega)) and np.all(omega >= 0)):
            raise ValueError(f"output_scale must be finite and >= 0 (non-negative C), "
                             f"got {omega!r}")
        object.__setattr__(self, "buf_decay", tuple(float(v) for v in theta))
        object.__setattr__(self, "output_scale", tuple(float(v) for v in omega))
        scale = float(self.scale)
        if not (np.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {self.scale!r}")
        object.__setattr__(self, "scale", scale)

    @property
    def num_buffers(self) -> int:
        return len(self.buf_decay)

    def coefficients(self, n: int) -> np.ndarray:
        """Toeplitz coefficients ``c_0..c_{n−1}`` of ``C = scale · C_raw`` (``c_0 = scale``)."""
        n = check_int("n", n, minimum=1)
        return self.scale * _blt_coefficients(np.asarray(self.buf_decay),
                                              np.asarray(self.output_scale), n)

    def normalized_coefficients(self, n: int) -> np.ndarray:
        """``c / ‖c‖₂`` for horizon ``n``: unit single-participation sensitivity."""
        c = self.coefficients(n)
        return c / np.linalg.norm(c)

    def normalized(self, n: int) -> "BufferedToeplitz":
        """The same BLT scaled so that ``‖c_{0:n}‖₂ = 1`` (what the accountants assume)."""
        raw = _blt_coefficients(np.asarray(self.buf_decay), np.asarray(self.output_scale),
                                check_int("n", n, minimum=1))
        return BufferedToeplitz(self.buf_decay, self.output_scale, 1.0 / float(np.linalg.norm(raw)))

    def inverse_apply(self, z: np.ndarray) -> np.ndarray:
        """``C^{-1} z`` by the streaming buffer recursion; ``z`` has steps on axis 0."""
        z = np.asarray(z, dtype=np.float64)
        theta = np.asarray(self.buf_decay)
        omega = np.asarray(self.output_scale)
        bufs = np.zeros((theta.size,) + z.shape[1:])
        out = np.empty_like(z)
        for t in range(z.shape[0]):
            out[t] = z[t] - np.tensordot(omega, bufs, axes=1)
            bufs = theta.reshape((-1,) + (1,) * (z.ndim - 1)) * bufs + out[t]
        return out / self.scale

    def prefix_sum_mse(self, n: int) -> float:
        """The BandMF objective ``mean(cumsum(β²))·‖c‖²`` of this ``C`` at horizon ``n``."""
        return _blt_loss_and_grad(np.asarray(self.buf_decay), np.asarray(self.output_scale),
                                  check_int("n", n, minimum=1))[0]  # scale invariant


def _blt_coefficients(theta: np.ndarray, omega: np.ndarray, n: int) -> np.ndarray:
    powers = np.arange(n - 1, dtype=np.float64)[:, None]
    with np.errstate(under="ignore"):
        tail = (theta[None, :] ** powers) @ omega if n > 1 else np.zeros(0)
    return np.concatenate([[1.0], tail])


def _blt_loss_and_grad(theta: np.ndarray, omega: np.ndarray, n: int):
    """Prefix-sum loss of the BLT ``(θ, ω)`` and its gradient w.r.t. ``(θ, ω)``.

    ``β = C^{-1} 1`` by the streaming recursion (``O(n·d)``), the adjoint ``λ = C^{-T}(2wβ)``
    by the reversed recursion, ``∂f/∂c_k = −Σ_{i≥k} λ_i β_{i−k}`` (a correlation, by FFT), and
    the chain rule through ``c_k = Σ_j ω_j θ_j^{k−1}``.
    """
    from scipy import signal

    d = theta.size
    weights = (n - np.arange(n)) / n
    c = _blt_coefficients(theta, omega, n)
    # beta = C^{-1} 1 (forward buffers); lam = C^{-T} r (backward buffers).
    beta = np.empty(n)
    bufs = np.zeros(d)
    for t in range(n):
        beta[t] = 1.0 - omega @ bufs
        bufs = theta * bufs + beta[t]
    f = float(weights @ beta**2)
    norm2 = float(c @ c)
    r = 2.0 * weights * beta
    lam = np.empty(n)
    bufs = np.zeros(d)
    for t in range(n - 1, -1, -1):
        lam[t] = r[t] - omega @ bufs
        bufs = theta * bufs + lam[t]
    # grad_f[k] = -sum_{i>=k} lam_i beta_{i-k}  (k = 0..n-1)
    corr = signal.fftconvolve(lam, beta[::-1])[n - 1:]
    grad_c = -corr * norm2 + f * 2.0 * c  # d(f * norm2)/dc_k
    g = grad_c[1:]  # c_0 = 1 is fixed
    k = np.arange(n - 1, dtype=np.float64)[:, None]
    with np.errstate(under="ignore", divide="ignore", invalid="ignore"):
        pw = theta[None, :] ** k  # θ^{k}, k = 0..n-2 (for c_{k+1})
        dpw = np.where(k > 0, k * theta[None, :] ** np.maximum(k - 1, 0), 0.0)
    grad_omega = g @ pw
    grad_theta = (g @ dpw) * omega
    return f * norm2, np.concatenate([grad_theta, grad_omega])


def _blt_initial(n: int, buffers: int) -> tuple[np.ndarray, np.ndarray]:
    """Decays spread geometrically towards 1, scales fitted (NNLS) to the max-error
    coefficients ``binom(2k,k)/4^k`` (the Toeplitz square root of the prefix-sum workload)."""
    target = max_error_coefficients(n)[1:]
    theta = 1.0 - np.geomspace(0.5, min(0.5, 1.0 / n), buffers) if buffers > 1 else np.array([0.9])
    theta = np.clip(theta, 0.0, 1.0 - 1e-6)
    if n == 1:
        return theta, np.zeros(buffers)
    basis = theta[None, :] ** np.arange(n - 1, dtype=np.float64)[:, None]
    omega, _ = optimize.nnls(basis, target)
    return theta, omega


@functools.lru_cache(maxsize=32)
def _optimal_blt(n: int, buffers: int, max_iter: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    theta0, omega0 = _blt_initial(n, buffers)
    if n == 1:
        return tuple(theta0), tuple(omega0)
    d = buffers

    def fun(x):
        with np.errstate(all="ignore"):
            loss, grad = _blt_loss_and_grad(x[:d], x[d:], n)
        if not (math.isfinite(loss) and loss > 0 and np.all(np.isfinite(grad))):
            return 1e4, np.zeros_like(x)
        return math.log(loss), grad / loss

    x0 = np.concatenate([theta0, omega0])
    bounds = [(0.0, 1.0)] * d + [(0.0, None)] * d
    res = optimize.minimize(fun, x0, jac=True, method="L-BFGS-B", bounds=bounds,
                            options={"maxiter": max_iter, "ftol": 0.0, "gtol": 1e-10,
                                     "maxcor": 30})
    x = np.asarray(res.x, dtype=np.float64)
    if not fun(x)[0] <= fun(x0)[0]:  # never worse than the feasible initialisation
        x = x0
    theta, omega = np.clip(x[:d], 0.0, 1.0), np.maximum(x[d:], 0.0)
    order = np.argsort(-theta)
    return tuple(float(v) for v in theta[order]), tuple(float(v) for v in omega[order])


def blt_strategy(n: int, buffers: int = 4, *, max_iter: int = 500) -> BufferedToeplitz:
    """BLT with ``buffers`` buffers optimised for the prefix-sum workload at horizon ``n``.

    Minimises the same objective as BandMF, ``mean(cumsum(β²))·‖c‖²`` with ``c`` the full
    length-``n`` first column (module docstring; jax_privacy ``buffered_toeplitz.optimize`` with
    single-participation sensitivity and mean error), over ``θ ∈ [0, 1]^d``, ``ω ≥ 0`` by
    L-BFGS-B with an analytic gradient (:func:`_blt_loss_and_grad`) from an NNLS fit to the
    max-error coefficients; never returns a point worse than that initialisation. Cached per
    ``(n, buffers, max_iter)``.

    Args:
        n: horizon (number of steps), ≥ 1.
        buffers: number of buffers ``d``, ``1 ≤ d ≤ n``.
        max_iter: L-BFGS-B iteration cap.
    """
    n, buffers = _check_n_bands(n, buffers)
    max_iter = check_int("max_iter", max_iter, minimum=1)
    theta, omega = _optimal_blt(n, buffers, max_iter)
    return BufferedToeplitz(theta, omega)
