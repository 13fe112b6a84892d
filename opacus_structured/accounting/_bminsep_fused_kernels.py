"""The numba kernels of :mod:`opacus_structured.accounting.bminsep_fused` (imported lazily:
numba is the optional ``[fast]`` extra). Read that module's docstring for the algorithms."""

import math

import numba
import numpy as np

from .bminsep_mc import _LOG_HEADROOM

u64 = np.uint64
LN2_HI = 6.93147180369123816490e-01  # ln 2 split so that k·LN2_HI is exact for |k| < 2¹¹
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.44269504088896338700e+00
MAGIC = 6755399441055744.0  # 1.5·2⁵²: adding and subtracting it rounds to the nearest integer
TWO_M53 = 1.0 / 9007199254740992.0
EXP_FLOOR = -708.0  # exp arguments below it are raised to it (bminsep_fused docstring)
LN2 = 0.6931471805599453


GAMMA = u64(0x9E3779B97F4A7C15)  # SplitMix64's increment (2⁶⁴/φ)
SLOW_STRIDE = u64(1 << 20)  # extra draws per element available to the slow path


@numba.njit(inline="always")
def splitmix64(key, counter):
    """Output ``counter`` of SplitMix64 seeded so that its state is ``key + counter·γ``
    (Steele, Lea & Flood 2014; Vigna's ``splitmix64.c`` finaliser): a counter-based generator,
    so a row of lanes has no loop-carried state and vectorises."""
    z = key + counter * GAMMA
    z = (z ^ (z >> u64(30))) * u64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> u64(27))) * u64(0x94D049BB133111EB)
    return z ^ (z >> u64(31))


@numba.njit(inline="always")
def uniform(key, counter):
    """A float64 uniform on ``[0, 1)`` (53 bits)."""
    return numba.float64(numba.int64(splitmix64(key, counter) >> u64(11))) * TWO_M53


@numba.njit(inline="always")
def finish_normal(bits, slow_key, element, X, F, R):
    """The ziggurat draw of one element whose fast test failed on ``bits``: the wedge test, the
    tail beyond ``r`` (Marsaglia's exact exponential method), and on rejection a fresh draw —
    extra bits from the element's own counters ``element·2²⁰ + k`` of ``slow_key``."""
    m52 = u64(0xFFFFFFFFFFFFF)
    ctr = element * SLOW_STRIDE
    while True:
        idx = numba.int64(bits & u64(255))
        neg = (bits >> u64(8)) & u64(1)
        x = numba.float64(numba.int64((bits >> u64(9)) & m52)) * X[idx] * 2.220446049250313e-16
        if x < X[idx + 1]:
            return -x if neg else x
        if idx == 0:
            while True:
                xx = -math.log1p(-uniform(slow_key, ctr)) / R
                yy = -math.log1p(-uniform(slow_key, ctr + u64(1)))
                ctr += u64(2)
                if yy + yy > xx * xx:
                    x = R + xx
                    return -x if neg else x
        u1 = uniform(slow_key, ctr)
        ctr += u64(1)
        if F[idx] + u1 * (F[idx + 1] - F[idx]) < math.exp(-0.5 * x * x):
            return -x if neg else x
        bits = splitmix64(slow_key, ctr)
        ctr += u64(1)


@numba.njit(inline="always")
def normal_row(row, bits, rejected, W, key, slow_key, first, X, F, R):
    """``row[s]`` = the standard normal of element ``first + s`` (``s < W``).

    Three passes: the counter hash and the 52-bit abscissa for all lanes (a loop LLVM
    vectorises); per lane the layer scale, the sign and the fast acceptance ``x < X[idx+1]``
    (≈ 98.8 %), noting the other lanes; then :func:`finish_normal` for those (kept out of the
    hot loop).
    """
    m52 = u64(0xFFFFFFFFFFFFF)
    for s in range(W):
        z = splitmix64(key, first + u64(s))
        bits[s] = z
        row[s] = numba.float64(numba.int64((z >> u64(9)) & m52))
    nrej = 0
    for s in range(W):
        z = bits[s]
        idx = numba.int64(z & u64(255))
        x = row[s] * X[idx] * 2.220446049250313e-16
        row[s] = -x if (z >> u64(8)) & u64(1) else x
        if x >= X[idx + 1]:
            rejected[nrej] = s
            nrej += 1
    for t in range(nrej):
        s = rejected[t]
        row[s] = finish_normal(bits[s], slow_key, first + u64(s), X, F, R)


@numba.njit(cache=True, nogil=True)
def raw(key, first, out):
    """``out[i]`` = SplitMix64 output ``first + i`` of ``key`` (for tests)."""
    for i in range(out.size):
        out[i] = splitmix64(key, first + u64(i))


@numba.njit(cache=True, nogil=True)
def normals(key, slow_key, out, X, F, R):
    """``out[i]`` = the standard normal of element ``i`` (rows of 128 lanes, as the kernel)."""
    bits = np.empty(128, np.uint64)
    rejected = np.empty(128, np.int64)
    n = out.size
    for r0 in range(0, n, 128):
        W = min(128, n - r0)
        normal_row(out[r0:r0 + W], bits, rejected, W, key, slow_key, u64(r0), X, F, R)


@numba.njit(cache=True, nogil=True, inline="always")
def exp_rows(g, kb, m, W):
    """``g[:m, :W] = e^{max(g, −708)}`` (Cody–Waite + degree-13 Taylor; ≤ 1 ulp)."""
    for r in range(m):
        row = g[r]
        for s in range(W):
            v = min(max(row[s], EXP_FLOOR), 709.0)
            kf = (v * INV_LN2 + MAGIC) - MAGIC
            x = (v - kf * LN2_HI) - kf * LN2_LO
            q = 1.0 / 6227020800.0
            q = q * x + 1.0 / 479001600.0
            q = q * x + 1.0 / 39916800.0
            q = q * x + 1.0 / 3628800.0
            q = q * x + 1.0 / 362880.0
            q = q * x + 1.0 / 40320.0
            q = q * x + 1.0 / 5040.0
            q = q * x + 1.0 / 720.0
            q = q * x + 1.0 / 120.0
            q = q * x + 1.0 / 24.0
            q = q * x + 1.0 / 6.0
            q = q * x + 0.5
            q = q * x + 1.0
            q = q * x + 1.0
            row[s] = q
            kb[s] = (numba.int64(kf) + 1023) << 52
        scale = kb.view(np.float64)
        for s in range(W):
            row[s] *= scale[s]


@numba.njit(cache=True, nogil=True, inline="always")
def window_dots(U, coef, toeplitz, offset, g, cq, toe, j, m, W, L):
    """``g[r] = offset[j+r] + Σ_k coef[j+r, k]·U[r+k]`` for ``r < m`` (lanes ``< W``).

    With a Toeplitz band ``toe`` (``R × (R+L−1)``, ``toe[t, t+k] = c_k``; empty when unused):
    ``R`` rows at a time by one BLAS matrix product over the whole tile (lanes ``≥ W`` hold
    stale finite values and are ignored), which at ``L ≥ 16`` beats the loops below despite the
    band's zeros. Otherwise four output rows per pass over ``U``: row ``U[r+κ]`` meets output
    ``r+t`` with coefficient ``coef[j+r+t, κ−t]`` (zero outside ``0 ≤ κ−t < L``, table ``cq``),
    so each loaded row feeds four accumulations; the rest row by row.
    """
    r = 0
    R = toe.shape[0]
    if R > 0:
        while r + R <= m:
            out = g[r:r + R]
            np.dot(toe, U[r:r + R + L - 1], out)
            for t in range(R):
                o = offset[j + r + t]
                row = out[t]
                for s in range(W):
                    row[s] += o
            r += R
    while r + 4 <= m and L >= 8:
        for t in range(4):
            ci = 0 if toeplitz else j + r + t
            for kk in range(L + 3):
                k = kk - t
                cq[t, kk] = coef[ci, k] if 0 <= k < L else 0.0
        g0, g1, g2, g3 = g[r], g[r + 1], g[r + 2], g[r + 3]
        o0, o1, o2, o3 = offset[j + r], offset[j + r + 1], offset[j + r + 2], offset[j + r + 3]
        for s in range(W):
            g0[s] = o0
            g1[s] = o1
            g2[s] = o2
            g3[s] = o3
        for kk in range(L + 3):
            a0, a1, a2, a3 = cq[0, kk], cq[1, kk], cq[2, kk], cq[3, kk]
            urow = U[r + kk]
            for s in range(W):
                u = urow[s]
                g0[s] += a0 * u
                g1[s] += a1 * u
                g2[s] += a2 * u
                g3[s] += a3 * u
        r += 4
    while r < m:
        ci = 0 if toeplitz else j + r
        grow = g[r]
        o = offset[j + r]
        for s in range(W):
            grow[s] = o
        for k in range(L):
            a = coef[ci, k]
            urow = U[r + k]
            for s in range(W):
                grow[s] += a * urow[s]
        r += 1


