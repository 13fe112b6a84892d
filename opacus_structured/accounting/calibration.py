r"""Noise calibration: the smallest noise multiplier whose ε stays within a target.

:func:`calibrate_noise_multiplier` first checks that the target is reachable at all (one
evaluation at the largest σ searched, ``max_sigma``: fails at once with :class:`CalibrationError`
otherwise), then brackets the target by doubling/halving σ and bisects on
σ (ε is non-increasing in σ for every scheme here). It returns the *upper* end of the final
bracket, so ``epsilon(result) <= target_epsilon`` always holds: calibration never
under-reports. :func:`calibrate_within_tolerance` bisects until ε itself is within a relative
tolerance *below* the target (what ``opacus_structured.make_private_with_epsilon`` promises).
:func:`hinted_noise_multiplier` checks a remembered answer of :func:`calibrate_noise_multiplier`
in two evaluations instead of a whole search.
"""

from __future__ import annotations

import math
from typing import Callable

from .._validation import check_open_unit, check_positive

__all__ = ["calibrate_noise_multiplier", "calibrate_within_tolerance", "CalibrationError",
           "hinted_noise_multiplier"]

MAX_NOISE_MULTIPLIER = 1e4
MIN_NOISE_MULTIPLIER = 1e-3


class CalibrationError(ValueError):
    """The target cannot be met inside the searched range of noise multipliers."""


def _checked(epsilon_of_sigma: Callable[[float], float],
             progress: Callable[[float, float], None] | None) -> Callable[[float], float]:
    """``epsilon_of_sigma`` that refuses NaN, reports each evaluation to ``progress`` and
    remembers its values (a search asks for the same σ again at the bracket's low end)."""
    seen: dict[float, float] = {}

    def ev(sigma: float) -> float:
        if sigma in seen:
            return seen[sigma]
        eps = float(epsilon_of_sigma(sigma))
        if math.isnan(eps):
            raise FloatingPointError(f"epsilon is NaN at noise_multiplier={sigma}")
        if progress is not None:
            progress(sigma, eps)
        seen[sigma] = eps
        return eps
    return ev


def _reachable(ev: Callable[[float], float], target_epsilon: float, max_sigma: float) -> float:
    """ε(σ_max), after checking it meets the target. ε is non-increasing in σ, so if the largest
    σ searched misses the target no bracket exists; a large σ has a narrow PLD, so this costs
    one cheap evaluation and an unreachable target fails at once."""
    eps_max = ev(max_sigma)
    if eps_max > target_epsilon:
        raise CalibrationError(
            f"target_epsilon={target_epsilon} is out of reach: even noise_multiplier="
            f"{max_sigma:g} gives epsilon={eps_max:.4g}; raise the budget or take fewer steps")
    return eps_max


def _bracket_from_above(ev: Callable[[float], float], target_epsilon: float, initial: float,
                        max_sigma: float) -> tuple[float, float]:
    """``(σ, ε(σ))`` with ``ε(σ) ≤ target``, doubling σ from ``initial`` (``CalibrationError``
    past ``max_sigma``)."""
    hi = check_positive("initial", initial)
    if hi < max_sigma:
        _reachable(ev, target_epsilon, max_sigma)
    eps_hi = ev(hi)
    while eps_hi > target_epsilon:
        if hi >= max_sigma:
            raise CalibrationError(
                f"target_epsilon={target_epsilon} needs noise_multiplier > {max_sigma} "
                f"(epsilon={eps_hi:.4g} at {hi:.4g}); raise the budget or take fewer steps")
        hi = min(hi * 2.0, max_sigma)
        eps_hi = ev(hi)
    return hi, eps_hi


#: ``initial="scaled"``: the bracket's step around the first guess
_SCALED_STEP = 1.25


