"""Poisson subsampling with the Gaussian mechanism (plain DP-SGD), priced by our core.

Semantics: at every step each of the n examples joins the batch independently with probability
``sample_rate`` (so batch sizes vary); the clipped sum gets N(0, σ²C²) noise. Relation:
add/remove one example. This is the scheme Opacus' ``DPDataLoader`` implements.

Pricing: the remove direction is dominated by ``P = (1-q)·N(0, σ) + q·N(1, σ)`` versus
``Q = N(0, σ)``, the add direction by ``(Q, P)`` (Mironov et al. 2019; Zhu, Dong & Wang 2022);
both are built as :class:`~opacus_structured.accounting.MixturePair` and discretised with the
pessimistic connect-the-dots algorithm. It agrees with dp_accounting's
``from_gaussian_mechanism(sampling_prob=q)`` (a peer oracle in the tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from typing import Optional

from .._validation import check_int, check_positive, check_probability
from ..accounting import pld as pld_lib
from ..accounting.mixture import MixturePair
from ..accounting.profiles import PairProfile
from ..accounting.quiet_rdp import quiet_rdp_orders as _quiet_rdp_orders
from ..accounting.quiet_rdp import subsampled_gaussian_rdp
from ..accounting.resource_guard import PricedEpsilon
from .base import Scheme, register_scheme

__all__ = ["PoissonScheme", "poisson_pair", "rdp_epsilon", "rdp_epsilon_and_order"]


def poisson_pair(noise_multiplier: float, sample_rate: float) -> MixturePair:
    """Remove-direction dominating pair of the Poisson-subsampled Gaussian mechanism."""
    q = check_probability("sample_rate", sample_rate)
    s = check_positive("noise_multiplier", noise_multiplier)
    return MixturePair.from_components([1.0, 0.0], [q, 1.0 - q], [0.0], [1.0], s)


#: RDP orders of :func:`rdp_epsilon`: fine near 1 (needed when ε is large) plus dp_accounting's.
RDP_ORDERS = tuple(1.0 + k / 100.0 for k in range(1, 100)) + (
    2.25, 2.5, 3.0, 3.5, 4.0, 4.5, *range(5, 64), 128, 256, 512, 1024)


def rdp_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """Rényi-DP upper bound on ε(δ) of ``steps`` Poisson-subsampled Gaussian steps (add/remove),
    by dp_accounting's ``RdpAccountant``; O(1) in ``steps``."""
    return rdp_epsilon_and_order(noise_multiplier, sample_rate, steps, delta)[0]


def rdp_epsilon_and_order(noise_multiplier: float, sample_rate: float, steps: int,
                          delta: float) -> tuple[float, float]:
    """:func:`rdp_epsilon` and the RDP order that attains it (``nan`` for zero steps)."""
    q = check_probability("sample_rate", sample_rate)
    s = check_positive("noise_multiplier", noise_multiplier)
    steps = check_int("steps", steps, minimum=0)
    if steps == 0:
        return 0.0, math.nan
    return _rdp_of_parts(((s, q, steps),), float(delta))


