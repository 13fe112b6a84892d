r"""What a training run's accountant has priced, as the per-order RDP curve a dataset budget
charges (:mod:`opacus_structured.dataset_budget`).

A :class:`~opacus_structured.dataset_budget.DatasetBudget` composes releases with a Rényi
filter, so each run must be described by an RDP curve that **upper-bounds** what its
accountant prices. :func:`accountant_rdp` derives it from the accountant's own record — its
history of ``(σ, q, steps)`` chunked into accounting units exactly as
:meth:`SchemeAccountant._composed <opacus_structured.accountants.base.SchemeAccountant>` does
(a multi-step unit at its smallest σ), and the unamplified Gaussian parts of observed releases
(:mod:`~opacus_structured.accountants.observed_release`) — with one curve per unit:

* **Poisson-subsampled Gaussian** (``PoissonScheme``): the exact RDP of the step,
  dp_accounting's ``RdpAccountant`` (:func:`~opacus_structured.accounting.renyi_filter.
  poisson_gaussian_rdp`); no tail;
* **μ-GDP accountants** (``gdp-full-batch``, ``shuffle``: they price with ``mu()``): the
  Gaussian curve :math:`\alpha\mu^2/2`, exact; no tail;
* **a scheme with a whole-run Rényi accountant** (random allocation, balls-in-bins through
  it): its bound of both directions, carried to the filter's orders by monotonicity in the
  order (:func:`~opacus_structured.accounting.renyi_filter.rdp_at_orders`); no tail;
* **every other scheme**: the RDP of the finite part of the unit's pessimistic PLD and its tail
  mass (:func:`~opacus_structured.accounting.renyi_filter.pld_rdp`; why it is an upper bound:
  :mod:`~opacus_structured.accounting.private_selection`). Truncated Poisson's ``baseline``
  analysis has no PLD; the same mechanism is priced by its tight analysis. Where the PLD is
  not that of a pair of distributions (structured subsampling's two-sided Theorems E.8 and
  F.2), the unit's own pair's Rényi divergence, as private selection prices it (the switching
  or Gaussian-mixture pair: :func:`_pair_route`);
* an unamplified Gaussian part at multiplier σ: :math:`\alpha/(2\sigma^2)` per part;
* the earlier phases of a run resumed under another scheme
  (:mod:`~opacus_structured.accountants.phases`): each by the accountant of its own scheme,
  added (:func:`phases_rdp`).

A Monte Carlo estimate (``bminsep-mc``), a lower bound, or an accountant that is not one of
the package's scheme accountants raises ``ValueError``: nothing is charged that is not a
guarantee. Per-unit curves are cached per ``(scheme, σ, q, discretization, orders)``, so a
guard that asks at every reservation pays for each setting once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence

import numpy as np

from ..accounting import mixture_renyi as mr
from ..accounting import renyi_filter as rf
from ..accounting import switching_renyi as sw
from ..accounting.bounds import BoundKind
from ..schemes.poisson import PoissonScheme

__all__ = ["accountant_rdp", "phases_rdp", "unit_rdp", "run_units", "curve_route"]


def _guarantee_scheme(scheme):
    """The scheme to price (truncated Poisson's baseline analysis -> its tight analysis, the
    same mechanism); raises for a scheme whose ε is not a guarantee."""
    bound = getattr(scheme, "bound", None)
    if bound not in (BoundKind.UPPER, BoundKind.TIGHT):
        kind = getattr(bound, "value", bound)
        raise ValueError(f"scheme {scheme.name!r} reports a {kind} epsilon, not a guarantee: a "
                         f"dataset budget charges only guarantees (certify the noise "
                         f"multiplier and use a scheme with an upper bound)")
    if getattr(scheme, "analysis", "tight") != "tight":
        scheme = dataclasses.replace(scheme, analysis="tight")
    return scheme


def _renyi_source(scheme):
    """The scheme whose whole-run Rényi accountant prices ``scheme`` (balls-in-bins: its random
    allocation), or ``None`` when it has none."""
    source = scheme.renyi_scheme() if hasattr(scheme, "renyi_scheme") else scheme
    return source if callable(getattr(source, "renyi", None)) else None


def _renyi_route(scheme, sigma: float, orders: tuple) -> Optional[np.ndarray]:
    """The scheme's own whole-run Rényi bound at ``orders`` (``None`` when it has none)."""
    source = _renyi_source(scheme)
    if source is None:
        return None
    bound = source.renyi(sigma)
    keep = np.asarray(bound.orders, dtype=np.float64) > 1
    return rf.rdp_at_orders(np.asarray(bound.orders)[keep], np.asarray(bound.rdp)[keep], orders)


