r"""The price of a private selection: :func:`selection_epsilon` and :func:`calibrate_selection`.

One *trial* is one DP training run plus its DP score. It is described by

* a dp_accounting ``DpEvent`` (e.g. ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))`` composed
  ``T`` times and with the score's ``GaussianDpEvent``): priced by dp_accounting's
  ``RdpAccountant`` with ``RepeatAndSelectDpEvent(trial, mean_trials, shape)`` (shape =
  ``eta``, ``inf`` for the Poisson law);
* a :class:`PureDpTrial` (a pure ε-DP trial): the closed form of
  :func:`~opacus_structured.accounting.private_selection.pure_selection_epsilon` for a
  truncated negative binomial, the RDP route with :math:`\min(\varepsilon,
  \lambda\varepsilon^2/2)` for the Poisson law;
* one of our accountants holding the run's history (any scheme), or a :class:`TrialCost`
  (an accountant plus the score's Gaussian releases). Its RDP curve comes from the scheme's
  own pricing: Poisson subsampling (and Opacus' ``RDPAccountant``) as the dp_accounting event
  of its history (an exact RDP curve); μ-GDP accountants (full-batch, shuffle) as the Gaussian
  curve :math:`\lambda\mu^2/2`; random allocation and balls-in-bins also by their whole-run
  Rényi accountant; a scheme whose accounting unit has the *switching* profile of a
  Poisson-subsampled Gaussian (structured subsampling under Theorems 4.2, 4.4 and 4.5/G.1)
  by the Rényi divergence of that dominating pair, computed without a PLD grid
  (:mod:`~opacus_structured.accounting.switching_renyi`: the equivalent event's exact curve
  plus a correction bounded from above); a unit whose profile is that of a two-sided
  Gaussian-mixture pair, possibly behind a top level's perfect-privacy share (Theorems E.1,
  E.8, F.1, F.2: a Poisson bottom level, or several windows per series) by that pair's Rényi
  divergence in both directions, bounded above by x-space quadrature with certified cells
  (:mod:`~opacus_structured.accounting.mixture_renyi`; one route per tail cut, as for the PLD);
  every other scheme from the pessimistic PLD of each accounting unit
  (:func:`~opacus_structured.accounting.private_selection.pld_renyi`, which explains why that
  is an upper bound and how the grid's tail mass is charged to δ).

:func:`selection_epsilon` returns a
:class:`~opacus_structured.accounting.resource_guard.PricedEpsilon` whose ``route`` names what
priced the trial (:data:`ROUTES`).

A scheme with neither an RDP curve nor a dominating pair (a Monte Carlo estimate, a baseline
(ε, δ) analysis) raises ``ValueError`` naming it: no ε is guessed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as _rdp
from opacus.accountants import RDPAccountant

from .._validation import check_open_unit, check_positive
from ..accountants.base import SchemeAccountant
from ..accountants.budget_curves import run_units
from ..accounting import mixture_renyi as mr
from ..accounting import private_selection as ps
from ..accounting import switching_renyi as sw
from ..accounting.bounds import BoundKind
from ..accounting.quiet_rdp import quiet_rdp_orders as _quiet_rdp_orders
from ..accounting.resource_guard import PricedEpsilon
from ..schemes.poisson import PoissonScheme

__all__ = ["TrialCost", "PureDpTrial", "selection_epsilon", "calibrate_selection", "trial_signature",
           "SelectionCalibrationError", "ROUTES"]

#: What can price a trial (:attr:`PricedEpsilon.route` of :func:`selection_epsilon`), with the
#: sentence its ``note`` carries.
ROUTES = {
    "event": "dp_accounting's RdpAccountant with RepeatAndSelectDpEvent (the trial's exact RDP "
             "curve)",
    "pure-dp": "a pure epsilon-DP trial (Papernot & Steinke Thm 2 at lambda -> inf)",
    "gdp": "the Gaussian RDP curve lambda mu^2/2 of a mu-GDP run (exact)",
    "renyi-accountant": "the scheme's whole-run Renyi accountant",
    "switching-pair": "the Renyi divergence of the switching dominating pair of each unit (the "
                      "equivalent Poisson-subsampled Gaussian's exact curve plus the switching "
                      "correction, bounded above), no PLD grid",
    "mixture-pair": "the Renyi divergence of each unit's two-sided Gaussian-mixture dominating "
                    "pair (structured subsampling's Theorems E.1, E.8, F.1, F.2), both "
                    "directions, bounded above by x-space quadrature with certified cell bounds, "
                    "no PLD grid",
    "pld-renyi": "the Renyi divergences of each unit's pessimistic PLD (an upper bound; loose "
                 "at moderate orders, where the grid's tail dominates)",
}


@dataclasses.dataclass(frozen=True)
class TrialCost:
    """A trial priced by one of our accountants plus Gaussian releases made after training
    (the private score): ``score_noise_multipliers`` are their noise multipliers (standard
    deviation / sensitivity), each composed with the run."""

    run: Any
    score_noise_multipliers: tuple = ()

    def __post_init__(self):
        sigmas = tuple(check_positive("score_noise_multiplier", s)
                       for s in self.score_noise_multipliers)
        object.__setattr__(self, "score_noise_multipliers", sigmas)


@dataclasses.dataclass(frozen=True)
class PureDpTrial:
    """A trial that is ε-DP (pure): e.g. a Laplace-noised or exponential-mechanism run."""

    epsilon: float

    def __post_init__(self):
        object.__setattr__(self, "epsilon", check_positive("epsilon", self.epsilon))


def _check_common(mean_trials, eta, delta):
    return (ps.check_mean_trials(mean_trials), ps.check_eta(eta),
            check_open_unit("delta", delta))


# ---- dp_accounting events -------------------------------------------------------------------
def _event_rdp(event, orders) -> np.ndarray:
    acc = _rdp.RdpAccountant(list(orders))
    if not acc.supports(event):
        raise ValueError(f"dp_accounting's RdpAccountant cannot price the trial event "
                         f"{event!r}; describe the trial with an event it supports or with "
                         f"one of our accountants")
    with _quiet_rdp_orders():  # an order whose series fails is left out (stays an upper bound)
        acc.compose(event)
    return np.asarray(acc._rdp, dtype=np.float64)


def _event_selection_epsilon(event, mean_trials, eta, delta, orders) -> float:
    if eta is None or eta >= 0:
        shape = math.inf if eta is None else eta
        acc = _rdp.RdpAccountant(list(orders))
        wrapped = dp_event.RepeatAndSelectDpEvent(event, mean_trials, shape)
        if not acc.supports(wrapped):
            raise ValueError(f"dp_accounting's RdpAccountant cannot price the trial event "
                             f"{event!r}; describe the trial with an event it supports or "
                             f"with one of our accountants")
        with _quiet_rdp_orders():
            return float(acc.compose(wrapped).get_epsilon(delta))
    # eta in (-1, 0): the theorem holds, dp_accounting does not take it; same formula here.
    rdp = ps.repeat_and_select_rdp(orders, _event_rdp(event, orders), mean_trials=mean_trials,
                                   eta=eta)
    return ps.rdp_epsilon(orders, rdp, delta)


def _history_event(history, rate: Optional[float]) -> dp_event.DpEvent:
    parts = [dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(rate if rate is not None else q,
                                       dp_event.GaussianDpEvent(sigma)), int(n))
             for sigma, q, n in history if n]
    return dp_event.ComposedDpEvent(parts)


# ---- our accountants ------------------------------------------------------------------------
def _unpack(trial):
    if isinstance(trial, TrialCost):
        return trial.run, trial.score_noise_multipliers
    return trial, ()


def _as_event(run, extras) -> Optional[dp_event.DpEvent]:
    """The dp_accounting event of a Poisson run (our accountant or Opacus' RDPAccountant),
    with the score's Gaussian releases; ``None`` for any other accountant."""
    if isinstance(run, RDPAccountant):
        rate = None
    elif (type(getattr(run, "scheme", None)) is PoissonScheme
          and not getattr(run, "unamplified", None)):
        rate = run.scheme.sample_rate
    else:
        return None
    if not run.history:
        raise ValueError("the trial's accountant has recorded no step: pass the accountant "
                         "of a finished training run")
    gauss = [dp_event.GaussianDpEvent(s) for s in extras]
    return dp_event.ComposedDpEvent([*_history_event(run.history, rate).events, *gauss])


#: Tail masses cut from each unit's PMF (each a valid decomposition; the smallest ε is kept).
CUTS = (0.0, 1e-16, 1e-13, 1e-10)


def _unit_sigmas(acc) -> list[tuple[float, Optional[float], int]]:
    """``(σ, sample rate, count)`` per accounting unit of an accountant's history, as its
    ``_composed`` builds them (a multi-step unit priced at its smallest noise multiplier):
    :func:`~opacus_structured.accountants.budget_curves.run_units`, which the dataset budget
    charges by too."""
    return run_units(acc.scheme, acc.history)


def _unit_parts(acc, discretization: float):
    """``(pld, count)`` per accounting unit (:func:`_unit_sigmas`)."""
    return [(acc.scheme.pld(s, sample_rate=q, discretization=discretization), n)
            for s, q, n in _unit_sigmas(acc)]


def _unit_profiles(run) -> Optional[Iterator[tuple]]:
    """``(profile, count)`` per accounting unit, each rate checked (lazily: a route stops at
    the first unit it cannot take); ``None`` when the scheme has no ``profile``."""
    scheme = run.scheme
    if not callable(getattr(scheme, "profile", None)):
        return None

    def units():
        for sigma, rate, count in _unit_sigmas(run):
            scheme.check_sample_rate(rate)
            yield scheme.profile(sigma), count

    return units()


def _compose_units(units, orders, gaussian, label: str, worlds: int) -> list[tuple]:
    """One route per tail cut (:data:`CUTS`) and world: ``gaussian`` plus, over ``units``
    (per cut ``(count, [(rdp, tail) per world])``; a unit with one world serves every
    world), ``count`` times each unit's curve and tail mass."""
    routes = []
    for c in range(len(CUTS)):
        for k in range(worlds):
            rdp, tail = gaussian.copy(), 0.0
            for per_cut in units:
                count, unit = per_cut[c]
                r, t = unit[min(k, len(unit) - 1)]
                rdp, tail = rdp + count * r, tail + count * t
            routes.append((orders, rdp, tail, label))
    return routes


def _switching_route(run, orders, gaussian) -> Optional[tuple]:
    """The ``"switching-pair"`` route when every accounting unit's profile is the switching
    profile of a Poisson-subsampled Gaussian (:func:`~opacus_structured.accounting.
    switching_renyi.equivalent_subsampled_gaussian`); ``None`` otherwise."""
    profiles = _unit_profiles(run)
    if profiles is None:
        return None
    rdp = gaussian.copy()
    for profile, count in profiles:
        equivalent = sw.equivalent_subsampled_gaussian(profile)
        if equivalent is None:
            return None
        rdp = rdp + count * sw.switching_rdp(orders, *equivalent)
    return orders, rdp, 0.0, "switching-pair"


def _mixture_routes(run, orders, gaussian) -> Optional[list[tuple]]:
    """The ``"mixture-pair"`` routes, one per tail cut (:data:`CUTS`), when every accounting
    unit's profile is that of a two-sided Gaussian-mixture pair, possibly behind a top
    level's perfect-privacy share (:func:`~opacus_structured.accounting.mixture_renyi.
    profile_worlds`: Theorems E.1, E.8, F.1, F.2); ``None`` otherwise."""
    profiles = _unit_profiles(run)
    if profiles is None:
        return None
    units = []
    for profile, count in profiles:
        worlds = mr.profile_worlds(profile, orders, CUTS)
        if worlds is None:
            return None
        units.append([(count, [world]) for world in worlds])
    return _compose_units(units, orders, gaussian, "mixture-pair", 1)


def _gaussian_rdp(orders, extras, unamplified) -> np.ndarray:
    """RDP of the score's Gaussian releases and the unamplified parts: λ/(2σ²) each."""
    out = np.zeros_like(orders)
    for s in extras:
        out = out + orders / (2 * s ** 2)
    for s, n in unamplified.items():
        out = out + n * orders / (2 * s ** 2)
    return out


def _renyi_routes(run) -> list[tuple[np.ndarray, np.ndarray, float, str]]:
    """A whole-run Rényi accountant where the scheme has one (random allocation, and
    balls-in-bins through it): its RDP bound of both directions of the Lemma 2.8 pair at its
    own orders, at the run's smallest σ (more noise is post-processing)."""
    scheme = run.scheme
    if hasattr(scheme, "renyi_scheme"):
        scheme = scheme.renyi_scheme()
    if not callable(getattr(scheme, "renyi", None)):
        return []
    sigma = min(s for s, _, n in run.history if n)
    bound = scheme.renyi(sigma)
    orders = np.asarray(bound.orders, dtype=np.float64)
    keep = orders > 1
    units = run.scheme.compositions(len(run))
    return [(orders[keep], units * np.asarray(bound.rdp, dtype=np.float64)[keep], 0.0,
             "renyi-accountant")]


def _check_priceable(run) -> None:
    """Refuse a trial that has no RDP curve or dominating pair, naming why."""
    if not isinstance(run, SchemeAccountant):
        raise ValueError(f"a trial must be a dp_accounting DpEvent, one of opacus_structured's "
                         f"scheme accountants, or a TrialCost; got {type(run).__name__}")
    if run.scheme is None:
        raise ValueError(f"the trial's {type(run).__name__} is unbound (no scheme): pass the "
                         f"accountant of a finished run")
    name = run.scheme.name
    if not run.history:
        raise ValueError("the trial's accountant has recorded no step: pass the accountant of a "
                         "finished training run")
    if run.scheme.bound not in (BoundKind.UPPER, BoundKind.TIGHT):
        raise ValueError(f"scheme {name!r} reports a {run.scheme.bound.value} epsilon, not a "
                         f"guarantee; private selection needs a trial with an RDP curve or a "
                         f"dominating pair")
    if getattr(run.scheme, "analysis", "tight") != "tight":
        raise ValueError(f"scheme {name!r} with analysis={run.scheme.analysis!r} has no "
                         f"dominating pair (an (epsilon, delta) bound only); use "
                         f"analysis='tight' for a selected trial")


def _accountant_worlds(run, extras, orders, discretization
                       ) -> list[tuple[np.ndarray, np.ndarray, float, str]]:
    """Routes ``[(orders, rdp, tail_mass, route)]`` of one trial priced by our accountant;
    each is a valid bound on its own (the smallest final ε is kept)."""
    _check_priceable(run)
    name = run.scheme.name
    unamplified = getattr(run, "unamplified", {}) or {}
    gaussian = _gaussian_rdp(orders, extras, unamplified)
    if hasattr(run, "mu") and callable(run.mu):  # μ-GDP accountants: Gaussian RDP, exact
        mu = float(run.mu())
        if not math.isfinite(mu):
            raise ValueError(f"scheme {name!r}: the run's mu-GDP parameter is infinite")
        return [(orders, orders * mu ** 2 / 2 + gaussian, 0.0, "gdp")]
    switching = _switching_route(run, orders, gaussian)
    if switching is not None:  # at most the PLD's Rényi at every order, and no grid to build
        return [switching]
    mixture = _mixture_routes(run, orders, gaussian)
    if mixture is not None:  # the pair's own divergence; the PLD route is refused or looser
        return mixture
    routes = [(o, r + _gaussian_rdp(o, extras, unamplified), t, label)
              for o, r, t, label in _renyi_routes(run)]
    try:
        parts = _unit_parts(run, discretization)
    except (NotImplementedError, ValueError) as err:  # e.g. random allocation: no valid PLD
        if routes:
            return routes
        raise ValueError(f"scheme {name!r} has no privacy loss distribution to derive an RDP "
                         f"curve from ({err}); it cannot be priced for private selection") \
            from None
    units = [[(count, ps.pld_renyi(pld, orders, cut=cut)) for cut in CUTS]
             for pld, count in parts]
    return routes + _compose_units(units, orders, gaussian, "pld-renyi", 2)


def _priced(value: float, route: str) -> PricedEpsilon:
    return PricedEpsilon(float(value), route, ROUTES[route])


def selection_epsilon(trial, *, mean_trials: float, eta: Optional[float], delta: float,
                      orders: Optional[Sequence[float]] = None,
                      discretization: Optional[float] = None) -> float:
    r"""ε(δ) of the *whole* private selection: a secret number of trials :math:`K` (mean
    ``mean_trials``; truncated negative binomial of shape ``eta``, ``eta=None`` Poisson), each
    a run described by ``trial``, releasing only the best (Papernot & Steinke 2022, Thm 2 / 6;
    :mod:`~opacus_structured.accounting.private_selection`).

    Args:
        trial: one trial (module docstring): a ``DpEvent``, one of our accountants holding the
            run's history, or a :class:`TrialCost`. Every trial of the search must be this one.
        mean_trials: :math:`\mathbb E[K] \ge 1`.
        eta: shape in :math:`(-1, \infty)` (0 logarithmic, 1 geometric), or ``None``: Poisson.
        delta: target δ in (0, 1).
        orders: Rényi orders (default dp_accounting's).
        discretization: PLD grid for schemes priced by PLD (default the accountant's own).

    Returns:
        ε as a :class:`~opacus_structured.accounting.resource_guard.PricedEpsilon` (a float):
        an upper bound (never the winner's own ε); its ``route`` names what priced the trial
        (:data:`ROUTES`: ``"event"``, ``"pure-dp"``, ``"gdp"``, ``"renyi-accountant"``,
        ``"switching-pair"``, ``"mixture-pair"`` or ``"pld-renyi"``).
    """
    mean_trials, eta, delta = _check_common(mean_trials, eta, delta)
    orders = ps.DEFAULT_ORDERS if orders is None else np.asarray(orders, dtype=np.float64)
    if isinstance(trial, dp_event.DpEvent):
        return _priced(_event_selection_epsilon(trial, mean_trials, eta, delta, orders),
                       "event")
    if isinstance(trial, PureDpTrial):
        if eta is not None:
            return _priced(ps.pure_selection_epsilon(trial.epsilon, mean_trials=mean_trials,
                                                     eta=eta), "pure-dp")
        rdp = ps.repeat_and_select_rdp(orders, ps.pure_dp_rdp(trial.epsilon, orders),
                                       mean_trials=mean_trials, eta=None)
        return _priced(ps.rdp_epsilon(orders, rdp, delta), "pure-dp")
    run, extras = _unpack(trial)
    event = _as_event(run, extras)
    if event is not None:
        return _priced(_event_selection_epsilon(event, mean_trials, eta, delta, orders),
                       "event")
    d = getattr(run, "discretization", None) if discretization is None else \
        check_positive("discretization", discretization)
    routes = _accountant_worlds(run, extras, orders, d if d is not None else 1e-4)
    values, errors = [], []
    drawn_mean = ps.drawn_mean_trials(mean_trials, eta)
    for route_orders, rdp, tail, label in routes:
        selected = ps.repeat_and_select_rdp(route_orders, rdp, mean_trials=mean_trials,
                                            eta=eta)
        try:
            values.append((ps.epsilon_with_tail(route_orders, selected, delta, tail_mass=tail,
                                                mean_trials=drawn_mean), label))
        except ValueError as err:
            errors.append(err)
    if not values:
        raise errors[0]
    return _priced(*min(values, key=lambda v: v[0]))


def _flat(event) -> tuple:
    """An event's leaves in order, nested compositions flattened (one mechanism, one key)."""
    if isinstance(event, dp_event.ComposedDpEvent):
        return tuple(leaf for e in event.events for leaf in _flat(e))
    return (repr(event),)


def trial_signature(trial) -> tuple:
    """What makes two trials the same base mechanism (the theorem needs one): the event
    itself, or the accountant's class, scheme, history and unpriced Gaussian parts, plus the
    score's noise multipliers."""
    if isinstance(trial, (dp_event.DpEvent, PureDpTrial)):
        return ("event", _flat(trial))
    run, extras = _unpack(trial)
    event = _as_event(run, extras)
    if event is not None:  # a Poisson run is its dp_accounting event
        return ("event", _flat(event))
    scheme = getattr(run, "scheme", None)
    scheme_repr = repr(scheme.to_dict()) if hasattr(scheme, "to_dict") else repr(scheme)
    history = tuple(tuple(float(v) for v in h) for h in getattr(run, "history", ()) if h[2])
    unamplified = tuple(sorted((getattr(run, "unamplified", {}) or {}).items()))
    return ("accountant", type(run).__name__, scheme_repr, history, unamplified,
            tuple(extras))


class SelectionCalibrationError(ValueError):
    """No noise multiplier in the searched range meets the selection's target ε."""


def calibrate_selection(target_epsilon: float, *, delta: float, mean_trials: float,
                        eta: Optional[float], trial_for_sigma: Callable[[float], Any],
                        sigma_range: tuple[float, float] = (0.3, 100.0),
                        rtol: float = 1e-3, **pricing) -> float:
    r"""The per-trial noise multiplier σ whose whole search costs at most ``target_epsilon``.

    ``trial_for_sigma(σ)`` builds the trial at σ (an event or an accountant with the planned
    history). Bisection on :math:`\log\sigma` over ``sigma_range`` until the bracket is within
    ``rtol``; the returned σ is one at which :func:`selection_epsilon` was *computed* to be
    :math:`\le` ``target_epsilon`` (the sound side, whether or not ε(σ) is exactly monotone).

    Raises:
        SelectionCalibrationError: when even the largest σ is over the target, naming the ε
            reached there.
    """
    target = check_positive("target_epsilon", target_epsilon)
    lo, hi = (check_positive("sigma_range[0]", sigma_range[0]),
              check_positive("sigma_range[1]", sigma_range[1]))
    if not lo < hi:
        raise ValueError(f"sigma_range must be (low, high) with low < high, got {sigma_range}")
    rtol = check_positive("rtol", rtol)

    def eps(sigma):
        return selection_epsilon(trial_for_sigma(sigma), mean_trials=mean_trials, eta=eta,
                                 delta=delta, **pricing)

    at_hi = eps(hi)
    if not at_hi <= target:
        raise SelectionCalibrationError(
            f"even sigma={hi:g} gives a search epsilon of {at_hi:.4g} > target_epsilon="
            f"{target:g}; raise sigma_range's upper end, the target, or lower mean_trials")
    if eps(lo) <= target:
        return lo
    while hi / lo > 1 + rtol:
        mid = math.sqrt(lo * hi)
        if eps(mid) <= target:
            hi = mid
        else:
            lo = mid
    return hi