@functools.lru_cache(maxsize=1024)
def _rdp_one_step(sigma: float, q: float):
    """RDP curve over :data:`RDP_ORDERS` of one Poisson-subsampled Gaussian step: the vector
    dp_accounting's ``RdpAccountant`` adds ``count`` times per composed event (its
    ``_compute_rdp_poisson_subsampled_gaussian``), read-only; ``None`` where this dp_accounting
    has no such function. Cached per ``(σ, q)``: it costs up to ~1.6 s of CPU (the fractional
    orders' series near q = 1/8), and an accountant or callback asks at every step for a
    history whose step count alone changed."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    if not hasattr(rdp, "compute_epsilon"):
        return None
    curve = subsampled_gaussian_rdp(q, sigma, list(RDP_ORDERS))
    if curve is not None:
        curve.setflags(write=False)
    return curve


@functools.lru_cache(maxsize=256)
def _rdp_of_parts(parts: tuple, delta: float) -> tuple[float, float]:
    """RDP ε(δ) and optimal order of ``(σ, q, steps)`` parts (cached: accountants and callbacks
    ask at every step).

    Bit for bit what dp_accounting's ``RdpAccountant(RDP_ORDERS)`` returns after composing
    ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))`` ``steps`` times per part, in order: it
    starts from zeros, adds ``steps`` times the one-step curve per part and calls
    ``compute_epsilon`` (``tests/test_resource_guard.py`` checks the equality); the one-step
    curve is cached per ``(σ, q)`` (:func:`_rdp_one_step`)."""
    import dp_accounting
    import numpy as np
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    curves = [(steps, _rdp_one_step(sigma, q)) for sigma, q, steps in parts if steps]
    if any(curve is None for _, curve in curves):
        acc = rdp.RdpAccountant(list(RDP_ORDERS))
        with _quiet_rdp_orders():
            for sigma, q, steps in parts:
                if steps:
                    acc.compose(dp_accounting.PoissonSampledDpEvent(
                        q, dp_accounting.GaussianDpEvent(sigma)), steps)
            eps, order = acc.get_epsilon_and_optimal_order(delta)
        return float(eps), float(order)
    orders = np.array(list(RDP_ORDERS))
    total = np.zeros_like(orders, dtype=np.float64)
    for steps, curve in curves:
        total += steps * curve
    with _quiet_rdp_orders():
        eps, order = rdp.compute_epsilon(orders, total, delta)
    return float(eps), float(order)


#: Integer orders where :func:`_rdp_lower_curve` evaluates the RDP curve exactly.
_ANCHORS = (2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32, 40, 48, 56, 63)


@functools.lru_cache(maxsize=1024)
def _rdp_lower_curve(sigma: float, q: float):
    r"""A lower bound of the one-step RDP curve :math:`\rho(\alpha)` over :data:`RDP_ORDERS`
    (``None`` when dp_accounting has no curve function, or for ``q = 1``, whose curve is
    cheap), a few milliseconds where the curve itself takes up to ~0.5 s.

    dp_accounting's integer-order formula (the one that computes the curve there) gives
    :math:`\rho` exactly at :data:`_ANCHORS`. Three facts bound it elsewhere, the largest
    value is kept: :math:`h(\alpha) = (\alpha - 1)\rho(\alpha) = \log
    \mathbb{E}_Q[(P/Q)^\alpha]` is convex with :math:`h(1) = 0`, so it lies above every
    secant line of two consecutive known points outside their segment; Rényi divergences are
    non-decreasing in the order (:math:`\rho(\alpha) \ge \rho(a)` for an anchor
    :math:`a \le \alpha`); and :math:`\rho(\alpha) \ge \mathrm{KL}(P\|Q) \ge
    2\,\mathrm{TV}(P, Q)^2` (Pinsker) with :math:`\mathrm{TV} = q\,(2\Phi(1/(2\sigma)) -
    1)` exactly (:math:`P - Q = q(\mathcal{N}(1, \sigma^2) - \mathcal{N}(0, \sigma^2))`)."""
    import numpy as np
    from dp_accounting.rdp import rdp_privacy_accountant as rdp
    from scipy import special

    curve_of = getattr(rdp, "_compute_rdp_poisson_subsampled_gaussian", None)
    if curve_of is None or not 0.0 < q < 1.0:
        return None
    anchors = np.array(_ANCHORS, dtype=float)
    with _quiet_rdp_orders():
        rho = np.asarray(curve_of(q=q, noise_multiplier=sigma, orders=anchors), dtype=float)
    if not np.all(np.isfinite(rho)):
        return None
    knots = np.concatenate([[1.0], anchors])
    h = np.concatenate([[0.0], (anchors - 1.0) * rho])
    slopes = np.diff(h) / np.diff(knots)
    tv = q * (2.0 * special.ndtr(0.5 / sigma) - 1.0)
    pinsker = 2.0 * tv * tv
    order = np.array(RDP_ORDERS)
    best = (order - 1.0) * pinsker
    at = np.searchsorted(anchors, order, side="right") - 1
    best = np.where(at >= 0, np.maximum(best, (order - 1.0) * rho[np.maximum(at, 0)]), best)
    # every order lies outside all segments but at most one: the secants there, all at once
    column = order[:, None]
    outside = (column <= knots[:-1]) | (column >= knots[1:])
    lines = np.where(outside, h[:-1] + slopes * (column - knots[:-1]), -np.inf)
    return np.maximum(best, lines.max(axis=1)) / (order - 1.0)


def rdp_lower_bound(parts: tuple, delta: float) -> float:
    r"""A lower bound of the ε(δ) that :func:`_rdp_of_parts` returns for ``(σ, q, steps)``
    parts (``-inf`` when none is available): dp_accounting's conversion
    (``compute_epsilon``) applied, order by order, to a lower bound of the composed curve
    (:func:`_rdp_lower_curve`). The conversion's value :math:`\max(0, \cdot)` at an order is
    non-decreasing in the RDP there (0 below :math:`-\log(1 - \delta^2)`, then
    :math:`\rho + \log(1 - 1/\alpha) - \log(\delta\alpha)/(\alpha - 1)`), and the
    minimum over orders keeps that, so the result is at most the route's ε."""
    import numpy as np
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    if not hasattr(rdp, "compute_epsilon"):
        return -math.inf
    total = np.zeros(len(RDP_ORDERS))
    for sigma, q, steps in parts:
        if not steps:
            continue
        curve = _rdp_lower_curve(sigma, q)
        if curve is None:
            return -math.inf
        total += steps * curve
    return float(rdp.compute_epsilon(np.array(RDP_ORDERS), total, delta)[0])


