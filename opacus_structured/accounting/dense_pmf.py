r"""dp_accounting's dense-PMF composition, ε(δ) and connect-the-dots builder, vectorised.

Three dp_accounting 0.6 routines spend most of their time in Python-level loops or in per-call
overhead, which made truncated Poisson's default ``max_batch_size`` search in ``make_private``
take ~4 s for 20 steps (issue 41: ~12 compositions and ε(δ) reads; on the 1e-4 grid a step PMF
has ~190,000 points and a composed one ~364,000):

* ``DensePLDPmf.self_compose`` → ``common.self_convolve`` → ``compute_self_convolve_bounds``:
  the Chernoff truncation window is the minimum / maximum over 40 orders θ of
  :math:`(n \log M(\theta) + \log(2/\tau))/\theta`, each log-MGF one
  ``scipy.special.logsumexp`` call over the whole PMF (85 % of the composition).
  :func:`self_convolve_bounds` first bounds all 40 (:func:`_screen`: powers of one ``exp``
  array, with a rigorous error bound), keeps the orders whose bound can be the extreme one
  (one or two per side), and evaluates those as scipy 1.17's ``logsumexp(a, b=probs)`` does,
  operation for operation (:func:`_log_mgf_exact`: zero weights masked to :math:`-\infty`, the
  maximum split out of the sum, ``log1p(s) + log(m) + a_max``; scipy itself for a tie or a
  non-finite result). dp_accounting's bound loop then runs unchanged on them: the same window,
  integer for integer.
* ``_get_epsilon_for_delta``: a Python loop over the PMF from the largest loss down.
  :class:`_DenseEpsilon` finds the same stopping point with ``np.cumsum`` (sequential, so every
  partial sum is the loop's) over the same losses (``itertools.count`` from the top loss is a
  repeated subtraction, which ``np.cumsum`` repeats), with ``math.exp``'s exponentials
  (``np.exp`` where it returns the same bits, :func:`_numpy_exp_is_math_exp`) and
  ``math.log`` wherever ``np.log`` could decide a comparison differently, and returns what
  the loop returns. The partial sums do not depend on δ: :func:`epsilon_reader` reads ε at
  several δ for one pass.
* ``create_pmf_pessimistic_connect_dots_fixed_gap`` computes the PMF with numpy, then builds a
  ``{loss: prob}`` dictionary and turns it back into a list (``create_pmf``); above
  ``_MAX_PMF_SPARSE_SIZE`` points :func:`connect_dots_fixed_gap` wraps the same array in the same
  ``DensePLDPmf`` directly (sparse sizes and invalid input go to dp_accounting's own function).

:func:`self_compose` is ``PrivacyLossDistribution.self_compose`` with these: the FFT power, the
roll and the infinity mass are dp_accounting's code line for line; a sparse PMF is composed by
dp_accounting while the result can stay sparse, else converted with its own ``to_dense_pmf``
exactly as ``SparsePLDPmf.self_compose`` does. The tests hold every output (window, lower loss,
PMF array, infinity mass, ε) equal to dp_accounting's on many PLDs (``tests/test_dense_pmf.py``).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution
from scipy import fft, special

__all__ = [
    "dense_probs",
    "self_convolve_bounds",
    "composition_bounds",
    "self_compose_pmf",
    "self_compose",
    "epsilon_for_delta_pmf",
    "epsilon_reader",
    "epsilon_for_delta",
    "connect_dots_fixed_gap",
]

#: dp_accounting's default Chernoff orders, before division by the PMF length.
_ORDERS = np.concatenate((np.arange(-20, 0), np.arange(1, 21)))
#: Elements per 2-D block of :func:`_log_mgfs` (8 MiB per float64 temporary).
_BLOCK = 1 << 20


def dense_probs(pmf) -> np.ndarray:
    """The dense probability array dp_accounting composes for ``pmf`` (a sparse PMF's span from
    its smallest to its largest loss, zeros between: ``to_dense_pmf()._probs``, vectorised)."""
    probs = getattr(pmf, "_probs", None)
    if probs is not None:
        return np.asarray(probs)
    loss_probs = getattr(pmf, "_loss_probs", None)
    if loss_probs is not None:
        if not loss_probs:
            return np.zeros(1)
        keys = np.fromiter(loss_probs.keys(), dtype=np.int64)
        out = np.zeros(int(keys.max() - keys.min()) + 1)
        out[keys - keys.min()] = np.fromiter(loss_probs.values(), dtype=np.float64)
        return out
    return np.asarray(pmf.to_dense_pmf()._probs)  # pylint: disable=protected-access


def _log_mgf_exact(probs: np.ndarray, kf: np.ndarray, order: float, end: int,
                   step: int, nonzero: np.ndarray) -> float:
    r"""``special.logsumexp(np.arange(len(probs)) * order, b=probs)``, bit for bit.

    scipy 1.17 masks zero weights to :math:`-\infty`, takes the largest remaining exponent
    :math:`a_{\max}` out of the sum (its weight ``m``), sums ``b * exp(a - a_max)`` over the rest
    and returns ``log1p(s / m) + log(m) + a_max``. ``k * order`` is monotone in k, so
    :math:`a_{\max}` is at the last (order > 0) or first (order < 0) index of non-zero weight,
    ``end``; a tie with its neighbour (``step``: -1 or +1, over ``nonzero``), or any non-finite
    result, is left to scipy itself.
    """
    a_max = kf[end] * order
    pos = int(np.searchsorted(nonzero, end))
    nxt = pos + step
    if 0 <= nxt < len(nonzero) and kf[nonzero[nxt]] * order == a_max:
        return float(special.logsumexp(kf * order, b=probs))
    t = kf * order
    t -= a_max
    np.exp(t, out=t)
    t *= probs
    t[end] = probs[end] * 0.0                   # a[i_max] = -inf: b * exp(-inf)
    s = t.sum()
    m = probs[end]                              # sum(b * i_max): the one non-zero term
    with np.errstate(divide="ignore", invalid="ignore"):
        s = s if s == 0 else s / m
        sgn = np.sign(s + 1) * np.sign(m)
        s = -s - 2 if s < -1 else s
        out = np.log1p(s) + np.log(np.abs(m)) + a_max
    if sgn < 0 or not np.isfinite(out):
        return float(special.logsumexp(kf * order, b=probs))
    return out


def _screen(probs: np.ndarray, kf: np.ndarray, first: int, last: int, num_times: int,
            log_two_over_tau: float, orders: np.ndarray) -> Optional[np.ndarray]:
    r"""Every order's bound :math:`(n \log M(\theta) + \log(2/\tau))/\theta` to within a
    rigorous error, fast: ``(approx, err)`` rows, or ``None`` when the PMF has a negative or
    non-finite weight (then every order is computed exactly).

    :math:`M(j/L) = e^{j\,\mathrm{last}/L} \sum_k p_k r_k^{\,j}` with
    :math:`r_k = e^{(k - \mathrm{last})/L} \le e`, the powers by repeated multiplication (one
    ``exp`` pass per side instead of 20), likewise for the negative orders from ``first``.

    Error (u = 2^-53, non-negative weights, an ``exp`` within 4 ulp). Here: each term carries at
    most ~250 u of relative error (the argument's rounding, ``exp``, 19 products, the order
    ``fl(j/L)`` against ``j/L``), any summation order at most L u, and adding
    :math:`j\,\mathrm{last}/L` and the ``log`` a few u of :math:`|\log M|`: in all
    :math:`\le (L + 300)\,u + u|\log M|`. scipy's value: its exponents carry ~50 u, its
    pairwise sum at most L u, and ``log1p(s) + log(m)`` at most 8 u of 1,500 (m is a positive
    double, so :math:`|\log m| \le 745`, and :math:`|\log(1 + s)| \le 1455`): in all
    :math:`\le (L + 13{,}000)\,u + 2u|\log M|`. So :math:`|\log M_{\rm here} - \log M_{\rm
    scipy}| \le e_M = 2\,(2L + 14{,}000 + 3|\log M|)\,u` (a factor 2 to spare); ``err`` is
    four times :math:`e_M` carried through the bound, plus the bound's own rounding.
    """
    if not (np.all(probs >= 0) and np.all(np.isfinite(probs))):
        return None
    size = len(probs)
    u = 2.0 ** -53
    log_mgf = np.empty(len(orders))
    for sign, ref in ((1, last), (-1, first)):
        r = np.exp(sign * (kf - ref) / size)
        power = r.copy()
        for j in range(1, 21):
            total = float(np.dot(probs, power))
            value = sign * j * ref / size + (math.log(total) if total > 0 else -math.inf)
            log_mgf[_ORDERS == sign * j] = value
            power *= r
    if not np.all(np.isfinite(log_mgf)):
        return None
    e_m = 2.0 * (2 * size + 14_000 + 3 * np.abs(log_mgf)) * u
    approx = (num_times * log_mgf + log_two_over_tau) / orders
    err = 4.0 * ((num_times * e_m + 4 * u * (num_times * np.abs(log_mgf) + abs(log_two_over_tau)))
                 / np.abs(orders) + 4 * u * np.abs(approx)) + 1e-9
    return np.stack([approx, err])


def _log_mgfs(probs: np.ndarray, orders: np.ndarray, num_times: int,
              log_two_over_tau: float) -> np.ndarray:
    """scipy's ``logsumexp(np.arange(L) * order, b=probs)`` for the orders that can decide the
    bounds (NaN for the others: they provably cannot, see :func:`_screen`)."""
    kf = np.arange(len(probs), dtype=np.float64)
    nonzero = np.flatnonzero(probs != 0)
    out = np.full(len(orders), np.nan)
    if not len(nonzero):
        return np.array([special.logsumexp(kf * o, b=probs) for o in orders])
    first, last = int(nonzero[0]), int(nonzero[-1])
    screen = _screen(probs, kf, first, last, num_times, log_two_over_tau, orders)
    need = np.ones(len(orders), dtype=bool)
    if screen is not None:
        approx, err = screen
        lo, hi = approx - err, approx + err
        up, down = orders > 0, orders < 0
        # the upper bound is a minimum over the positive orders: one whose bound is surely
        # above another's cannot attain it (the lower bound, a maximum, mirrored)
        need[up] = lo[up] <= hi[up].min()
        need[down] = hi[down] >= lo[down].max()
    def exact(i):
        o = orders[i]
        out[i] = _log_mgf_exact(probs, kf, o, last if o > 0 else first, -1 if o > 0 else 1,
                                nonzero)

    for i in np.flatnonzero(need):
        exact(i)
    bounds = (num_times * out[need] + log_two_over_tau) / orders[need]
    if not np.all(np.isfinite(bounds)):  # dp_accounting would skip it: the others may decide
        for i in np.flatnonzero(~need):
            exact(i)
    return out


def self_convolve_bounds(input_list, num_times: int,
                         tail_mass_truncation: float = 0) -> tuple[int, int]:
    """``common.compute_self_convolve_bounds(input_list, num_times, tail_mass_truncation)``
    (default orders): the same integers, from scipy's log-MGF values (:func:`_log_mgf_exact`)
    at the orders that can attain the minimum / maximum (:func:`_screen`)."""
    input_list = np.asarray(input_list)
    upper_bound = (len(input_list) - 1) * num_times
    lower_bound = 0
    if tail_mass_truncation == 0:
        return lower_bound, upper_bound
    orders = _ORDERS / len(input_list)
    log_two_over_tau = math.log(2 / tail_mass_truncation)
    log_mgfs = _log_mgfs(input_list, orders, num_times, log_two_over_tau)
    for order, log_mgf_value in zip(orders, log_mgfs, strict=True):
        if np.isnan(log_mgf_value):
            continue  # screened out: its bound is provably not the extreme one
        bound = (num_times * log_mgf_value + log_two_over_tau) / order
        if not math.isfinite(bound):
            continue
        if order > 0:
            upper_bound = min(upper_bound, math.ceil(bound))
        if order < 0:
            lower_bound = max(lower_bound, math.floor(bound))
    return lower_bound, upper_bound


def _directions(pld: PrivacyLossDistribution) -> list:
    pmfs = [pld._pmf_remove]  # pylint: disable=protected-access
    if not pld._symmetric:  # pylint: disable=protected-access
        pmfs.append(pld._pmf_add)  # pylint: disable=protected-access
    return pmfs


def composition_bounds(pld: PrivacyLossDistribution, count: int,
                       tail_mass_truncation: float) -> list[tuple[int, int]]:
    """Per direction (remove, then add unless symmetric), the truncation window
    ``self_compose(count)`` cuts out of the direction's dense grid (:func:`dense_probs`)."""
    return [self_convolve_bounds(dense_probs(pmf), count, tail_mass_truncation)
            for pmf in _directions(pld)]


