"""``WholeRunAccountant``: a :class:`~opacus_structured.accountants.base.SchemeAccountant` for
schemes whose accounting unit is the whole planned run (balls-in-bins, random allocation of a
matrix mechanism), priced with one call to ``scheme.epsilon`` / ``scheme.delta``."""

from __future__ import annotations

import math
from typing import ClassVar, Optional

from .._validation import check_open_unit
from .base import SchemeAccountant

__all__ = ["WholeRunAccountant"]


class WholeRunAccountant(SchemeAccountant):
    """Prices the whole recorded run with one call to ``scheme.epsilon`` / ``scheme.delta``.

    For schemes whose accounting unit is the planned run (balls-in-bins, random allocation of a
    matrix mechanism). A history with several noise multipliers is priced at the smallest one
    (``mixed_sigma = "min"``: more noise is post-processing, never under-reports) or refused
    (``mixed_sigma = "raise"``).
    """

    mixed_sigma: ClassVar[str] = "min"

    def _sigma_and_steps(self) -> tuple[Optional[float], int]:
        sigmas = sorted({s for s, _, n in self.history if n})
        steps = len(self)
        if not sigmas:
            return None, 0
        if len(sigmas) > 1 and self.mixed_sigma == "raise":
            raise ValueError(f"{self.scheme.name} prices a run with one noise multiplier; the "
                             f"history has {sigmas}")
        return sigmas[0], steps

    def _priced(self, kind: str, value: float, discretization: Optional[float]) -> float:
        # The run is one unit: the price depends on (σ, units), not on the step count, so a
        # callback asking every step does not recompute it.
        sigma, steps = self._sigma_and_steps()
        if sigma is None:
            return 0.0
        d = self.discretization if discretization is None else discretization
        key = (kind, sigma, self.scheme.compositions(steps), value, d)
        if key not in self._cache:
            price = self.scheme.epsilon if kind == "epsilon" else self.scheme.delta
            self._cache[key] = price(sigma, steps, value, discretization=d)
        return self._cache[key]

    def get_epsilon(self, delta: float, *, discretization: Optional[float] = None,
                    **kwargs) -> float:
        self._require_observed()
        delta = check_open_unit("delta", delta)
        if self.without_noise:
            return math.inf
        if self.phases:  # the run is one phase of a composed run (accountants/phases)
            return self._phases_epsilon(delta, discretization)
        return self._priced("epsilon", delta, discretization)

    def get_delta(self, epsilon: float, *, discretization: Optional[float] = None) -> float:
        self._require_observed()
        if math.isnan(epsilon):
            raise ValueError("epsilon must not be NaN")
        if self.without_noise:
            return 1.0
        if self.phases:
            return float(self._phases_delta(epsilon, discretization))
        return self._priced("delta", float(epsilon), discretization)