@functools.lru_cache(maxsize=32)
def _poisson_pld(sigma: float, q: float, discretization: float):
    """The pessimistic PLD of one Poisson-subsampled Gaussian step, cached per ``(σ, q,
    discretization)`` as :mod:`.structured` caches its PLDs: an accountant or a callback
    prices the history at every step, and rebuilt the same one-step PLD each time (~0.05-0.3 s).
    PLDs are values here (composition builds new objects; :mod:`..accounting.numerics`
    records on those), checked in ``tests/test_accountant_poisson.py``."""
    pair = poisson_pair(sigma, q)
    return pld_lib.pld_from_profile(PairProfile(pair), PairProfile(pair.reversed()),
                                    discretization=discretization)


@register_scheme
@dataclasses.dataclass(frozen=True)
class PoissonScheme(Scheme):
    """Poisson-subsampled Gaussian (DP-SGD with Opacus' ``DPDataLoader``).

    Args:
        sample_rate: per-example inclusion probability q in (0, 1]. ``None`` takes the rate
            that Opacus' optimizer hook reports at each step (what ``PrivacyEngine`` passes).
    """

    name = "poisson"
    summary = "Poisson-subsampled Gaussian (plain DP-SGD), add/remove relation"

    sample_rate: Optional[float] = None

    def __post_init__(self):
        if self.sample_rate is not None:
            object.__setattr__(self, "sample_rate",
                               check_probability("sample_rate", self.sample_rate))

    def expected_sample_rate(self):
        return self.sample_rate

    def steps_per_epoch(self) -> int:
        """``floor(1/q)`` steps per epoch, as Opacus counts them (``len(DPDataLoader)`` for a
        loader whose rate is ``q = 1/len(loader)``); needs a fixed ``sample_rate``."""
        if self.sample_rate is None:
            raise NotImplementedError("a PoissonScheme without sample_rate has no epoch length "
                                      "(the rate comes from Opacus' hook)")
        return max(1, math.floor(1.0 / self.sample_rate + 1e-9))

    def implemented_by(self, sampler_scheme) -> bool:
        """Any Poisson sampler when the rate comes from Opacus' hook (``sample_rate=None``:
        the hook reports ``1/len(loader)``, checked against nothing else); otherwise a Poisson
        sampler at this rate."""
        if self.sample_rate is None:
            return isinstance(sampler_scheme, PoissonScheme)
        return sampler_scheme == self

    def is_template(self) -> bool:
        """Without ``sample_rate`` the rate comes from Opacus' hook."""
        return self.sample_rate is None

    def checkpoint_scheme(self, saved):
        """Equal schemes; a rate-less template adopts a saved rate; a checkpoint taken under
        the template (rates in its history) resumes under a fixed rate (the accountant checks
        the history's rates against it)."""
        if saved == self:
            return self
        if not isinstance(saved, PoissonScheme):
            return None
        if self.sample_rate is None:
            return saved
        if saved.sample_rate is None:
            return self
        return None

    def pld(self, noise_multiplier, *, sample_rate=None,
            discretization=pld_lib.DEFAULT_DISCRETIZATION):
        self.check_sample_rate(sample_rate)
        q = self.sample_rate if self.sample_rate is not None else sample_rate
        if q is None:
            raise ValueError("PoissonScheme needs a sample_rate (set it on the scheme, or let "
                             "Opacus' optimizer hook report it)")
        return _poisson_pld(check_positive("noise_multiplier", noise_multiplier),
                            check_probability("sample_rate", q), discretization)

    def epsilon_over_budget(self, error, noise_multiplier, steps, delta, *, discretization,
                            sample_rate=None):
        r"""Over the memory budget: the Rényi-DP upper bound (route ``"rdp"``).

        The Poisson-subsampled Gaussian has RDP curve :math:`\rho_T(\alpha) = T\,\rho(\alpha)`
        (Mironov, Talwar & Zhang 2019, add/remove relation; dp_accounting's ``RdpAccountant``),
        and :math:`\varepsilon(\delta) = \min_\alpha \rho_T(\alpha) + \log((\alpha-1)/\alpha)
        - (\log\delta + \log\alpha)/(\alpha-1)` (Canonne, Kamath & Steinke 2020, Prop. 12),
        over orders :math:`\alpha \in \{1.01, \dots, 1.99\} \cup` dp_accounting's defaults.
        Its memory and time do not depend on :math:`T`. It is an *upper* bound on the ε of the
        PLD route: sound, and looser by the RDP-to-(ε, δ) conversion — typically 5-30 % above the
        PLD value (measured in ``tests/test_resource_guard.py``), with no a-priori bound on the gap.
        """
        q = self.sample_rate if self.sample_rate is not None else sample_rate
        if q is None:
            raise error
        value = rdp_epsilon(noise_multiplier, q, self.compositions(steps), delta)
        return PricedEpsilon(
            value, "rdp",
            "Renyi-DP upper bound (dp_accounting RdpAccountant, Poisson-subsampled Gaussian): "
            "sound, typically 5-30% above the PLD epsilon (no a-priori bound on the gap); the "
            "PLD route was over the memory budget - raise --memory-budget for it",
            refused_estimate_bytes=error.estimated_bytes, memory_budget_bytes=error.budget)

    def certified_alternatives_below(self, history, delta, below):
        r"""The Rényi-DP route (:meth:`certified_alternatives`), left out when a cheap lower
        bound of it is above ``below`` (the PLD value it would be compared with): it could not
        be chosen, and computing it is most of a first ``get_epsilon`` (its fractional orders'
        series, up to ~0.5 s per (σ, q) near q = 1/8; issue 46). :func:`rdp_lower_bound`."""
        parts = self._rdp_parts(history)
        if parts is not None and rdp_lower_bound(parts, float(delta)) > \
                float(below) * (1 + 1e-9) + 1e-12:
            return []
        return self.certified_alternatives(history, delta)

    def _rdp_parts(self, history) -> Optional[tuple]:
        parts = []
        for sigma, rate, steps in history:
            q = self.sample_rate if self.sample_rate is not None else rate
            if q is None:
                return None
            parts.append((float(sigma), float(q), self.compositions(steps)))
        return tuple(parts)

    def certified_alternatives(self, history, delta):
        r"""The Rényi-DP upper bound of the whole ``history`` (route ``"rdp"``).

        The RDP curve of the Poisson-subsampled Gaussian is computed in log space per order
        (dp_accounting's ``RdpAccountant``; relative error of order :math:`10^{-15}`, no
        composition round-off: :math:`\rho_T = \sum_t \rho_t`), so it is certified at every
        δ. Its only grid is the order grid :data:`RDP_ORDERS`; any order gives a valid bound,
        so the grid only makes it looser (the details record the optimal order and whether it
        sits at the edge of the grid).
        """
        parts = self._rdp_parts(history)
        if parts is None:
            return []
        eps, order = _rdp_of_parts(parts, float(delta))
        return [PricedEpsilon(
            float(eps), "rdp",
            "Renyi-DP upper bound (dp_accounting RdpAccountant, Poisson-subsampled Gaussian)",
            rdp_order=float(order),
            rdp_order_at_grid_edge=float(order) in (min(RDP_ORDERS), max(RDP_ORDERS)))]

    @classmethod
    def from_training(cls, *, dataset_size: int, steps_per_epoch: int,
                      epochs: Optional[int] = None) -> "PoissonScheme":
        """Poisson at ``q = 1/steps_per_epoch``: the rate Opacus' ``DPDataLoader`` uses for a
        loader of ``steps_per_epoch`` batches (expected batch ``dataset_size/steps_per_epoch``);
        ``epochs`` is not needed (each step is priced on its own)."""
        check_int("dataset_size", dataset_size, minimum=1)
        return cls(sample_rate=1.0 / check_int("steps_per_epoch", steps_per_epoch, minimum=1))

    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--sample-rate", type=float, required=True, metavar="q",
                            help="per-example Poisson inclusion probability, in (0, 1]")

    @classmethod
    def from_cli_args(cls, args):
        return cls(sample_rate=args.sample_rate)