def _stays_sparse(size: int, num_times: int) -> bool:
    """``size ** num_times <= _MAX_PMF_SPARSE_SIZE`` without the big integer."""
    if size <= 1:
        return True
    total = 1
    for _ in range(num_times):
        total *= size
        if total > pld_pmf._MAX_PMF_SPARSE_SIZE:  # pylint: disable=protected-access
            return False
    return True


def self_compose_pmf(pmf: pld_pmf.PLDPmf, num_times: int, tail_mass_truncation: float = 1e-15,
                     bounds: Optional[tuple[int, int]] = None) -> pld_pmf.PLDPmf:
    """``pmf.self_compose(num_times, tail_mass_truncation)``. ``bounds``: the window of
    :func:`self_convolve_bounds` on the PMF's dense grid, when already computed."""
    if isinstance(pmf, pld_pmf.SparsePLDPmf):
        if num_times <= 0 or num_times == 1 or _stays_sparse(pmf.size, num_times):
            return pmf.self_compose(num_times, tail_mass_truncation)
        pmf = pmf.to_dense_pmf()
    if type(pmf) is not pld_pmf.DensePLDPmf or num_times <= 0:
        return pmf.self_compose(num_times, tail_mass_truncation)
    # pylint: disable=protected-access
    input_list = pmf._probs
    # common.self_convolve
    if bounds is None:
        bounds = self_convolve_bounds(input_list, num_times, tail_mass_truncation)
    truncation_lower_bound, truncation_upper_bound = bounds
    output_len = truncation_upper_bound - truncation_lower_bound + 1
    fast_len = fft.next_fast_len(max(output_len, len(input_list)))
    truncated_convolution_output = np.real(
        fft.ifft(fft.fft(input_list, fast_len) ** num_times))
    output_list = np.roll(truncated_convolution_output, -truncation_lower_bound)[:output_len]
    # DensePLDPmf.self_compose
    lower_loss = pmf._lower_loss * num_times + truncation_lower_bound
    probs = np.array(output_list)
    inf_prob = (tail_mass_truncation
                - math.expm1(num_times * math.log1p(- pmf._infinity_mass)))
    return pld_pmf.DensePLDPmf(pmf._discretization, lower_loss, probs, inf_prob,
                               pmf._pessimistic_estimate)


