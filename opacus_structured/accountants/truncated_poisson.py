"""Opacus accountant for truncated Poisson sampling (``"truncated-poisson"``).

Prices the steps Opacus reports with :class:`~opacus_structured.schemes.TruncatedPoissonScheme`
(Ganesh 2025, Theorems 3.1/3.3/3.4, or the (ε, δ + e^ε η) baseline). The scheme carries n, p
and B; the ``sample_rate`` Opacus reports (``1/len(data_loader)``) is only checked against
``scheme.expected_sample_rate()``.

Opacus' registry builds accountants without arguments, so ``PrivacyEngine(accountant=
"truncated-poisson")`` holds an *unbound* accountant that cannot know n, p, B; it raises (naming
the fix) instead of pricing. Follow it with ``opacus_structured.make_private(engine, ...,
max_batch_size=B)`` (or ``make_private_with_epsilon``), which reads n and p from the DataLoader
and installs a bound one; or set ``engine.accountant = TruncatedPoissonAccountant(scheme)``
before ``make_private``, or register a configured class with
``register_scheme_accountant("my-name", scheme, base=TruncatedPoissonAccountant)``.
"""

from __future__ import annotations

import math
from typing import Optional

from .._validation import check_open_unit, check_positive
from ..accounting import pld as pld_lib
from ..schemes.truncated_poisson import TruncatedPoissonScheme
from .base import SchemeAccountant

__all__ = ["TruncatedPoissonAccountant"]


class TruncatedPoissonAccountant(SchemeAccountant):
    """Accountant of :class:`TruncatedPoissonScheme` (tight or baseline analysis).

    Args:
        scheme: the truncated Poisson scheme (it holds n, p, B and the relation); ``None``
            builds an unbound accountant (Opacus' registry), which refuses to price.
        discretization: PLD discretisation interval (pessimistic).
    """

    mechanism_name = "truncated-poisson"
    scheme_class = TruncatedPoissonScheme

    def __init__(self, scheme: Optional[TruncatedPoissonScheme] = None, *,
                 discretization: float = pld_lib.DEFAULT_DISCRETIZATION):
        super().__init__(scheme, discretization=discretization)

    def _segments(self):
        for _, rate, _ in self.history:  # histories set directly (get_noise_multiplier)
            self.scheme.check_sample_rate(rate)
        return [(sigma, int(n)) for sigma, _, n in self.history if n]

    def phase_refusal(self):
        if self.scheme.analysis != "tight":
            return ("is priced by the (ε, δ + e^ε η) baseline, which has no PLD (use "
                    "analysis='tight')")
        return None

    def get_epsilon(self, delta: float, *, discretization: Optional[float] = None,
                    **kwargs) -> float:
        """ε(δ) for all recorded steps (tight: composed mixture PLDs; baseline: see scheme)."""
        self._require_observed()
        if self.scheme.analysis == "tight" or self.phases:
            return super().get_epsilon(delta, discretization=discretization)
        delta = check_open_unit("delta", delta)
        if self.without_noise:
            return math.inf
        d = self.discretization if discretization is None else check_positive(
            "discretization", discretization)
        return self.scheme.epsilon_for_segments(self._segments(), delta, discretization=d)

    def get_delta(self, epsilon: float, *, discretization: Optional[float] = None) -> float:
        """δ(ε) for all recorded steps."""
        self._require_observed()
        if self.scheme.analysis == "tight":
            return super().get_delta(epsilon, discretization=discretization)
        if math.isnan(epsilon):
            raise ValueError("epsilon must not be NaN")
        if self.without_noise:
            return 1.0
        d = self.discretization if discretization is None else check_positive(
            "discretization", discretization)
        return self.scheme.delta_for_segments(self._segments(), float(epsilon), discretization=d)