def _scaled_bracket(ev: Callable[[float], float], target_epsilon: float, max_sigma: float,
                    min_sigma: float) -> tuple[float, float] | None:
    """``(lo, hi)`` with ``ε(lo) > target ≥ ε(hi)`` found from the guess σ_max·ε(σ_max)/target
    (ε ∝ 1/σ, as for large σ) in steps of :data:`_SCALED_STEP`; ``None`` when ε(σ_max) = 0
    gives no guess. Large σ have narrow PLDs, so this skips the costly small-σ evaluations of
    doubling from σ = 1. Raises :class:`CalibrationError` when σ_max misses the target."""
    eps_max = _reachable(ev, target_epsilon, max_sigma)
    if not eps_max > 0:
        return None
    guess = min(max(max_sigma * eps_max / target_epsilon, min_sigma), max_sigma)
    if ev(guess) <= target_epsilon:
        hi, lo = guess, max(guess / _SCALED_STEP, min_sigma)
        while ev(lo) <= target_epsilon:
            if lo <= min_sigma:
                return lo, lo
            hi, lo = lo, max(lo / _SCALED_STEP, min_sigma)
        return lo, hi
    lo, hi = guess, min(guess * _SCALED_STEP, max_sigma)
    while ev(hi) > target_epsilon:  # ends: ε(σ_max) <= target
        lo, hi = hi, min(hi * _SCALED_STEP, max_sigma)
    return lo, hi


def calibrate_noise_multiplier(epsilon_of_sigma: Callable[[float], float], target_epsilon: float,
                               *, rtol: float = 1e-3, initial: float | str = 1.0,
                               max_sigma: float = MAX_NOISE_MULTIPLIER,
                               min_sigma: float = MIN_NOISE_MULTIPLIER,
                               progress: Callable[[float, float], None] | None = None) -> float:
    """Smallest σ (to relative tolerance ``rtol``) with ``epsilon_of_sigma(σ) <= target_epsilon``.

    Args:
        epsilon_of_sigma: ε at the target δ as a function of the noise multiplier.
        target_epsilon: the privacy budget, > 0.
        rtol: relative width of the final bracket on σ.
        initial: where the bracket search starts: a σ (doubling / halving from it), or
            ``"scaled"``: from σ_max·ε(σ_max)/target in steps of 1.25 (fewer and cheaper
            evaluations when ε falls about as 1/σ; the same contract either way).
        progress: optional callback ``(sigma, epsilon)`` after each evaluation.

    Raises:
        CalibrationError: if even ``max_sigma`` exceeds the target.
    """
    target_epsilon = check_positive("target_epsilon", target_epsilon)
    rtol = check_positive("rtol", rtol)
    check_open_unit("rtol", rtol)

    ev = _checked(epsilon_of_sigma, progress)
    if initial == "scaled":
        found = _scaled_bracket(ev, target_epsilon, max_sigma, min_sigma)
        if found is not None:
            lo, hi = found
            if lo == hi:  # min_sigma itself meets the target
                return hi
            return smallest_passing(lambda sigma: ev(sigma) <= target_epsilon, lo, hi,
                                    lambda lo_, hi_: hi_ - lo_ > rtol * hi_)
        initial = 1.0
    elif isinstance(initial, str):
        raise ValueError(f"initial must be a positive number or 'scaled', got {initial!r}")
    hi, eps_hi = _bracket_from_above(ev, target_epsilon, initial, max_sigma)
    lo = hi / 2.0
    while ev(lo) <= target_epsilon:
        hi = lo
        if lo <= min_sigma:
            return hi
        lo = max(lo / 2.0, min_sigma)
    # Invariant: eps(lo) > target >= eps(hi).
    return smallest_passing(lambda sigma: ev(sigma) <= target_epsilon, lo, hi,
                            lambda lo_, hi_: hi_ - lo_ > rtol * hi_)