def self_compose(pld: PrivacyLossDistribution, num_times: int,
                 tail_mass_truncation: float = 1e-15,
                 bounds: Optional[Sequence[tuple[int, int]]] = None) -> PrivacyLossDistribution:
    """``pld.self_compose(num_times, tail_mass_truncation)``; ``bounds`` as returned by
    :func:`composition_bounds` (computed here when ``None``)."""
    pmfs = _directions(pld)
    if bounds is None:
        bounds = [None] * len(pmfs)
    composed = [self_compose_pmf(pmf, num_times, tail_mass_truncation, b)
                for pmf, b in zip(pmfs, bounds, strict=True)]
    return PrivacyLossDistribution(*composed)


_LIBM_EXP: Optional[bool] = None


def _numpy_exp_is_math_exp() -> bool:
    """Whether ``np.exp`` returns ``math.exp``'s bits (checked once, on 2**14 arguments).

    numpy computes float64 ``exp`` with the C library's ``exp`` (as ``math.exp`` does) unless
    the CPU has AVX-512, where it uses its own SIMD code, whose last bits differ for a share of
    the arguments (750 of these 16,384 on an Intel Xeon with AVX-512); then
    :func:`epsilon_for_delta_pmf` maps ``math.exp`` (:func:`_libm_exp`: slower, same bits)."""
    global _LIBM_EXP
    if _LIBM_EXP is None:
        x = np.linspace(-745.0, 709.0, 1 << 13)
        x = np.concatenate([x, np.random.default_rng(0).uniform(-40.0, 40.0, 1 << 13)])
        _LIBM_EXP = bool(np.array_equal(np.exp(x), _libm_exp(x)))
    return _LIBM_EXP