@functools.lru_cache(maxsize=256)
def _cached_unit(scheme, sigma: float, rate: Optional[float], discretization: float,
                 orders: tuple) -> tuple[np.ndarray, float]:
    return _unit(scheme, sigma, rate, discretization, orders)


def _unit(scheme, sigma, rate, discretization, orders) -> tuple[np.ndarray, float]:
    if type(scheme) is PoissonScheme:
        q = scheme.sample_rate if scheme.sample_rate is not None else rate
        if q is None:
            raise ValueError("a rate-less PoissonScheme needs the step's sample rate")
        return np.array(rf.poisson_gaussian_rdp(q, sigma, orders)), 0.0
    renyi = _renyi_route(scheme, sigma, orders)
    if renyi is not None:
        return renyi, 0.0
    pld = scheme.pld(sigma, sample_rate=rate, discretization=discretization)
    try:
        return rf.pld_rdp(pld, orders)
    except ValueError:  # the PLD is no pair of distributions' (Theorems E.8, F.2)
        pair = _pair_route(scheme, sigma, rate, orders)
        if pair is None:
            raise
        return pair


def _pair_route(scheme, sigma, rate, orders) -> Optional[tuple[np.ndarray, float]]:
    """``(curve, 0)``: the Rényi divergence of the unit's own pair, as private selection
    prices it (:mod:`~opacus_structured.tuning.pricing`): the switching pair's
    (:func:`~opacus_structured.accounting.switching_renyi.switching_rdp`) or the two-sided
    Gaussian-mixture pair's, untruncated (:func:`~opacus_structured.accounting.
    mixture_renyi.profile_worlds`); ``None`` for a scheme without such a profile."""
    if not callable(getattr(scheme, "profile", None)):
        return None
    scheme.check_sample_rate(rate)
    profile = scheme.profile(sigma)
    grid = np.asarray(orders, dtype=np.float64)
    equivalent = sw.equivalent_subsampled_gaussian(profile)
    if equivalent is not None:
        return np.asarray(sw.switching_rdp(grid, *equivalent), dtype=np.float64), 0.0
    worlds = mr.profile_worlds(profile, grid, (0.0,))
    if worlds is None:
        return None
    curve, tail = worlds[0]
    return np.asarray(curve, dtype=np.float64), float(tail)


def unit_rdp(scheme, noise_multiplier: float, sample_rate: Optional[float],
             orders: Sequence[float], *, discretization: float) -> tuple[np.ndarray, float]:
    """``(curve, tail_mass)`` of one accounting unit of ``scheme`` at σ (and the hook's rate)."""
    scheme = _guarantee_scheme(scheme)
    orders = tuple(float(o) for o in orders)
    args = (float(noise_multiplier), None if sample_rate is None else float(sample_rate),
            float(discretization), orders)
    try:
        curve, tail = _cached_unit(scheme, *args)
    except TypeError:  # an unhashable scheme: priced every time
        curve, tail = _unit(scheme, *args)
    return curve.copy(), tail


