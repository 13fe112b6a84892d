r"""The numerical error of a composed PLD, and when its ε(δ) is certified.

A pessimistic PLD (:mod:`.pld`) upper-bounds the privacy loss *in exact arithmetic*. Composing
it in floating point adds errors of three kinds; this module tracks each one and decides
whether the ε(δ) read off the composed PLD is still a guarantee.

**Truncated tail mass** (sound). dp_accounting drops at most ``tail_mass_truncation`` per
composition outside the Chernoff window and puts the right part at infinity; the per-step grid of
:func:`~.pld.pld_from_profile` stops where δ ≤ 1e-18 and puts the rest at infinity. Both are
*pessimistic*: they add to the composed PLD's **infinity mass**, which
:math:`\delta(\varepsilon)` counts in full. They make ε larger (``inf`` once the infinity mass
exceeds δ), never smaller. The certificate reports them (``infinity_mass``, ``truncated_mass``).

**FFT round-off** (not sound by itself). ``self_compose(T)`` computes
:math:`\mathrm{IFFT}(\mathrm{FFT}(p)^T)`: a relative error :math:`u` (unit round-off,
:math:`2^{-53}`) in a Fourier coefficient :math:`\hat p_k` becomes :math:`T u` in
:math:`\hat p_k^{\,T}` (and the forward/inverse transforms add :math:`u \log_2 N`). Back in loss
space the composed PMF carries an error of :math:`L^1` norm about

.. math::

    e_{\mathrm{FFT}} \approx u\,(T + \log_2 N)\,\textstyle\sum_k |\hat Z_k|, \qquad
    \hat Z = \mathrm{FFT}(\text{composed PMF}),

of either sign (negative "probabilities" in the tails are its visible part). A heterogeneous
``compose`` (one ``fftconvolve``) adds the same term with :math:`T = 1`, and errors already in
the inputs carry over (``T``-fold for a self-composition, additively for a composition).
:func:`fft_roundoff` returns :data:`ROUNDOFF_SAFETY` times this first-order estimate; measured
against an exact reference (binary powering by *direct* convolution of non-negative arrays,
whose error is relative, ``tests/test_certified_numerics.py``) the true :math:`L^1` error was
0.17–0.67 of the estimate over :math:`T \in [10^2, 10^6]`, grids 1e-3 and 1e-4, rates 1e-4 to
0.5. The hockey-stick weights :math:`(1 - e^{\varepsilon - \ell})_+` lie in :math:`[0, 1]`, so
:math:`|\delta_{\text{computed}}(\varepsilon) - \delta_{\text{exact}}(\varepsilon)| \le e` for
every ε: the **round-off floor**.

**Decision rule** (:func:`certify`). The PLD route is certified at δ iff
:math:`\delta \ge` :data:`CERTIFY_FACTOR` :math:`\times e`; it then returns ε at
:math:`\delta - e` (and :func:`~.pld.delta_for_epsilon` returns :math:`\delta + e`), which
covers the round-off. Below that, ε would be round-off (at 1e6 steps and δ = 1e-12 the
uncorrected value moved between 0.86 and ∞ with the grid), so :func:`certify` raises
:class:`NumericalPrecisionError`; the scheme then moves to a route certified there (Rényi DP for
Poisson subsampling, :meth:`~opacus_structured.schemes.base.Scheme.certified_alternatives`) and
labels it, or the error reaches the user naming δ, the floor and the fixes. Where both routes
are certified the smaller ε is returned (:func:`~opacus_structured.schemes.base.best_route`).
:func:`check_a_priori` applies the same rule *before* composing, with the smallest spectral sum a
composed PMF has (:data:`MIN_SPECTRAL_SUM`), so hopeless requests do not pay for a composition.

Monotonicity: on one route ε(δ) is non-increasing in δ (a PLD's hockey-stick curve is, and the
shift by the constant ``e`` keeps it so); the set of certified routes only grows with δ; so the
minimum over the routes certified at δ is non-increasing in δ. Across grids: the RDP route does
not depend on the grid, and each grid's PLD value is an upper bound certified up to its own
round-off correction, so no grid can return less than the true ε.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .resource_guard import _dense_probs as _dense

__all__ = [
    "UNIT_ROUNDOFF",
    "ROUNDOFF_SAFETY",
    "CERTIFY_FACTOR",
    "MIN_SPECTRAL_SUM",
    "NumericalPrecisionError",
    "PLDNumerics",
    "numerics_of",
    "fft_roundoff",
    "after_self_compose",
    "roundoff_bounds",
    "after_compose",
    "a_priori_roundoff",
    "check_a_priori",
    "Certificate",
    "certify",
]

#: Unit round-off of float64 (``2**-53``).
UNIT_ROUNDOFF = float(np.finfo(np.float64).eps) / 2
#: Multiplier on the first-order FFT round-off estimate (measured ratios true/estimate ≤ 0.67).
ROUNDOFF_SAFETY = 2.0
#: The PLD route is certified at δ only when δ ≥ CERTIFY_FACTOR × round-off floor.
CERTIFY_FACTOR = 10.0
#: Lower estimate of :math:`\sum_k |\hat Z_k|` for a composed PMF: its grid spans the Chernoff
#: window (about ±8 standard deviations at tail mass 1e-15), where a bell-shaped PMF has
#: :math:`\sum_k |\hat Z_k| \approx N / (2.5\,\sigma_{\text{grid}}) \approx 6`; measured 6.6–22.
MIN_SPECTRAL_SUM = 4.0

_ATTR = "_opacus_structured_numerics"


class NumericalPrecisionError(ValueError):
    """δ is within :data:`CERTIFY_FACTOR` of the PLD route's round-off floor: ε(δ) from the
    composed PLD would not be a certified upper bound (raised instead of returning it)."""

    def __init__(self, message: str, *, delta: float, floor: float, compositions: int):
        super().__init__(message)
        self.delta = float(delta)
        self.floor = float(floor)
        self.compositions = int(compositions)


@dataclasses.dataclass(frozen=True)
class PLDNumerics:
    """Numerical history of a PLD built by :mod:`.pld`.

    ``roundoff``: bound on the :math:`L^1` round-off error of its finite part (worst
    direction); ``compositions``: FFT multiplications behind it (``T`` of a self-composition,
    summed over parts); ``truncated_mass``: tail mass the compositions were allowed to move to
    infinity (pessimistic, already in the infinity mass).
    """

    roundoff: float = 0.0
    compositions: int = 0
    truncated_mass: float = 0.0


def numerics_of(pld) -> PLDNumerics:
    """The recorded numerics of ``pld`` (zero for a PLD :mod:`.pld` did not compose: a single
    step built by connect-the-dots has no FFT round-off)."""
    return getattr(pld, _ATTR, None) or PLDNumerics()


def _attach(pld, record: PLDNumerics):
    setattr(pld, _ATTR, record)
    return pld


def _directions(pld) -> list:
    pmfs = [pld._pmf_remove]  # pylint: disable=protected-access
    if not getattr(pld, "_symmetric", False):
        pmfs.append(pld._pmf_add)  # pylint: disable=protected-access
    return pmfs


def fft_roundoff(probs, multiplications: int) -> float:
    r""":data:`ROUNDOFF_SAFETY` :math:`\cdot\, u\,(T + \log_2 N) \sum_k |\hat Z_k|` for a PMF
    ``probs`` (:math:`N` points) produced by FFT with ``multiplications`` = :math:`T`
    (module docstring); also at least twice its negative mass (visible round-off)."""
    p = np.asarray(probs, dtype=np.float64)
    n = len(p)
    if n <= 1 or multiplications <= 0:
        return 0.0
    spectral = float(np.abs(np.fft.rfft(p)).sum() * 2 - abs(p.sum()))  # Σ_k |Ẑ_k| (real p)
    model = ROUNDOFF_SAFETY * UNIT_ROUNDOFF * (multiplications + math.log2(n)) * spectral
    negative = float(-p[p < 0].sum())
    return max(model, 2.0 * negative)


def _worst(pld, multiplications: int) -> float:
    return max(fft_roundoff(_dense(pmf), multiplications) for pmf in _directions(pld))


def _spectral_bounds(p: np.ndarray) -> tuple[float, float]:
    r"""Bounds on the spectral sum :func:`fft_roundoff` computes, without the FFT: at least
    :math:`|\hat Z_0| = |\sum_k p_k|` (every other term is non-negative), at most
    :math:`2\sqrt{(N/2 + 1)\,N \sum_k p_k^2}` (Cauchy-Schwarz over the rfft's :math:`N/2 + 1`
    terms, Parseval :math:`\sum_k |\hat Z_k|^2 = N \sum_k p_k^2`); both widened by 1e-6 of
    :math:`\sum_k |p_k|` for the FFT's own round-off."""
    n = len(p)
    slack = 1e-6 * float(np.abs(p).sum())
    lo = max(0.0, abs(float(p.sum())) - slack)
    hi = 2.0 * math.sqrt((n // 2 + 1) * n * float(np.dot(p, p))) * (1 + 1e-6) + slack
    return lo, hi


def roundoff_bounds(composed, base, count: int) -> tuple[float, float]:
    """``(lo, hi)`` with ``lo <= roundoff <= hi`` for the ``roundoff`` that
    :func:`after_self_compose` would record on ``composed = base.self_compose(count)``, without
    its FFTs (the spectral sum bounded by :func:`_spectral_bounds`, the rest as there). For
    deciding whether ε(δ − roundoff) clears a threshold before paying for the FFTs."""
    lo_worst, hi_worst = 0.0, 0.0
    for pmf in _directions(composed):
        p = np.asarray(_dense(pmf), dtype=np.float64)
        n = len(p)
        if n <= 1 or count <= 0:
            continue
        negative = 2.0 * float(-p[p < 0].sum())
        scale = ROUNDOFF_SAFETY * UNIT_ROUNDOFF * (count + math.log2(n))
        spec_lo, spec_hi = _spectral_bounds(p)
        lo_worst = max(lo_worst, max(scale * spec_lo, negative))
        hi_worst = max(hi_worst, max(scale * spec_hi, negative))
    b = numerics_of(base)
    return count * b.roundoff + lo_worst, count * b.roundoff + hi_worst


def after_self_compose(composed, base, count: int, tail_mass_truncation: float):
    """Record the numerics of ``composed = base.self_compose(count)`` on ``composed``."""
    b = numerics_of(base)
    rec = PLDNumerics(
        roundoff=count * b.roundoff + _worst(composed, count),
        compositions=count * max(b.compositions, 1),
        truncated_mass=count * b.truncated_mass + tail_mass_truncation)
    return _attach(composed, rec)


def after_compose(result, a, b, tail_mass_truncation: float):
    """Record the numerics of ``result = a.compose(b)`` on ``result``."""
    na, nb = numerics_of(a), numerics_of(b)
    rec = PLDNumerics(
        roundoff=na.roundoff + nb.roundoff + _worst(result, 1),
        compositions=max(na.compositions, 1) + max(nb.compositions, 1),
        truncated_mass=na.truncated_mass + nb.truncated_mass + tail_mass_truncation)
    return _attach(result, rec)


def a_priori_roundoff(compositions: int) -> float:
    """The smallest round-off floor a ``compositions``-fold FFT composition can have
    (:data:`MIN_SPECTRAL_SUM`; known before composing)."""
    return ROUNDOFF_SAFETY * UNIT_ROUNDOFF * max(int(compositions), 0) * MIN_SPECTRAL_SUM


def _refusal(delta: float, floor: float, compositions: int, what: str) -> NumericalPrecisionError:
    need = CERTIFY_FACTOR * floor
    return NumericalPrecisionError(
        f"delta={delta:g} is below the numerical precision of the PLD route: after "
        f"{compositions:,} compositions its FFT round-off is about {floor:.2g} in delta "
        f"({what}), and a certified epsilon needs delta >= {CERTIFY_FACTOR:g} x that = "
        f"{need:.2g}. Use delta >= {need:.2g}, fewer steps, or a scheme with a Renyi-DP route "
        f"(Poisson subsampling); a finer or coarser --discretization does not lower this floor",
        delta=delta, floor=floor, compositions=compositions)


def check_a_priori(compositions: int, delta: float) -> None:
    """Raise :class:`NumericalPrecisionError` when even the smallest possible round-off floor
    of a ``compositions``-fold composition (:func:`a_priori_roundoff`) rules δ out."""
    floor = a_priori_roundoff(compositions)
    if delta < CERTIFY_FACTOR * floor:
        raise _refusal(delta, floor, compositions, "lower estimate, before composing")


@dataclasses.dataclass(frozen=True)
class Certificate:
    """Numerical error budget of a PLD's ε(δ) (all in units of δ).

    ``roundoff``: :math:`L^1` bound of the FFT round-off (subtracted from δ before reading ε);
    ``infinity_mass``: composed infinity mass (worst direction; pessimistic, counted in δ;
    includes genuine infinite losses and truncations); ``truncated_mass``: the part the
    compositions' tail truncation may have moved there; ``compositions``; ``factor``:
    :data:`CERTIFY_FACTOR`.
    """

    roundoff: float
    infinity_mass: float
    truncated_mass: float
    compositions: int
    factor: float = CERTIFY_FACTOR

    @property
    def min_delta(self) -> float:
        """Smallest δ at which the PLD route is certified."""
        return self.factor * self.roundoff

    def record(self) -> dict:
        return {"numerical_roundoff": self.roundoff, "infinity_mass": self.infinity_mass,
                "truncated_mass": self.truncated_mass, "compositions": self.compositions,
                "certified_min_delta": self.min_delta}


def certify(pld, delta: float) -> Certificate:
    """The :class:`Certificate` of ``pld`` at ``delta``; raises :class:`NumericalPrecisionError`
    when ``delta < CERTIFY_FACTOR × roundoff`` (see the module docstring)."""
    rec = numerics_of(pld)
    inf_mass = max(float(pmf._infinity_mass) for pmf in _directions(pld))  # pylint: disable=protected-access
    cert = Certificate(rec.roundoff, inf_mass, rec.truncated_mass, rec.compositions)
    if delta < cert.min_delta:
        raise _refusal(delta, rec.roundoff, rec.compositions, "estimated from the composed PMF")
    return cert