@numba.njit(inline="always")
def lane_participations(part_key, lane, n, p, b, warm, log_q, out, fill):
    """Participation times of lane ``lane``'s example under b-min-sep (Algorithm 1 or, warm,
    Algorithm 2): first available iteration ``a`` (warm: ``0`` w.p. ``1/(1+(b−1)p)``, else
    uniform on ``1..b−1``), ``τ₁ = a + G₁ − 1``, ``τ_{k+1} = τ_k + b − 1 + G_{k+1}``,
    ``G ~ Geometric(p)`` by inversion (``⌊ln U/ln(1−p)⌋ + 1``, ``U ∈ (0, 1]``). Its draws are the
    lane's counters ``lane·2³² + k`` of ``part_key``. Returns the count; writes the times to
    ``out`` when ``fill``."""
    ctr = u64(lane) << u64(32)
    a = 0
    if warm and b > 1:
        if uniform(part_key, ctr) * (1.0 + (b - 1) * p) < (b - 1) * p:
            a = 1 + min(b - 2, numba.int64(uniform(part_key, ctr + u64(1)) * (b - 1)))
        ctr += u64(2)
    count = 0
    pos = a - 1
    gap = 0
    while True:
        u = 1.0 - uniform(part_key, ctr)  # (0, 1]
        ctr += u64(1)
        pos += gap + 1 + numba.int64(math.floor(math.log(u) / log_q)) if log_q < 0.0 else gap + 1
        if pos >= n:
            return count
        if fill:
            out[count] = pos
        count += 1
        gap = b - 1