def run_units(scheme, history) -> list[tuple[float, Optional[float], int]]:
    """``[(σ, q, units)]``: the accounting units an accountant prices for ``history``
    (per-step schemes: one unit per step; otherwise chunks of ``steps_per_unit`` steps, each
    at its smallest σ and its first step's rate — post-processing of more noise never
    under-reports)."""
    entries = [(float(s), None if q is None else float(q), int(n)) for s, q, n in history
               if int(n)]
    if scheme.unit == "step":
        return entries
    total = sum(n for _, _, n in entries)
    scheme.compositions(total)  # validates the run length (a planned run is not exceeded)
    per_unit = scheme.steps_per_unit()
    sigmas = np.repeat([s for s, _, _ in entries], [n for _, _, n in entries])
    rates = [q for _, q, n in entries for _ in range(n)]
    starts = np.arange(0, total, per_unit)
    lows = np.minimum.reduceat(sigmas, starts) if total else []
    counts: dict = {}
    for start, low in zip(starts, lows, strict=True):
        key = (float(low), rates[int(start)])
        counts[key] = counts.get(key, 0) + 1
    return [(s, q, n) for (s, q), n in counts.items()]


def phases_rdp(accountant, orders: Sequence[float]) -> tuple[np.ndarray, float]:
    """``(curve, tail_mass)`` of the earlier phases of a run resumed under another scheme
    (:mod:`~opacus_structured.accountants.phases`): each phase priced by the accountant of its
    own scheme, their curves added (sequential composition). Zeros without phases."""
    curve, tail = np.zeros(len(orders)), 0.0
    for phase in getattr(accountant, "phases", None) or []:
        c, t = accountant_rdp(accountant._phase_accountant(phase), orders)  # noqa: SLF001
        curve, tail = curve + c, tail + t
    return curve, tail


def accountant_rdp(accountant, orders: Sequence[float], *, history=None,
                   discretization: Optional[float] = None) -> tuple[np.ndarray, float]:
    """``(curve, tail_mass)`` upper-bounding what ``accountant`` prices (module docstring),
    for its ``history`` or the ``history`` given (a projection: the steps recorded plus the
    steps about to be released). Raises ``ValueError`` for what cannot be charged."""
    orders = tuple(float(o) for o in orders)
    arr = np.asarray(orders)
    scheme = getattr(accountant, "scheme", None)
    if scheme is None or not hasattr(accountant, "history"):
        raise ValueError(f"a dataset budget charges runs priced by opacus_structured's scheme "
                         f"accountants; {type(accountant).__name__} is not one (or is "
                         f"unbound)")
    scheme = _guarantee_scheme(scheme)
    history = list(accountant.history if history is None else history)
    if any(float(s) == 0.0 for s, _, n in history if int(n)):
        return np.full(len(orders), np.inf), 0.0  # a step without noise: no bound
    curve, tail = phases_rdp(accountant, orders)
    for sigma, n in (getattr(accountant, "unamplified", None) or {}).items():
        curve = curve + int(n) * rf.gaussian_rdp(sigma, arr)
    mu_of = getattr(accountant, "mu", None)
    if callable(mu_of):  # μ-GDP accountants price with mu() of their history
        saved = accountant.history
        accountant.history = history
        try:
            mu = float(mu_of())
        finally:
            accountant.history = saved
        if not math.isfinite(mu):
            return np.full(len(orders), np.inf), 0.0
        return curve + arr * mu * mu / 2.0, tail
    d = float(discretization if discretization is not None
              else getattr(accountant, "discretization", 1e-4))
    for sigma, rate, units in run_units(scheme, history):
        unit, unit_tail = unit_rdp(scheme, sigma, rate, orders, discretization=d)
        curve = curve + units * unit
        tail += units * unit_tail
    return curve, tail


def curve_route(accountant) -> str:
    """Which curve :func:`accountant_rdp` charges for ``accountant`` (recorded in the file)."""
    scheme = getattr(accountant, "scheme", None)
    if callable(getattr(accountant, "mu", None)):
        return "mu-GDP: alpha mu^2 / 2 (exact)"
    if type(scheme) is PoissonScheme:
        return "Poisson-subsampled Gaussian: dp_accounting RDP (exact)"
    if _renyi_source(scheme) is not None:
        return "the scheme's Renyi accountant"
    return "RDP of the pessimistic PLD's finite part, tail mass charged"