def _exp_or_inf(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _libm_exp(x: np.ndarray) -> np.ndarray:
    """``math.exp`` element-wise (the C library's bits, which dp_accounting's loop uses), with
    ``inf`` where it overflows (arguments above ``log(DBL_MAX)`` ~ 709.78, where ``np.exp``
    returns ``inf`` too) instead of ``OverflowError``."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty(len(x))
    safe = x <= 709.0  # exp(709) ~ 8.2e307: math.exp cannot overflow (NaN stays NaN)
    out[safe] = np.fromiter(map(math.exp, x[safe].tolist()), dtype=np.float64,
                            count=int(safe.sum()))
    out[~safe] = [_exp_or_inf(v) for v in x[~safe].tolist()]
    return out


class _DenseEpsilon:
    r"""``pld_pmf._get_epsilon_for_delta`` on one dense PMF, for any δ, without the Python loop.

    The loop walks the losses :math:`\ell_k` from the top (``itertools.count(top, -d)``: a
    repeated subtraction, which ``np.cumsum`` repeats exactly), adding ``prob`` to
    ``mass_upper`` and ``math.exp(-loss) * prob`` to ``mass_lower`` one at a time (so the
    partial sums are ``np.cumsum``'s; they do not depend on δ and are computed once), and stops
    before the first k with ``log((mass_upper - delta) / mass_lower) >= loss``. That test is
    evaluated with ``np.log`` and re-evaluated with ``math.log`` wherever the two sides are
    within 1e-12 (relative) of each other, so every decision is the loop's; the exponentials
    are ``math.exp``'s (:func:`_numpy_exp_is_math_exp`).

    Losses below :math:`-\log(\mathrm{DBL\_MAX}) \approx -709.78`: ``exp(-loss)`` is ``inf``
    here (``np.exp``'s value; ``math.exp``, and so dp_accounting's loop, would raise
    ``OverflowError``), a zero probability adds 0 (not ``inf * 0 = NaN``), and a partial sum
    ``mass_lower`` that is not finite (``inf``, or NaN from ``inf`` plus ``-inf`` round-off
    entries) can only follow a loss below -709, since :math:`|\mathrm{mass\_lower}_k| \le
    e^{-\ell_{k-1}} \sum |p|` (the losses decrease) and :math:`2 e^{709} < \mathrm{DBL\_MAX}`
    (:math:`\sum |p| \le 2`). Reaching it, the loop has passed a negative loss :math:`\ell_j` without breaking, so
    :math:`\delta(\ell_j) \le \delta` (or ``mass_upper`` :math:`\le \delta`), hence
    :math:`\delta(0) \le \delta` and ε = 0 is exact; that is returned (what the loop returns
    once ``mass_upper <= mass_lower + delta``). Those entries never decide a break:
    ``log((mass_upper - delta) / inf)`` is ``-inf``, a NaN is not a candidate."""

    def __init__(self, pmf: pld_pmf.DensePLDPmf):
        # pylint: disable=protected-access
        self.infinity_mass = pmf._infinity_mass
        probs = np.flip(np.asarray(pmf._probs, dtype=np.float64))
        n = self.n = len(probs)
        upper_loss = (pmf._lower_loss + len(pmf._probs) - 1) * pmf._discretization
        losses = self.losses = np.full(n, -pmf._discretization)
        losses[0] = upper_loss
        np.cumsum(losses, out=losses)
        if _numpy_exp_is_math_exp():
            with np.errstate(over="ignore"):
                exps = np.exp(-losses)
        else:
            exps = _libm_exp(-losses)
        # upper[k], lower[k]: the loop's mass_upper, mass_lower before it looks at losses[k]
        upper = self.upper = np.empty(n + 1)
        upper[0] = self.infinity_mass
        upper[1:] = probs
        np.cumsum(upper, out=upper)
        lower = self.lower = np.empty(n + 1)
        lower[0] = 0.0
        with np.errstate(over="ignore", invalid="ignore"):
            np.multiply(exps, probs, out=lower[1:])
            lower[1:][probs == 0] = 0.0  # exp(-loss) * 0: 0, also where exp(-loss) is inf
            np.cumsum(lower, out=lower)
        self.positive = lower[:n] > 0
        self.zero_after = np.flatnonzero(lower[1:] == 0)  # k with mass_lower == 0 after k

    def _stop(self, delta: float) -> int:
        """The first k at which the loop breaks (n if it never does), scanning from the first
        candidate in blocks that double in size."""
        n, upper, lower, losses = self.n, self.upper, self.lower, self.losses
        candidate = (upper[:n] > delta) & self.positive
        start = int(np.argmax(candidate)) if candidate.any() else n
        block = 4096
        while start < n:
            end = min(n, start + block)
            idx = start + np.flatnonzero(candidate[start:end])
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                ratios = (upper[idx] - delta) / lower[idx]
                logs = np.log(ratios)
            near = np.flatnonzero(np.abs(logs - losses[idx])
                                  <= 1e-12 * np.maximum(1.0, np.abs(losses[idx])))
            if len(near):
                logs[near] = [math.log(r) for r in ratios[near].tolist()]
            hits = idx[logs >= losses[idx]]
            if len(hits):
                return int(hits[0])
            start, block = end, 2 * block
        return n

    def __call__(self, delta: float) -> float:
        if self.infinity_mass > delta:
            return math.inf
        upper, lower, losses = self.upper, self.lower, self.losses
        stop = self._stop(delta)
        # return max(0, loss) as soon as mass_upper >= delta with mass_lower == 0 (after adding)
        zero = self.zero_after[self.zero_after < stop]
        early = zero[upper[zero + 1] >= delta]
        if len(early):
            return max(0, float(losses[early[0]]))
        mass_upper, mass_lower = upper[stop], lower[stop]
        if not math.isfinite(mass_lower):  # past a loss below -709: ε = 0 (class docstring)
            return 0
        if mass_upper <= mass_lower + delta:
            return 0
        with np.errstate(divide="ignore"):
            return math.log((mass_upper - delta) / mass_lower)


def _reader(pmf: pld_pmf.PLDPmf) -> Callable[[float], float]:
    if type(pmf) is not pld_pmf.DensePLDPmf or len(pmf._probs) == 0:  # pylint: disable=protected-access
        return pmf.get_epsilon_for_delta
    return _DenseEpsilon(pmf)


def epsilon_for_delta_pmf(pmf: pld_pmf.PLDPmf, delta: float) -> float:
    """``pmf.get_epsilon_for_delta(delta)`` (a dense PMF's without the Python loop:
    :class:`_DenseEpsilon`; a sparse PMF's is dp_accounting's)."""
    return _reader(pmf)(delta)


def epsilon_reader(pld: PrivacyLossDistribution) -> Callable[[float], float]:
    """``delta -> pld.get_epsilon_for_delta(delta)`` (the larger ε of the two directions), the
    δ-independent work done once, for reading ε at several δ."""
    readers = [_reader(pmf) for pmf in _directions(pld)]
    if len(readers) == 1:
        return readers[0]
    remove, add = readers
    return lambda delta: max(remove(delta), add(delta))


def epsilon_for_delta(pld: PrivacyLossDistribution, delta: float) -> float:
    """``pld.get_epsilon_for_delta(delta)``: the larger ε of the two directions."""
    return epsilon_reader(pld)(delta)


def connect_dots_fixed_gap(discretization: float, rounded_epsilon_lower: int,
                           rounded_epsilon_upper: int, deltas) -> pld_pmf.PLDPmf:
    """``pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap`` without the dictionary round
    trip of ``create_pmf`` for a dense result (above ``_MAX_PMF_SPARSE_SIZE`` points)."""
    deltas = np.asarray(deltas, dtype=np.float64)
    size = rounded_epsilon_upper - rounded_epsilon_lower + 1
    if (size <= pld_pmf._MAX_PMF_SPARSE_SIZE  # pylint: disable=protected-access
            or deltas.size != size or np.any(deltas < 0) or np.any(deltas > 1)
            or np.any(np.diff(deltas) > pld_pmf._DELTA_DIFF_TOLERANCE)):  # pylint: disable=protected-access
        return pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(
            discretization, rounded_epsilon_lower, rounded_epsilon_upper, deltas)
    deltas = np.minimum.accumulate(deltas)
    delta_diffs = np.diff(deltas)
    probs = np.zeros_like(deltas)
    probs[0] = 1 - deltas[0] + delta_diffs[0] / math.expm1(discretization)
    probs[1:-1] = ((delta_diffs[1:] - delta_diffs[:-1] * math.exp(discretization))
                   / math.expm1(discretization))
    probs[-1] = delta_diffs[-1] / math.expm1(-discretization)
    probs = np.maximum(0.0, probs)
    # create_pmf: the dictionary keyed by range(lower, upper + 1) lists back to the same array
    return pld_pmf.DensePLDPmf(discretization, int(rounded_epsilon_lower), probs, deltas[-1],
                               True)