@numba.njit(cache=True, nogil=True, fastmath={"contract"})
def fused(n, L, b, p, warm, block, tile, coef, toeplitz, toe, cols, offset, remove,
          seeds, X, F, R, sigma, Y, want_y, loss):
    """Losses of ``loss.size`` samples (``remove``: with the example's mode; else ``add``).
    Tiles of ``tile`` samples, blocks of ``block`` iterations; ``seeds[t]`` holds tile ``t``'s
    keys (Gaussians, rejected Gaussians, participation)."""
    S = loss.size
    q = 1.0 - p
    log_q = math.log1p(-p) if p < 1.0 else -math.inf
    linear_decay_ok = (block + b) * -log_q <= _LOG_HEADROOM
    nblocks = (n + block - 1) // block
    U = np.zeros((block + L - 1, tile))
    g = np.empty((block, tile))
    buf = np.empty((b, tile))
    lb = np.empty((b, tile))
    scale = np.empty(tile)
    kb = np.empty(tile, np.int64)
    mx = np.empty(tile)
    bits = np.empty(tile, np.uint64)
    rejected = np.empty(tile, np.int64)
    ptr = np.zeros(tile + 1, np.int64)
    ptau = np.empty(16 * tile, np.int64)
    cq = np.zeros((4, L + 3))
    ntiles = (S + tile - 1) // tile
    for t in range(ntiles):
        s0 = t * tile
        W = min(tile, S - s0)
        key, slow_key, part_key = seeds[t, 0], seeds[t, 1], seeds[t, 2]
        if remove:  # the tile's participation times, per lane (count, then fill: same draws)
            for s in range(W):
                ptr[s + 1] = ptr[s] + lane_participations(part_key, s, n, p, b, warm, log_q,
                                                           ptau, False)
            if ptau.size < ptr[W]:
                ptau = np.empty(2 * ptr[W], np.int64)
            for s in range(W):
                lane_participations(part_key, s, n, p, b, warm, log_q, ptau[ptr[s]:], True)
        U[:, :] = 0.0
        buf[:, :] = 1.0
        scale[:] = 0.0
        for blk in range(nblocks - 1, -1, -1):
            j = blk * block
            m = min(block, n - j)
            if blk != nblocks - 1:  # the next L−1 rows become this block's tail
                for rr in range(L - 2, -1, -1):
                    dst, src = U[m + rr], U[rr]
                    for s in range(W):
                        dst[s] = src[s]
            for r in range(m):  # element (i, s) of the tile is counter i·tile + s
                normal_row(U[r], bits, rejected, W, key, slow_key, u64((j + r) * tile), X, F,
                           R)
            if remove:
                for s in range(W):
                    for e in range(ptr[s], ptr[s + 1]):
                        tau = ptau[e]
                        k0 = max(0, j - tau)
                        k1 = min(L, j + m - tau)
                        for k in range(k0, k1):
                            U[tau + k - j, s] += cols[tau, k]
            if want_y:
                for r in range(m):
                    for s in range(W):
                        Y[j + r, s0 + s] = U[r, s] * sigma
            # g_r = ⟨c_{j+r}, u⟩/σ + ln p − ‖c_{j+r}‖²/(2σ²), four rows per pass over u
            window_dots(U, coef, toeplitz, offset, g, cq, toe, j, m, W, L)
            for s in range(W):  # per-lane maxima (a vectorisable loop), then across lanes
                mx[s] = g[0, s]
            for r in range(1, m):
                grow = g[r]
                for s in range(W):
                    mx[s] = max(mx[s], grow[s])
            top = -math.inf
            for s in range(W):
                top = max(top, mx[s])
            if linear_decay_ok and m * (max(0.0, top) + LN2) <= _LOG_HEADROOM:
                exp_rows(g, kb, m, W)
                for i in range(j + m - 1, j - 1, -1):
                    cur = buf[i % b]
                    nxt = buf[(i + 1) % b]
                    gi = g[i - j]
                    for s in range(W):
                        cur[s] = cur[s] * gi[s] + nxt[s] * q
                for s in range(W):
                    mx[s] = buf[0, s]
                for k in range(1, b):
                    row = buf[k]
                    for s in range(W):
                        mx[s] = max(mx[s], row[s])
                for k in range(b):
                    row = buf[k]
                    for s in range(W):
                        row[s] /= mx[s]
                for s in range(W):
                    scale[s] += math.log(mx[s])
            else:  # log-space recursion over this block (rare: huge ℓ or p near 1)
                for k in range(b):
                    for s in range(W):
                        lb[k, s] = math.log(buf[k, s]) + scale[s]
                for i in range(j + m - 1, j - 1, -1):
                    cur = lb[i % b]
                    nxt = lb[(i + 1) % b]
                    gi = g[i - j]
                    for s in range(W):
                        x1 = nxt[s] + log_q
                        x2 = cur[s] + gi[s]
                        hi_ = max(x1, x2)
                        if hi_ == -math.inf:
                            cur[s] = -math.inf
                        else:
                            cur[s] = hi_ + math.log1p(math.exp(min(x1, x2) - hi_))
                for s in range(W):
                    lm = lb[0, s]
                    for k in range(1, b):
                        if lb[k, s] > lm:
                            lm = lb[k, s]
                    scale[s] = lm
                    for k in range(b):
                        buf[k, s] = math.exp(lb[k, s] - lm)
        for s in range(W):
            if warm and b > 1:
                tot = 0.0
                for k in range(1, b):
                    tot += buf[k, s]
                tot = tot * p + buf[0, s]
                loss[s0 + s] = math.log(tot) - math.log1p((b - 1) * p) + scale[s]
            else:
                loss[s0 + s] = math.log(buf[0, s]) + scale[s]
