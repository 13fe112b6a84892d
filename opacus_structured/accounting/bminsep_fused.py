r"""The fused (numba) sampler of the plain b-min-sep privacy loss: one compiled pass per tile.

:func:`~opacus_structured.accounting.bminsep_mc.streamed_bminsep_losses` draws the output
``u = y/σ`` in time blocks and prices it with numpy: the Gaussians alone (numpy's float64
ziggurat, ≈ 11 ns per element on the 2-core VM of :doc:`/benchmarks`) cap it near 6× jax_privacy.
This module runs the whole per-sample program — Gaussians, the mode ``C x/σ``, the window dot
products ``⟨c_i, u⟩``, ``G_i = p·e^{ℓ_i}`` and the linear-space suffix recursion — in one numba
kernel over **tiles** of :data:`TILE` samples, so every array of a tile stays in the core's L2
cache, and draws the Gaussians with its own generator:

* **Generator.** SplitMix64 (Steele, Lea & Flood 2014; the finaliser of Vigna's
  ``splitmix64.c``) used counter-based: element ``(i, s)`` of a tile (iteration ``i``, lane
  ``s``) takes output ``i·TILE + s`` of the tile's 64-bit key, so a row of lanes has no
  loop-carried state and its hashing vectorises. Keys are drawn from the caller's
  :class:`numpy.random.Generator` (two per tile: the main draws and the rare extra draws of
  rejected elements, which use the element's own counter range ``element·2²⁰ + k``). The
  tests check the hash against a Python-integer implementation.
* **Gaussians.** The 256-layer ziggurat of Marsaglia & Tsang (2000) with numpy's float64
  layout — 8 bits pick the layer, 1 bit the sign, 52 bits the abscissa; wedges by exact
  rejection against ``e^{−x²/2}``; the tail past ``r`` by Marsaglia's exact exponential method.
  It is an *exact* sampler of :math:`N(0,1)` up to the 52-bit grid of the abscissa (as numpy's);
  the layer table is solved here in float64 so that every layer has area ``v`` to ``≈ 1e−13``
  relative (the top layer closes at ``X_255 (1 − e^{−X_255²/2}) = v``). About 1.5 ns per normal
  here (numpy's ``standard_normal``: ≈ 11 ns).
* **exp.** ``e^x`` by Cody–Waite reduction (``x = k ln 2 + r``, ``|r| ≤ ln 2/2``), the degree-13
  Taylor polynomial (truncation ``< 2e−18``) and ``2^k`` built from its exponent bits: at most
  1 ulp from the correctly rounded value on ``[−708, 709]`` (tested). Arguments below ``−708``
  are raised to ``−708``: they enter only as ``G_i f_{i+b} ≤ p e^{−708}`` next to the term
  ``(1−p) f_{i+1}``, which the per-block renormalisation keeps ``≥ (1−p)^{T+b}``, so no float64
  sum changes.

* **Participation.** The example's participation times are drawn in the kernel per lane, from
  the lane's own counters of a third key: the first available iteration (Algorithm 2's warm
  start or 0), then geometric gaps by inversion — the law of
  :func:`~opacus_structured.accounting.bminsep_mc.sample_bminsep_participation` (the tests
  check the mean output ``C·p0`` per iteration and ``E_P[e^{−ln(P/Q)}] = 1``).

Everything else is the float64 arithmetic of the streamed numpy sampler (same linear recursion,
same per-block renormalisation, same log-space fallback when a block could leave the
float64 range), so the losses are those of :func:`~opacus_structured.accounting.bminsep_mc.
bminsep_log_ratio` on the drawn outputs to ``1e−9`` (tested with ``return_outputs=True``).

The random stream is this module's (``stream = "fused"``): for a seed it gives other samples than
the numpy path (``stream = "numpy"``), from the same law. The sharded runner records the stream of
a run and refuses to merge shards of two streams.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

__all__ = ["TILE", "FUSED_BLOCK", "fused_available", "fused_bminsep_losses",
           "ziggurat_tables", "fused_standard_normal", "splitmix64_raw", "numba_module"]

#: Samples per tile (the kernel's SIMD width × cache blocking; part of the random stream).
TILE = 128
#: Iterations per time block. Not part of the random stream (a Gaussian's counter is its
#: iteration and lane): another block size gives the same samples up to rounding. 256 halves
#: the per-block work of 128 (tail copy, renormalisation); a tile fits L2 up to ≈ 128 bands.
FUSED_BLOCK = 256
_BLAS_MIN_BANDS = 16  # Toeplitz window dots by BLAS from this many bands
_BLAS_ROWS = 32  # output rows per BLAS product


@lru_cache(maxsize=1)
def ziggurat_tables() -> tuple[np.ndarray, np.ndarray, float]:
    """``(X, F, r)``: layer edges ``X[0..256]`` (``X[0] = v/f(r)`` the base layer's virtual
    width, ``X[1] = r``, ``X[256] = 0``), ``F = e^{−X²/2}`` and the tail start ``r``.

    ``r`` is the root of "the top layer has area ``v``" (bisection to the float64 limit; it is
    numpy's constant 3.6541528853610088), ``v = r f(r) + ∫_r^∞ f``.
    """
    from scipy import special

    def f(x):
        return math.exp(-0.5 * x * x)

    def build(r):
        v = r * f(r) + math.sqrt(math.pi / 2) * float(special.erfc(r / math.sqrt(2)))
        X = [v / f(r), r]
        for i in range(1, 255):
            y = f(X[i]) + v / X[i]
            if y >= 1.0:
                return None, v
            X.append(math.sqrt(-2.0 * math.log(y)))
        return X, v

    lo, hi = 3.4, 3.8  # top-layer area minus v: < 0 at lo (too few layers fit), > 0 at hi

    def gap(r):
        X, v = build(r)
        return -1.0 if X is None else X[255] * (1.0 - f(X[255])) - v

    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if gap(mid) > 0:
            hi = mid
        else:
            lo = mid
    r = lo if abs(gap(lo)) <= abs(gap(hi)) else hi
    X, _ = build(r)
    Xa = np.array(X + [0.0])
    F = np.exp(-0.5 * Xa * Xa)
    F[-1] = 1.0
    for a in (Xa, F):
        a.setflags(write=False)
    return Xa, F, r


_KERNELS: list = []


def numba_module():
    """The ``numba`` module, or ``None`` when it is not installed or ``OPACUS_STRUCTURED_NUMBA=0``
    (numba is the optional ``[fast]`` accelerator; the numpy program never needs it)."""
    import os

    if os.environ.get("OPACUS_STRUCTURED_NUMBA", "1") == "0":
        return None
    try:
        import numba  # optional: the [fast] extra
    except ImportError:
        return None
    return numba


def _kernels():
    """The jitted kernels module (:mod:`._bminsep_fused_kernels`), or ``None`` without numba."""
    if not _KERNELS:
        kernels = None
        if numba_module() is not None:
            from . import _bminsep_fused_kernels as kernels  # optional: numba
        _KERNELS.append(kernels)
    return _KERNELS[0]


def fused_available() -> bool:
    """Whether the fused sampler can run (numba installed and not disabled)."""
    return _kernels() is not None


def _require():
    k = _kernels()
    if k is None:
        raise ValueError("the fused sampler needs numba (pip install \"opacus-structured[fast]\"); "
                         "or use accelerator='numpy'")
    return k


def _tile_keys(rng: np.random.Generator, count: int) -> np.ndarray:
    """``(count, 3)`` 64-bit keys of each tile (Gaussians, rejected Gaussians' extra draws,
    participation) from ``rng``."""
    return rng.integers(0, 2**64, size=(count, 3), dtype=np.uint64, endpoint=False)


def splitmix64_raw(key: int, first: int, size: int) -> np.ndarray:
    """Outputs ``first .. first+size−1`` of the kernels' counter-based SplitMix64 for ``key``
    (for tests)."""
    out = np.empty(int(size), dtype=np.uint64)
    _require().raw(np.uint64(key), np.uint64(first), out)
    return out


def fused_standard_normal(size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` standard normals from the kernels' ziggurat (elements ``0 .. size−1`` of one
    key pair drawn from ``rng``; for tests and diagnostics)."""
    X, F, R = ziggurat_tables()
    key, slow_key, _ = _tile_keys(rng, 1)[0]
    out = np.empty(int(size))
    _require().normals(key, slow_key, out, X, F, R)
    return out


@lru_cache(maxsize=1)
def _blas_controller():
    """threadpoolctl's controller of the loaded BLAS libraries (inspected once), or ``None``."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover - threadpoolctl comes with scipy's test deps
        return None
    return ThreadpoolController()


def _one_blas_thread(active: bool):
    """The kernel's small BLAS products on one thread (a pool of worker processes already
    fills the cores; threads would oversubscribe them). A no-op without threadpoolctl."""
    import contextlib

    controller = _blas_controller() if active else None
    if controller is None:
        return contextlib.nullcontext()
    return controller.limit(limits=1, user_api="blas")


def fused_bminsep_losses(strategy, noise_multiplier: float, sampling_prob: float, min_sep: int,
                         warm_start: bool, direction: str, num_samples: int,
                         rng: np.random.Generator, *, return_outputs: bool = False,
                         tile: int = TILE, block: int = FUSED_BLOCK):
    """Privacy-loss samples of plain b-min-sep on the fused kernel (see the module docstring).

    :func:`~opacus_structured.accounting.bminsep_mc.streamed_bminsep_losses` with
    ``accelerator="fused"`` validates the arguments and calls this. ``rng`` gives three 64-bit
    keys per tile (Gaussians, the rejected Gaussians' extra draws, the example's participation,
    drawn in the kernel per lane from its own counters). ``tile`` is part of the random stream;
    ``block`` is not (same samples up to rounding).
    """
    fused = _require().fused
    S = int(num_samples)
    st, sigma, p, b = strategy, noise_multiplier, sampling_prob, min_sep
    n, L = st.n, st.bands
    offset = math.log(p) - st.squared_norms / (2.0 * sigma**2)
    cols = np.ascontiguousarray(st.columns / sigma)
    toe = np.zeros((0, 0))
    if st._toeplitz_c is not None:
        coef, toeplitz = np.ascontiguousarray((st._toeplitz_c / sigma)[None, :]), True
        if L >= _BLAS_MIN_BANDS:
            toe = np.zeros((_BLAS_ROWS, _BLAS_ROWS + L - 1))
            for t in range(_BLAS_ROWS):
                toe[t, t:t + L] = coef[0]
    else:
        coef, toeplitz = cols, False
    ntiles = -(-S // tile)
    seeds = _tile_keys(rng, ntiles)
    X, F, R = ziggurat_tables()
    Y = np.empty((n, S)) if return_outputs else np.empty((1, 1))
    loss = np.empty(S)
    with _one_blas_thread(toe.size > 0):
        fused(n, L, b, p, bool(warm_start), block, tile, coef, toeplitz, toe, cols, offset,
              direction == "remove", seeds, X, F, R, float(sigma), Y, bool(return_outputs), loss)
    if direction != "remove":
        loss = -loss
    return (loss, Y) if return_outputs else loss
