r"""The dynamic program behind the remove-direction Rényi sum of random allocation (Lemma 3.3).

Schuchardt & Kalinin, "Sampling-Free Privacy Accounting for Matrix Mechanisms under Random
Allocation", Eq. 16–19 (digest ``shared/spec/seed4-random-allocation-mf.md`` §5.3–5.4). For a
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
  11,628 states and 38,760 transitions a bin against 6.1 million cube cells). The transitions
  between state sets depend on ``(w, A)`` only and are built once (cached); after ``2w`` bins
  the set no longer changes, so every later bin reuses the same index arrays and only its
  weights, from row ``pos`` of ``G``, are new. Values are kept in the linear domain scaled per
  total ``m``: each bin computes the log of every contribution, subtracts the largest
  contribution arriving at the same total ``m'`` and adds the exponentials up with one
  ``bincount``. The wrap-around pairs (prefix × last bins) enter at the last bins instead of in a
  closing sum, which keeps every factor bounded (below).

**Same value.** Both evaluate the sum above exactly in real arithmetic; they differ only by
rounding (the tests compare them, brute force over all ``b^α`` tuples and the exact order-2/3
sums to ``1e-12`` relative). The one place where the sparse program can lose more than rounding is
underflow: a contribution below ``e^{-700}`` times the largest one arriving at the same total is
dropped. With ``g = max_i G_ii/σ²`` and every entry of ``G`` at most ``max_i G_ii`` (true for a
Gram matrix and its τ-truncation), each bin multiplies a state's value by at most
``e^{c(m+t)-c(m)}/t!`` with ``c(m) = g·m(m-1)/2`` (the interaction of the new count ``t`` with
earlier, distinct bins is at most ``g·t·m``), while ``S_α ≥ e^{c(α)}/α!`` (all ``α`` draws in the
bin with the largest ``G_ii``). Summing the dropped mass over every bin and transition gives a
relative loss of at most ``b · T · b^α · e^{-700}`` (``T`` transitions a bin), i.e.
``e^{-600}`` here. :func:`log_rest_sums` uses the sparse program when that bound is below
``e^{-40}`` and the dense one otherwise (and for any ``G`` with an off-diagonal entry above the
largest diagonal one), so the value returned never depends on the choice beyond rounding.
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
    """One bin's move from a state set to the next (index arrays only; no ``G``)."""

    m: np.ndarray        # (n,) total of each source state
    window: np.ndarray   # (n, nr) float: the last nr counts, oldest first
    prefix: np.ndarray   # (n, nr) float: the first nr counts (zeros without wrap-around)
    src: np.ndarray      # (T,) source state of each transition, sorted by destination total
    t: np.ndarray        # (T,) the new bin's count
    dst: np.ndarray      # (T,) destination state
    starts: np.ndarray   # (K,) first transition of each destination total
    group: np.ndarray    # (T,) index into starts of each transition's destination total
    totals: np.ndarray   # (K,) the destination totals m'
    n_next: int
    next_m: np.ndarray   # (n_next,) total of each destination state


class _Plan(NamedTuple):
    initial: np.ndarray          # (n0, 2nr+1) or (n0, nr+1) int rows of the first state set
    stages: tuple[_Stage, ...]   # the last one repeats for every later bin


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.setflags(write=False)
    return a


def _stage(rows: np.ndarray, nr: int, wrap: bool, A: int) -> tuple[_Stage, np.ndarray]:
    """Transitions out of the state rows ``[prefix.., m, window..]`` and the next rows."""
    off = nr if wrap else 0               # column of m
    m = rows[:, off]
    reps = A - m + 1                       # t = 0..A-m
    src = np.repeat(np.arange(len(rows)), reps)
    first = np.cumsum(reps) - reps
    t = np.arange(len(src)) - np.repeat(first, reps)
    new = np.empty((len(src), rows.shape[1]), dtype=np.int64)
    if wrap:
        new[:, :nr] = rows[src, :nr]
    new[:, off] = m[src] + t
    if nr:
        new[:, off + 1:-1] = rows[src, off + 2:]
        new[:, -1] = t
    nxt, dst = np.unique(new, axis=0, return_inverse=True)
    dst = dst.reshape(-1)
    order = np.argsort(new[:, off], kind="stable")
    src, t, dst = src[order], t[order], dst[order]
    mdst = m[src] + t
    totals, starts = np.unique(mdst, return_index=True)
    group = np.searchsorted(totals, mdst)
    window = rows[:, off + 1:].astype(np.float64)
    prefix = rows[:, :nr].astype(np.float64) if wrap else np.zeros((len(rows), nr))
    st = _Stage(*(_frozen(x) for x in (m, window, prefix, src, t, dst, starts, group, totals)),
                n_next=len(nxt), next_m=_frozen(nxt[:, off]))
    return st, nxt


