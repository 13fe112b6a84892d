"""Opacus accountant for matrix mechanisms under random allocation (``"random-allocation-mf"``).

Prices the whole planned run with :class:`~opacus_structured.schemes.random_allocation_mf.
RandomAllocationMFScheme` (Rényi DP / conditional composition, Schuchardt & Kalinin). The run
must use one noise multiplier (a mix raises: the strategy's correlated noise does not compose
step by step).
"""

from __future__ import annotations

from typing import Optional

from ..accounting import pld as pld_lib
from ..schemes.random_allocation_mf import RandomAllocationMFScheme
from .base import WholeRunAccountant

__all__ = ["RandomAllocationMFAccountant"]


class RandomAllocationMFAccountant(WholeRunAccountant):
    """``RandomAllocationMFAccountant(RandomAllocationMFScheme(...))``; register a configured
    one for Opacus' registry with :func:`~opacus_structured.accountants.base.
    register_scheme_accountant`."""

    mechanism_name = "random-allocation-mf"
    mixed_sigma = "raise"
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
