r"""The dynamic program behind the remove-direction Rényi sum of random allocation (Lemma 3.3).

Schuchardt & Kalinin, "Sampling-Free Privacy Accounting for Matrix Mechanisms under Random
Allocation" (arXiv:2601.21636; docs/references.md), Eq. 16–19. For a
``b × b`` matrix ``G`` that is zero outside a cyclic band, and ``α = 0..A``, both functions here
return

.. math::

    \log S_\alpha, \qquad S_\alpha = \sum_{r \in \mathbb N^b,\ \sum_j r_j = \alpha}
    \prod_j \frac{1}{r_j!}\, \exp\Big(\sum_j \frac{r_j(r_j-1) G_{jj}}{2\sigma^2}
    + \sum_{i<j} \frac{G_{ij} r_i r_j}{\sigma^2}\Big),

the count-vector form of the tuple sum of Lemma 3.2 (Eq. 12–13). The sum runs over bins
``0..b-1`` in order; the state after a bin is the total so far ``m``, the last ``w-1`` counts
(the window every later pair with a bin in it needs) and, when the band wraps around, the first
``w-1`` counts (the prefix that closes the cycle).

* :func:`log_rest_sums_dense` is the paper's algorithm as first written here: log-domain arrays
  over the full cube ``(prefix, m, r_1..r_{w-1})`` of side ``A+1``, a ``logsumexp`` per bin.
  Most of the cube is unreachable (the counts of disjoint bins must sum to at most ``m``).
* :func:`log_rest_sums_sparse` runs the same recursion over the **reachable** states only:
  tuples with ``Σ prefix + Σ window ≤ m ≤ A``, ``C(A+2w-1, 2w-1)`` of them against
  ``C(A+w-1, w-1)·(A+1)^w`` in the cube (for the issue-41 setting, ``w = 3`` and ``A = 14``:
  11,628 states and 38,760 moves a bin against 6.1 million cube cells). The moves between state
  sets depend on ``(w, A)`` only and are built once (cached); after at most ``w + 1`` bins the
  set no longer changes, so every later bin reuses the same index arrays and only its weights,
  from row ``pos`` of ``G``, are new. The wrap-around pairs (prefix × last bins) enter at the
  last bins, as interactions of the new count with the prefix, instead of in a closing sum.

  Values are linear, scaled by ``e^{-c(m)}`` with ``c(m) = g·m(m-1)/2`` and ``g = max_i
  G_ii/σ²``. A state ``s`` (total ``m_s``) that receives ``t`` draws in the new bin ``p`` gains
  ``e^{t·lin_s + G_pp t(t-1)/2σ²}/t!`` with ``lin_s`` the interaction with the window (and the
  prefix, at the last bins) over σ², which after scaling is ``ρ_s^t · q_t`` with ``ρ_s =
  e^{lin_s - g·m_s} ≤ 1`` and ``q_t = e^{t(t-1)/2·(G_pp/σ² - g)}/t! ≤ 1/t!`` (``lin_s ≤ g·m_s``
  because the bins it involves are distinct and every entry of ``G`` is at most ``max_i
  G_ii``). So one ``exp`` per state and running products over ``t`` give every move (no ``exp``
  per move); the states that differ only in the oldest window count, which the new bin merges,
  are contiguous (rows sorted ``[m, prefix, r_1..r_{w-2}, r_0]``) and summed by one
  ``bincount``; each total ``m`` keeps its own log-scale, set a priori to ``max_t (scale(m-t) +
  log q_t)`` and renormalised to its largest value after the bin.

**Same value.** Both evaluate the sum above exactly in real arithmetic; they differ only by
rounding (the tests compare them, count-vector enumeration, brute force over all ``b^α`` tuples
and the exact order-2/3 sums, to ``1e-12`` relative). The one place where the sparse program can
lose more than rounding is underflow: a move worth less than ``e^{-700}`` of its total's a-priori
scale is lost (or rounded as a subnormal). In scaled units every factor is at most ``1/t!``, a
total's scale is at most ``n^m 2^m/m!`` after ``n`` bins, a unit of scaled mass reaches order
``α`` with weight at most ``(b-n)^{α-m}/(α-m)!``, and ``S_α e^{-c(α)} ≥ 1/α!`` (all ``α`` draws in
the bin with the largest ``G_ii``). Summing over every bin and move bounds the relative loss by
``b · T · (2b)^α · e^{-700}`` (``T`` moves a bin; :func:`sparse_underflow_log_bound`), ``e^{-590}``
here. :func:`log_rest_sums` uses the sparse program when that bound is below ``e^{-40}`` and the
dense one otherwise (and for any ``G`` with an off-diagonal entry above its largest diagonal
one, or a negative diagonal; and for ``w = 1``, where the dense program has no unreachable
states and is faster), so the value returned never depends on the choice beyond rounding.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import numpy as np
from scipy import special

__all__ = ["log_rest_sums", "log_rest_sums_dense", "log_rest_sums_sparse",
           "sparse_underflow_log_bound"]

#: exp(x) for x below this is dropped or subnormal; the loss bound of the module docstring uses it.
_UNDERFLOW_LOG = -700.0
#: the sparse program is used when its relative underflow loss is certified below e**this.
_MAX_LOSS_LOG = -40.0


# ----------------------------------------------------------------------------------------------
# the dense log-domain program (the reference)
# ----------------------------------------------------------------------------------------------
def _lse(x: np.ndarray, axis: int) -> np.ndarray:
    mx = np.max(x, axis=axis, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    with np.errstate(divide="ignore"):
        out = np.log(np.sum(np.exp(x - mx), axis=axis, keepdims=True)) + mx
    return np.squeeze(out, axis=axis)


def _prefixes(nr: int, a1: int) -> list[tuple[int, ...]]:
    return [lv for lv in itertools.product(range(a1), repeat=nr) if sum(lv) <= a1 - 1]


def _prefix_log_weight(G: np.ndarray, s2: float, prefix, logfact: np.ndarray) -> float:
    lw = 0.0
    nr = len(prefix)
    for i in range(nr):
        lw += G[i, i] * prefix[i] * (prefix[i] - 1) / (2 * s2) - logfact[prefix[i]]
        for j in range(i + 1, nr):
            lw += G[i, j] * prefix[i] * prefix[j] / s2
    return lw


def log_rest_sums_dense(G: np.ndarray, sigma: float, w: int, wrap: bool, max_order: int
                        ) -> np.ndarray:
    """``log S_α`` for ``α = 0..max_order`` by the dense log-domain program (module docstring).

    ``G`` must be zero outside the window ``w`` (linear distance ``< w``) and, with ``wrap``,
    the wrap-around pairs between the first and the last ``w-1`` bins.
    """
    b = G.shape[0]
    A = max_order
    a1 = A + 1
    s2 = sigma ** 2
    logfact = special.gammaln(np.arange(a1) + 1.0)
    t = np.arange(a1, dtype=np.float64)
    nr = w - 1  # suffix length

    if wrap and nr > 0:
        prefixes = _prefixes(nr, a1)
        start = nr
    else:
        prefixes = [None]
        start = 0
    P = len(prefixes)
    shape = (P, a1) + (a1,) * nr
    S = np.full(shape, -np.inf)
    for pi, lv in enumerate(prefixes):
        if lv is None:
            S[(pi, 0) + (0,) * nr] = 0.0
        else:
            S[(pi, sum(lv)) + tuple(lv)] = _prefix_log_weight(G, s2, lv, logfact)

    r_grids = np.meshgrid(*([t] * nr), indexing="ij") if nr else []
    m_idx = np.arange(a1)
    src = m_idx[None, :] - m_idx[:, None]        # [t, m'] -> m = m' - t
    valid = src >= 0
    src_c = np.where(valid, src, 0)
    for pos in range(start, b):
        d0 = G[pos, pos] * t * (t - 1) / (2 * s2) - logfact        # (T,)
        lin = np.zeros((1,) * nr)
        for i in range(nr):
            q = pos - nr + i                     # position of r_{i+1}
            if q >= 0 and G[pos, q] != 0:
                lin = lin + G[pos, q] * r_grids[i] / s2
        # contrib[t, P, m, r1..] = S + t*lin + d0[t]
        contrib = (S[None] + t.reshape((a1,) + (1,) * (nr + 2)) * lin[None, None, None]
                   + d0.reshape((a1,) + (1,) * (nr + 2)))
        X = _lse(contrib, axis=3) if nr else contrib          # drop r1: (T, P, M, r2..)
        # new[P, m', r2.., t] = X[t, P, m'-t, r2..]
        idx = src_c.reshape((a1, 1, a1) + (1,) * max(nr - 1, 0))
        idx = np.broadcast_to(idx, X.shape)
        Y = np.take_along_axis(X, idx, axis=2)
        Y = np.where(valid.reshape((a1, 1, a1) + (1,) * max(nr - 1, 0)), Y, -np.inf)
        S = np.moveaxis(Y, 0, -1) if nr else _lse(Y, axis=0)
    # closure: wrap-around pairs (prefix bin i, last bin j) not seen by the forward pass
    if wrap and nr > 0:
        cyc = np.zeros((P,) + (a1,) * nr)
        pre = np.array(prefixes, dtype=np.float64)  # (P, nr), positions 0..nr-1
        for i in range(nr):
            for jj in range(nr):
                j = b - nr + jj                      # suffix position of r_{jj+1}
                if j - i >= w and G[i, j] != 0:
                    cyc = cyc + (G[i, j] / s2) * pre[:, i].reshape((P,) + (1,) * nr) * \
                        r_grids[jj][None]
        total = S + cyc[:, None]
    else:
        total = S
    flat = total.reshape(P, a1, -1)
    per_m = _lse(flat, axis=2)                     # (P, M)
    return _lse(per_m, axis=0)                     # (M,)


# ----------------------------------------------------------------------------------------------
# the sparse program over reachable states
# ----------------------------------------------------------------------------------------------
class _Stage(NamedTuple):
    """One bin's move from a state set to the next (index arrays only; no ``G``).

    State rows are ``[m, prefix.., r_1..r_{nr-1}, r_0]`` (window oldest last), sorted, so that
    the states of one total are contiguous and, inside them, the states that differ only in the
    oldest count ``r_0`` — the ones the new bin merges — are contiguous too.
    """

    m: np.ndarray          # (n,) total of each state
    window: np.ndarray     # (nr, n) float: the last nr counts, oldest first
    prefix: np.ndarray     # (nr, n) float: the first nr counts (zeros without wrap-around)
    n_t: np.ndarray        # (A+1,) states with m <= A - t: a prefix of the rows
    run: np.ndarray        # (n,) run of each row: runs are rows equal but for r_0
    k_t: np.ndarray        # (A+1,) runs with m <= A - t: a prefix of the runs
    seg_m: np.ndarray      # (S,) total of each run
    dst: tuple             # (A+1,) arrays: next state of run j with the new count t
    next_starts: np.ndarray  # first next state of each total present
    next_totals: np.ndarray  # those totals
    next_m: np.ndarray     # (n_next,) total of each next state


class _Plan(NamedTuple):
    initial: np.ndarray          # int rows of the first state set
    stages: tuple[_Stage, ...]   # the last one repeats for every later bin


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.setflags(write=False)
    return a


def _stage(rows: np.ndarray, nr: int, nl: int, A: int) -> tuple[_Stage, np.ndarray]:
    """The move out of the sorted state rows (``_Stage``) and the next sorted rows."""
    m = rows[:, 0]
    if nr:
        key = rows[:, :-1]
        change = np.any(key[1:] != key[:-1], axis=1)
        seg_starts = np.concatenate([[0], np.flatnonzero(change) + 1])
    else:
        key, seg_starts = rows, np.arange(len(rows))
    seg = key[seg_starts]                              # [m, prefix.., r_1..r_{nr-1}]
    seg_m = seg[:, 0]
    tt = np.arange(A + 1)
    n_t = np.searchsorted(m, A - tt, side="right")
    k_t = np.searchsorted(seg_m, A - tt, side="right")
    parts = []
    for t in range(A + 1):
        s = seg[:k_t[t]]
        rest = s[:, 1 + nl:]                           # r_1..r_{nr-1}
        col_t = np.full((len(s), 1), t) if nr else np.zeros((len(s), 0), dtype=np.int64)
        parts.append(np.concatenate([s[:, :1] + t, s[:, 1:1 + nl], rest[:, 1:], col_t,
                                     rest[:, :1]], axis=1))
    allnew = np.concatenate(parts)
    # with a window (nr >= 1) the new count t is the newest window entry, so every next state
    # has exactly one (run, t); without one (nr = 0) the totals m + t collide across t
    nxt, inv = np.unique(allnew, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    bounds = np.concatenate([[0], np.cumsum(k_t)])
    dst = tuple(_frozen(inv[bounds[t]:bounds[t + 1]]) for t in range(A + 1))
    window = (np.concatenate([rows[:, -1:], rows[:, 1 + nl:-1]], axis=1) if nr
              else np.zeros((len(rows), 0))).astype(np.float64).T
    prefix = (rows[:, 1:1 + nl] if nl else np.zeros((len(rows), nr))).astype(np.float64).T
    run = np.repeat(np.arange(len(seg_starts)), np.diff(np.append(seg_starts, len(rows))))
    next_totals, next_starts = np.unique(nxt[:, 0], return_index=True)
    st = _Stage(*(_frozen(x) for x in (m, window, prefix, n_t, run, k_t, seg_m)),
                dst=dst, next_starts=_frozen(next_starts), next_totals=_frozen(next_totals),
                next_m=_frozen(nxt[:, 0]))
    return st, nxt


@functools.lru_cache(maxsize=8)
def _plan(nr: int, wrap: bool, A: int) -> _Plan:
    """State sets and moves for window ``nr + 1`` and max order ``A``, up to the first stage
    whose state set maps onto itself (after at most ``nr + 2`` bins: from then on the reachable
    states are all rows with ``Σ prefix + Σ window ≤ m ≤ A``)."""
    nl = nr if wrap else 0
    if nl:
        pre = np.array(_prefixes(nr, A + 1), dtype=np.int64).reshape(-1, nr)
        # window = prefix: [m, l.., r_1..r_{nr-1}, r_0] with r = l
        rows = np.concatenate([pre.sum(axis=1, keepdims=True), pre, pre[:, 1:], pre[:, :1]],
                              axis=1)
        rows = np.unique(rows, axis=0)
    else:
        rows = np.zeros((1, 1 + nr), dtype=np.int64)
    initial = _frozen(rows)
    stages = []
    for _ in range(nr + 3):
        st, nxt = _stage(rows, nr, nl, A)
        stages.append(st)
        if nxt.shape == rows.shape and np.array_equal(nxt, rows):
            break
        rows = nxt
    else:  # pragma: no cover - the argument in the docstring says it cannot happen
        raise RuntimeError(f"state sets of the Rényi program did not settle (w={nr + 1}, A={A})")
    return _Plan(initial, tuple(stages))


def sparse_underflow_log_bound(b: int, w: int, wrap: bool, max_order: int) -> float:
    """Log of the bound ``b · T · (2b)^A · e^{-700}`` on the relative underflow loss of
    :func:`log_rest_sums_sparse` (module docstring; ``T`` moves a bin)."""
    nr = w - 1
    A = max_order
    cols = 2 * nr + 1 if (wrap and nr) else nr + 1      # state columns: m, (prefix,) window
    per_bin = math.comb(A + cols + 1, cols + 1)
    return math.log(b) + math.log(per_bin) + A * math.log(2 * b) + _UNDERFLOW_LOG


@functools.lru_cache(maxsize=8)
def _index_tables(A: int) -> tuple[np.ndarray, np.ndarray]:
    """``back[m', t] = m' - t`` (``A + 1``, a ``-inf`` slot, where negative) and
    ``total[m, t] = min(m + t, A)`` (entries with ``m + t > A`` are never read)."""
    i = np.arange(A + 1)
    back = i[:, None] - i[None, :]
    back = np.where(back >= 0, back, A + 1)
    total = np.minimum(i[:, None] + i[None, :], A)
    return _frozen(back), _frozen(total)


def _group_normalise(values: np.ndarray, starts: np.ndarray, totals: np.ndarray,
                     scale: np.ndarray, A: int) -> tuple[np.ndarray, np.ndarray]:
    """Divide each total's values by their largest and move its log into ``scale``."""
    top = np.maximum.reduceat(values, starts)
    ok = top > 0
    sizes = np.diff(np.concatenate([starts, [len(values)]]))
    values = values / np.repeat(np.where(ok, top, 1.0), sizes)
    out = np.full(A + 1, -np.inf)
    with np.errstate(divide="ignore"):
        out[totals] = np.where(ok, scale[totals] + np.log(np.where(ok, top, 1.0)), -np.inf)
    return values, out


def log_rest_sums_sparse(G: np.ndarray, sigma: float, w: int, wrap: bool, max_order: int
                         ) -> np.ndarray:
    """``log S_α`` for ``α = 0..max_order`` over the reachable states (module docstring).

    Same contract as :func:`log_rest_sums_dense`; needs ``max G ≤ max_i G_ii`` and
    ``max_i G_ii ≥ 0`` (the scaling below), which :func:`log_rest_sums` checks.
    """
    b = G.shape[0]
    A = max_order
    nr = w - 1
    wrap = bool(wrap and nr)
    s2 = sigma ** 2
    g = max(float(np.max(np.diag(G))), 0.0) / s2
    logfact = special.gammaln(np.arange(A + 1) + 1.0)
    tq = np.arange(A + 1, dtype=np.float64)
    c = g * tq * (tq - 1) / 2                      # the scaling c(m): values are S·e^{-c(m)}
    start = nr if wrap else 0
    plan = _plan(nr, wrap, A)

    rows = plan.initial
    if wrap:
        logv = np.array([_prefix_log_weight(G, s2, r[1:1 + nr], logfact) for r in rows])
        logv = logv - c[rows[:, 0]]
    else:
        logv = np.zeros(1)
    totals, starts = np.unique(rows[:, 0], return_index=True)
    scale = np.full(A + 1, -np.inf)
    scale[totals] = np.maximum.reduceat(logv, starts)
    values = np.exp(logv - scale[rows[:, 0]])
    m_last = rows[:, 0]

    for k, pos in enumerate(range(start, b)):
        st = plan.stages[min(k, len(plan.stages) - 1)]
        a = np.zeros(nr)
        cl = np.zeros(nr)
        for i in range(nr):
            q = pos - nr + i                          # bin of window column i (oldest first)
            if q >= 0:
                a[i] = G[pos, q] / s2
            if wrap and pos - i >= w:                 # wrap-around pair (prefix bin i, pos)
                cl[i] = G[i, pos] / s2
        # ρ_s = e^{lin_s - g m_s} <= 1: the new count's interaction with earlier, distinct bins
        rho = np.exp(a @ st.window + cl @ st.prefix - g * st.m)
        logq = tq * (tq - 1) / 2 * (G[pos, pos] / s2 - g) - logfact        # <= -log t!
        # a priori scale of each next total m': max over t of (scale[m' - t] + log q_t)
        back, total = _index_tables(A)
        ref = (np.append(scale, -np.inf)[back] + logq[None, :]).max(axis=1)
        K = np.exp(scale[None, :] + logq[:, None]                # [t, m] <= 1; 0: no total m
                   - np.where(np.isfinite(ref), ref, 0.0)[total])
        new = np.zeros(len(st.next_m))
        prod = values
        for t in range(A + 1):
            n, kk = st.n_t[t], st.k_t[t]
            if t:
                prod = prod[:n] * rho[:n]
            runs = np.bincount(st.run[:n], weights=prod, minlength=kk) if nr else prod
            new[st.dst[t]] += runs * K[t].take(st.seg_m[:kk])     # distinct within one t
        values, scale = _group_normalise(new, st.next_starts, st.next_totals, ref, A)
        m_last = st.next_m

    sums = np.bincount(m_last, weights=values, minlength=A + 1)
    with np.errstate(divide="ignore"):
        return np.log(sums) + np.where(np.isfinite(scale), scale, 0.0) + c


def log_rest_sums(G: np.ndarray, sigma: float, w: int, wrap: bool, max_order: int
                  ) -> np.ndarray:
    """``log S_α`` for ``α = 0..max_order``: the sparse program when its underflow loss is
    certified negligible (module docstring), else the dense one. A window of one bin
    (``w = 1``: DP-SGD) has no unreachable states (the state is the total alone) and the dense
    program, a few array operations per bin, is the faster there (3× at ``b = 234``, ``A = 64``).
    """
    G = np.asarray(G, dtype=np.float64)
    b = G.shape[0]
    diag_max = float(np.max(np.diag(G))) if b else 0.0
    if (b and w > 1 and 0.0 <= diag_max and float(np.max(G)) <= diag_max
            and sparse_underflow_log_bound(b, w, wrap, max_order) < _MAX_LOSS_LOG):
        return log_rest_sums_sparse(G, sigma, w, wrap, max_order)
    return log_rest_sums_dense(G, sigma, w, wrap, max_order)