@functools.lru_cache(maxsize=8)
def _plan(nr: int, wrap: bool, A: int) -> _Plan:
    """State sets and transitions for window ``nr + 1`` and max order ``A``, up to the first
    stage whose state set maps onto itself (after at most ``nr + 2`` bins: from then on the
    reachable states are all rows with ``Σ prefix + Σ window ≤ m ≤ A``)."""
    if wrap and nr:
        pre = np.array(_prefixes(nr, A + 1), dtype=np.int64).reshape(-1, nr)
        rows = np.concatenate([pre, pre.sum(axis=1, keepdims=True), pre], axis=1)
        rows = np.unique(rows, axis=0)
    else:
        rows = np.zeros((1, nr + 1), dtype=np.int64)
    initial = _frozen(rows)
    stages = []
    for _ in range(nr + 3):
        st, nxt = _stage(rows, nr, wrap, A)
        stages.append(st)
        if nxt.shape == rows.shape and np.array_equal(nxt, rows):
            break
        rows = nxt
    else:  # pragma: no cover - the argument in the docstring says it cannot happen
        raise RuntimeError(f"state sets of the Rényi program did not settle (w={nr + 1}, A={A})")
    return _Plan(initial, tuple(stages))


def sparse_underflow_log_bound(b: int, w: int, wrap: bool, max_order: int) -> float:
    """Log of the bound ``b · T · b^A · e^{-700}`` on the relative underflow loss of
    :func:`log_rest_sums_sparse` (module docstring; ``-inf`` for ``w = 1``, where every total
    is a single state and nothing is dropped relative to another state)."""
    nr = w - 1
    if nr == 0:
        return -math.inf
    A = max_order
    cols = 2 * nr + 1 if wrap else nr + 1          # state columns: (prefix,) m, window
    per_bin = math.comb(A + cols + 1, cols + 1)     # transitions a bin
    return math.log(b) + math.log(per_bin) + A * math.log(b) + _UNDERFLOW_LOG


def log_rest_sums_sparse(G: np.ndarray, sigma: float, w: int, wrap: bool, max_order: int
                         ) -> np.ndarray:
    """``log S_α`` for ``α = 0..max_order`` over the reachable states (module docstring).

    Same contract as :func:`log_rest_sums_dense`.
    """
    b = G.shape[0]
    A = max_order
    nr = w - 1
    wrap = bool(wrap and nr)
    s2 = sigma ** 2
    logfact = special.gammaln(np.arange(A + 1) + 1.0)
    tq = np.arange(A + 1, dtype=np.float64)
    start = nr if wrap else 0
    plan = _plan(nr, wrap, A)

    # initial values: log weight of each prefix (or the empty state), scaled per total
    rows = plan.initial
    if wrap:
        logv = np.array([_prefix_log_weight(G, s2, r[:nr], logfact) for r in rows])
        m0 = rows[:, nr]
    else:
        logv = np.zeros(1)
        m0 = np.zeros(1, dtype=np.int64)
    scale = np.full(A + 1, -np.inf)
    np.maximum.at(scale, m0, logv)
    values = np.exp(logv - scale[m0])
    m_last = m0

    for k, pos in enumerate(range(start, b)):
        st = plan.stages[min(k, len(plan.stages) - 1)]
        a = np.zeros(nr)
        c = np.zeros(nr)
        for i in range(nr):
            q = pos - nr + i                          # bin of window column i
            if q >= 0:
                a[i] = G[pos, q] / s2
            if wrap and pos - i >= w:                 # wrap-around pair (prefix bin i, pos)
                c[i] = G[i, pos] / s2
        lin = st.window @ a + st.prefix @ c if nr else np.zeros(len(st.m))
        with np.errstate(divide="ignore"):
            base = np.log(values) + scale[st.m]
        quad = G[pos, pos] * tq * (tq - 1) / (2 * s2) - logfact
        e = base[st.src] + st.t * lin[st.src] + quad[st.t]
        top = np.maximum.reduceat(e, st.starts)
        top_safe = np.where(np.isfinite(top), top, 0.0)
        values = np.bincount(st.dst, weights=np.exp(e - top_safe[st.group]),
                             minlength=st.n_next)
        scale = np.full(A + 1, -np.inf)
        scale[st.totals] = top
        m_last = st.next_m

    sums = np.bincount(m_last, weights=values, minlength=A + 1)
    with np.errstate(divide="ignore"):
        return np.log(sums) + np.where(np.isfinite(scale), scale, 0.0)


def log_rest_sums(G: np.ndarray, sigma: float, w: int, wrap: bool, max_order: int
                  ) -> np.ndarray:
    """``log S_α`` for ``α = 0..max_order``: the sparse program when its underflow loss is
    certified negligible (module docstring), else the dense one."""
    G = np.asarray(G, dtype=np.float64)
    b = G.shape[0]
    diag_max = float(np.max(np.diag(G))) if b else 0.0
    if (b and float(np.max(G)) <= diag_max
            and sparse_underflow_log_bound(b, w, wrap, max_order) < _MAX_LOSS_LOG):
        return log_rest_sums_sparse(G, sigma, w, wrap, max_order)
    return log_rest_sums_dense(G, sigma, w, wrap, max_order)
