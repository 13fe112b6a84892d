"""Opacus accountant for full-batch DP-GD (``"gdp-full-batch"``), the :class:`GDPScheme`.

Every example is in every step (the batch sampler is
:class:`~opacus_structured.samplers.full_batch.FullBatchSampler`, so Opacus' hook reports
``sample_rate = 1``); each step is a Gaussian mechanism with sensitivity 1, i.e. (1/σ)-GDP, and
steps at noise multipliers σ_i compose to μ-GDP with μ = √(Σ_i 1/σ_i²) (Dong, Roth & Su 2022,
Cor. 3.3; μ = √T/σ at a constant σ). ε and δ are that closed form (exact, no PLD, memory and time
independent of the number of steps), the same numbers as ``GDPScheme.epsilon``.

The name is not ``"gdp"``: Opacus registers its own ``"gdp"`` accountant (a central-limit
approximation for *Poisson* sampling), and replacing it would change what a stock script
prints. ``PrivacyEngine(accountant="gdp-full-batch")`` followed by
``opacus_structured.make_private(engine, ...)`` trains full-batch DP-GD. The scheme has no
parameters, so the accountant is bound from construction.
"""

from __future__ import annotations

import math
from typing import Optional

from .._validation import check_open_unit
from ..accounting.gaussian import gdp_delta, gdp_epsilon
from ..schemes.gdp import GDPScheme
from .base import SchemeAccountant

__all__ = ["GDPFullBatchAccountant"]


class GDPFullBatchAccountant(SchemeAccountant):
    """Full-batch DP-GD: ``T`` composed Gaussian mechanisms at noise multiplier σ."""

    default_scheme = GDPScheme()
    mechanism_name = "gdp-full-batch"
    scheme_class = GDPScheme

    def mu(self) -> float:
        """μ = √(Σ_i n_i/σ_i²) of the recorded history (``n_i`` steps at ``σ_i``)."""
        total = 0.0
        for sigma, q, n in self.history:
            if n:
                self.scheme.check_sample_rate(q)
                total += int(n) / float(sigma) ** 2
        return math.sqrt(total)

    def phase_pld(self, discretization: float):
        """This run as one phase of a composed run: the Gaussian PLD of its μ."""
        return self._gaussian_phase_pld(self.mu(), discretization)

    def get_epsilon(self, delta: float, *, discretization: Optional[float] = None,
                    **kwargs) -> float:
        """Exact ε(δ) of μ-GDP (``discretization`` is accepted and unused), or of the composed
        phases (a PLD) after a resume under another scheme."""
        self._require_observed()
        delta = check_open_unit("delta", delta)
        if self.without_noise:
            return math.inf
        if self.phases:
            return self._phases_epsilon(delta, discretization)
        return gdp_epsilon(delta, self.mu())

    def get_delta(self, epsilon: float, *, discretization: Optional[float] = None) -> float:
        """Exact δ(ε) of μ-GDP."""
        self._require_observed()
        if math.isnan(epsilon):
            raise ValueError("epsilon must not be NaN")
        if self.without_noise:
            return 1.0
        if self.phases:
            return float(self._phases_delta(epsilon, discretization))
        return float(gdp_delta(float(epsilon), self.mu()))