def hinted_noise_multiplier(epsilon_of_sigma: Callable[[float], float], target_epsilon: float,
                            hint: float, *, rtol: float = 1e-3) -> float | None:
    r"""``hint`` if it meets the contract of :func:`calibrate_noise_multiplier` (same ``rtol``),
    else ``None``; two evaluations of ``epsilon_of_sigma``.

    The contract: :math:`\varepsilon(\sigma) \le` target, and no σ below
    :math:`\sigma(1 - \text{rtol})` meets the target. With ε non-increasing in σ, the two
    checks :math:`\varepsilon(\text{hint}) \le \text{target} < \varepsilon(\text{hint}\,
    (1 - \text{rtol}))` prove both, so a remembered σ (an earlier run's answer for the same
    scheme, steps, δ and discretization) is as good as a new search, and a stale one (the
    accounting changed since) is refused rather than trusted.
    """
    target_epsilon = check_positive("target_epsilon", target_epsilon)
    hint = check_positive("hint", hint)
    check_open_unit("rtol", check_positive("rtol", rtol))
    ev = _checked(epsilon_of_sigma, None)
    if not ev(hint) <= target_epsilon:
        return None
    if hint * (1 - rtol) >= MIN_NOISE_MULTIPLIER and not ev(hint * (1 - rtol)) > target_epsilon:
        return None
    return hint


def calibrate_within_tolerance(epsilon_of_sigma: Callable[[float], float],
                               target_epsilon: float, *, epsilon_tolerance: float = 0.01,
                               initial: float = 1.0, max_sigma: float = MAX_NOISE_MULTIPLIER,
                               min_sigma: float = MIN_NOISE_MULTIPLIER,
                               sigma_rtol: float = 1e-9,
                               progress: Callable[[float, float], None] | None = None
                               ) -> tuple[float, float]:
    """``(σ, ε(σ))`` with ``(1 − epsilon_tolerance)·target ≤ ε(σ) ≤ target``: never above the
    target, and within ``epsilon_tolerance`` (relative) below it.

    Brackets like :func:`calibrate_noise_multiplier`, then bisects on σ keeping
    ``ε(lo) > target ≥ ε(hi)`` until ``ε(hi)`` is within the tolerance. If ε jumps across the
    whole tolerance band (the bracket shrinks below ``sigma_rtol·σ`` first, or ``min_sigma``
    already meets the target) the σ returned still satisfies ``ε ≤ target``; the caller sees
    the ε it gets.

    Raises:
        CalibrationError: if even ``max_sigma`` exceeds the target.
    """
    target_epsilon = check_positive("target_epsilon", target_epsilon)
    epsilon_tolerance = check_open_unit("epsilon_tolerance", epsilon_tolerance)
    floor = (1.0 - epsilon_tolerance) * target_epsilon

    ev = _checked(epsilon_of_sigma, progress)
    hi, eps_hi = _bracket_from_above(ev, target_epsilon, initial, max_sigma)
    if eps_hi >= floor:
        return hi, eps_hi
    lo = hi / 2.0
    eps_lo = ev(lo)
    while eps_lo <= target_epsilon:
        hi, eps_hi = lo, eps_lo
        if eps_hi >= floor or lo <= min_sigma:
            return hi, eps_hi
        lo = max(lo / 2.0, min_sigma)
        eps_lo = ev(lo)
    # Invariant: eps(lo) > target >= eps(hi) and eps(hi) < floor.
    while eps_hi < floor and hi - lo > sigma_rtol * hi:
        mid = 0.5 * (lo + hi)
        eps_mid = ev(mid)
        if eps_mid <= target_epsilon:
            hi, eps_hi = mid, eps_mid
        else:
            lo = mid
    return hi, eps_hi


def smallest_passing(ok: Callable[[float], bool], lo: float, hi: float,
                     wider: Callable[[float, float], bool]) -> float:
    """Bisection for a monotone ``ok`` (false, then true) with ``ok(lo)`` false and ``ok(hi)``
    true: the upper end of the bracket once ``wider(lo, hi)`` is false (so ``ok`` holds at the
    value returned: rounded to the safe side)."""
    while wider(lo, hi):
        mid = 0.5 * (lo + hi)
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def smallest_passing_int(ok: Callable[[int], bool], lo: int, hi: int) -> int:
    """Smallest integer in ``(lo, hi]`` with ``ok`` true, by bisection, for a monotone ``ok``
    (false up to some point, then true) with ``ok(lo)`` false and ``ok(hi)`` true."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi
