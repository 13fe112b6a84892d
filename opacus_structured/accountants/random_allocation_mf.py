"""Opacus accountant for matrix mechanisms under random allocation (``"random-allocation-mf"``).

Prices the whole planned run with :class:`~opacus_structured.schemes.random_allocation_mf.
RandomAllocationMFScheme` (Rényi DP / conditional composition, Schuchardt & Kalinin). The run
must use one noise multiplier (a mix raises: the strategy's correlated noise does not compose
step by step).
"""

from __future__ import annotations

import math
from typing import Optional

from .._validation import check_open_unit
from ..accounting import pld as pld_lib
from ..schemes.random_allocation_mf import RandomAllocationMFScheme
from .base import SchemeAccountant

__all__ = ["RandomAllocationMFAccountant"]


class RandomAllocationMFAccountant(SchemeAccountant):
    """``RandomAllocationMFAccountant(RandomAllocationMFScheme(...))``; register a configured
    one for Opacus' registry with :func:`~opacus_structured.accountants.base.
    register_scheme_accountant`."""

    mechanism_name = "random-allocation-mf"
    scheme_class = RandomAllocationMFScheme

    def __init__(self, scheme: Optional[RandomAllocationMFScheme] = None, *,
                 discretization: float = pld_lib.DEFAULT_DISCRETIZATION):
        if scheme is None and self.default_scheme is None:
            raise ValueError("RandomAllocationMFAccountant needs a RandomAllocationMFScheme "
                             "(strategy, bands, epochs, batches_per_epoch)")
        scheme = scheme if scheme is not None else self.default_scheme
        if not isinstance(scheme, RandomAllocationMFScheme):
            raise ValueError(f"RandomAllocationMFAccountant needs a RandomAllocationMFScheme, "
                             f"got {scheme!r}")
        super().__init__(scheme, discretization=discretization)

    def _sigma_and_steps(self) -> tuple[Optional[float], int]:
        sigmas = {s for s, _, n in self.history if n}
        steps = len(self)
        if not sigmas:
            return None, 0
        if len(sigmas) > 1:
            raise ValueError(f"random-allocation-mf prices a run with one noise multiplier; "
                             f"the history has {sorted(sigmas)}")
        return sigmas.pop(), steps

    def get_epsilon(self, delta: float, *, discretization: Optional[float] = None,
                    **kwargs) -> float:
        delta = check_open_unit("delta", delta)
        sigma, steps = self._sigma_and_steps()
        if sigma is None:
            return 0.0
        d = self.discretization if discretization is None else discretization
        return self.scheme.epsilon(sigma, steps, delta, discretization=d)

    def get_delta(self, epsilon: float, *, discretization: Optional[float] = None) -> float:
        if math.isnan(epsilon):
            raise ValueError("epsilon must not be NaN")
        sigma, steps = self._sigma_and_steps()
        if sigma is None:
            return 0.0
        d = self.discretization if discretization is None else discretization
        return self.scheme.delta(sigma, steps, float(epsilon), discretization=d)
