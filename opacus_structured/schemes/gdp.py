r"""Full-batch DP-GD, worst case, as a scheme (``gdp``).

Semantics: every step uses the *whole* dataset (no subsampling; ``len(data_loader) == 1``, so
Opacus' hook reports ``sample_rate = 1``); the clipped sum gets :math:`\mathcal N(0,\sigma^2C^2I)`
noise; add/remove relation. Each step is the Gaussian mechanism with sensitivity 1 (in units of
C), i.e. :math:`(1/\sigma)`-GDP, and :math:`T` steps are :math:`\mu`-GDP with
:math:`\mu = \sqrt{T}/\sigma` (Dong, Roth & Su 2022, Cor. 3.3; the worst case of Koskela et al.
2023, §4.1). :meth:`GDPScheme.gdp_epsilon` is that closed form; :meth:`GDPScheme.pld` is the
pessimistic PLD of one step (dp_accounting's ``from_gaussian_mechanism``), whose composition
agrees with the closed form up to the discretisation (tested).

Per-example (individual) accounting and the individual filter for the same mechanism live in
:mod:`opacus_structured.accounting.individual_gdp` and :mod:`lightning_callbacks`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from dp_accounting.pld import privacy_loss_distribution as dp_pld

from .._validation import check_int, check_positive
from ..accounting import pld as pld_lib
from ..accounting.gaussian import gdp_delta, gdp_epsilon, gdp_mu
from ..accounting.resource_guard import PricedEpsilon
from .base import BoundKind, Scheme, register_scheme

__all__ = ["GDPScheme"]


@register_scheme
@dataclasses.dataclass(frozen=True)
class GDPScheme(Scheme):
    """Full-batch DP-GD (every example in every step), worst-case μ = √T/σ."""

    name = "gdp"
    summary = "full-batch DP-GD (no subsampling), worst case mu = sqrt(T)/sigma"

    def expected_sample_rate(self) -> float:
        return 1.0

    def steps_per_epoch(self) -> int:
        """One step per epoch: every step uses the whole dataset."""
        return 1

    @property
    def bound(self) -> str:
        return BoundKind.TIGHT

    def pld(self, noise_multiplier, *, sample_rate=None,
            discretization=pld_lib.DEFAULT_DISCRETIZATION):
        """Pessimistic PLD of one Gaussian step with sensitivity 1 and noise ``σ``."""
        self.check_sample_rate(sample_rate)
        sigma = check_positive("noise_multiplier", noise_multiplier)
        return dp_pld.from_gaussian_mechanism(
            standard_deviation=sigma, sensitivity=1.0, pessimistic_estimate=True,
            value_discretization_interval=check_positive("discretization", discretization))

    def epsilon(self, noise_multiplier, steps, delta, *,
                discretization=pld_lib.DEFAULT_DISCRETIZATION, sample_rate=None):
        r"""ε(δ) in closed form, no PLD (memory and time independent of ``steps``).

        :math:`T` steps are :math:`\mu`-GDP with :math:`\mu = \sqrt{T}/\sigma`, whose exact
        profile is :math:`\delta(\varepsilon) = \Phi(-\varepsilon/\mu + \mu/2)
        - e^{\varepsilon}\Phi(-\varepsilon/\mu - \mu/2)`; ε(δ) is its root, found by Brent's
        method in log space and rounded up (:func:`~opacus_structured.accounting.gaussian.gdp_epsilon`).
        It is the exact ε: the pessimistic PLD route is at or above it by the discretisation.
        ``discretization`` is accepted for a uniform signature and unused (route
        ``"closed-form"``).
        """
        self.check_sample_rate(sample_rate)
        check_positive("discretization", discretization)
        value = self.gdp_epsilon(noise_multiplier, steps, delta)
        return PricedEpsilon(value, "closed-form",
                             "exact mu-GDP closed form, mu = sqrt(T)/sigma (no discretisation)",
                             mu=self.mu(noise_multiplier, steps))

    def delta(self, noise_multiplier, steps, epsilon, *,
              discretization=pld_lib.DEFAULT_DISCRETIZATION, sample_rate=None):
        """δ(ε) of μ-GDP with μ = √T/σ, exact (:func:`~opacus_structured.accounting.gdp_delta`)."""
        self.check_sample_rate(sample_rate)
        check_positive("discretization", discretization)
        return gdp_delta(epsilon, self.mu(noise_multiplier, steps))

    def noise_for_epsilon(self, target_epsilon: float, steps: int, delta: float) -> float:
        r"""Smallest σ with ε(δ) ≤ ``target_epsilon`` after ``steps`` steps, by inversion:
        :math:`\mu^* = ` :func:`~opacus_structured.accounting.gdp_mu` (largest μ meeting
        (ε, δ), rounded down) and :math:`\sigma = \sqrt{T}/\mu^*`, rounded up until
        ``gdp_epsilon`` confirms the target (never under-reports)."""
        target_epsilon = check_positive("target_epsilon", target_epsilon)
        steps = check_int("steps", steps, minimum=1)
        mu = gdp_mu(target_epsilon, delta)
        if not mu > 0:
            raise ValueError(f"no noise multiplier reaches epsilon={target_epsilon:g} at "
                             f"delta={delta:g} (the largest mu is 0)")
        sigma = math.sqrt(steps) / mu
        if not math.isfinite(sigma):
            raise ValueError(f"epsilon={target_epsilon:g} at delta={delta:g} after {steps} "
                             f"steps needs an infinite noise multiplier")
        # gdp_mu and gdp_epsilon solve the same equation to floating-point accuracy (relative
        # ~1e-6 when mu is tiny and delta(eps) is a difference of two near-equal Phi values):
        # raise sigma by a geometrically growing step until both confirm the target.
        bump = 1e-12
        for _ in range(64):
            if (gdp_delta(target_epsilon, self.mu(sigma, steps)) <= delta
                    and self.gdp_epsilon(sigma, steps, delta) <= target_epsilon):
                return sigma
            sigma = math.nextafter(sigma * (1.0 + bump), math.inf)
            bump *= 2.0
        raise ValueError(f"could not confirm sigma={sigma:g} for epsilon={target_epsilon:g}")

    @classmethod
    def from_training(cls, *, dataset_size: int, steps_per_epoch: int,
                      epochs: Optional[int] = None) -> "GDPScheme":
        """Full-batch DP-GD has no parameter: every example in every step (one step per
        epoch, whatever the DataLoader's batch size was)."""
        check_int("dataset_size", dataset_size, minimum=1)
        check_int("steps_per_epoch", steps_per_epoch, minimum=1)
        return cls()

    def mu(self, noise_multiplier: float, steps: int) -> float:
        """μ = √T/σ of ``steps`` steps."""
        steps = check_int("steps", steps, minimum=0)
        return math.sqrt(steps) / check_positive("noise_multiplier", noise_multiplier)

    def gdp_epsilon(self, noise_multiplier: float, steps: int, delta: float) -> float:
        """Closed-form ε(δ) of μ-GDP with μ = √T/σ (exact; Cor. C.2 of Koskela et al.)."""
        return gdp_epsilon(delta, self.mu(noise_multiplier, steps))
